#!/usr/bin/env bash
# SmolLM2 servers side by side on SGLang 0.5.23 with fa3, as the default was measured
# against fixed 16 (results/adaptive/README.md). Parts made here first: lab/build-gpu-kit.sh 0.5.23
# .kit0523, bash lab/pack-fa3.sh, bash lab/pack-smollm2.sh, the shipped draft copied to .smol-pdraft
# (results/smollm2-draft/{config.json,model.safetensors}) and .bench-eval
# (sglang-dflash-fetch-datasets --data-dir .bench-eval --datasets gsm8k,humaneval,mt-bench).
# A call carries 64 MiB in all, so the parts travel in six staging calls, back to back (the machine
# goes back 30 s after a call returns), then the measuring calls carry .smol-pdraft and .bench-eval:
#   bash lab/gpu_smollm2_pair.sh stage     {kit 1, kit 2, FA3 6}, {kit 3, FA3 1}, {FA3 2, 3}, {FA3 4, 5},
#                                          {SmolLM2 1, 2}, {SmolLM2 3, 4}: says what is still missing
#   bash lab/gpu_smollm2_pair.sh sweep     interleaved sweep, pinned, servers started together on fixed KV
#                                          pools; env IMPLS (plugin-fixed,adaptive) SETS (gsm8k,mt-bench)
#                                          LEVELS (4) WAVES (96) BUDGET (seconds, 530) NAME (sweep)
#                                          PROMPTS (16: the first N of each set, cycled within a wave)
#                                          NEW_TOKENS (256; sweep and profile: each request's output limit)
#   bash lab/gpu_smollm2_pair.sh profile   profile_step on the sets' prompts in the chat template; env
#                                          IMPLS CONC (4) STEPS (40) SET (gsm8k, or a comma list: mixed)
#                                          LIGHT (--light-too) NAME; WAVE=1 one whole wave (with LIGHT=--light:
#                                          its timeline, any server), EOS=1 requests end at EOS as in the sweeps
# ATTENTION (fa3): the servers' attention backend; triton needs no FA3 parts staged.
# Results go to $OUT/NAME. Pool them with python -m sglang_dflash.bench.pool.
case "${1:-}" in -h|--help|"") awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
mode=$1
out=${OUT:-$PWD/smollm2-pair-out}
if ! source lab/gpu_setup.sh 0.5.23; then
    echo "gpu_smollm2_pair: kit incomplete; stashed: $(ls /tmp/kit-0.5.23-parts /tmp/fa3-parts 2>/dev/null | tr '\n' ' ')"
    [ "$mode" = stage ] && exit 0 || exit 3
fi
if ! gpu_model /tmp/smollm2; then
    [ "$mode" = stage ] && exit 0 || exit 4
fi
[ -f /tmp/kit-0.5.23-site/sgl_kernel/flash_ops.abi3.so ] || echo "gpu_smollm2_pair: FA3 not staged yet" >&2
[ "$mode" = stage ] && { echo "gpu_smollm2_pair: staged"; exit 0; }
[ -f .smol-pdraft/model.safetensors ] || { echo "gpu_smollm2_pair: carry .smol-pdraft" >&2; exit 2; }
mkdir -p /tmp/smol-draft && cp .smol-pdraft/* /tmp/smol-draft/
server="--attention-backend ${ATTENTION:-fa3} --grammar-backend none --cuda-graph-max-bs-decode 64 --max-running-requests 64 --max-total-tokens 65536 --log-level warning"
mkdir -p "$out"
git log --oneline -1 > "$out/commit.txt" 2>/dev/null || true
case $mode in
    sweep)
        python3 -m sglang_dflash.bench.sweep --model-path /tmp/smollm2 --draft-model-path /tmp/smol-draft \
            --impls "${IMPLS:-plugin-fixed,adaptive}" --interleave --start-together --pin-cpus \
            --datasets "${SETS:-gsm8k,mt-bench}" --data-dir .bench-eval --num-prompts "${PROMPTS:-16}" --max-new-tokens "${NEW_TOKENS:-256}" \
            --concurrencies "${LEVELS:-4}" --waves "${WAVES:-96}" --time-budget "${BUDGET:-530}" \
            --server-args "$server" --output-dir "$out/${NAME:-sweep}" 2>&1 | grep -vE "it/s\]|s/it\]" | tail -60 ;;
    profile)
        python3 -m sglang_dflash.bench.profile_step --model-path /tmp/smollm2 --draft-model-path /tmp/smol-draft \
            --impls "${IMPLS:-plugin-fixed,adaptive}" --concurrency "${CONC:-4}" --steps "${STEPS:-40}" ${LIGHT---light-too} \
            $([ "${WAVE:-0}" = 1 ] && echo --wave) $([ "${EOS:-0}" = 1 ] && echo --stop-at-eos) \
            --dataset "${SET:-gsm8k}" --data-dir .bench-eval --max-new-tokens "${NEW_TOKENS:-256}" \
            --server-args "$server" --trace-dir /tmp/traces --output-dir "$out/${NAME:-profile}" 2>&1 | tail -40 ;;
    *) echo "gpu_smollm2_pair: unknown mode $mode (stage, sweep or profile)" >&2; exit 2 ;;
esac
