"""Where a decode step's time goes: plugin DFLASH vs the built-in, under the same steady load.

Each implementation serves the same target and draft; while ``--concurrency`` requests keep the
batch full, SGLang's profiler records ``--steps`` scheduler steps with Python stacks. The traces
are summarised here (they are tens of MB): per step, the host time of every Python function
(inclusive), the GPU kernel time and the number of launches.

    python scripts/profile_step.py --model-path T --draft-model-path D --output-dir OUT [--impls plugin,builtin]
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import threading
import time
import urllib.request
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmark_sglang import Server, ServerSpec, run_requests  # noqa: E402


SPEC_CODE = ("sglang_dflash/", "speculative/")


def load_trace(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize_trace(events: list[dict], steps: int, top: int = 80) -> dict:
    """Per-step host time by Python function (inclusive, scheduler thread) and GPU kernel totals."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in complete if e.get("cat") == "kernel"]
    python = [e for e in complete if e.get("cat") == "python_function"]
    # The scheduler thread is the one with the most Python time.
    per_thread = defaultdict(float)
    for e in python:
        per_thread[(e.get("pid"), e.get("tid"))] += e["dur"]
    main = max(per_thread, key=per_thread.get) if per_thread else None
    by_function, self_time = defaultdict(float), defaultdict(float)
    calls = defaultdict(int)
    stack: list[dict] = []  # open calls; a call's self time is its duration minus its children's
    for e in sorted((e for e in python if (e.get("pid"), e.get("tid")) == main), key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            self_time[stack[-1]["name"]] -= e["dur"]
        stack.append(e)
        by_function[e["name"]] += e["dur"]
        self_time[e["name"]] += e["dur"]
        calls[e["name"]] += 1
    ours = lambda n: any(k in n for k in SPEC_CODE)  # noqa: E731
    kernel_time = defaultdict(float)
    for e in kernels:
        kernel_time[e["name"][:90]] += e["dur"]
    span = (max(e["ts"] + e["dur"] for e in complete) - min(e["ts"] for e in complete)) if complete else 0.0
    per_step = lambda us: round(us / steps, 1)  # noqa: E731
    ranked = sorted(by_function.items(), key=lambda x: -x[1])
    return {
        "steps": steps,
        "trace_span_us_per_step": per_step(span),
        "gpu_kernel_us_per_step": per_step(sum(e["dur"] for e in kernels)),
        "kernel_launches_per_step": round(len(kernels) / steps, 1),
        "python_us_per_step": {n: per_step(t) for n, t in ranked[:top]},
        "python_calls_per_step": {n: round(calls[n] / steps, 2) for n, _ in ranked[:top]},
        "python_self_us_per_step": {n: per_step(t) for n, t in sorted(self_time.items(), key=lambda x: -x[1])[:top]},
        # every function of the speculative worker's own code, inclusive
        "spec_code_us_per_step": {n: per_step(t) for n, t in ranked if ours(n)},
        "kernels_us_per_step": {n: per_step(t) for n, t in sorted(kernel_time.items(), key=lambda x: -x[1])[:top]},
    }


def keep_busy(url: str, payload: dict, concurrency: int, stop: threading.Event) -> threading.Thread:
    def loop():
        while not stop.is_set():
            run_requests(url, [payload] * concurrency, concurrency, desc="load")

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def wait_for_trace(trace_dir: str, timeout_s: float = 180) -> None:
    """Until a trace file exists and its size has stopped changing (the exporter writes for a while)."""
    deadline, last = time.time() + timeout_s, None
    while time.time() < deadline:
        sizes = [os.path.getsize(p) for p in glob.glob(os.path.join(trace_dir, "*.json*"))]
        if sizes and sizes == last:
            return
        last = sizes or None
        time.sleep(3)


def profile_impl(spec: ServerSpec, args, out_dir: str) -> dict:
    trace_dir = os.path.join(args.trace_dir, spec.label)
    os.makedirs(trace_dir, exist_ok=True)
    payload = {"text": args.prompt, "sampling_params": {"max_new_tokens": args.max_new_tokens, "temperature": 0,
                                                         "ignore_eos": True}}
    with Server(spec, log_path=os.path.join(out_dir, f"server-{spec.label}.log"), timeout_s=600) as server:
        stop = threading.Event()
        loader = keep_busy(server.url, payload, args.concurrency, stop)
        time.sleep(args.settle_s)  # batch full, caches warm
        start = {"output_dir": trace_dir, "num_steps": args.steps, "activities": ["CPU", "GPU"], "with_stack": True}
        req = urllib.request.Request(server.url + "/start_profile", data=json.dumps(start).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=600).read()  # answers plain text
        wait_for_trace(trace_dir)
        stop.set()
        loader.join(timeout=120)
    traces = sorted(glob.glob(os.path.join(trace_dir, "*.json*")))
    if not traces:
        raise SystemExit(f"{spec.label}: no trace written to {trace_dir}")
    return {"trace": os.path.basename(traces[-1]), **summarize_trace(load_trace(traces[-1]), args.steps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--draft-model-path", required=True)
    ap.add_argument("--impls", default="plugin,builtin")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--prompt", default="Write a long story about a lighthouse keeper and the sea.")
    ap.add_argument("--settle-s", type=float, default=8.0)
    ap.add_argument("--server-args", default="--attention-backend triton --grammar-backend none "
                    "--disable-piecewise-cuda-graph --cuda-graph-max-bs 32 --mem-fraction-static 0.3 --log-level warning")
    ap.add_argument("--trace-dir", default="/tmp/dflash-traces")
    ap.add_argument("--output-dir", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    report = {"settings": vars(args)}
    for impl in args.impls.split(","):
        spec = ServerSpec(impl, args.model_path, args.draft_model_path, None, args.server_args.split())
        report[impl] = profile_impl(spec, args, args.output_dir)
        print(json.dumps({impl: {k: report[impl][k] for k in ("trace_span_us_per_step", "gpu_kernel_us_per_step",
                                                               "kernel_launches_per_step")}}), flush=True)
    with open(os.path.join(args.output_dir, "profile_step.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
