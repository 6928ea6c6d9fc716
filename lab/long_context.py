#!/usr/bin/env python3
"""Long prompts with the sliding-window draft (issue 78, item 6): 32k-token prompts through chunked
prefill on the Qwen3.5-4B rig (zero weights: every draft accepted), the plugin with its draft K/V on
every position, the plugin with the ring (``SGLANG_DFLASH_DRAFT_RING=1``), and the built-in, all
with ``--speculative-draft-window-size W``; one server at a time, each warmed by a short request
and a full-length one.

    python3 -m lab.long_context OUT [--impls plugin,plugin-ring,builtin] [--prompt-tokens 32768]
        [--concurrency 1,4] [--requests 4] [--window 4096] [--shape qwen3.5-4b] [--backend fa3]

Per server and concurrency (the same prompts for every server, after one full-length warm-up
request): each request's time to first token (the 32k prefill, chunked), its decode rate after it,
the level's output tokens a second, and the plugin's decode steps, eager drafts and verifies and
host time by part before and after the level; per server: the target's KV pool
(``max_total_num_tokens``, which the ring enlarges by the draft rows it no longer keeps), the KV in
use at the end of each level (under the ring the draft's stays within the window), and the plugin's
``dflash.draft_kv`` (layout, tokens, window, budget). Writes ``OUT/long_context.json`` as it goes.
"""

import argparse
import json
import os
import random
import statistics
import time

from sglang_dflash.bench import rig
from sglang_dflash.bench.client import generate_stream, kv_loads, run_requests, server_info
from sglang_dflash.bench.server import Server, ServerError, ServerSpec

IMPLS = {  # name: (implementation, extra environment)
    "plugin": ("plugin", {}),
    "plugin-ring": ("plugin", {"SGLANG_DFLASH_DRAFT_RING": "1"}),
    "builtin": ("builtin", {}),
}


def server_spec(name: str, target: str, draft: str, args) -> ServerSpec:
    impl, env = IMPLS[name]
    flags = ["--attention-backend", args.backend, "--speculative-draft-window-size", str(args.window),
             "--context-length", str(args.prompt_tokens + 2 * args.max_new_tokens + 64),
             "--max-running-requests", str(max(args.levels)), "--cuda-graph-max-bs-decode", str(max(args.levels)),
             "--mamba-radix-cache-strategy", "extra_buffer", "--mem-fraction-static", str(args.mem_fraction),
             "--log-level", "warning", *rig.server_flags("zero")]
    return ServerSpec(impl, target, draft, None, flags, {**rig.server_env("zero", args.shape), **env})


def prompts(n: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    """Distinct prompts (no radix hit between them), token ids well inside the vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(10, min(vocab, 100_000)) for _ in range(tokens)] for _ in range(n)]


def level(url: str, batch: list[list[int]], concurrency: int, max_new_tokens: int) -> dict:
    payloads = [{"input_ids": p, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                    "ignore_eos": True}} for p in batch]
    results, wall = run_requests(url, payloads, concurrency, desc=f"c{concurrency}")
    ok = [r for r in results if r.ok]
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    decode = [round((r.completion_tokens - 1) / (r.latency - r.ttft), 1) for r in ok
              if r.ttft is not None and r.completion_tokens > 1 and r.latency > r.ttft]
    return {"requests": len(results), "errors": [r.error for r in results if not r.ok][:3],
            "ttft_ms": [round(t, 1) for t in ttft], "ttft_ms_median": round(statistics.median(ttft), 1) if ttft else None,
            "decode_tok_s": decode, "decode_tok_s_median": round(statistics.median(decode), 1) if decode else None,
            "output_tok_s": round(sum(r.completion_tokens for r in ok) / wall, 1), "wall_s": round(wall, 2),
            "kv_in_use_after": kv_loads(url, flush=False).get("num_used_tokens")}


def step_counts(url: str) -> dict:
    """What tells a per-step decode cost from a per-request one: the plugin's decode steps, those
    whose draft or verify ran outside CUDA graphs, and its host time by part; the built-in reports
    none of these (an empty dict then)."""
    info = server_info(url).get("dflash") or {}
    host = (info.get("stalls") or {}).get("decode_host")
    keep = {k: info[k] for k in ("decode_steps", "eager_drafts", "eager_verifies", "prefills", "widths_used") if k in info}
    return {**keep, "decode_host": host} if host is not None else keep


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--impls", default="plugin,plugin-ring,builtin")
    ap.add_argument("--shape", default="qwen3.5-4b", choices=sorted(rig.HYBRID_SHAPES))
    ap.add_argument("--backend", default="fa3")
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=4, help="requests a level")
    ap.add_argument("--window", type=int, default=4096, help="--speculative-draft-window-size")
    ap.add_argument("--mem-fraction", type=float, default=0.8)
    ap.add_argument("--rig-dir", default="/tmp/dflash-rig")
    ap.add_argument("--timeout", type=float, default=420, help="seconds a server may take to start")
    args = ap.parse_args()
    names = [n.strip() for n in args.impls.split(",") if n.strip()]
    if set(names) - set(IMPLS):
        ap.error(f"--impls: no server {sorted(set(names) - set(IMPLS))} (servers: {', '.join(IMPLS)})")
    args.levels = [int(c) for c in args.concurrency.split(",")]
    if args.prompt_tokens < 1 or args.requests < 1 or min(args.levels) < 1 or args.window < 1:
        ap.error("--prompt-tokens, --requests, --concurrency and --window must be positive")
    os.makedirs(args.out, exist_ok=True)
    target, draft = rig.write_rig(os.path.join(args.rig_dir, args.shape), args.shape)
    vocab = rig.vocab(args.shape)
    report = {"shape": args.shape, "prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens,
              "window": args.window, "backend": args.backend, "servers": {}}
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name}: starting", flush=True)
        got = report["servers"][name] = {"levels": {}}
        started = time.time()
        try:
            with Server(server_spec(name, target, draft, args), log_path=os.path.join(args.out, f"server-{name}.log"),
                        timeout_s=args.timeout) as s:
                got["start_s"] = round(time.time() - started, 1)
                generate_stream(s.url, {"input_ids": list(range(10, 522)),
                                        "sampling_params": {"max_new_tokens": 32, "temperature": 0}})
                # one full-length request too, so that no kernel variant of the long lengths
                # compiles inside a measured one
                generate_stream(s.url, {"input_ids": prompts(1, args.prompt_tokens, vocab, seed=1)[0],
                                        "sampling_params": {"max_new_tokens": 32, "temperature": 0}})
                got["max_total_num_tokens"] = kv_loads(s.url, flush=False).get("max_total_num_tokens")
                for j, c in enumerate(args.levels):
                    batch = prompts(args.requests, args.prompt_tokens, vocab, seed=1000 + j)  # alike for every server
                    before = step_counts(s.url)
                    got["levels"][f"c{c}"] = level(s.url, batch, c, args.max_new_tokens)
                    got["levels"][f"c{c}"]["server_before"], got["levels"][f"c{c}"]["server_after"] = before, step_counts(s.url)
                    print(f"[{i}/{len(names)}] {name} c{c}: {got['levels'][f'c{c}']['ttft_ms_median']} ms to first "
                          f"token, {got['levels'][f'c{c}']['output_tok_s']} tok/s", flush=True)
                got["draft_kv"] = (server_info(s.url).get("dflash") or {}).get("draft_kv")
        except ServerError as e:
            got["failed"] = str(e)[:500]
            print(f"[{i}/{len(names)}] {name}: {got['failed']}", flush=True)
        with open(os.path.join(args.out, "long_context.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
