"""Abort and load stress against a running SGLang server, with the KV pool read before and after.

    python -m sglang_dflash.bench.stress --base-url http://127.0.0.1:30000 aborts --requests 1000 --abort-fraction 0.2
    python -m sglang_dflash.bench.stress --base-url http://127.0.0.1:30000 load --concurrency 64 --seconds 300

``aborts`` sends requests of mixed prompt and output lengths; a share of them is dropped mid-stream
by closing the connection, as a client that goes away does. ``load`` holds a fixed number of
requests in flight for a fixed time. Both then flush the radix cache and read ``/v1/loads``: after
the run the used KV tokens and running requests must be back where they were. Prints one JSON
object (also written to ``--out``); exit code 1 when the server died, leaked, or answered errors.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .cli import parser
from .client import generate_stream, get_json, kv_loads, progress

WORDS = "the of and to in is was for on that with as by at from it an be this which or are".split()


def mixed_payloads(n: int, seed: int, max_prompt_words: int, max_new_tokens: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.choice([rng.randint(1, 32), rng.randint(32, max_prompt_words)])
        out.append({"text": " ".join(rng.choice(WORDS) for _ in range(words)),
                    "sampling_params": {"max_new_tokens": rng.choice([1, rng.randint(2, 64), max_new_tokens]),
                                        "temperature": rng.choice([0.0, 0.7]), "ignore_eos": True}})
    return out


def mixed_request(rng: random.Random, payload: dict) -> dict:
    """``payload`` with one of the parameter sets users send: greedy, sampled, penalized, a minimum
    length, stop strings, logit bias, logprobs or a regex, each verify position taking its own."""
    params = dict(payload["sampling_params"])
    extra: dict = {}
    kind = rng.choice(("greedy", "sampled", "penalized", "min_new_tokens", "stop", "logit_bias", "logprobs", "regex"))
    if kind == "greedy":
        params["temperature"] = 0.0
    elif kind == "sampled":
        params.update(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02)
    elif kind == "penalized":
        params.update(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1)
    elif kind == "min_new_tokens":
        params.update(min_new_tokens=params["max_new_tokens"] // 2, ignore_eos=False)
    elif kind == "stop":
        params.update(stop=["the", "\n\n"], ignore_eos=False)
    elif kind == "logit_bias":
        params["logit_bias"] = {str(rng.randrange(100, 1000)): 3.0}
    elif kind == "logprobs":
        extra = {"return_logprob": True, "top_logprobs_num": 3}
    else:
        params.update(regex="[a-z ,.]{1,200}", ignore_eos=False)
    return {**payload, "sampling_params": params, **extra}


def stream(base_url: str, payload: dict, abort_after_chunks: int | None = None) -> dict:
    r = generate_stream(base_url, payload, abort_after_chunks=abort_after_chunks)
    status = "aborted" if r.aborted else "completed" if r.ok else "error"
    return {"status": status, "tokens": r.completion_tokens, **({"error": r.error[:200]} if r.error else {})}


def alive(base_url: str) -> bool:
    try:
        get_json(base_url + "/health_generate", timeout=60)
        return True
    except (OSError, ValueError):
        return False


def settle(base_url: str, timeout_s: float = 60) -> dict:
    """Loads once the server has let go of everything (aborts are processed asynchronously)."""
    deadline = time.time() + timeout_s
    loads = kv_loads(base_url)
    while time.time() < deadline and (loads.get("num_used_tokens") or loads.get("num_running_reqs")):
        time.sleep(1)
        loads = kv_loads(base_url)
    return loads


def after_run(base_url: str, before: dict, settle_s: float) -> dict:
    """Is the server up, and are used KV tokens and running requests back where they were?"""
    up = alive(base_url)
    after = settle(base_url, settle_s) if up else {}
    leak = {k: (after.get(k) or 0) - (before.get(k) or 0) for k in ("num_used_tokens", "num_running_reqs")}
    return {"server_alive": up, "loads_before": before, "loads_after": after, "leak": leak if up else None}


def run_aborts(base_url: str, requests: int, abort_fraction: float, concurrency: int, seed: int = 0,
               max_prompt_words: int = 1500, max_new_tokens: int = 256, settle_s: float = 60) -> dict:
    rng = random.Random(seed + 1)
    payloads = mixed_payloads(requests, seed, max_prompt_words, max_new_tokens)
    plan = [rng.randint(1, 8) if rng.random() < abort_fraction else None for _ in payloads]
    before = settle(base_url, settle_s)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(progress(pool.map(lambda a: stream(base_url, *a), zip(payloads, plan)), requests, "aborts"))
    wall = time.perf_counter() - t0
    count = {s: sum(r["status"] == s for r in results) for s in ("completed", "aborted", "error")}
    return {"mode": "aborts", "requests": requests, "planned_aborts": sum(p is not None for p in plan), **count,
            "errors_sample": [r["error"] for r in results if r["status"] == "error"][:5],
            "output_tokens": sum(r["tokens"] for r in results), "wall_s": round(wall, 1),
            **after_run(base_url, before, settle_s)}


def cancellable(payload: dict, max_new_tokens: int) -> dict:
    """``payload`` at full length with nothing that ends it early (stops, a regex, EOS), so a client
    that hangs up after at most 8 chunks always does so mid-stream."""
    params = {k: v for k, v in payload["sampling_params"].items() if k not in ("stop", "regex", "min_new_tokens")}
    return {**payload, "sampling_params": {**params, "max_new_tokens": max_new_tokens, "ignore_eos": True}}


def sample_memory(probe, stop: threading.Event, every_s: float, series: list) -> None:
    """``probe()`` every ``every_s`` seconds until ``stop``, each reading stamped with its second."""
    t0 = time.perf_counter()
    while True:
        try:
            series.append({"t_s": round(time.perf_counter() - t0, 1), **probe()})
        except Exception as e:  # a reading is evidence, never a reason to stop the load
            series.append({"t_s": round(time.perf_counter() - t0, 1), "error": f"{type(e).__name__}: {e}"})
        if stop.wait(every_s):
            return


def late_growth(series: list, key: str) -> int | None:
    """How much ``key`` grew over the second half of a memory series: warm-up (compiles, caches,
    allocator pools) is done by then, so what still grows is a leak. None with under 3 readings."""
    points = [(r["t_s"], r[key]) for r in series if key in r]
    if len(points) < 3:
        return None
    middle = next(p for p in points if p[0] >= points[-1][0] / 2)
    return points[-1][1] - middle[1]


def run_load(base_url: str, concurrency: int, seconds: float, seed: int = 0, max_new_tokens: int = 256,
             settle_s: float = 60, abort_fraction: float = 0.0, mixed_params: bool = False,
             memory_probe=None, memory_every_s: float = 30) -> dict:
    """``concurrency`` requests in flight for ``seconds``; with ``abort_fraction`` that share of them
    is dropped mid-stream (each at full length, see :func:`cancellable`), with ``mixed_params`` each
    takes one of :func:`mixed_request`'s sets. ``memory_probe()`` (for example ``Server.memory``) is
    read every ``memory_every_s`` seconds: growth that levels off is warm-up, growth that keeps on is
    a leak, which two readings cannot tell apart."""
    payloads = mixed_payloads(4096, seed, 400, max_new_tokens)
    if mixed_params:
        rng = random.Random(seed + 2)
        payloads = [mixed_request(rng, p) for p in payloads]
    before = settle(base_url, settle_s)
    stop_at = time.perf_counter() + seconds
    lock, results, latencies, series, done = threading.Lock(), [], [], [], threading.Event()
    sampler = None
    if memory_probe is not None:
        sampler = threading.Thread(target=sample_memory, args=(memory_probe, done, memory_every_s, series), daemon=True)
        sampler.start()

    def worker(i):
        k, rng = i, random.Random(seed * 1000 + i)
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            cut = rng.randint(1, 8) if rng.random() < abort_fraction else None
            payload = payloads[k % len(payloads)]
            r = stream(base_url, payload if cut is None else cancellable(payload, max_new_tokens), cut)
            with lock:
                results.append(r)
                if r["status"] == "completed":
                    latencies.append(time.perf_counter() - t)
            k += concurrency

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done.set()
    if sampler is not None:
        sampler.join()
    tokens = sum(r["tokens"] for r in results)
    latencies.sort()
    return {"mode": "load", "concurrency": concurrency, "seconds": seconds, "wall_s": round(wall, 1),
            "requests": len(results), "aborted": sum(r["status"] == "aborted" for r in results),
            "cancel_share_planned": abort_fraction, **({"memory_series": series} if memory_probe else {}),
            "errors": sum(r["status"] == "error" for r in results),
            "errors_sample": [r.get("error") for r in results if r["status"] == "error"][:5],
            "output_tokens": tokens, "output_tok_s": round(tokens / wall, 1),
            "latency_p50_s": round(latencies[len(latencies) // 2], 3) if latencies else None,
            "latency_max_s": round(latencies[-1], 3) if latencies else None,
            **after_run(base_url, before, settle_s)}


def verdict(report: dict) -> bool:
    errors = report.get("error", 0) if report["mode"] == "aborts" else report["errors"]
    return report["server_alive"] and errors == 0 and not any((report["leak"] or {}).values())


def main(argv=None) -> int:
    ap = parser(__doc__, prog="python -m sglang_dflash.bench.stress")
    ap.add_argument("--base-url", default="http://127.0.0.1:30000", help="the running server")
    ap.add_argument("--out", help="also write the JSON report here")
    ap.add_argument("--settle-seconds", type=float, default=60, help="how long to wait for the pool to drain")
    sub = ap.add_subparsers(dest="mode", required=True, metavar="{aborts,load}", help="what to run")
    a = sub.add_parser("aborts", help="mixed requests, a share dropped mid-stream", formatter_class=ap.formatter_class)
    a.add_argument("--requests", type=int, default=1000, help="requests in all")
    a.add_argument("--abort-fraction", type=float, default=0.2, help="share of requests dropped mid-stream, in [0, 1]")
    a.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    a.add_argument("--max-prompt-words", type=int, default=1500, help="longest prompt (the lengths vary)")
    a.add_argument("--max-new-tokens", type=int, default=256, help="longest output (the lengths vary)")
    a.add_argument("--seed", type=int, default=0, help="of the prompts, lengths and abort plan")
    lo = sub.add_parser("load", help="a fixed number of requests in flight for a fixed time",
                        formatter_class=ap.formatter_class)
    lo.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    lo.add_argument("--seconds", type=float, default=300, help="how long to hold the load")
    lo.add_argument("--max-new-tokens", type=int, default=256, help="longest output (the lengths vary)")
    lo.add_argument("--abort-fraction", type=float, default=0.0, help="share of requests dropped mid-stream")
    lo.add_argument("--mixed-params", action="store_true",
                    help="each request with one of the parameter sets users send (penalties, stops, logprobs, ...)")
    args = ap.parse_args(argv)
    if args.settle_seconds < 0:
        ap.error("--settle-seconds must be >= 0")
    if args.mode == "aborts" and (not 0 <= args.abort_fraction <= 1 or args.requests < 1 or args.concurrency < 1
                                  or args.max_prompt_words < 32 or args.max_new_tokens < 1):
        ap.error("--abort-fraction in [0, 1], --requests and --concurrency >= 1, --max-prompt-words >= 32, "
                 "--max-new-tokens >= 1")
    if args.mode == "load" and (args.concurrency < 1 or args.seconds <= 0 or args.max_new_tokens < 1
                                or not 0 <= args.abort_fraction <= 1):
        ap.error("--concurrency >= 1, --seconds > 0, --max-new-tokens >= 1 and --abort-fraction in [0, 1]")
    if not alive(args.base_url):
        ap.error(f"no healthy server at {args.base_url}")
    if args.mode == "aborts":
        report = run_aborts(args.base_url, args.requests, args.abort_fraction, args.concurrency, args.seed,
                            args.max_prompt_words, args.max_new_tokens, args.settle_seconds)
    else:
        report = run_load(args.base_url, args.concurrency, args.seconds, max_new_tokens=args.max_new_tokens,
                          settle_s=args.settle_seconds, abort_fraction=args.abort_fraction,
                          mixed_params=args.mixed_params)
    report["pass"] = verdict(report)
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
