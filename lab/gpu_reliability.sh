#!/usr/bin/env bash
# The reliability group on a real tokenizer (SmolLM2-135M-Instruct and the shipped draft), on the
# lent GPU machine. Parts made here first: lab/build-gpu-kit.sh VERSION .kitXXXX, bash
# lab/pack-smollm2.sh, and the draft copied to .smol-pdraft (results/smollm2-draft/{config.json,
# model.safetensors}). A call carries 64 MiB in all, so the parts travel in staging calls back to
# back (the machine goes back 30 s after a call returns):
#   bash lab/gpu_reliability.sh stage                 {kit 1, 2}, {kit 3, SmolLM2 1}, {SmolLM2 2, 3}
#   bash lab/gpu_reliability.sh "odd or empty or serves_what"   carrying SmolLM2 4 and .smol-pdraft
#   bash lab/gpu_reliability.sh openai
#   DFLASH_LOAD_SECONDS=300 bash lab/gpu_reliability.sh load
#   bash lab/gpu_reliability.sh --beside-load "odd or empty or serves_what"
#       the load in the background (its own pytest, pytest-load.log), and once its servers are up
#       the expression beside it: one call instead of two. First starts on a fresh machine take
#       3-4 minutes a server (Triton compiles, graph capture), later ones about a minute, and plain
#       decoding restarts after each of the four requests that end it (about a minute each).
#   DFLASH_LOAD_PAIRS=qwen3.5-hybrid DFLASH_HYBRID_RUNS=plugin_switching bash lab/gpu_reliability.sh --beside-load-tests "hybrid and not reliability"
#       the same, with any GPU tests beside the load (the expression is gpu_tests.sh's as it stands;
#       they run without DFLASH_TARGET, which would point the bf16 rule's calibration at SmolLM2)
# What fits one call (0.5.23, H200, 2026-12-02): plain decoding's odd requests on a fresh machine
# (7 minutes); on a warm machine a 300 s load beside the openai test (415 s) or beside the hybrid
# switching test (514 s). On a fresh machine a 300 s load ends too late beside anything (kit and
# SmolLM2 set-up 1.5 minutes, a first start 3): give it a warm machine or its own call.
# DFLASH_ODD_IMPLS, DFLASH_ODD_CASES, DFLASH_LOAD_PAIRS and DFLASH_LOAD_IMPL (ar: plain decoding
# under the same load) split the group across calls; reliability_summary.py joins them. 0.5.23 is
# measured in full (2026-12-02); on 0.5.17 the odd requests and openai (2026-12-02).
# 0.5.17 (H200): plain decoding's odd requests 486 s on a fresh machine, the plugin's and the built-in's 446 s,
# openai 275 s; staging: kit 1-2, kit 3 with SmolLM2 1-2, SmolLM2 3-4.
# SGLANG_VERSION picks the release (default 0.5.23). Evidence and server logs go to $OUT.
case "${1:-}" in -h|--help|"") awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
export SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
if ! source lab/gpu_setup.sh "$SGLANG_VERSION"; then
    echo "gpu_reliability: kit $SGLANG_VERSION incomplete"; exit 0
fi
gpu_model /tmp/smollm2 || { echo "gpu_reliability: SmolLM2 parts incomplete"; exit 0; }
[ "$1" = stage ] && { echo "gpu_reliability: staged"; exit 0; }
case "$1" in --beside-load|--beside-load-tests) [ -n "${2:-}" ] || { echo "gpu_reliability: $1 EXPRESSION" >&2; exit 2; } ;; esac
[ -f .smol-pdraft/model.safetensors ] && mkdir -p /tmp/smol-draft && cp -n .smol-pdraft/* /tmp/smol-draft/
[ -f /tmp/smol-draft/model.safetensors ] || { echo "gpu_reliability: carry .smol-pdraft" >&2; exit 2; }
# Servers of an earlier call that was cut off run in sessions of their own: clear the GPU first.
# Anchored on the interpreter, so a calling shell whose command line names the module survives.
pkill -f '^[^ ]*python[^ ]* -m sglang[.]launch_server' && sleep 5
export DFLASH_TARGET=/tmp/smollm2 DFLASH_DRAFT=/tmp/smol-draft
results=${OUT:-$PWD/gpu-results}
if [ "$1" = --beside-load ] || [ "$1" = --beside-load-tests ]; then
    beside="reliability and ($2)" unset=()
    [ "$1" = --beside-load-tests ] && beside=$2 unset=(-u DFLASH_TARGET -u DFLASH_DRAFT)
    rm -f "$results/load-servers-up"
    DFLASH_PYTEST_LOG=pytest-load.log bash lab/gpu_tests.sh "reliability and load" > /dev/null 2>&1 &
    load=$!
    for _ in $(seq 120); do
        [ -f "$results/load-servers-up" ] || ! kill -0 $load 2> /dev/null && break
        sleep 5
    done
    env "${unset[@]}" bash lab/gpu_tests.sh "$beside"
    wait $load
    tail -5 "$results/pytest-load.log"
else
    bash lab/gpu_tests.sh "reliability and ($1)"
fi
