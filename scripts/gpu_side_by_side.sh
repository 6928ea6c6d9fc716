#!/usr/bin/env bash
# AR vs plugin DFLASH vs SGLang's built-in DFLASH on the same target, draft and attention backend,
# at concurrency 1, 8 and 32, on two datasets; writes the report and merges results/summary.json keys.
#   here first:  python scripts/fetch_datasets.py --data-dir .bench-data --datasets gsm8k,mt-bench
#   then (GPU, carry .devkit and .bench-data):  bash scripts/gpu_side_by_side.sh [TARGET DRAFT]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_setup.sh
out=${OUT:-$PWD/bench-out}
tiny=/tmp/dflash-tiny
if [ $# -lt 2 ]; then
    [ -f $tiny/draft/model.safetensors ] || python3 scripts/make_tiny_pair.py $tiny > /dev/null 2>&1
fi
python3 benchmark_sglang.py --model-path "${1:-$tiny/target}" --draft-model-path "${2:-$tiny/draft}" \
    --impls ar,plugin,builtin --datasets gsm8k,mt-bench --data-dir .bench-data \
    --num-prompts ${NUM_PROMPTS:-64} --max-new-tokens 256 --concurrencies 1,8,32 \
    --server-args "--attention-backend triton --grammar-backend none --disable-piecewise-cuda-graph --cuda-graph-max-bs 32 --mem-fraction-static 0.3 --dtype bfloat16 --log-level warning" \
    --output-dir "$out" --log-dir /tmp/bench-logs --summary "$out/summary.json"
