"""GPU: plain decoding and the plugin's DFLASH on a float32 pair, token for token.

A lean cousin of tests/gpu/test_server_gpu.py for proving a new SGLang release on a tight GPU
budget: the servers start together, each with a fixed KV pool; every prompt has one length (each
new prompt shape costs the float32 Triton attention a ~20 s compile on SGLang 0.5.23); and the JSON
is rewritten after each stage, so a run cut short still says how far it got.

    python -m lab.lossless_pair OUTDIR [--prompts 200] [--new-tokens 128] [--block 16]
                                [--widths auto [--width-policy cycle] [--fallback force] [--plain-too]]
                                [--server-default [--plain-too]]
                                [--smollm2 TARGET_DIR --draft DIR --data-dir DIR] [--context-ab 64]
                                [--prefill-graphs off|on|N] [--in-flight 32] [--backend triton] [--dtype float32]
    python -m lab.lossless_pair OUTDIR --backend flashinfer --dtype bfloat16 --ab-only \
                                --context-ab 64 --ab-env SGLANG_DFLASH_SKIP_HOST_LENGTHS=0

Two pairs: the tiny one (random weights, about 1.3 tokens a step) and, with ``--smollm2``,
SmolLM2-135M-Instruct with the shipped draft (about 3.5 a step on gsm8k), whose blocks are mostly
accepted: gsm8k questions, chat-templated, each cut to its last 64 tokens so every prompt has one length.

Greedy prompts must match AR exactly (float32, IEEE dots); a stop/budget workload puts stop tokens
and budgets inside verify blocks and must match AR's tokens and finish reasons; both KV pools must
be back to 0 afterwards. Exit 1 on any mismatch.

``--context-ab N`` also starts the plugin with one switch flipped (``--ab-env``; by default the draft
context written by eager launches after the accept, ``SGLANG_DFLASH_CONTEXT_IN_GRAPH=0``) and first
sends the first N greedy prompts one at a time to both plugin servers: where the switch changes no
kernel, the tokens and the drafts must be the same, so every request must take as many verify steps
on either (the in-graph write also fills rejected rows, which must never be read). Sent before
anything else, they meet the same widths on both under ``--width-policy cycle``.

That A/B is how a backend without a float32 path (``--backend flashinfer --dtype bfloat16``) is
checked decisively: two servers running the same kernels on the same requests one at a time must
agree to the bit, where plain decoding in bfloat16 only agrees up to near-ties. ``--ab-only`` starts
just those two servers; the comparison with plain decoding needs float32.
"""

import argparse
import json
import os
import random
import sys
from concurrent.futures import ThreadPoolExecutor

from sglang_dflash import compat
from sglang_dflash.bench.client import kv_loads, run_requests, server_info
from sglang_dflash.bench.server import (Server, ServerSpec, exit_on_sigterm, prefill_graph_flags,
                                        start_together, stop_all)
from lab.tiny_pair import DEFAULT_DIR, ensure_tiny_pair

FLAGS = ["--attention-backend", "triton", "--grammar-backend", "none",
         "--cuda-graph-max-bs-decode", "8", "--mem-fraction-static", "0.3", "--max-total-tokens", "131072",
         "--max-running-requests", "64",
         "--log-level", "warning", "--dtype", "float32"]
# SGLang's CUDA rmsnorm has no float32 path; TF32 dots make AR disagree with itself (0.05 nats).
ENV = {"SGLANG_DFLASH_FP32_NORM": "1", "TRITON_F32_DEFAULT": "ieee"}


def server_flags(prefill_graphs="off", backend="triton", dtype="float32"):
    """FLAGS on ``backend`` in ``dtype``, with prefills eager (off), from SGLang's default graphs (on)
    or from graphs of up to N tokens."""
    flags = list(FLAGS)
    flags[flags.index("--attention-backend") + 1] = backend
    flags[flags.index("--dtype") + 1] = dtype
    return flags + prefill_graph_flags(prefill_graphs, "--prefill-graphs")


def server_env(dtype="float32"):
    """ENV for a float32 run; a half-precision one runs SGLang's own kernels as they are."""
    return dict(ENV) if dtype == "float32" else {}


