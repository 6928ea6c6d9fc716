#!/bin/bash
# GPU smoke test of plain SGLang from the kit (the repo's plugin kept out): an AR server and
# built-in DFLASH servers (overlap scheduler on and off) on a tiny random Qwen3/DFlash pair, each
# asked one greedy /generate. Writes to $OUT: env.txt, ar.log, dflash.log, dflash-nooverlap.log,
# results.txt.
#   bash lab/smoke-sglang.sh VERSION        (the kit's parts must all have been carried)
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;; esac
ver=${1:?usage: smoke-sglang.sh VERSION}
out=${OUT:-/tmp/smoke-out}
mkdir -p "$out"
cd "$(dirname "$0")/.."
t0=$(date +%s)
source lab/gpu-env.sh "$ver" || exit 0
export SGLANG_PLUGINS=none  # an allow-list naming no plugin: plain SGLang only
res=$out/results.txt
echo "kit ready after $(( $(date +%s) - t0 )) s" | tee "$res"

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    timeout 120 python3 - <<'PY'
import importlib, importlib.metadata as md
for m in ["torch", "triton", "sglang", "sgl_kernel", "flashinfer", "transformers", "tokenizers",
          "tvm_ffi", "xgrammar"]:
    try:
        mod = importlib.import_module(m)
        print(f"{m:14s} {str(getattr(mod, '__version__', '?')):24s} {mod.__file__}")
    except Exception as e:
        print(f"{m:14s} IMPORT FAILED: {type(e).__name__}: {e}")
import torch
import sgl_kernel.kvcacheio as kv
print("sgl_kernel has get_device_accessible_ptr:", hasattr(torch.ops.sgl_kernel, "get_device_accessible_ptr"))
import sglang.kernels.ops.gemm.cutedsl_dual_gemm as dg
print("dual gemm module:", dg, "can_use:", dg.can_use_dual_gemm(16, 512, 1536, dg.DualGemmQuantMode.UNQUANT))
PY
    # Whether the bundled Rust radix tree (built against torch 2.14) loads on this torch.
    echo "--- rust tree core import:"
    timeout 60 python3 -c "import sglang.srt.mem_cache.rust_tree_core.extension as e; print('rust tree core OK', e.bindings)" 2>&1 | tail -3
    echo "--- tiny pair:"
    # The script reads the draft config class from the repo's package (the plugin stays off).
    PYTHONPATH=$PWD:$PYTHONPATH timeout 120 python3 scripts/make_tiny_pair.py /tmp/tiny 2>&1 | tail -5
    ls /tmp/tiny/target /tmp/tiny/draft
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

# SGLang 0.5.20 renamed the CUDA-graph flags: --disable-piecewise-cuda-graph became
# --disable-prefill-cuda-graph, and --cuda-graph-max-bs (now ambiguous) --cuda-graph-max-bs-decode.
if [ "$(printf '%s\n' 0.5.20 "$ver" | sort -V | head -1)" = 0.5.20 ]; then
    graph=(--disable-prefill-cuda-graph --cuda-graph-max-bs-decode 4)
else
    graph=(--disable-piecewise-cuda-graph --cuda-graph-max-bs 4)
fi
common=(--attention-backend triton "${graph[@]}" --mem-fraction-static 0.3 --model-path /tmp/tiny/target)
draft=(--speculative-algorithm DFLASH --speculative-draft-model-path /tmp/tiny/draft)
pids=()
start() {  # start NAME PORT ARGS...: launch a server in the background, its log in $out/NAME.log
    local name=$1 port=$2; shift 2
    # Own process group, so that stop takes the server's scheduler and detokenizer with it.
    setsid python3 -m sglang.launch_server "${common[@]}" --port "$port" "$@" > "$out/$name.log" 2>&1 &
    pids+=($!)
    eval "pid_$port=$! t_$port=$(date +%s)"
}
probe() {  # probe NAME PORT LIMIT: wait for /health, then one /generate
    local name=$1 port=$2 limit=$3 pid_var=pid_$2 t_var=t_$2
    local pid=${!pid_var} ts=${!t_var}
    while ! curl -sf "localhost:$port/health" > /dev/null; do
        if ! kill -0 "$pid" 2> /dev/null; then echo "$name: server died" | tee -a "$res"; tail -30 "$out/$name.log"; return 1; fi
        if [ $(( $(date +%s) - ts )) -gt "$limit" ]; then echo "$name: not up after $limit s" | tee -a "$res"; tail -30 "$out/$name.log"; return 1; fi
        sleep 2
    done
    echo "$name: up after $(( $(date +%s) - ts )) s" | tee -a "$res"
    curl -s "localhost:$port/generate" -H 'Content-Type: application/json' \
        -d '{"text": "hello", "sampling_params": {"max_new_tokens": 16, "temperature": 0}, "return_logprob": true}' \
        | python3 -c "import json,sys; r=json.load(sys.stdin); m=r.get('meta_info',{}); print(json.dumps({'text': r.get('text'), 'ids': r.get('output_ids') or [t[1] for t in m.get('output_token_logprobs',[])], 'spec_verify_ct': m.get('spec_verify_ct'), 'completion_tokens': m.get('completion_tokens'), 'error': r.get('error') or r.get('message')}))" \
        2>&1 | sed "s/^/$name: /" | tee -a "$res"
}
stop() { kill -- -"$1" 2> /dev/null; wait "$1" 2> /dev/null; }

# AR first, alone: it pays for the JIT kernel builds that later servers find cached.
start ar 30000
probe ar 30000 $(( 330 - ($(date +%s) - t0) ))
stop "$pid_30000"
# Both DFLASH servers at once, to stay within one run's limit. The later one sizes its KV pool
# from what the other left free, so it gets only ~10k tokens: enough here, not for benchmarks.
start dflash 30001 "${draft[@]}"
start dflash-nooverlap 30002 "${draft[@]}" --disable-overlap-schedule
probe dflash 30001 $(( 500 - ($(date +%s) - t0) ))
probe dflash-nooverlap 30002 $(( 510 - ($(date +%s) - t0) ))
for p in "${pids[@]}"; do stop "$p"; done
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$res"
