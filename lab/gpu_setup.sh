#!/usr/bin/env bash
# Source on the GPU machine (no registry there): SGLang from the carried kit, then this checkout
# installed in development mode so SGLang's plugin loader finds the entry point.
#   source lab/gpu_setup.sh
# The kit comes either whole (.devkit) or in parts (.carry1, .carry2 from lab/pack_carry.sh,
# one per run, back to back): every run stashes the parts it carries in /tmp/devkit-parts.
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; return 0 2>/dev/null || exit 0 ;; esac
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
parts=/tmp/devkit-parts
mkdir -p $parts
# No-clobber: a script that sources this again does not copy the parts again.
# A carried folder without parts (a dataset, say) is skipped, also under `set -e`.
for d in "$here"/.carry[0-9]; do
    [ -f "$d/manifest.sha256" ] && { cp -n "$d"/*.part* "$d"/manifest.sha256 $parts/ 2>/dev/null || true; }
done
[ -f "$here/.carry5/gguf_to_hf.py" ] && cp "$here/.carry5/gguf_to_hf.py" $parts/

have_parts() {  # have_parts kit|gguf: all parts of the manifest are stashed, with the right checksums
    [ -f $parts/manifest.sha256 ] && (cd $parts && grep " $1.part" manifest.sha256 | sha256sum -c --quiet 2>/dev/null)
}
if [ -f "$here/.devkit/gpu-env.sh" ]; then
    source "$here/.devkit/gpu-env.sh"
elif [ -f /tmp/devkit-site/.ok ]; then
    export PYTHONPATH=/tmp/devkit-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
elif have_parts kit; then
    mkdir -p /tmp/devkit-site && cat $parts/kit.part* | tar -xJ -C /tmp/devkit-site && touch /tmp/devkit-site/.ok
    export PYTHONPATH=/tmp/devkit-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
else
    echo "gpu_setup: the kit is not complete on this machine (stashed: $(ls $parts | tr '\n' ' '));" \
         "carry .devkit, or .carry1 and .carry2 in back-to-back runs" >&2
    return 1
fi

# gpu_model DIR: the SmolLM2 HF folder, converted once all GGUF parts are stashed.
gpu_model() {
    [ -f "$1/config.json" ] && return 0
    have_parts gguf || { echo "gpu_model: GGUF parts missing (stashed: $(ls $parts | tr '\n' ' '))" >&2; return 1; }
    cat $parts/gguf.part* > /tmp/smollm2.gguf && python3 $parts/gguf_to_hf.py /tmp/smollm2.gguf "$1" && rm -f /tmp/smollm2.gguf
}

site=/tmp/devkit-site
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
    echo "$here" > "$site/sglang_dflash_dev.pth"
fi
export PYTHONPATH="$here:$PYTHONPATH"
