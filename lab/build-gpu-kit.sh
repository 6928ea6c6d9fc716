#!/bin/bash
# Build the kit that lets the GPU machine (no package registry, torch 2.11 / triton 3.6 already
# there) import one SGLang version: the wheels in lab/gpu-kit-VERSION.txt, unpacked, stripped and
# packed into one tar.xz, split so each part rides along with one run.
#
#   lab/build-gpu-kit.sh VERSION OUTDIR      e.g.  lab/build-gpu-kit.sh 0.5.23 .kit0523
#
# Writes OUTDIR-p1 .. OUTDIR-pN, each holding one part (kit-VERSION.partNN) and the checksum list
# of all parts. A run may carry at most 64 MiB and the tracked tree already takes ~32 MB, hence
# parts of 23 MiB (24.1 MB). Carry the parts in back-to-back runs (the machine stays warm 30 s)
# and start each run with `source lab/gpu-env.sh VERSION`: it stashes what the run carries in
# /tmp and unpacks the kit once all parts are there.
#
# Left out to fit: FA3 (sgl_kernel/flash_ops.abi3.so, 1.1 GB) and the sm100 ops, so use
# --attention-backend triton (or flashinfer, which JIT-compiles its kernels); sglang/test,
# sglang/multimodal_gen, SGLang's Rust benchmark module, and xgrammar 0.2.1's static library.
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;; esac
set -euo pipefail
ver=${1:?usage: build-gpu-kit.sh VERSION OUTDIR}
out=${2:?usage: build-gpu-kit.sh VERSION OUTDIR}
list=$(cd "$(dirname "$0")" && pwd)/gpu-kit-$ver.txt
[ -f "$list" ] || { echo "no package list $list" >&2; exit 1; }
part_mb=${KIT_PART_MB:-23}
# One wheel folder per list: unzipping a shared one would mix two versions of a package.
wheels=${KIT_CACHE:-$HOME/.cache/sglang-gpu-kit}/wheels-$ver-$(sha256sum "$list" | cut -c1-8)
mkdir -p "$wheels"
plat=""
for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    plat+=" --platform ${p}_x86_64"
done
# The GPU machine runs CPython 3.12; --no-deps because the list is the closure we want, minus
# what the image has (torch above all, which pip would otherwise pull in at 2 GB).
grep -v '^#' "$list" | grep . > "$wheels/reqs.txt"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $plat --platform any -d "$wheels" -r "$wheels/reqs.txt"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
for w in "$wheels"/*.whl; do
    unzip -qq -o "$w" -d "$stage" -x 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/sm100/*' \
        'sglang/test/*' 'sglang/multimodal_gen/*' 'sglang/srt/rust_extensions/_bench*' 'xgrammar/lib/*' \
        2> >(grep -v '^caution: excluded filename not matched' >&2)
done
# Debug symbols are most of the size of these libraries and of no use there.
find "$stage" -name '*.so' -exec strip --strip-unneeded {} + 2>/dev/null || true
rm -rf "$out"-p* "$out.tmp"
mkdir -p "$out.tmp"
(cd "$stage" && tar -cf - --exclude='__pycache__' --sort=name . | xz -9 -T2) \
    | split -b "${part_mb}M" -d - "$out.tmp/kit-$ver.part"
(cd "$out.tmp" && sha256sum kit-"$ver".part* > "kit-$ver.sha256")
i=0
for f in "$out.tmp"/kit-"$ver".part*; do
    i=$((i + 1))
    mkdir -p "$out-p$i"
    mv "$f" "$out-p$i/"
    cp "$out.tmp/kit-$ver.sha256" "$out-p$i/"
done
rm -rf "$out.tmp"
du -sh "$out"-p*
