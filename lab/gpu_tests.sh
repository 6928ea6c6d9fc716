#!/usr/bin/env bash
# GPU test run on the lent machine: bash lab/gpu_tests.sh [pytest -k expression]
# The kit: lab/build-gpu-kit.sh parts carried in back-to-back runs (lab/gpu_setup.sh; SGLANG_VERSION picks the release).
# Results (JSON evidence, server logs) go to $OUT when set, else ./gpu-results. Each fits one 10-minute run:
#   bash lab/gpu_tests.sh "not bfloat16 and not reliability and not draft_graphs"
#                                # triton kernels, fp32 lossless, sampling, KV
#   bash lab/gpu_tests.sh draft_graphs                          # fp32: the plugin's draft graphs against
#                                # SGLang's runner, the same verify steps request by request
#   bash lab/gpu_tests.sh bfloat16                              # bf16 near-tie rule, plugin and built-in
#   DFLASH_TARGET=/tmp/smollm2 DFLASH_DRAFT=/tmp/smol-draft bash lab/gpu_tests.sh reliability
#                                # odd requests (AR, built-in, plugin), the openai client, c64 load with
#                                # cancels on SmolLM2 and the Qwen3.5 hybrid (lab/gpu_reliability.sh stages it)
#   DFLASH_TP_SIZE=2 bash lab/gpu_tests.sh "float32 and greedy" # on nvidia-h200-x2
#   bash lab/gpu_tests.sh "hybrid and not builtin"              # Qwen3.5 hybrid target, draft window
#   bash lab/gpu_tests.sh "hybrid and builtin"                  # the built-in on the checkpoint test
#   DFLASH_TARGET=/tmp/smollm2 DFLASH_DRAFT=$PWD/results/smollm2-draft bash lab/gpu_tests.sh "bfloat16 and greedy"
#                                # bf16 rule on a real pair, held-out chat prompts (carry .bench-eval with
#                                # gsm8k, humaneval and mt-bench)
#   DFLASH_ATTENTION_BACKEND=fa3 DFLASH_PLUGIN_ENV=SGLANG_DFLASH_WIDTHS=auto,SGLANG_DFLASH_RAGGED=1,SGLANG_DFLASH_FALLBACK=force,SGLANG_DFLASH_WIDTH_POLICY=cycle \
#     DFLASH_RUNS=plugin:16 \
#     DFLASH_TARGET=/tmp/smollm2 DFLASH_DRAFT=$PWD/results/smollm2-draft bash lab/gpu_tests.sh "bfloat16 and greedy"
#                                # ragged verify (fa3, FA3 staged), width-1 lanes forced, under the same rule
#   DFLASH_PREFILL_GRAPHS=on bash lab/gpu_tests.sh ...          # prefills from SGLang's default breakable graphs
#                                # (a number N: captured up to N tokens); the default, off, runs them eagerly
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
source lab/gpu_setup.sh "${SGLANG_VERSION:-0.5.17}" || exit 0
export DFLASH_TINY_DIR=${DFLASH_TINY_DIR:-/tmp/dflash-tiny} DFLASH_GPU_RESULTS=${OUT:-$PWD/gpu-results}
[ -f "$DFLASH_TINY_DIR/draft/model.safetensors" ] || python3 scripts/make_tiny_pair.py "$DFLASH_TINY_DIR" > /dev/null 2>&1
# --line-buffered: a call's timeout that ends the run still leaves what pytest printed in the log.
python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider ${1:+-k "$1"} 2>&1 | grep --line-buffered -vE "it/s\]|s/it\]" | tee "$DFLASH_GPU_RESULTS/${DFLASH_PYTEST_LOG:-pytest.log}"
