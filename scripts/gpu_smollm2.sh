#!/usr/bin/env bash
# Train and measure a DFlash draft for SmolLM2-135M-Instruct on the lent GPU. A run carries at most
# 64 MiB, so the kit and the two model chunks travel in separate runs issued back to back (the
# machine stays warm 30 s; each phase checks what the previous one left in /tmp).
# Here first: ../shared/devkit/pack-smollm2.sh
#             python scripts/fetch_datasets.py --data-dir .bench-data --datasets sharegpt,gsm8k,humaneval,mbpp,mt-bench
#   0. any run carrying .devkit (unpacks the kit), then, carrying .devkit-m1:  bash .devkit-m1/stash.sh
#   1. carry .devkit-m2 .bench-data:   bash scripts/gpu_smollm2.sh train    (regenerates, then trains CHUNK_MINUTES)
#   2. carry .bench-data:              bash scripts/gpu_smollm2.sh resume   (as often as the budget allows)
#   3. carry .bench-data:              bash scripts/gpu_smollm2.sh measure [IMPLS]; bash scripts/gpu_smollm2.sh baseline
# The draft comes back in 15 MB parts: cat $files_at/draft.part* > results/smollm2-dflash-b16/model.safetensors
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_setup.sh
out=${OUT:-$PWD/smollm2-out}
target=/tmp/smollm2 draft=/tmp/smollm2-dflash-b16
flags="--attention-backend triton --grammar-backend none --disable-piecewise-cuda-graph --cuda-graph-max-bs 32 --mem-fraction-static 0.5 --log-level warning"
train_draft() {  # one chunk of training; a chunk that finds a checkpoint resumes it (schedule by --steps)
    python3 -m sglang_dflash.train --target $target --out $draft --data-dir .bench-data \
        --datasets sharegpt,gsm8k,mbpp,mt-bench --per-dataset ${PER_DATASET:-6000} --max-new-tokens 384 \
        --block-size 16 --draft-layers 3 --mask-token-id 16 --steps ${STEPS:-8000} --batch-size 16 \
        --save-every 500 --pause-after-minutes ${CHUNK_MINUTES:-7} "$@" 2>&1 | tr '\r' '\n' | awk 'NR % 300 == 0 || !/it\/s\]|s\/it\]/'
    tail -n 2 $draft/train_log.jsonl
    # Each chunk sends the draft home, so a machine lost before 'measure' loses no training.
    cp $draft/config.json $draft/train_log.jsonl "$out"/ && split -b 15m $draft/model.safetensors "$out"/draft.part
}
case "${1:?train|resume|measure|baseline}" in
train)
    [ -f /tmp/devkit-parts/gguf.part00 ] || { echo "chunk 1 is gone: the machine was not warm; stash it again"; exit 1; }
    bash .devkit-m2/stash.sh && bash .devkit-m2/assemble.sh $target
    python3 -c "from transformers import AutoTokenizer as T; t=T.from_pretrained('$target'); print({i: t.convert_ids_to_tokens(i) for i in range(17)})"
    # The mask is a special row the chat never emits: id 16 is <empty_output> (printed above).
    python3 -m sglang_dflash.train --target $target --out $draft-untrained --block-size 16 --draft-layers 3 \
        --mask-token-id 16 --steps 0
    train_draft ;;
resume)
    [ -f $draft/trainer_state.pt ] || { echo "the training state is gone: the machine was not warm"; exit 1; }
    train_draft --resume ;;
measure)  # measure [IMPLS]: a sweep of ~4 servers fits one 10-minute run; results.json is written per server
    [ -f $draft/model.safetensors ] || { echo "the trained draft is gone: the machine was not warm"; exit 1; }
    python3 benchmark_sglang.py --model-path $target --draft-model-path $draft --impls ${2:-ar,plugin,builtin,ngram} \
        --datasets gsm8k,humaneval,mt-bench --data-dir .bench-data --num-prompts ${NUM_PROMPTS:-32} --max-new-tokens 256 \
        --concurrencies 1,8,32 --server-args "$flags" --output-dir "$out/trained" --log-dir /tmp/bench-logs \
        --summary "$out/trained/summary.json" ;;
baseline)  # the untrained draft (same layout, --steps 0) on the same prompts
    python3 benchmark_sglang.py --model-path $target --draft-model-path $draft-untrained --impls plugin \
        --datasets gsm8k,humaneval,mt-bench --data-dir .bench-data --num-prompts 16 --max-new-tokens 256 --concurrencies 8 \
        --server-args "$flags" --output-dir "$out/untrained" --log-dir /tmp/bench-logs ;;
esac
