"""GPU: plain decoding and the plugin's DFLASH on the tiny float32 pair, token for token.

A lean cousin of tests/gpu/test_server_gpu.py for proving a new SGLang release on a tight GPU
budget: the servers start together, each with a fixed KV pool; every prompt has one length (each
new prompt shape costs the float32 Triton attention a ~20 s compile on SGLang 0.5.23); and the JSON
is rewritten after each stage, so a run cut short still says how far it got.

    python lab/lossless_pair.py OUTDIR [--prompts 200] [--new-tokens 128] [--block 16]
                                [--widths auto [--width-policy cycle] [--fallback force]] [--context-ab 64]

Greedy prompts must match AR exactly (float32, IEEE dots); a stop/budget workload puts stop tokens
and budgets inside verify blocks and must match AR's tokens and finish reasons; both KV pools must
be back to 0 afterwards. Exit 1 on any mismatch.

``--context-ab N`` also starts the plugin with the draft context written by eager launches after
the accept (``SGLANG_DFLASH_CONTEXT_IN_GRAPH=0``) and sends the first N greedy prompts one at a time
to both plugin servers: the drafts must be the same, so every request must take as many verify
steps on either (the in-graph write also fills rejected rows, which must never be read).
"""

import argparse
import json
import os
import random
import sys
from concurrent.futures import ThreadPoolExecutor

from sglang_dflash import compat
from sglang_dflash.bench.client import kv_loads, run_requests, server_info
from sglang_dflash.bench.server import Server, ServerSpec, exit_on_sigterm, start_together, stop_all
from tiny_pair import DEFAULT_DIR, ensure_tiny_pair

FLAGS = ["--attention-backend", "triton", "--grammar-backend", "none", "--disable-prefill-cuda-graph",
         "--cuda-graph-max-bs-decode", "8", "--mem-fraction-static", "0.3", "--max-total-tokens", "131072",
         "--max-running-requests", "64",
         "--log-level", "warning", "--dtype", "float32"]
# SGLang's CUDA rmsnorm has no float32 path; TF32 dots make AR disagree with itself (0.05 nats).
ENV = {"SGLANG_DFLASH_FP32_NORM": "1", "TRITON_F32_DEFAULT": "ieee"}


def workload(n, new_tokens, vocab, length=32):
    rng = random.Random(0)
    ids = [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]
    greedy = [{"input_ids": p, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0}} for p in ids]
    # Token 0 (the tiny target's magnet) is drafted and emitted often: stops and budgets land inside blocks.
    stops = [{"input_ids": p, "sampling_params": {"max_new_tokens": 5 + i, "temperature": 0,
                                                   **({"stop_token_ids": [0]} if i % 2 else {})}}
             for i, p in enumerate(ids[:48])]
    return greedy, stops


