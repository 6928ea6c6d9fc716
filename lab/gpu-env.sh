# Source on the GPU machine, from any run that carries one or more kit parts made by
# lab/build-gpu-kit.sh:   source lab/gpu-env.sh 0.5.23 || exit 0
# A run can carry only part of the kit, and the machine keeps /tmp only while it stays warm
# (30 s after a run), so every run stashes the parts it carries in /tmp/kit-VERSION-parts; the
# run that completes the set unpacks the kit to /tmp/kit-VERSION-site, once per machine.
# Returns 1 (after saying which parts are stashed) while the kit is still incomplete.
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; return 0 2>/dev/null || exit 0 ;; esac
_kv=${1:?usage: source lab/gpu-env.sh VERSION}
_kroot=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_kparts=/tmp/kit-$_kv-parts
_ksite=/tmp/kit-$_kv-site
mkdir -p "$_kparts"
for _kf in "$_kroot"/.[!.]*/kit-"$_kv".* "$_kroot"/[!.]*/kit-"$_kv".*; do
    [ -f "$_kf" ] && [ ! -f "$_kparts/${_kf##*/}" ] && cp "$_kf" "$_kparts"/
done
# FA3 (lab/pack-fa3.sh), when its parts come along: stashed like the kit's, installed below.
_kfa=/tmp/fa3-parts
for _kf in "$_kroot"/.fa3-p*/fa3.*; do
    [ -f "$_kf" ] && mkdir -p "$_kfa" && [ ! -f "$_kfa/${_kf##*/}" ] && cp "$_kf" "$_kfa"/
done
if [ ! -f "$_ksite/.ok" ]; then
    if [ -f "$_kparts/kit-$_kv.sha256" ] && (cd "$_kparts" && sha256sum -c --quiet "kit-$_kv.sha256" > /dev/null 2>&1); then
        rm -rf "$_ksite" && mkdir -p "$_ksite" &&
            cat "$_kparts"/kit-"$_kv".part* | tar -xJ -C "$_ksite" && touch "$_ksite/.ok"
        echo "gpu-env: kit $_kv unpacked to $_ksite"
    else
        echo "gpu-env: kit $_kv incomplete; stashed: $(cd "$_kparts" && ls | tr '\n' ' ')" >&2
        return 1
    fi
fi
if [ -f "$_kfa/fa3.sha256" ] && [ ! -f "$_ksite/sgl_kernel/flash_ops.abi3.so" ]; then
    if (cd "$_kfa" && sha256sum -c --quiet fa3.sha256 > /dev/null 2>&1); then
        cat "$_kfa"/fa3.part* | xz -d > "$_ksite/sgl_kernel/flash_ops.abi3.so" && echo "gpu-env: FA3 installed"
    else
        echo "gpu-env: FA3 incomplete; stashed: $(cd "$_kfa" && ls | tr '\n' ' ')" >&2
    fi
fi
# Triton's kernels in one known place, so lab/compile-cache.sh can hand them to the next machine;
# a carried .compile-cache/ is unpacked there once a machine.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
if [ -f "$_kroot/.compile-cache/compile-cache.tar.xz" ] && [ ! -f "$TRITON_CACHE_DIR/.from-carry" ]; then
    mkdir -p "$TRITON_CACHE_DIR" && xz -dc "$_kroot/.compile-cache/compile-cache.tar.xz" | tar -x -C "$TRITON_CACHE_DIR" &&
        touch "$TRITON_CACHE_DIR/.from-carry" &&
        echo "gpu-env: $(find "$TRITON_CACHE_DIR" -mindepth 1 -maxdepth 1 -type d | wc -l) Triton kernels unpacked from .compile-cache"
fi
# kit-shim/sitecustomize.py stands in for a cutlass-only SGLang module; see its docstring.
export PYTHONPATH=$_kroot/lab/kit-shim:$_ksite${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# The kit's sglang-kernel is the one built for the image's torch 2.11 (0.4.5); SGLang >= 0.5.20
# asks for a newer one at start-up. 0.5.23 guards the two ops 0.4.5 lacks, so skip the check.
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
# SGLang 0.5.23's default radix-tree core is a bundled Rust extension built against libtorch
# 2.14's C++ API. It does load on 2.11, but nothing vouches for the object layouts it shares with
# torch; the pure-Python tree core does the same work and was the one the smoke test ran.
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=${SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND:-python}
unset _kv _kroot _kparts _ksite _kf _kfa
