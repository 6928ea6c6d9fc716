#!/usr/bin/env bash
# Source on the GPU machine (no registry there): SGLang from the carried kit, then this checkout
# installed in development mode so SGLang's plugin loader finds the entry point.
#   source scripts/gpu_setup.sh
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -f "$here/.devkit/gpu-env.sh" ]; then
    source "$here/.devkit/gpu-env.sh"
elif [ -f /tmp/devkit-site/.ok ]; then  # a later run on the same warm machine need not carry the kit
    export PYTHONPATH=/tmp/devkit-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
else
    echo "gpu_setup: no .devkit carried and /tmp/devkit-site is gone (the machine was not warm)" >&2; return 1
fi
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