def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder for lossless.json and the server logs")
    parser.add_argument("--prompts", type=int, default=200, help="greedy prompts (default 200)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per greedy prompt (default 128)")
    parser.add_argument("--block", type=int, default=16, help="DFLASH block size (default 16)")
    parser.add_argument("--tiny-dir", default=DEFAULT_DIR, help="the tiny pair (made if absent)")
    parser.add_argument("--widths", default="", help="the plugin's SGLANG_DFLASH_WIDTHS (adaptive width), e.g. auto")
    parser.add_argument("--width-policy", default="cycle",
                        help="with --widths: SGLANG_DFLASH_WIDTH_POLICY (default cycle: a new width every step)")
    parser.add_argument("--fallback", default="",
                        help="with --widths: SGLANG_DFLASH_FALLBACK (force: requests in and out of the per-request "
                             "fallback on a fixed pattern, whole batches in it every third step)")
    parser.add_argument("--context-ab", type=int, default=0, metavar="N",
                        help="compare the verify steps of N prompts, one at a time, with the draft context "
                             "written in the verify graphs and after the accept (default 0: not run)")
    args = parser.parse_args()
    exit_on_sigterm()
    os.makedirs(args.out, exist_ok=True)
    target, draft, vocab = ensure_tiny_pair(args.tiny_dir)
    widths = {"SGLANG_DFLASH_WIDTHS": args.widths, "SGLANG_DFLASH_WIDTH_POLICY": args.width_policy} if args.widths else {}
    if args.fallback:
        if not args.widths:
            parser.error("--fallback needs --widths (width 1 among them)")
        widths["SGLANG_DFLASH_FALLBACK"] = args.fallback
    record = {"sglang": compat.running().version, "family": compat.running().family, "dtype": "float32", **widths,
              "prompts": args.prompts, "new_tokens": args.new_tokens, "block_size": args.block, "stage": "start"}
    path = os.path.join(args.out, "lossless.json")

    def save(**kw):
        record.update(kw)
        with open(path, "w") as f:
            json.dump(record, f, indent=1)

    servers = {
        "ar": Server(ServerSpec("ar", target, extra_args=FLAGS, extra_env=ENV),
                     log_path=os.path.join(args.out, "server-ar.log"), timeout_s=420),
        "plugin": Server(ServerSpec("plugin", target, draft, args.block, FLAGS, {**ENV, **widths}),
                         log_path=os.path.join(args.out, "server-plugin.log"), timeout_s=420),
    }
    if args.context_ab:
        servers["plugin-eager-context"] = Server(
            ServerSpec("plugin-eager-context", target, draft, args.block, FLAGS,
                       {**ENV, **widths, "SGLANG_DFLASH_CONTEXT_IN_GRAPH": "0"}),
            log_path=os.path.join(args.out, "server-plugin-eager-context.log"), timeout_s=420)
    greedy, stops = workload(args.prompts, args.new_tokens, vocab)
    try:
        start_together(list(servers.values()))  # fixed pools: no start can shrink another's
        save(stage="servers up")
        pair = {k: servers[k] for k in ("ar", "plugin")}
        with ThreadPoolExecutor(2) as pool:
            outs = dict(zip(pair, pool.map(
                lambda s: (run_requests(s.url, greedy, 32)[0], run_requests(s.url, stops, 16)[0], kv_loads(s.url)),
                pair.values())))
        plugin_info = server_info(servers["plugin"].url).get("dflash")
        if args.context_ab:
            save(stage="context a/b")
            one_by_one = greedy[: args.context_ab]
            with ThreadPoolExecutor(2) as pool:
                ab = dict(zip(("plugin", "plugin-eager-context"), pool.map(
                    lambda name: run_requests(servers[name].url, one_by_one, 1)[0], ("plugin", "plugin-eager-context"))))
            steps = {k: [r.spec_verify_ct for r in v] for k, v in ab.items()}
            differ = [i for i, (a, b) in enumerate(zip(steps["plugin"], steps["plugin-eager-context"])) if a != b]
            save(context_ab={"prompts": len(one_by_one), "requests_with_other_verify_steps": len(differ),
                             "first": differ[:10], "verify_steps": {k: sum(v) for k, v in steps.items()},
                             "same_tokens": all(a.output_ids == b.output_ids for a, b in zip(*ab.values()))})
    finally:
        stop_all(list(servers.values()))
    (ar_greedy, ar_stops, ar_kv), (dg, ds, dkv) = outs["ar"], outs["plugin"]
    greedy_div = [(i, first_divergence(a.output_ids, b.output_ids)) for i, (a, b) in enumerate(zip(ar_greedy, dg))]
    greedy_div = [(i, d) for i, d in greedy_div if d is not None]
    stop_div = [i for i, (a, b) in enumerate(zip(ar_stops, ds))
                if a.output_ids != b.output_ids or a.meta.get("finish_reason") != b.meta.get("finish_reason")]
    tokens, verify = sum(r.completion_tokens for r in dg), sum(r.spec_verify_ct for r in dg)
    errors = sum(bool(r.error) for r in ar_greedy + dg + ar_stops + ds)
    save(stage="done", greedy_mismatches=len(greedy_div), first_divergences=greedy_div[:10],
         stop_mismatches=len(stop_div), errors=errors, accept_length=tokens / max(verify, 1),
         tokens=tokens, ar_kv_after=ar_kv, plugin_kv_after=dkv, plugin_dflash=plugin_info)
    print(json.dumps(record))
    clean = not greedy_div and not stop_div and not errors
    if args.context_ab:
        clean = clean and record["context_ab"]["requests_with_other_verify_steps"] == 0 and record["context_ab"]["same_tokens"]
    idle = all(kv.get("num_used_tokens") == 0 and kv.get("num_running_reqs") == 0 for kv in (ar_kv, dkv))
    sys.exit(0 if clean and idle else 1)


if __name__ == "__main__":
    main()
