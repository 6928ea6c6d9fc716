#!/usr/bin/env bash
# Train and measure a DFlash draft for SmolLM2-135M-Instruct on the lent GPU. A run carries at most
# 64 MiB, so the kit and the two model chunks travel in separate runs issued back to back (the
# machine stays warm 30 s; each phase checks what the previous one left in /tmp).
# Here first: ../shared/devkit/pack-smollm2.sh
#             python scripts/fetch_datasets.py --data-dir .bench-data --datasets sharegpt,gsm8k,humaneval,mbpp,mt-bench
#   0. any run carrying .devkit (unpacks the kit), then, carrying .devkit-m1:  bash .devkit-m1/stash.sh
#   1. carry .devkit-m2 .bench-data:   bash scripts/gpu_smollm2.sh train
#   2. carry .bench-data:              bash scripts/gpu_smollm2.sh measure
# The draft comes back in 15 MB parts: cat $files_at/draft.part* > results/smollm2-dflash-b16/model.safetensors
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_setup.sh
out=${OUT:-$PWD/smollm2-out}
target=/tmp/smollm2 draft=/tmp/smollm2-dflash-b16
case "${1:?train|measure}" in
train)
    [ -f /tmp/devkit-parts/gguf.part00 ] || { echo "chunk 1 is gone: the machine was not warm; stash it again"; exit 1; }
    bash .devkit-m2/stash.sh && bash .devkit-m2/assemble.sh $target
    python3 -c "from transformers import AutoTokenizer as T; t=T.from_pretrained('$target'); print({i: t.convert_ids_to_tokens(i) for i in range(17)})"
    # The mask is a special row the chat never emits: id 16 is <empty_output> (printed above).
    python3 -m sglang_dflash.train --target $target --out $draft-untrained --block-size 16 --draft-layers 3 \
        --mask-token-id 16 --steps 0
    # --max-minutes keeps the phase inside one 10-minute run (the LR schedule fits the budget).
    python3 -m sglang_dflash.train --target $target --out $draft --data-dir .bench-data \
        --datasets sharegpt,gsm8k,mbpp,mt-bench --per-dataset ${PER_DATASET:-1200} --max-new-tokens 384 \
        --block-size 16 --draft-layers 3 --mask-token-id 16 --steps 20000 --max-minutes ${TRAIN_MINUTES:-5} \
        --batch-size 16 --save-every 500 2>&1 | tr '\r' '\n' | awk 'NR % 200 == 0 || !/it\/s\]|s\/it\]/'
    tail -n 3 $draft/train_log.jsonl
    cp $draft/config.json $draft/train_log.jsonl "$out"/ && split -b 15m $draft/model.safetensors "$out"/draft.part ;;
measure)
    [ -f $draft/model.safetensors ] || { echo "the trained draft is gone: the machine was not warm"; exit 1; }
    flags="--attention-backend triton --grammar-backend none --disable-piecewise-cuda-graph --cuda-graph-max-bs 32 --mem-fraction-static 0.5 --log-level warning"
    python3 benchmark_sglang.py --model-path $target --draft-model-path $draft --impls ar,plugin,builtin,ngram \
        --datasets gsm8k,humaneval,mt-bench --data-dir .bench-data --num-prompts ${NUM_PROMPTS:-32} --max-new-tokens 256 \
        --concurrencies 1,8,32 --server-args "$flags" --output-dir "$out/trained" --log-dir /tmp/bench-logs \
        --summary "$out/trained/summary.json"
    python3 benchmark_sglang.py --model-path $target --draft-model-path $draft-untrained --impls plugin \
        --datasets gsm8k,humaneval,mt-bench --data-dir .bench-data --num-prompts 16 --max-new-tokens 256 --concurrencies 8 \
        --server-args "$flags" --output-dir "$out/untrained" --log-dir /tmp/bench-logs ;;
esac
