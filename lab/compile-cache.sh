#!/usr/bin/env bash
# Triton's compiled kernels from one GPU machine to the next. A fresh machine compiles every Triton
# kernel a server uses, each autotuned variant too: the Qwen3.5-4B rig's first start took 206-253 s
# against 83-103 s once its kernels were built (H200, 0.5.23, 2026-12-05). gpu-env.sh points Triton
# at /tmp/triton-cache and, when a call carries .compile-cache/, unpacks it there first.
#   bash lab/compile-cache.sh save OUT   at the end of a call whose servers ran: the cache as
#                                        OUT/compile-cache.tar.xz (kept under 15 MiB), and the run
#                                        folders' server logs in OUT/server-logs.tgz, since at most
#                                        8 files come back from OUT
# Then, here: mkdir -p .compile-cache && cp FILES_AT/compile-cache.tar.xz .compile-cache/, and carry
# .compile-cache in the call that starts the first server (the kit and the cache share its 64 MiB).
# The cache matches the kit it was built with: Triton recompiles what it does not find.
set -euo pipefail
case "${1:-}" in
    save) out=${2:?usage: bash lab/compile-cache.sh save OUT} ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "usage: bash lab/compile-cache.sh save OUT (--help: what it does)" >&2; exit 2 ;;
esac
cache=${TRITON_CACHE_DIR:-/tmp/triton-cache}
if [ ! -d "$cache" ] || [ -z "$(ls -A "$cache")" ]; then
    echo "compile-cache: $cache is empty; nothing saved"
    exit 0
fi
mapfile -t logs < <(cd "$out" && find . -mindepth 2 -maxdepth 2 -name 'server-*.log' | sort)
if [ ${#logs[@]} -gt 0 ]; then
    tar -czf "$out/server-logs.tgz" -C "$out" "${logs[@]}" && (cd "$out" && rm -f "${logs[@]}")
fi
archive=$(mktemp --suffix .tar.xz)
tar -C "$cache" --exclude ./.from-carry -cf - . | xz -T0 -6 > "$archive"
size=$(stat -c %s "$archive")
kernels=$(find "$cache" -mindepth 1 -maxdepth 1 -type d | wc -l)
if [ "$size" -le $((15 * 1024 * 1024)) ]; then
    mv "$archive" "$out/compile-cache.tar.xz"
    echo "compile-cache: $kernels kernels, $((size / 1024)) KiB in $out/compile-cache.tar.xz"
else
    rm -f "$archive"
    echo "compile-cache: $kernels kernels, $((size / 1024 / 1024)) MiB packed, over the 15 MiB a returned file may hold; not saved"
fi