def switch(text):
    """``NAME=VALUE`` -> {NAME: VALUE}, for --ab-env."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE")
    return {name: value}


def workload(n, new_tokens, vocab, length=32):
    rng = random.Random(0)
    ids = [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]
    greedy = [{"input_ids": p, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0}} for p in ids]
    # Token 0 (the tiny target's magnet) is drafted and emitted often: stops and budgets land inside blocks.
    stops = [{"input_ids": p, "sampling_params": {"max_new_tokens": 5 + i, "temperature": 0,
                                                   **({"stop_token_ids": [0]} if i % 2 else {})}}
             for i, p in enumerate(ids[:48])]
    return greedy, stops


def smollm2_workload(n, new_tokens, tokenizer, questions, keep=64):
    """The first ``n`` questions of at least ``keep`` tokens, cut to their last ``keep`` (the ask
    stays), inside the chat template: one prompt length. Stops on a newline, budgets inside blocks."""
    pre, post = (tokenizer(part, add_special_tokens=False).input_ids for part in tokenizer.apply_chat_template(
        [{"role": "user", "content": "\0"}], tokenize=False, add_generation_prompt=True).split("\0"))
    cut = [ids[-keep:] for ids in (tokenizer(q, add_special_tokens=False).input_ids for q in questions)
           if len(ids) >= keep]
    if len(cut) < n:
        raise SystemExit(f"lossless_pair: {len(cut)} questions hold {keep} tokens, {n} asked for")
    ids = [pre + q + post for q in cut[:n]]
    newline = tokenizer("\n", add_special_tokens=False).input_ids[-1]
    greedy = [{"input_ids": p, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0}} for p in ids]
    stops = [{"input_ids": p, "sampling_params": {"max_new_tokens": 5 + i, "temperature": 0,
                                                   **({"stop_token_ids": [newline]} if i % 2 else {})}}
             for i, p in enumerate(ids[:48])]
    return greedy, stops


def compare(ar, plugin):
    """Mismatches of one plugin server's (greedy, stops, kv) against AR's."""
    (ar_greedy, ar_stops, _), (greedy, stops, kv) = ar, plugin
    div = [(i, first_divergence(a.output_ids, b.output_ids)) for i, (a, b) in enumerate(zip(ar_greedy, greedy))]
    div = [(i, d) for i, d in div if d is not None]
    stop_div = [i for i, (a, b) in enumerate(zip(ar_stops, stops))
                if a.output_ids != b.output_ids or a.meta.get("finish_reason") != b.meta.get("finish_reason")]
    tokens, verify = sum(r.completion_tokens for r in greedy), sum(r.spec_verify_ct for r in greedy)
    return dict(greedy_mismatches=len(div), first_divergences=div[:10], stop_mismatches=len(stop_div),
                errors=sum(bool(r.error) for r in greedy + stops), accept_length=tokens / max(verify, 1),
                tokens=tokens, kv_after=kv)


def same_requests(a, b):
    """Two plugin servers' answers to the same requests, sent one at a time: the A/B record."""
    steps = [(x.spec_verify_ct, y.spec_verify_ct) for x, y in zip(a, b)]
    differ = [i for i, (x, y) in enumerate(steps) if x != y]
    tokens = [i for i, (x, y) in enumerate(zip(a, b)) if x.output_ids != y.output_ids]
    return {"prompts": len(a), "requests_with_other_verify_steps": len(differ), "first": differ[:10],
            "verify_steps": {"plugin": sum(x for x, _ in steps), "plugin-switched": sum(y for _, y in steps)},
            "same_tokens": not tokens, "requests_with_other_tokens": len(tokens),
            "errors": sum(bool(r.error) for r in list(a) + list(b))}


def ab_clean(ab):
    return (ab["requests_with_other_verify_steps"] == 0 and ab["same_tokens"] and not ab.get("errors")
            and ab["prompts"] > 0)


def all_idle(kv_loads_after):
    """Every server's KV pool back to 0 with nothing running."""
    return all(kv.get("num_used_tokens") == 0 and kv.get("num_running_reqs") == 0 for kv in kv_loads_after)


