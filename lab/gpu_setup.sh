#!/usr/bin/env bash
# Source on the GPU machine (no registry there): SGLang from the carried kit of one release, then
# this checkout on PYTHONPATH with a hand-written dist-info, so SGLang's plugin loader finds it.
#   source lab/gpu_setup.sh [VERSION] || exit 0     (VERSION: default $SGLANG_VERSION, else 0.5.17)
# The kit (lab/build-gpu-kit.sh) and the SmolLM2 GGUF (lab/pack-smollm2.sh) travel in parts, one
# per run, back to back: every run stashes what it carries in /tmp. Returns 1 while the kit is
# incomplete. `gpu_model DIR` converts the stashed SmolLM2 parts into an HF folder, once.
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; return 0 2>/dev/null || exit 0 ;; esac
_version=${1:-${SGLANG_VERSION:-0.5.17}}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
models=/tmp/model-parts
mkdir -p $models
for d in "$here"/.smol-p[0-9]; do
    [ -d "$d" ] && cp -n "$d"/* $models/ 2>/dev/null
done
source "$here/lab/gpu-env.sh" "$_version" || return 1

gpu_model() {
    [ -f "$1/config.json" ] && return 0
    (cd $models && sha256sum -c --quiet smollm2.sha256) ||
        { echo "gpu_model: SmolLM2 parts missing (stashed: $(ls $models | tr '\n' ' '))" >&2; return 1; }
    cat $models/smollm2.gguf.part* > /tmp/smollm2.gguf && python3 $models/gguf_to_hf.py /tmp/smollm2.gguf "$1" &&
        rm -f /tmp/smollm2.gguf
}

site=/tmp/kit-$_version-site
if [ ! -d "$site/sglang_dflash-0.1.0.dist-info" ]; then
    # The metadata pip would write for `pip install -e .`, minus the build step pip cannot do offline.
    mkdir -p "$site/sglang_dflash-0.1.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: sglang-dflash\nVersion: 0.1.0\n' > "$site/sglang_dflash-0.1.0.dist-info/METADATA"
    python3 - "$here/pyproject.toml" > "$site/sglang_dflash-0.1.0.dist-info/entry_points.txt" <<'PY'
import sys, tomllib
eps = tomllib.load(open(sys.argv[1], "rb"))["project"]["entry-points"]
for group, items in eps.items():
    print(f"[{group}]"); [print(f"{k} = {v}") for k, v in items.items()]
PY
fi
export PYTHONPATH="$here:$PYTHONPATH"
unset _version
