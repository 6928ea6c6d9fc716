"""Where a decode step's time goes: plugin DFLASH vs the built-in, on the same work.

Each implementation serves the same target and draft. SGLang's profiler records, with Python
stacks, either ``--steps`` scheduler steps while ``--concurrency`` requests keep the batch full, or
(``--wave``) one whole wave of ``--concurrency`` identical requests, so both are traced over the same
context lengths. The traces are summarised here (they are tens of MB): per step, the host time of
every Python function (inclusive and self), the GPU kernel time and launches, the GPU time by the
worker call that launched each kernel, and where the host waited on the GPU.

    python -m sglang_dflash.bench.profile_step --model-path T --draft-model-path D --output-dir OUT \\
        [--impls plugin,builtin] [--wave]
    python -m sglang_dflash.bench.profile_step --rig zero --impls ar,plugin,builtin --output-dir OUT

``--rig zero|random`` profiles the benchmark's real-shape pair (no download; token-id prompts).
``--dataset NAME`` sends a cached set's prompts in the target's chat template, as the sweeps do, in
place of the one ``--prompt`` (with a raw-text prompt a chat draft accepts less, and an adaptive
server verifies narrower widths than it does in the sweeps).

The summary goes to OUT/profile_step.json, the raw traces to --trace-dir.
"""

from __future__ import annotations

import functools
import glob
import gzip
import itertools
import json
import os
import re
import shlex
import statistics
import sys
import threading
import time
from collections import defaultdict
from typing import Optional

from . import rig, sweep
from .cli import comma_list, parser
from .client import post_json, run_requests
from .datasets import DEFAULT_DIR, FETCH_COMMAND, load_dataset_prompts, problem_with_cache, problem_with_names
from .server import DFLASH_IMPLS, Server, ServerSpec, is_implementation, split_block_size
from .stats import summarize


SPEC_CODE = ("sglang_dflash/", "speculative/")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
OUTSIDE = "(outside the speculative worker)"