def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder for lossless.json and the server logs")
    parser.add_argument("--prompts", type=int, default=200, help="greedy prompts (default 200)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per greedy prompt (default 128)")
    parser.add_argument("--block", type=int, default=16, help="DFLASH block size (default 16)")
    parser.add_argument("--tiny-dir", default=DEFAULT_DIR, help="the tiny pair (made if absent)")
    parser.add_argument("--smollm2", default="", metavar="TARGET_DIR",
                        help="the SmolLM2 pair instead of the tiny one: the target's HF folder (needs --draft)")
    parser.add_argument("--draft", default="", help="with --smollm2: the draft's folder (results/smollm2-draft)")
    parser.add_argument("--data-dir", default=".bench-eval", help="with --smollm2: where gsm8k.jsonl lies")
    parser.add_argument("--widths", default="", help="the plugin's SGLANG_DFLASH_WIDTHS (adaptive width), e.g. auto")
    parser.add_argument("--width-policy", default="cycle",
                        help="with --widths: SGLANG_DFLASH_WIDTH_POLICY (default cycle: a new width every step)")
    parser.add_argument("--fallback", default="",
                        help="with --widths: SGLANG_DFLASH_FALLBACK (force: requests in and out of the per-request "
                             "fallback on a fixed pattern, whole batches in it every third step)")
    parser.add_argument("--server-default", action="store_true",
                        help="the plugin as a user launches it: no --speculative-num-draft-tokens and no "
                             "SGLANG_DFLASH_WIDTHS (adaptive width by default; fails unless it reports several widths)")
    parser.add_argument("--plain-too", action="store_true",
                        help="with --widths or --server-default: a third server, the plugin with its block named "
                             "(--speculative-num-draft-tokens), which must verify that one width, checked the same way")
    parser.add_argument("--prefill-graphs", default="off", metavar="off|on|N",
                        help="prefills eager (off, default), from SGLang's default breakable graphs (on, as a user "
                             "passing no graph flag gets them), or from graphs of up to N tokens")
    parser.add_argument("--context-ab", type=int, default=0, metavar="N",
                        help="compare the tokens and verify steps of N prompts, one at a time, with and without "
                             "the --ab-env switch (default 0: not run)")
    parser.add_argument("--ab-env", type=switch, default={"SGLANG_DFLASH_CONTEXT_IN_GRAPH": "0"}, metavar="NAME=VALUE",
                        help="what the A/B's second plugin server differs by (default "
                             "SGLANG_DFLASH_CONTEXT_IN_GRAPH=0: the draft context written after the accept)")
    parser.add_argument("--ab-only", action="store_true",
                        help="with --context-ab: only the two plugin servers, no comparison with plain decoding")
    parser.add_argument("--in-flight", type=int, default=32, metavar="N",
                        help="requests at a time (default 32; the stop workload takes half): 8 or less keeps every "
                             "decode batch within the float32 servers' CUDA graphs, so the plugin's draft graphs serve")
    parser.add_argument("--backend", default="triton", help="--attention-backend of every server (default triton)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="--dtype of every server (default float32; a half type needs --ab-only)")
    args = parser.parse_args()
    if args.in_flight < 1:
        parser.error("--in-flight must be 1 or more")
    if args.ab_only and not args.context_ab:
        parser.error("--ab-only needs --context-ab N")
    if args.dtype != "float32" and not args.ab_only:
        parser.error(f"--dtype {args.dtype}: plain decoding agrees with DFLASH only up to near-ties there; "
                     "check with --context-ab N --ab-only (the same kernels on both servers)")
    if args.ab_only and (args.plain_too or args.server_default):
        parser.error("--ab-only runs no plain-decoding comparison: drop --plain-too and --server-default")
    if args.fallback and not args.widths:
        parser.error("--fallback needs --widths (width 1 among them)")
    if args.plain_too and not (args.widths or args.server_default):
        parser.error("--plain-too needs --widths or --server-default (without them the plugin is already plain)")
    if args.widths and args.server_default:
        parser.error("--server-default leaves SGLANG_DFLASH_WIDTHS unset: drop --widths")
    if args.smollm2 and not args.draft:
        parser.error("--smollm2 needs --draft")
    try:
        flags = server_flags(args.prefill_graphs, args.backend, args.dtype)
    except ValueError as e:
        parser.error(str(e))
    exit_on_sigterm()
    os.makedirs(args.out, exist_ok=True)
    if args.smollm2:
        from transformers import AutoTokenizer
        target, draft = args.smollm2, args.draft
        with open(os.path.join(args.data_dir, "gsm8k.jsonl")) as f:
            questions = [json.loads(line)["prompt"] for line in f]
        greedy, stops = smollm2_workload(args.prompts, args.new_tokens, AutoTokenizer.from_pretrained(target), questions)
    else:
        target, draft, vocab = ensure_tiny_pair(args.tiny_dir)
        greedy, stops = workload(args.prompts, args.new_tokens, vocab)
    widths = {"SGLANG_DFLASH_WIDTHS": args.widths, "SGLANG_DFLASH_WIDTH_POLICY": args.width_policy} if args.widths else {}
    if args.fallback:
        widths["SGLANG_DFLASH_FALLBACK"] = args.fallback
    record = {"sglang": compat.running().version, "family": compat.running().family, "dtype": args.dtype,
              "backend": args.backend,
              "pair": "smollm2" if args.smollm2 else "tiny", **widths,
              "prompts": args.prompts, "new_tokens": args.new_tokens, "block_size": args.block,
              "server_default": args.server_default,
              "prefill_graphs": args.prefill_graphs, "in_flight": args.in_flight, "stage": "start"}
    path = os.path.join(args.out, "lossless.json")

    def save(**kw):
        record.update(kw)
        with open(path, "w") as f:
            json.dump(record, f, indent=1)

    def server(name, env):
        plain = name == "ar"
        block = None if plain or (name == "plugin" and args.server_default) else args.block
        spec = ServerSpec("ar" if plain else "plugin", target, None if plain else draft, block, flags,
                          {**server_env(args.dtype), **env})
        return Server(spec, log_path=os.path.join(args.out, f"server-{name}.log"), timeout_s=420)

    servers = {} if args.ab_only else {"ar": server("ar", {})}
    servers["plugin"] = server("plugin", widths)
    if args.plain_too:
        servers["plugin-plain"] = server("plugin-plain", {})
    if args.context_ab:
        servers["plugin-switched"] = server("plugin-switched", {**widths, **args.ab_env})
        record["ab_env"] = args.ab_env
    checked = [] if args.ab_only else [k for k in servers if k in ("ar", "plugin", "plugin-plain")]
    try:
        start_together(list(servers.values()))  # fixed pools: no start can shrink another's
        save(stage="servers up")
        if args.context_ab:
            # First, while both plugin servers have run nothing: a width policy that cycles by step
            # count (and the forced fallback) then takes the same widths on both, step by step.
            save(stage="context a/b")
            one_by_one = greedy[: args.context_ab]
            with ThreadPoolExecutor(2) as pool:
                ab = dict(zip(("plugin", "plugin-switched"), pool.map(
                    lambda name: run_requests(servers[name].url, one_by_one, 1)[0], ("plugin", "plugin-switched"))))
            save(context_ab=same_requests(ab["plugin"], ab["plugin-switched"]))
        if args.ab_only:
            save(stage="done", ab_kv_after={k: kv_loads(servers[k].url) for k in ("plugin", "plugin-switched")},
                 plugin_dflash=server_info(servers["plugin"].url).get("dflash"))
            print(json.dumps(record))
            sys.exit(0 if ab_clean(record["context_ab"]) and all_idle(record["ab_kv_after"].values()) else 1)
        with ThreadPoolExecutor(len(checked)) as pool:
            outs = dict(zip(checked, pool.map(
                lambda s: (run_requests(s.url, greedy, args.in_flight)[0],
                           run_requests(s.url, stops, max(1, args.in_flight // 2))[0], kv_loads(s.url)),
                [servers[k] for k in checked])))
        plugin_info = server_info(servers["plugin"].url).get("dflash")
        plain_info = server_info(servers["plugin-plain"].url).get("dflash") if args.plain_too else None
    finally:
        stop_all(list(servers.values()))
    main_result = compare(outs["ar"], outs["plugin"])
    main_result["plugin_kv_after"] = main_result.pop("kv_after")
    save(stage="done", **main_result, ar_kv_after=outs["ar"][2], plugin_dflash=plugin_info)
    if args.plain_too:
        save(plain={**compare(outs["ar"], outs["plugin-plain"]), "widths": (plain_info or {}).get("widths")})
    print(json.dumps(record))
    results = [main_result] + ([record["plain"]] if args.plain_too else [])
    clean = not any(r["greedy_mismatches"] or r["stop_mismatches"] or r["errors"] for r in results)
    if args.context_ab:
        clean = clean and ab_clean(record["context_ab"])
    if args.server_default:  # the default is adaptive width; a named block is the one width
        clean = clean and len((plugin_info or {}).get("widths") or []) > 1
    if args.plain_too:
        clean = clean and (plain_info or {}).get("widths") == [args.block]
    if args.prefill_graphs != "off":  # the check covers what it says: prefills replayed from SGLang's graphs
        clean = clean and bool((plugin_info or {}).get("prefills_in_graphs"))
    sys.exit(0 if clean and all_idle(outs[k][2] for k in checked) else 1)


if __name__ == "__main__":
    main()
