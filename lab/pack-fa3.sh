#!/bin/bash
# Pack FA3 (sgl_kernel/flash_ops.abi3.so of sglang-kernel 0.4.5, 1.1 GB; the kit leaves it out)
# into parts that ride along with GPU runs, as the kit does.
#
#   bash lab/pack-fa3.sh [OUTDIR]      (default .fa3: writes .fa3-p1 .. .fa3-pN)
#   FA3_SIZES_MB=16,22.4,22.4,21.3,21.3,21.3 bash lab/pack-fa3.sh   (parts sized to ride with the kit's)
#
# Stripped and packed with xz, split into 23 MiB parts (a run carries 64 MiB, the tree ~30 MB).
# Carry them in back-to-back runs after the kit's; `source lab/gpu-env.sh VERSION` stashes them
# in /tmp and, once all are there and the kit is unpacked, puts the library into the kit's
# sgl_kernel/, so `--attention-backend fa3` works.
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;; esac
set -euo pipefail
out=${1:-.fa3}
wheels=${KIT_CACHE:-$HOME/.cache/sglang-gpu-kit}/fa3
mkdir -p "$wheels"
wheel=$(ls "$wheels"/sglang_kernel-0.4.5-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d "$wheels" sglang-kernel==0.4.5
    wheel=$(ls "$wheels"/sglang_kernel-0.4.5-*.whl | head -1)
fi
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
unzip -qq -o "$wheel" 'sgl_kernel/flash_ops.abi3.so' -d "$stage"
strip --strip-unneeded "$stage/sgl_kernel/flash_ops.abi3.so" 2>/dev/null || true
rm -rf "$out"-p* "$out.tmp"
mkdir -p "$out.tmp"
if [ -n "${FA3_SIZES_MB:-}" ]; then
    # Parts of the sizes given (MB, the rest in one more part), to fill what each staging call
    # leaves beside the kit: 16,22.4,22.4,21.3,21.3,21.3 rides with 0.5.23's kit parts 1-2 (one
    # part), 3 (two), then three, then the last (docs/gpu-lab.md).
    xz -${FA3_XZ_LEVEL:-9} -T2 -c "$stage/sgl_kernel/flash_ops.abi3.so" > "$out.tmp/fa3.xz"
    python3 - "$out.tmp" "$FA3_SIZES_MB" <<'PY'
import os, sys
folder, sizes = sys.argv[1], [int(float(mb) * 1e6) for mb in sys.argv[2].split(",")]
data = open(os.path.join(folder, "fa3.xz"), "rb").read()
off = 0
for i, size in enumerate(sizes + [len(data)]):
    if off < len(data):
        open(os.path.join(folder, f"fa3.part{i:02d}"), "wb").write(data[off:off + size])
    off += size
PY
    rm -f "$out.tmp/fa3.xz"
else
    xz -${FA3_XZ_LEVEL:-9} -T2 -c "$stage/sgl_kernel/flash_ops.abi3.so" | split -b "${FA3_PART_MB:-23}M" -d - "$out.tmp/fa3.part"
fi
(cd "$out.tmp" && sha256sum fa3.part* > fa3.sha256)
i=0
for f in "$out.tmp"/fa3.part*; do
    i=$((i + 1))
    mkdir -p "$out-p$i"
    mv "$f" "$out-p$i/"
    cp "$out.tmp/fa3.sha256" "$out-p$i/"
done
rm -rf "$out.tmp"
du -sh "$out"-p*
