#!/usr/bin/env bash
# Train and measure a DFlash draft for SmolLM2-135M-Instruct on the lent GPU. A run carries at most
# 64 MiB, so the kit and the model travel in parts (scripts/pack_carry.sh), one per run, back to back
# (the machine stays warm 30 s); every run stashes its part and says what is still missing.
# Here first: ../shared/devkit/pack-smollm2.sh && bash scripts/pack_carry.sh
#             python scripts/fetch_datasets.py --data-dir .bench-data --datasets sharegpt,gsm8k,humaneval,mbpp,mt-bench
#             python scripts/fetch_datasets.py --data-dir .bench-eval --datasets gsm8k,humaneval,mt-bench  (0.6 MB)
# The tree carries the shipped draft (24 MB), so each run holds one part and little else:
#   runs 1-5, carrying .carry1 .. .carry5:  source scripts/gpu_setup.sh || true   (or any GPU test command)
#   then, carrying .bench-data:             bash scripts/gpu_smollm2.sh train      (regenerates, trains; again: resumes)
#   or, carrying .bench-eval:               bash scripts/gpu_smollm2.sh measure [IMPLS] | profile | extra
# The draft comes back in 15 MB parts: cat $files_at/draft.part* > results/smollm2-draft/model.safetensors
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_setup.sh
out=${OUT:-$PWD/smollm2-out}
target=/tmp/smollm2
# The shipped draft when the tree has one, else the one trained on this machine.
draft=/tmp/smollm2-dflash-b16
[ -f results/smollm2-draft/model.safetensors ] && [ "$1" != train ] && [ ! -f $draft/trainer_state.pt ] \
    && draft=$PWD/results/smollm2-draft
flags="--attention-backend triton --grammar-backend none --disable-piecewise-cuda-graph --cuda-graph-max-bs 32 --mem-fraction-static 0.5 --log-level warning"
bench() {  # bench IMPLS DRAFT OUTDIR CONCURRENCIES NUM_PROMPTS
    python3 benchmark_sglang.py --model-path $target --draft-model-path $2 --impls $1 \
        --datasets gsm8k,humaneval,mt-bench --data-dir $data --num-prompts $5 --max-new-tokens 256 \
        --concurrencies $4 --waves ${WAVES:-4} --server-args "$flags" --output-dir "$out/$3" --log-dir /tmp/bench-logs \
        --summary "$out/$3/summary.json"
}
gpu_model $target
data=.bench-data; [ -d $data ] || data=.bench-eval
case "${1:?train|measure|profile|extra}" in
train)  # regenerates once, then trains TRAIN_MINUTES in all, PAUSE_MINUTES per run: run it again to resume
    python3 -c "from transformers import AutoTokenizer as T; t=T.from_pretrained('$target'); print({i: t.convert_ids_to_tokens(i) for i in range(17)})"
    # The mask is a special row the chat never emits: id 16 is <empty_output> (printed above).
    # EXAMPLES=examples.jsonl.xz (a regenerated set from an earlier run) skips the regeneration;
    # INIT_FROM=DIR starts from that draft with a fresh schedule.
    mkdir -p $draft
    [ -n "${EXAMPLES:-}" ] && [ ! -f $draft/examples.jsonl ] && xz -dc "$EXAMPLES" > $draft/examples.jsonl
    resume=; [ -f $draft/trainer_state.pt ] && resume=--resume
    [ -z "$resume" ] && [ -n "${INIT_FROM:-}" ] && resume="--init-from $INIT_FROM"
    python3 -m sglang_dflash.train --target $target --out $draft --data-dir .bench-data \
        --datasets sharegpt,gsm8k,mbpp,mt-bench --per-dataset ${PER_DATASET:-12000} --max-new-tokens 384 \
        --block-size 16 --draft-layers 3 --mask-token-id 16 --steps 1000000 --anchors ${ANCHORS:-64} \
        --lr ${LR:-1e-3} --batch-size 16 --eval-examples ${EVAL_EXAMPLES:-256} --save-every 500 \
        --max-minutes ${TRAIN_MINUTES:-20} --pause-after-minutes ${PAUSE_MINUTES:-9} \
        $resume 2>&1 | tr '\r' '\n' | awk 'NR % 500 == 0 || !/^training draft:/'
    tail -n 2 $draft/train_log.jsonl
    python3 -c "import torch; s=torch.load('$draft/trainer_state.pt', weights_only=False)
print('step', s['step'], 'trained min', round(s['train_seconds'] / 60, 2))"
    cp $draft/config.json $draft/train_log.jsonl "$out"/ && split -b 15m $draft/model.safetensors "$out"/draft.part
    [ -n "${EXAMPLES:-}" ] || xz -T0 -c $draft/examples.jsonl > "$out"/examples.jsonl.xz ;;
measure)  # AR, the plugin and the built-in on the trained draft (the one trained on this machine if any)
    bench ${2:-ar,plugin,builtin} $draft trained 1,8,32 16 ;;
profile)  # where a step's time goes, plugin vs built-in on this pair, at concurrency 1 and 32
    for c in 1 32; do
        python3 scripts/profile_step.py --model-path $target --draft-model-path $draft --concurrency $c \
            --steps 30 --max-new-tokens 1024 --server-args "$flags" --output-dir "$out/profile-c$c"
    done ;;
extra)  # the untrained draft (same layout, --steps 0) and NGRAM on the same prompts
    python3 -m sglang_dflash.train --target $target --out $draft-untrained --block-size 16 --draft-layers 3 \
        --mask-token-id 16 --steps 0
    bench plugin $draft-untrained untrained 8 16
    bench ngram $draft ngram 1,8 16 ;;
esac
