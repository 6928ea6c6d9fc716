#!/usr/bin/env bash
# The real-shape rig (sparse checkpoints written on the spot, no download) on the GPU machine, once
# the kit (and, for fa3, FA3's parts) is staged by lab/gpu_setup.sh:
#   bash lab/gpu_rig.sh profile WEIGHTS BACKEND OUTDIR   step profile, plugin then built-in, c1/c8/c32
#   bash lab/gpu_rig.sh bench WEIGHTS BACKEND OUTDIR     ar, plugin and built-in interleaved, c1/c8/c32
# WEIGHTS: zero (every draft accepted) or random (tau ~ 1); BACKEND: fa3, triton or flashinfer.
# SHAPE picks the rig (--rig-shape: qwen3-8b by default, or qwen3.5-4b, qwen3.5-27b, qwen3.6-35b-a3b;
# the 35B-A3B zero rig routes with SGLANG_SIMULATE_UNIFORM_EXPERTS=1, set by the sweep), LAYOUT its target
# classes (--rig-layout; text for 0.5.17). SGLANG_VERSION (default 0.5.23) picks the kit and the
# CUDA-graph flags; IMPLS, WAVES, CONCURRENCIES, GRAPH_BS and KV_GB override the defaults
# (ar,plugin,builtin; 24; 1,8,32; 32; 4 GiB of KV a server, 6 above c48); the plugin verifies adaptive widths unless IMPLS names plugin-fixed; EXTRA_FLAGS
# go to every server (--enable-metrics: each request's first-token time split at SGLang's stamps);
# WAVE=1 profiles one whole wave of 256-token requests, its prefill included, instead of 20 steps;
# LIGHT=1 traces without Python stacks: kernel time, and where the GPU sits idle and why (with WAVE=1,
# both servers over the same context lengths; steady mode starts each trace at a context of its own);
# LIGHT=both traces each level both ways on one server, light first (cN-light, then cN).
# MAX_NEW=N: each request's length. Steady profile: default 2048 (at τ ≈ 1 and c1 a longer one keeps
# an admission out of the 20 traced steps). Bench: default 256 (1024 weighs a wave by its decode).
# PREFILL_GRAPHS=N: prefills from SGLang's breakable graphs (its default) up to N tokens (default 4096); off: eagerly.
# MEM_FRACTION (profile): each server's --mem-fraction-static (default 0.45; the servers run one at a
# time, so 0.85 fits a 35B-A3B fp8 server on an H100).
# PIN=1 (bench): each server on CPUs of its own (--pin-cpus), so no server's first tokens wait on another's.
# BUDGET=SECONDS (bench): --time-budget, set 30-60 s below the call's limit: a later server starts only if
# time to measure is left after it (a third of BUDGET, or MEASURE=SECONDS: a hybrid rig's cold starts take
# 3-5 minutes, its three levels of 16 waves under a minute), and a level cut by the budget keeps the waves it finished.
# LATER_START=SECONDS (bench, with BUDGET): what a later server's start is expected to take, in place of the slowest
# start so far (a fresh machine's first start compiles the target's kernels for the later ones).
# PACK=1: OUTDIR packed as OUTDIR.tgz at the end (a call returns at most 8 files from $OUT; a bench folder holds 7).
case "${1:-}" in -h|--help|"") awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;; esac
set -uo pipefail
mode=$1 weights=${2:?weights} backend=${3:?backend} out=${4:?outdir}
version=${SGLANG_VERSION:-0.5.23}
cd "$(dirname "$0")/.."
source lab/gpu_setup.sh "$version" || exit 1
# Prefills from SGLang's breakable prefill graphs, its default, captured up to PREFILL_GRAPHS tokens
# (default 4096: a c32 wave of 128-token prompts; SGLang's own 8192 takes minutes at this size), or
# eagerly with PREFILL_GRAPHS=off (every rig run before 2026-11-25). Decode graphs up to GRAPH_BS.
case $version in
    0.5.17|0.5.18|0.5.19) graphs="--disable-piecewise-cuda-graph --cuda-graph-max-bs ${GRAPH_BS:-32}" ;;
    *) graphs="--disable-prefill-cuda-graph --cuda-graph-max-bs-decode ${GRAPH_BS:-32}" ;;
esac
prefill_graphs=${PREFILL_GRAPHS:-4096}
[ "$prefill_graphs" = off ] || graphs="--cuda-graph-max-bs-prefill $prefill_graphs ${graphs#--disable-* }"
flags="--attention-backend $backend $graphs --log-level warning ${EXTRA_FLAGS:-}"
rig_shape="--rig-shape ${SHAPE:-qwen3-8b} --rig-layout ${LAYOUT:-multimodal}"
# SGLang caps a speculative server at 48 running requests; beyond that every level's servers must
# run all their requests, or DFLASH runs c64 in two rounds where plain decoding runs one.
[ "${GRAPH_BS:-32}" -gt 48 ] && flags+=" --max-running-requests $GRAPH_BS"
concs=${CONCURRENCIES:-1,8,32}
# Each server's KV pool: 4 GiB holds 32 rig requests (128 + 256 tokens) but not 64 (23,380 of 24,576
# tokens on a DFLASH server), so a level above 48 gets 6 GiB; KV_GB overrides.
top=$(tr , '\n' <<< "$concs" | sort -n | tail -1)
kv_gb=${KV_GB:-$([ "$top" -gt 48 ] && echo 6 || echo 4)}
mkdir -p "$out"
case $mode in
    profile)
        python3 -m sglang_dflash.bench.profile_step --rig "$weights" $rig_shape --impls "${IMPLS:-plugin,builtin}" \
            --concurrency "$concs" --steps 20 --trace-dir /tmp/traces-$weights-$backend \
            $(case ${LIGHT:-0} in 1) echo --light ;; both) echo --light-too ;; esac) \
            $([ "${WAVE:-0}" = 1 ] && echo "--wave --max-new-tokens 256" || echo "--max-new-tokens ${MAX_NEW:-2048}") \
            --server-args "$flags --mem-fraction-static ${MEM_FRACTION:-0.45}" --output-dir "$out" ;;
    bench)
        python3 -m sglang_dflash.bench.sweep --rig "$weights" $rig_shape --impls "${IMPLS:-ar,plugin,builtin}" --interleave \
            --concurrencies "$concs" --num-prompts 8 --waves "${WAVES:-24}" --max-new-tokens "${MAX_NEW:-256}" \
            $([ "${PIN:-0}" = 1 ] && echo --pin-cpus) ${BUDGET:+--time-budget $BUDGET} ${MEASURE:+--measure-seconds $MEASURE} \
            ${LATER_START:+--later-start-seconds $LATER_START} \
            --kv-cache-gb "$kv_gb" --server-args "$flags" --output-dir "$out" --summary "$out/summary.json" ;;
    *) echo "gpu_rig.sh: unknown mode $mode (profile or bench)" >&2; exit 2 ;;
esac
rc=$?
if [ "${PACK:-0}" = 1 ] && [ -d "$out" ]; then
    tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && rm -rf "$out"
fi
exit $rc
