#!/usr/bin/env bash
# Train and measure a DFlash draft for SmolLM2-135M-Instruct on the lent GPU, in three runs issued
# back to back (the machine stays warm 30 s; each phase checks what the previous one left).
# Here first: ../shared/devkit/pack-smollm2.sh
#             python scripts/fetch_datasets.py --data-dir .bench-data --datasets sharegpt,gsm8k,humaneval,mbpp,mt-bench
#   1. carry .devkit .devkit-m1:               bash scripts/gpu_smollm2.sh stash
#   2. carry .devkit .devkit-m2 .bench-data:   bash scripts/gpu_smollm2.sh train
#   3. carry .devkit .bench-data:              bash scripts/gpu_smollm2.sh measure
# The draft comes back in 15 MB parts: cat $files_at/draft.part* > results/smollm2-dflash-b16/model.safetensors
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_setup.sh
out=${OUT:-$PWD/smollm2-out}
target=/tmp/smollm2 draft=/tmp/smollm2-dflash-b16
case "${1:?stash|train|measure}" in
stash)
    bash .devkit-m1/stash.sh && ls -la /tmp/devkit-parts ;;
train)
    [ -f /tmp/devkit-parts/gguf.part00 ] || { echo "chunk 1 is gone: the machine was not warm; run 'stash' again"; exit 1; }
    bash .devkit-m2/stash.sh && bash .devkit-m2/assemble.sh $target
    python3 -c "from transformers import AutoTokenizer as T; t=T.from_pretrained('$target'); print({i: t.convert_ids_to_tokens(i) for i in range(17)})"
    # The mask is a special row the chat never emits; id 16 should be <empty_output> (printed above: check it).
    python3 -m sglang_dflash.train --target $target --out $draft --data-dir .bench-data \
        --datasets sharegpt,gsm8k,mbpp,mt-bench --per-dataset ${PER_DATASET:-800} --max-new-tokens 384 \
        --block-size 16 --draft-layers 3 --mask-token-id 16 --steps ${STEPS:-1500} --batch-size 16 --save-every 500
    python3 -m sglang_dflash.train --target $target --out $draft-untrained --block-size 16 --draft-layers 3 \
        --mask-token-id 16 --steps 0
    cp $draft/config.json $draft/train_log.jsonl "$out"/ && split -b 15m $draft/model.safetensors "$out"/draft.part ;;
measure)
    [ -f $draft/model.safetensors ] || { echo "the trained draft is gone: the machine was not warm"; exit 1; }
    flags="--attention-backend triton --grammar-backend none --disable-piecewise-cuda-graph --cuda-graph-max-bs 16 --mem-fraction-static 0.5 --log-level warning"
    python3 benchmark_sglang.py --model-path $target --draft-model-path $draft --impls ar,plugin,ngram \
        --datasets gsm8k,humaneval,mt-bench --data-dir .bench-data --num-prompts 32 --max-new-tokens 256 \
        --concurrencies 1,8 --server-args "$flags" --output-dir "$out/trained" --log-dir /tmp/bench-logs
    python3 benchmark_sglang.py --model-path $target --draft-model-path $draft-untrained --impls plugin \
        --datasets gsm8k --data-dir .bench-data --num-prompts 16 --max-new-tokens 256 --concurrencies 8 \
        --server-args "$flags" --output-dir "$out/untrained" --log-dir /tmp/bench-logs ;;
esac