def load_trace(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def frame_name(name: str) -> str:
    """A Python frame's name without object addresses, so both servers' traces share names."""
    return re.sub(r" at 0x[0-9a-f]+", "", name)


def caller_label(frames: list[dict]) -> str:
    """The speculative-worker call that encloses a launch: its innermost frame of the worker's own
    code and the call it made, e.g. ``worker.py(336): draft_step > model_runner.py(1382): forward``.
    A CUDA-graph replay then names the graph (draft or target), an eager op the op."""
    for depth in range(len(frames) - 1, -1, -1):
        if any(k in frames[depth]["name"] for k in SPEC_CODE):
            label = frame_name(frames[depth]["name"])
            return label + (" > " + frame_name(frames[depth + 1]["name"]) if depth + 1 < len(frames) else "")
    return OUTSIDE


def scheduler_thread(events: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """Complete events, and the scheduler thread's (the one with the most Python time) Python
    frames and CUDA runtime calls."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    python = [e for e in complete if e.get("cat") == "python_function"]
    per_thread = defaultdict(float)
    for e in python:
        per_thread[(e.get("pid"), e.get("tid"))] += e["dur"]
    main = max(per_thread, key=per_thread.get) if per_thread else None
    on_main = lambda e: (e.get("pid"), e.get("tid")) == main  # noqa: E731
    return (complete, [e for e in python if on_main(e)],
            [e for e in complete if e.get("cat") in LAUNCH_CATEGORIES and on_main(e)])


def first_token_path(events: list[dict]) -> Optional[dict]:
    """Wave mode: from the wave's prefill call to the scheduler streaming its first tokens, in ms
    from the prefill call's start: the prefill's host call and GPU work, the next step's launch
    (the overlap scheduler launches it before it processes the prefill's result), the result
    processing, and every wait of the host on the GPU in between."""
    complete, python, runtime = scheduler_thread(events)
    worker = sorted((e for e in python if e["name"].endswith(": forward_batch_generation")
                     and any(k in e["name"] for k in SPEC_CODE)), key=lambda e: e["ts"])
    if not worker:
        return None
    prefill = worker[0]
    t0 = prefill["ts"]
    later = sorted((e for e in python if e["ts"] >= t0), key=lambda e: e["ts"])
    after = lambda name: next((e for e in later if e["name"].endswith(name)), None)  # noqa: E731
    processed, streamed = after(": process_batch_result_prefill"), after(": stream_output")
    if processed is None:
        return None
    end = processed["ts"] + processed["dur"]
    ms = lambda us: round(us / 1000, 3)  # noqa: E731
    inside = lambda e, outer: outer["ts"] <= e["ts"] <= outer["ts"] + outer["dur"]  # noqa: E731
    launched = {e.get("args", {}).get("correlation") for e in runtime if inside(e, prefill)}
    prefill_kernels = [e for e in complete if e.get("cat") == "kernel"
                       and e.get("args", {}).get("correlation") in launched]
    out = {"prefill_host": [0.0, ms(prefill["dur"])]}
    if prefill_kernels:
        out["prefill_gpu"] = [ms(min(e["ts"] for e in prefill_kernels) - t0),
                              ms(max(e["ts"] + e["dur"] for e in prefill_kernels) - t0)]
    if len(worker) > 1 and worker[1]["ts"] < end:
        out["next_step_host"] = [ms(worker[1]["ts"] - t0), ms(worker[1]["ts"] + worker[1]["dur"] - t0)]
    out["result_processed"] = [ms(processed["ts"] - t0), ms(end - t0)]
    if streamed is not None:
        out["first_tokens_streamed"] = ms(streamed["ts"] + streamed["dur"] - t0)
    out["host_waits"] = [[ms(e["ts"] - t0), ms(e["dur"]), e["name"]] for e in sorted(runtime, key=lambda e: e["ts"])
                         if t0 <= e["ts"] <= end and re.search(r"Synchronize|Memcpy", e["name"]) and e["dur"] >= 50]
    return out


def summarize_trace(events: list[dict], steps: int, top: int = 150, parents: int = 60, children: int = 10) -> dict:
    """Per-step host time by Python function (inclusive, scheduler thread), the ``children`` largest
    callees of the ``parents`` largest functions (what a function's time is made of), GPU kernel
    totals, and each kernel's time by the worker call that launched it."""
    complete, python, runtime = scheduler_thread(events)
    kernels = [e for e in complete if e.get("cat") == "kernel"]
    by_function, self_time = defaultdict(float), defaultdict(float)
    calls = defaultdict(int)
    callees = defaultdict(lambda: defaultdict(float))  # caller -> callee -> inclusive time
    callers = {}  # correlation id of a launch -> caller_label
    # One sweep over frames and launches in time order (a frame before its children), keeping the
    # open frames on a stack: a call's self time is its duration minus its children's.
    items = [(e["ts"], 0, -e["dur"], i, e) for i, e in enumerate(python)]
    items += [(e["ts"], 1, 0, i, e) for i, e in enumerate(runtime)]
    stack: list[dict] = []
    for ts, is_launch, _, _, e in sorted(items, key=lambda x: x[:4]):
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= ts:
            stack.pop()
        if is_launch:
            callers[e.get("args", {}).get("correlation")] = caller_label(stack)
            continue
        name = frame_name(e["name"])
        if stack:
            caller = frame_name(stack[-1]["name"])
            self_time[caller] -= e["dur"]
            callees[caller][name] += e["dur"]
        stack.append(e)
        by_function[name] += e["dur"]
        self_time[name] += e["dur"]
        calls[name] += 1
    ours = lambda n: any(k in n for k in SPEC_CODE)  # noqa: E731
    # Where the host waits for the GPU: synchronising calls, and copies (from pageable memory they block)
    waits = defaultdict(float)
    for e in runtime:
        if re.search(r"Synchronize|Memcpy", e["name"]):
            waits[callers.get(e.get("args", {}).get("correlation"), OUTSIDE) + " : " + e["name"]] += e["dur"]
    kernel_time, kernel_calls = defaultdict(float), defaultdict(int)
    by_caller = defaultdict(lambda: defaultdict(float))
    for e in kernels:
        name = e["name"][:90]
        kernel_time[name] += e["dur"]
        kernel_calls[name] += 1
        by_caller[callers.get(e.get("args", {}).get("correlation"), OUTSIDE)][name] += e["dur"]
    span = (max(e["ts"] + e["dur"] for e in complete) - min(e["ts"] for e in complete)) if complete else 0.0
    per_step = lambda us: round(us / steps, 1)  # noqa: E731
    ranked = sorted(by_function.items(), key=lambda x: -x[1])
    kernels_ranked = sorted(kernel_time.items(), key=lambda x: -x[1])[:top]
    callers_ranked = sorted(by_caller.items(), key=lambda x: -sum(x[1].values()))
    return {
        "steps": steps,
        "trace_span_us_per_step": per_step(span),
        "gpu_kernel_us_per_step": per_step(sum(e["dur"] for e in kernels)),
        "kernel_launches_per_step": round(len(kernels) / steps, 1),
        "python_us_per_step": {n: per_step(t) for n, t in ranked[:top]},
        "python_calls_per_step": {n: round(calls[n] / steps, 2) for n, _ in ranked[:top]},
        "python_self_us_per_step": {n: per_step(t) for n, t in sorted(self_time.items(), key=lambda x: -x[1])[:top]},
        "python_callees_us_per_step": {
            n: {c: per_step(t) for c, t in sorted(callees[n].items(), key=lambda x: -x[1])[:children]}
            for n, _ in ranked[:parents] if callees[n]
        },
        # every function of the speculative worker's own code, inclusive
        "spec_code_us_per_step": {n: per_step(t) for n, t in ranked if ours(n)},
        "kernels_us_per_step": {n: per_step(t) for n, t in kernels_ranked},
        "kernel_calls_per_step": {n: round(kernel_calls[n] / steps, 2) for n, _ in kernels_ranked},
        # GPU time by the worker call that launched it, then its largest kernels
        "gpu_us_per_step_by_caller": {c: per_step(sum(k.values())) for c, k in callers_ranked},
        "host_wait_us_per_step_by_caller": {c: per_step(t) for c, t in sorted(waits.items(), key=lambda x: -x[1])},
        "kernels_us_per_step_by_caller": {
            c: {n: per_step(t) for n, t in sorted(k.items(), key=lambda x: -x[1])[:8]} for c, k in callers_ranked
        },
    }


GPU_BUSY = ("kernel", "gpu_memcpy", "gpu_memset")


def idle_gaps(events: list[dict], steps: int, min_gap_us: float = 2.0, top: int = 12, kernels_top: int = 40) -> dict:
    """Where the GPU waits within steady decoding, from a trace without Python stacks (``--light``;
    stack tracing slows the host several-fold and makes every step look host-bound). Each idle
    stretch is named by the kernel that ends it and the host call that launched that kernel; when
    that launch came after the GPU had gone idle, the host was late, and the CPU ops it ran on that
    thread in the meantime (outermost only) say what it was doing."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    busy, launches = gpu_work(complete)
    if not busy:
        return {}
    ops = defaultdict(list)  # (pid, tid) -> outermost CPU ops, in time order
    for e in sorted((e for e in complete if e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation")),
                    key=lambda e: (e["ts"], -e["dur"])):
        thread = ops[(e.get("pid"), e.get("tid"))]
        if not thread or e["ts"] >= thread[-1]["ts"] + thread[-1]["dur"]:
            thread.append(e)
    by_next, host_late, host_doing = defaultdict(float), defaultdict(float), defaultdict(float)
    idle = 0.0
    end = busy[0]["ts"] + busy[0]["dur"]
    for e in busy[1:]:
        gap = e["ts"] - end
        if gap > min_gap_us:
            idle += gap
            launch = launches.get(e.get("args", {}).get("correlation"))
            via = launch["name"] if launch else "no launch seen"
            by_next[f"{e['name'][:60]} (via {via})"] += gap
            if launch is not None and launch["ts"] + launch["dur"] > end:
                late = min(gap, launch["ts"] + launch["dur"] - end)
                host_late[via] += late
                for op in ops[(launch.get("pid"), launch.get("tid"))]:
                    lo, hi = max(op["ts"], end), min(op["ts"] + op["dur"], launch["ts"])
                    if hi > lo:
                        host_doing[op["name"][:80]] += hi - lo
        end = max(end, e["ts"] + e["dur"])
    span = end - busy[0]["ts"]
    kernel_time, kernel_calls = defaultdict(float), defaultdict(int)
    for e in busy:
        kernel_time[e["name"][:90]] += e["dur"]
        kernel_calls[e["name"][:90]] += 1
    per_step = lambda us: round(us / steps, 1)  # noqa: E731
    ranked = lambda d, n=top: {k: per_step(v) for k, v in sorted(d.items(), key=lambda x: -x[1])[:n]}  # noqa: E731
    # The long tail too: small kernels add up where a step's GEMMs are the same on both sides.
    kernels = ranked(kernel_time, kernels_top)
    return {
        "gpu_span_us_per_step": per_step(span),
        "gpu_busy_us_per_step": per_step(span - idle),
        "gpu_idle_us_per_step": per_step(idle),
        "idle_before": ranked(by_next),
        "host_late_launching": ranked(host_late),
        "host_doing_while_late": ranked(host_doing),
        "kernels_us_per_step": kernels,
        "kernel_calls_per_step": {k: round(kernel_calls[k] / steps, 2) for k in kernels},
        "kernel_launches_per_step": round(len(busy) / steps, 1),
        **step_kinds(busy, launches),
    }


SCHEDULER_STAGE = "scheduler."  # SGLang's own spans of its loop (recv_requests, run_batch, ...)


def wave_timeline(events: list[dict], results: list, wall_s: float, top: int = 8) -> dict:
    """Where one whole wave's time went, from a light trace and the client's view of it, for any
    server (plain decoding too): the scheduler loop's iterations (SGLang's ``scheduler.*`` spans on
    the thread that holds most of them) from the first batch run to the last one's results, the host
    time of each stage, the GPU's busy and idle time
    over the wave and which stage the host was in while the GPU sat idle, the longest iterations
    (admissions show there), and how the wave drained (requests still running as time went on)."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    spans = [e for e in complete if e.get("cat") == "user_annotation" and e.get("name", "").startswith(SCHEDULER_STAGE)]
    per_thread = defaultdict(float)
    for e in spans:
        per_thread[(e.get("pid"), e.get("tid"))] += e["dur"]
    if not per_thread:
        return {}
    main = max(per_thread, key=per_thread.get)
    stages = sorted((e for e in spans if (e.get("pid"), e.get("tid")) == main), key=lambda e: e["ts"])
    runs = [e for e in stages if e["name"] == SCHEDULER_STAGE + "run_batch"]
    if not runs:
        return {}
    # to the last batch's results: the loop idles on afterwards until the profiler stops
    results_after = [e for e in stages if e["name"] == SCHEDULER_STAGE + "process_batch_result"
                     and e["ts"] >= runs[-1]["ts"]]
    t0 = runs[0]["ts"]
    t1 = max(e["ts"] + e["dur"] for e in results_after + [runs[-1]])
    stages = [e for e in stages if e["ts"] < t1]
    busy, _ = gpu_work(complete)
    busy = [e for e in busy if t0 <= e["ts"] <= t1]
    ms = lambda us: round(us / 1000, 2)  # noqa: E731
    host, calls = defaultdict(float), defaultdict(int)
    for e in stages:
        host[e["name"][len(SCHEDULER_STAGE):]] += e["dur"]
        calls[e["name"][len(SCHEDULER_STAGE):]] += 1
    # GPU idle stretches, each split over the stages the host was in meanwhile
    idle_while, idle, end = defaultdict(float), 0.0, t0
    stage_at = 0
    for e in busy + [{"ts": t1, "dur": 0}]:
        if e["ts"] > end:
            lo, hi = end, e["ts"]
            idle += hi - lo
            while stage_at < len(stages) and stages[stage_at]["ts"] + stages[stage_at]["dur"] <= lo:
                stage_at += 1
            covered = 0.0
            for st in stages[stage_at:]:
                if st["ts"] >= hi:
                    break
                part = min(hi, st["ts"] + st["dur"]) - max(lo, st["ts"])
                if part > 0:
                    idle_while[st["name"][len(SCHEDULER_STAGE):]] += part
                    covered += part
            idle_while["(between stages)"] += hi - lo - covered
        end = max(end, e["ts"] + e["dur"])
    # iterations: from one run_batch to the next, with their GPU work
    starts = [r["ts"] for r in runs] + [t1]
    iters, k = [], 0
    for i, r in enumerate(runs):
        gpu_us = 0.0
        while k < len(busy) and busy[k]["ts"] < starts[i + 1]:
            gpu_us += busy[k]["dur"]
            k += 1
        iters.append({"at_ms": ms(r["ts"] - t0), "loop_ms": ms(starts[i + 1] - r["ts"]),
                      "run_batch_ms": ms(r["dur"]), "gpu_busy_ms": ms(gpu_us)})
    loops = sorted(it["loop_ms"] for it in iters)
    pick = lambda q: loops[min(len(loops) - 1, int(q * len(loops)))]  # noqa: E731
    out = {
        "span_ms": ms(t1 - t0),
        "iterations": len(runs),
        "loop_ms": {"p10": pick(0.1), "p50": pick(0.5), "p90": pick(0.9), "max": loops[-1]},
        "host_ms": {k: ms(v) for k, v in sorted(host.items(), key=lambda x: -x[1])},
        "host_calls": dict(calls),
        "gpu_busy_ms": ms(sum(e["dur"] for e in busy)),
        "gpu_idle_ms": ms(idle),
        "gpu_idle_while_ms": {k: ms(v) for k, v in sorted(idle_while.items(), key=lambda x: -x[1])},
        "longest_iterations": sorted(iters, key=lambda it: -it["loop_ms"])[:top],
    }
    ok = [r for r in results if r.ok]
    if ok and wall_s > 0:
        sent = min(r.sent_at for r in ok)
        done = sorted(r.sent_at - sent + r.latency for r in ok)
        out["drain"] = {
            "wall_ms": round(wall_s * 1000, 1),
            # requests in flight on average: the batch the server saw, over the whole wave
            "mean_in_flight": round(sum(done) / wall_s, 2),
            "finished_ms": {f"{q}%": round(done[min(len(done) - 1, int(q / 100 * len(done)))] * 1000, 1)
                            for q in (10, 50, 90, 100)},
            "output_tokens": {"min": min(r.completion_tokens for r in ok),
                              "median": statistics.median(r.completion_tokens for r in ok),
                              "max": max(r.completion_tokens for r in ok)},
        }
    return out


# A kernel each decode step runs once: the plugin's block set-up, the built-in's.
STEP_MARKERS = ("_prepare_block_kernel", "_prepare_dflash_draft_block")


def gpu_work(events: list[dict]) -> tuple[list[dict], dict]:
    """A trace's GPU work (kernels, copies, memsets) in time order, and its launch calls by
    correlation id."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    busy = sorted((e for e in complete if e.get("cat") in GPU_BUSY), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in complete
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    return busy, launches


def split_steps(gpu: list[dict], launches: dict, marker: str, min_gap_us: float = 3.0) -> list[dict]:
    """The decode steps of ``gpu_work``'s output, each from one run of ``marker`` to the next: span,
    GPU idle, kernels, and its gaps over ``min_gap_us`` as (gap, the kernel that ended it, how late
    the host's launch call returned after the GPU went idle, or None), longest first."""
    marks = [i for i, e in enumerate(gpu) if marker in e["name"]]
    steps = []
    for first, nxt in zip(marks, marks[1:]):
        end, idle, gaps = gpu[first]["ts"], 0.0, []
        for e in gpu[first:nxt]:
            gap = e["ts"] - end
            if gap > min_gap_us:
                idle += gap
                launch = launches.get(e.get("args", {}).get("correlation"))
                late = None if launch is None else round(launch["ts"] + launch["dur"] - end, 1)
                gaps.append((round(gap, 1), e["name"][:60], late))
            end = max(end, e["ts"] + e["dur"])
        steps.append({"span_us": round(gpu[nxt]["ts"] - gpu[first]["ts"], 1), "idle_us": round(idle, 1),
                      "kernels": nxt - first, "gaps": sorted(gaps, reverse=True)})
    return steps


def steady_and_boundary(steps: list[dict], steady_gap_us: float = 50.0) -> dict:
    """Steady steps (no GPU gap of ``steady_gap_us``: a graph's own kernels leave gaps of a few µs)
    summarised apart from the steps a request boundary fell in (a prefill, a new request), whose
    waits a light profile's idle totals would otherwise mix in."""
    is_steady = lambda s: not s["gaps"] or s["gaps"][0][0] < steady_gap_us  # noqa: E731
    steady = [s for s in steps if is_steady(s)]
    median = lambda values: round(statistics.median(values), 1) if values else None  # noqa: E731
    # how far ahead of the GPU the host launched a steady step's kernels (a late launch is negative)
    leads = [-g[2] for s in steady for g in s["gaps"] if g[2] is not None]
    return {
        "steps": len(steps),
        "steady_steps": len(steady),
        "steady_span_us_median": median([s["span_us"] for s in steady]),
        "steady_idle_us_median": median([s["idle_us"] for s in steady]),
        "steady_kernels_median": median([s["kernels"] for s in steady]),
        "steady_host_lead_us_median": median(leads),
        "boundary_steps": [{**s, "gaps": s["gaps"][:6]} for s in steps if not is_steady(s)],
    }


def step_kinds(busy: list[dict], launches: dict) -> dict:
    """``{"step_kinds": ...}`` split at the first of STEP_MARKERS the trace runs, else nothing."""
    names = {e["name"] for e in busy}
    for marker in STEP_MARKERS:
        if any(marker in n for n in names):
            return {"step_kinds": {"marker": marker, **steady_and_boundary(split_steps(busy, launches, marker))}}
    return {}


# A decode step's phases, from the worker call that launched each kernel (plugin and built-in
# names alike; first match wins). The built-in's target prefill and verify share one call site.
PHASES = (
    ("target verify", ("> sglang/srt/managers/tp_worker.py", "prepare_for_verify")),
    ("draft forward", ("model_runner.py",)),
    ("draft context K/V", ("context_kv", "project_target_hidden", "_append_target_hidden", "_write_layer_kv",
                           "fused_kv_materialize", "norm_rope_split", "set_kv_buffer")),
    ("draft lm_head (eager)", ("GreedyDraftHead", "__call__", "_greedy_sample_from")),
    ("accept and commit", ("accept", "argmax", "apply_request_params", "commit", "penal")),
    ("block set-up", ("prepare_block", "prepare_dflash_draft_block", "VocabParallelEmbedding", "draft_step")),
)


def phase_of(caller: str) -> str:
    for phase, keys in PHASES:
        if any(k in caller for k in keys):
            return phase
    return "other"


def phase_table(level: dict) -> dict:
    """GPU us per step by phase, plus the step's span and the GPU's idle time within it."""
    phases = defaultdict(float)
    for caller, us in level["gpu_us_per_step_by_caller"].items():
        phases[phase_of(caller)] += us
    out = {p: round(phases[p], 1) for p, _ in PHASES + (("other", ()),) if phases[p]}
    out["GPU busy"] = level["gpu_kernel_us_per_step"]
    out["GPU idle within the step"] = round(level["trace_span_us_per_step"] - level["gpu_kernel_us_per_step"], 1)
    return out


def keep_busy(url: str, payloads: list[dict], concurrency: int, stop: threading.Event) -> threading.Thread:
    def loop():
        sent = 0
        while not stop.is_set():
            start = sent % len(payloads)  # each turn goes on round the prompts where the last stopped
            turn = sweep.full_wave(payloads[start:] + payloads[:start], concurrency)
            run_requests(url, turn, concurrency, desc="load")
            sent += concurrency

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


def worker_steps(events: list[dict]) -> int:
    """How many times the scheduler called the speculative worker (prefill and decode steps)."""
    return sum(
        1 for e in events
        if e.get("cat") == "python_function" and e.get("name", "").endswith(": forward_batch_generation")
        and any(k in e["name"] for k in SPEC_CODE)
    )


def profile_impl(spec: ServerSpec, args, out_dir: str, on_level=None) -> dict:
    """One server, traced at every ``--concurrency`` level in turn. Steady mode: ``--steps`` steps
    caught mid-flight under constant load. Wave mode: one whole wave of requests (identical unless
    ``--dataset``), from their prefill to their last token, so both implementations are traced over
    the same context lengths. ``on_level(report)`` is called after each level (a cut-off run keeps
    what it traced).
    With ``--light-too`` each level is traced twice on the same server, without stacks first
    (``c{N}-light``), then with them (``c{N}``)."""
    report = {}
    with Server(spec, log_path=os.path.join(out_dir, f"server-{spec.label}.log"), timeout_s=600) as server:
        for conc in args.concurrency:
            kinds = ((True, f"c{conc}-light"), (False, f"c{conc}")) if args.light_too else ((args.light, f"c{conc}"),)
            for light, key in kinds:
                report[key] = profile_level(server, spec, conc, args, light)
                if on_level is not None:
                    on_level(report)
    return report


def request_payloads(args) -> list[dict]:
    """What the load sends, in turn: the rig's token ids, a cached set's prompts in the target's chat
    template (``--dataset``), or the one ``--prompt`` as raw text; greedy, EOS ignored."""
    if args.rig:
        return rig.rig_payloads(1, args.rig_prompt_len, args.max_new_tokens, rig.vocab(args.rig_shape))
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    if args.stop_at_eos:  # what the sweeps send: the wave drains as requests end
        params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "top_k": 1}
    if not args.dataset:
        return [{"text": args.prompt, "sampling_params": params}]
    # several sets: their prompts in turn, so every wave mixes them
    per_set = [chat_texts(name, args.data_dir, args.dataset_prompts, args.model_path)
               for name in comma_list(args.dataset)]
    texts = [t for row in itertools.zip_longest(*per_set) for t in row if t is not None]
    return [{"text": text, "sampling_params": params} for text in texts]


@functools.lru_cache(maxsize=4)
def chat_texts(dataset: str, data_dir: str, n: int, model_path: str) -> tuple[str, ...]:
    """A set's first ``n`` prompts in the target's chat template, rendered once per run."""
    prompts = load_dataset_prompts(dataset, data_dir, n)
    return tuple(p["text"] for p in sweep.render_prompts(prompts, model_path, thinking=False))


def profile_level(server: Server, spec: ServerSpec, concurrency: int, args, light: bool) -> dict:
    trace_dir = os.path.join(args.trace_dir, spec.label, f"c{concurrency}" + ("-light" if light else ""))
    os.makedirs(trace_dir, exist_ok=True)
    payloads = request_payloads(args)
    start = {"output_dir": trace_dir, "activities": ["CPU", "GPU"], "with_stack": not light}
    wave = None
    batch = sweep.full_wave(payloads, concurrency)
    if args.wave:
        run_requests(server.url, batch, concurrency, desc=f"c{concurrency} warm-up")
        post_json(server.url + "/start_profile", start)
        results, wall_s = run_requests(server.url, batch, concurrency, desc=f"c{concurrency} wave")
        post_json(server.url + "/stop_profile", {})
        wave = summarize(results, wall_s)
    else:
        stop = threading.Event()
        loader = keep_busy(server.url, payloads, concurrency, stop)
        time.sleep(args.settle_s)  # batch full, caches warm
        post_json(server.url + "/start_profile", {**start, "num_steps": args.steps})
    wait_for_trace(trace_dir)
    if not args.wave:
        stop.set()
        loader.join(timeout=120)
    traces = sorted(glob.glob(os.path.join(trace_dir, "*.json*")))
    if not traces:
        raise SystemExit(f"{spec.label}: no trace written to {trace_dir}")
    events = load_trace(traces[-1])
    timeline = wave_timeline(events, results, wall_s) if args.wave and light else {}
    if args.wave and light:  # no Python frames to count: every request of a wave verifies in each step
        steps = max(1, round(wave["spec_verify_ct"] / concurrency)) if wave["spec_verify_ct"] else \
            timeline.get("host_calls", {}).get("run_batch", 1)  # plain decoding: its loop's iterations
    else:
        steps = worker_steps(events) if args.wave else args.steps
    if not steps:
        raise SystemExit(f"{spec.label}: the trace holds no call of the speculative worker")
    if light:
        report = {"trace": os.path.basename(traces[-1]), "steps": steps, **idle_gaps(events, steps)}
        if wave is not None:
            report["wave"] = {k: wave[k] for k in ("requests", "errors", "output_tokens", "spec_verify_ct",
                                                   "accept_length", "wall_s", "output_tok_s")}
            report["wave_timeline"] = timeline
        return report
    report = {"trace": os.path.basename(traces[-1]), **summarize_trace(events, steps)}
    report["phases_us_per_step"] = phase_table(report)
    if wave is not None:
        report["first_token_path_ms"] = first_token_path(events)
        report["wave"] = {k: wave[k] for k in ("requests", "errors", "output_tokens", "spec_verify_ct",
                                               "accept_length", "wall_s", "output_tok_s")}
    return report


def main(argv=None) -> int:
    ap = parser(__doc__, prog="python -m sglang_dflash.bench.profile_step")
    ap.add_argument("--model-path", help="target model (required unless --rig)")
    ap.add_argument("--draft-model-path", help="DFlash draft checkpoint (required unless --rig)")
    rig.add_options(ap)
    ap.add_argument("--impls", default="plugin,builtin",
                    help="comma list of servers to profile in turn: plugin, builtin, ar, ngram or spec:NAME")
    ap.add_argument("--concurrency", default="32",
                    help="comma list of requests in flight (wave mode: the wave), each traced on the same server")
    ap.add_argument("--steps", type=int, default=30, help="steady mode: steps to trace")
    ap.add_argument("--wave", action="store_true",
                    help="trace one whole wave of --concurrency requests instead of --steps steps mid-flight")
    ap.add_argument("--light", action="store_true",
                    help="trace without Python stacks and summarise only kernel time and where the GPU sits "
                         "idle and why, steady steps apart from request boundaries (stack tracing slows the host "
                         "several-fold); with --wave, both servers are traced over the same context lengths")
    ap.add_argument("--light-too", action="store_true",
                    help="trace each level both ways on the same server: without stacks (reported as cN-light), "
                         "then with them (cN)")
    ap.add_argument("--max-new-tokens", type=int, default=2048, help="output length of every request (at most, with --stop-at-eos)")
    ap.add_argument("--prompt", default="Write a long story about a lighthouse keeper and the sea.",
                    help="the one prompt every request sends, as raw text (unless --dataset)")
    ap.add_argument("--dataset", help="send this cached set's prompts in turn, in the target's chat template "
                    "(a comma list: the sets' prompts taking turns)")
    ap.add_argument("--dataset-prompts", type=int, default=64, help="how many of each set's first prompts to cycle")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="requests end at EOS, as in the sweeps (default: EOS ignored, every request as long)")
    ap.add_argument("--data-dir", default=DEFAULT_DIR, help=f"the prompt cache ({FETCH_COMMAND} fills it)")
    ap.add_argument("--settle-s", type=float, default=8.0,
                    help="steady mode: seconds of load before tracing starts (batch full, caches warm)")
    ap.add_argument("--server-args", default="--attention-backend triton --grammar-backend none "
                    "--disable-prefill-cuda-graph --cuda-graph-max-bs-decode 32 --mem-fraction-static 0.3 --log-level warning",
                    help="flags passed to every server, one string")
    ap.add_argument("--trace-dir", default="/tmp/dflash-traces", help="where SGLang's profiler writes the raw traces")
    ap.add_argument("--output-dir", required=True, help="profile_step.json and the server logs")
    args = ap.parse_args(argv)
    impls = comma_list(args.impls)
    unknown = [impl for impl in impls if not is_implementation(impl)]
    if unknown or not impls:
        ap.error(f"--impls: unknown implementations {unknown}" if unknown else "--impls: name at least one")
    try:
        args.concurrency = [int(c) for c in comma_list(args.concurrency)]
    except ValueError:
        ap.error("--concurrency: comma-separated integers")
    if not args.concurrency or min(args.concurrency) < 1 or args.steps < 1 or args.max_new_tokens < 1 or args.settle_s < 0:
        ap.error("--concurrency, --steps and --max-new-tokens >= 1, --settle-s >= 0")
    try:
        server_args = shlex.split(args.server_args)
    except ValueError as e:
        ap.error(f"--server-args: {e}")
    if args.dataset is not None:
        problem = ("--dataset: the rig sends token ids" if args.rig else problem_with_names(comma_list(args.dataset))
                   or problem_with_cache(comma_list(args.dataset), args.data_dir)
                   or (None if args.dataset_prompts >= 1 else "--dataset-prompts: at least 1"))
        if problem:
            ap.error(problem)
    if args.rig:
        rig.resolve_paths(ap, args)
        rig.write_rig(os.path.dirname(args.model_path), args.rig_shape, layout=args.rig_layout)
        server_args += rig.server_flags(args.rig)
    elif not (args.model_path and args.draft_model_path):
        ap.error("--model-path and --draft-model-path are required (unless --rig)")
    os.makedirs(args.output_dir, exist_ok=True)
    report = {"settings": vars(args)}

    def write(impl, levels):
        report[impl] = levels
        with open(os.path.join(args.output_dir, "profile_step.json"), "w") as f:
            json.dump(report, f, indent=1)
        level, last = next(reversed(levels.items()))
        keys = (("gpu_span_us_per_step", "gpu_busy_us_per_step", "gpu_idle_us_per_step") if level.endswith("light")
                or args.light else ("trace_span_us_per_step", "gpu_kernel_us_per_step", "kernel_launches_per_step"))
        print(json.dumps({impl: {level: {k: last.get(k) for k in keys}}}), flush=True)

    for name in impls:
        impl, block_size = split_block_size(name)  # plugin@8: that server's block size
        # A hybrid rig's recurrent-state pool sized for the top level, as the sweep sizes it.
        state_flags = rig.rig_hybrid.state_pool_for(
            args.rig_shape, server_args, max(args.concurrency),
            (block_size or 16) if impl in DFLASH_IMPLS else None)[0] if args.rig else []
        spec = ServerSpec(impl, args.model_path, args.draft_model_path, block_size, server_args + state_flags,
                          rig.server_env(args.rig, args.rig_shape) if args.rig else {})
        profile_impl(spec, args, args.output_dir, on_level=lambda levels, name=name: write(name, levels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
