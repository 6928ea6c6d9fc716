"""GPU: every request parameter under DFLASH against plain decoding, one row per parameter.

    python -m lab.request_params_matrix OUTDIR [--pair tiny|smollm2] [--impls plugin,builtin]
                                        [--prompts 32] [--new-tokens 48] [--grammar xgrammar|none]
                                        [--rows plain,n,...,sampled]

Servers, started together, each with a fixed KV pool (``--max-total-tokens``) so a neighbour's start
cannot shrink it, float32 (IEEE dots, float32 norms), the same flags: ``ar`` (plain decoding, overlap
scheduler), ``ar-sync`` (plain decoding, ``--disable-overlap-schedule``, which updates penalties
after every token; its penalizers in SGLang's accumulated order, see
``lab/ordered-penalizers/sitecustomize.py``) and each DFLASH implementation asked for. Every prompt
has one length, and two requests of a row go to every server before the row is compared, so its
float32 Triton kernels compile outside it. Each row sends the same payloads to every server and
compares output ids, finish reasons and (logprob rows) logprobs with ``ar-sync``:

  greedy rows: plain, each penalty, min_new_tokens, logit_bias, a combination, stop ids and stop
  strings mid-block, ignore_eos, streaming, logprobs (output, top-k, input logprobs from position
  0), json_schema, regex (xgrammar); then the sampled row: temperature 0.8 with top-p and a penalty,
  512 samples of one prompt per server, the total-variation distance of the first four tokens (the
  sequences, and each position's token) against a second ``ar-sync`` sample; last the rows that
  have crashed servers: n=2, chosen-id logprobs.

``matrix.json`` is rewritten after every row, so a run cut short keeps what it measured; run again
into the same OUTDIR with ``--rows`` naming the rest, and the earlier rows stay. A server that dies
is recorded under ``crashed`` with the row and SGLang's reason; a row the reference fails is listed
under ``unmeasured``. Exit 1 if a server of the plugin's (every impl but ``builtin*``: ``plugin``,
``adaptive``, ``plugin-fixed``, ...) crashes, differs from ``ar-sync`` on a measured greedy row, its logprobs differ by more than 0.01 nats, a sampled distance exceeds twice the AR-to-AR one
plus 0.05, or a live server's KV pool is not back to 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from sglang_dflash import compat
from sglang_dflash.bench.client import generate_stream, kv_loads, post_json, server_info
from sglang_dflash.bench.server import Server, ServerSpec, exit_on_sigterm, start_together, stop_all, startup_reason
from lab.tiny_pair import ensure_tiny_pair

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"SGLANG_DFLASH_FP32_NORM": "1", "TRITON_F32_DEFAULT": "ieee"}
# The reference's penalizers in one order, whatever its process (see the sitecustomize's docstring).
ORDERED_PENALIZERS = os.path.join(ROOT, "lab", "ordered-penalizers")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}
REGEX = r"[a-z]{2,8}( [a-z]{2,8}){2,5}\."


def flags(grammar: str) -> list[str]:
    # A fixed pool (--max-total-tokens) under a fraction that leaves room for three neighbours: the
    # servers can start together without one's load shrinking another's pool (start_together).
    return ["--attention-backend", "triton", "--grammar-backend", grammar, "--disable-prefill-cuda-graph",
            "--cuda-graph-max-bs-decode", "16", "--mem-fraction-static", "0.3", "--max-total-tokens", "131072",
            "--max-running-requests", "48", "--log-level", "warning", "--dtype", "float32"]


def prompts_for(pair: str, target: str, n: int, length: int = 32) -> list[list[int]]:
    """n prompts of one length: random ids on the tiny pair, gsm8k questions cut to length on SmolLM2."""
    rng = random.Random(0)
    if pair == "tiny":
        return [[rng.randrange(10, 250) for _ in range(length)] for _ in range(n)]
    from transformers import AutoTokenizer

    from sglang_dflash.bench.datasets import load_dataset_prompts

    tok = AutoTokenizer.from_pretrained(target)
    texts = load_dataset_prompts("gsm8k", os.path.join(ROOT, ".bench-eval"), 4 * n)
    ids = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    return [p[-length:] for p in ids if len(p) >= length][:n]


def rows(prompts: list[list[int]], new_tokens: int, grammar: bool, stop_text: dict) -> dict[str, list[dict]]:
    def each(**sp):
        return [{"input_ids": p, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, **sp}}
                for p in prompts]

    out = {
        "plain": each(),
        "repetition_penalty": each(repetition_penalty=1.3),
        "frequency_penalty": each(frequency_penalty=0.5),
        "presence_penalty": each(presence_penalty=0.8),
        "min_new_tokens": each(min_new_tokens=new_tokens // 2, stop_token_ids=[0]),
        "logit_bias": each(logit_bias={"5": 3.0, "0": -2.0}),
        "penalties_together": each(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.3,
                                   min_new_tokens=8, stop_token_ids=[0], logit_bias={"7": 1.5}),
        "stop_token_ids": each(stop_token_ids=[0]),
        "stop": [dict(r, sampling_params=dict(r["sampling_params"], stop=[stop_text[i]]))
                 for i, r in enumerate(each()) if stop_text.get(i)],
        "ignore_eos": each(ignore_eos=True),
        "stream": [dict(r, stream=True) for r in each(frequency_penalty=0.4)],
        "return_logprob": [dict(r, return_logprob=True, top_logprobs_num=5, logprob_start_len=0)
                           for r in each(presence_penalty=0.5)],
    }
    if grammar:
        out["json_schema"] = each(json_schema=json.dumps(SCHEMA))
        out["regex"] = each(regex=REGEX)
    # Last, after the sampled row: the rows that have crashed servers (the built-in in float32 on
    # n > 1; every server of SGLang 0.5.17 on chosen-id logprobs), so the rows before them measure.
    out["n"] = [dict(r, sampling_params=dict(r["sampling_params"], n=2)) for r in each()]
    out["token_ids_logprob"] = [dict(r, return_logprob=True, token_ids_logprob=[0, 1, 2]) for r in each()]
    return out


def row_order(greedy: list[str]) -> list[str]:
    """The greedy rows, the sampled row before the two that may crash a server."""
    risky = [r for r in ("n", "token_ids_logprob") if r in greedy]
    return [r for r in greedy if r not in risky] + ["sampled"] + risky


def call(url: str, payload: dict) -> list[dict]:
    """One /generate call; a list of outputs (n > 1 gives several)."""
    try:
        if payload.get("stream"):
            res = generate_stream(url, {k: v for k, v in payload.items() if k != "stream"})
            return [{"output_ids": res.output_ids, "meta_info": res.meta, "error": res.error}]
        out = post_json(url + "/generate", payload)
        return out if isinstance(out, list) else [out]
    except (OSError, ValueError) as e:
        return [{"error": f"{type(e).__name__}: {e}"}]


def run_row(servers: dict, payloads: list[dict]) -> dict[str, list[list[dict]]]:
    def one_server(server):
        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(lambda p: call(server.url, p), payloads))

    with ThreadPoolExecutor(len(servers)) as pool:
        return dict(zip(servers, pool.map(one_server, servers.values())))


def logprob_gap(a: dict, b: dict) -> float:
    """Largest |difference| of the output and input logprobs both servers gave (same tokens)."""
    gap = 0.0
    for key in ("output_token_logprobs", "input_token_logprobs"):
        for x, y in zip(a["meta_info"].get(key) or [], b["meta_info"].get(key) or []):
            if x[0] is not None and y[0] is not None and x[1] == y[1]:
                gap = max(gap, abs(x[0] - y[0]))
    for x, y in zip(a["meta_info"].get("output_top_logprobs") or [], b["meta_info"].get("output_top_logprobs") or []):
        if [t[1] for t in x] == [t[1] for t in y]:
            gap = max(gap, max((abs(s[0] - t[0]) for s, t in zip(x, y)), default=0.0))
        else:
            gap = max(gap, float("inf"))
    return gap


def compare(results: dict, reference: str = "ar-sync") -> dict:
    summary = {"reference_errors": sum(bool(o.get("error")) for outs in results[reference] for o in outs)}
    for name, outs in results.items():
        if name == reference:
            continue
        mismatched, errors, gap = [], 0, 0.0
        for i, (mine, ref) in enumerate(zip(outs, results[reference])):
            errors += sum(bool(o.get("error")) for o in mine)
            same = len(mine) == len(ref) and all(
                m.get("output_ids") == r.get("output_ids")
                and (m.get("meta_info") or {}).get("finish_reason") == (r.get("meta_info") or {}).get("finish_reason")
                for m, r in zip(mine, ref))
            if not same:
                mismatched.append(i)
            elif "output_token_logprobs" in (ref[0].get("meta_info") or {}):
                gap = max(gap, max(logprob_gap(m, r) for m, r in zip(mine, ref)))
        summary[name] = {"mismatches": len(mismatched), "first": mismatched[:8], "errors": errors,
                         "logprob_max_abs_diff": gap}
    return summary


def first_tokens_distribution(url: str, prompt: list[int], samples: int, k: int = 4) -> Counter:
    payload = {"input_ids": prompt, "sampling_params": {"max_new_tokens": k, "temperature": 0.8, "top_p": 0.95,
                                                        "repetition_penalty": 1.2}}
    with ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda _: call(url, payload)[0], range(samples)))
    return Counter(tuple(o.get("output_ids") or ()) for o in outs)


def total_variation(a: Counter, b: Counter) -> float:
    na, nb = sum(a.values()), sum(b.values())
    if not na or not nb:
        return 1.0
    return 0.5 * sum(abs(a[x] / na - b[x] / nb) for x in set(a) | set(b))


def marginal_tv(a: Counter, b: Counter, k: int = 4) -> float:
    """Largest total variation of one position's token over the first ``k`` (the joint distance
    of 4-token sequences is large even between two samples of one server; a position's is not)."""
    def at(c: Counter, i: int) -> Counter:
        out = Counter()
        for seq, n in c.items():
            out[seq[i] if len(seq) > i else None] += n
        return out
    return max(total_variation(at(a, i), at(b, i)) for i in range(k))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder for matrix.json and the server logs")
    parser.add_argument("--pair", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--target", default=None, help="target folder (smollm2: default /tmp/smollm2)")
    parser.add_argument("--draft", default=None, help="draft folder (smollm2: default results/smollm2-draft)")
    parser.add_argument("--impls", default="plugin,builtin", help="DFLASH implementations (default plugin,builtin)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per row (default 32)")
    parser.add_argument("--new-tokens", type=int, default=48, help="max_new_tokens per request (default 48)")
    parser.add_argument("--samples", type=int, default=512, help="samples for the sampled row (default 512)")
    parser.add_argument("--block", type=int, default=16, help="DFLASH block size (default 16)")
    parser.add_argument("--grammar", choices=("xgrammar", "none"), default="xgrammar")
    parser.add_argument("--rows", default="",
                        help="comma list of rows to run (default: all, in the order above); rows already in "
                             "OUTDIR/matrix.json and not named stay as they are")
    args = parser.parse_args()
    exit_on_sigterm()
    os.makedirs(args.out, exist_ok=True)
    if args.pair == "tiny":
        tiny_target, tiny_draft, _ = ensure_tiny_pair()
        target, draft = args.target or tiny_target, args.draft or tiny_draft
    else:
        target = args.target or "/tmp/smollm2"
        draft = args.draft or os.path.join(ROOT, "results", "smollm2-draft")
    impls = [i for i in args.impls.split(",") if i]
    ours = [i for i in impls if not i.startswith("builtin")]  # the plugin's servers: every one must match
    names = ["ar", "ar-sync", *impls]
    specs = {
        "ar": ServerSpec("ar", target, extra_args=flags(args.grammar), extra_env=ENV),
        "ar-sync": ServerSpec("ar", target, extra_args=flags(args.grammar) + ["--disable-overlap-schedule"],
                              extra_env={**ENV, "PYTHONPATH": os.pathsep.join(
                                  filter(None, [ORDERED_PENALIZERS, os.environ.get("PYTHONPATH")]))}),
        **{i: ServerSpec(i, target, draft, args.block, flags(args.grammar), ENV) for i in impls},
    }
    servers = {n: Server(specs[n], log_path=os.path.join(args.out, f"server-{n}.log"), timeout_s=480) for n in names}
    record = {"sglang": compat.running().version, "pair": args.pair, "dtype": "float32", "block_size": args.block,
              "prompts_per_row": args.prompts, "new_tokens": args.new_tokens, "reference": "ar-sync",
              "grammar_backend": args.grammar, "rows": {}, "stage": "start"}
    path = os.path.join(args.out, "matrix.json")
    if os.path.isfile(path):  # an earlier part of the same matrix: its rows stay
        with open(path) as f:
            record["rows"] = json.load(f).get("rows", {})

    def save(**kw):
        record.update(kw)
        with open(path, "w") as f:
            json.dump(record, f, indent=1)

    prompts = prompts_for(args.pair, target, args.prompts)
    all_rows = row_order(list(rows(prompts, args.new_tokens, args.grammar != "none", {})))
    wanted = [r for r in args.rows.split(",") if r] or all_rows
    unknown = sorted(set(wanted) - set(all_rows))
    if unknown:
        parser.error(f"--rows: unknown rows {unknown}; the rows are {','.join(all_rows)}")
    crashed = record.setdefault("crashed", {})

    def note_crashes(row: str) -> None:
        """A server that died during ``row``: where, and SGLang's own reason (its last exception line)."""
        for n, server in servers.items():
            if n not in crashed and server.proc is not None and server.proc.poll() is not None:
                crashed[n] = {"row": row, "reason": startup_reason(server.log_tail(400))}

    try:
        start_together(list(servers.values()))
        save(stage="servers up")
        # Stop strings from AR's own text, a few tokens in, so they land inside verify blocks.
        plain = run_row({"ar-sync": servers["ar-sync"]}, rows(prompts, args.new_tokens, False, {})["plain"])
        stop_text = {i: out[0].get("text", "")[8:11] for i, out in enumerate(plain["ar-sync"])
                     if len(out[0].get("text", "").strip()) > 12}
        greedy_rows = rows(prompts, args.new_tokens, args.grammar != "none", stop_text)
        for name in (r for r in all_rows if r in wanted):
            if name == "sampled":
                dists = {n: first_tokens_distribution(servers[n].url, prompts[0], args.samples) for n in names}
                again = first_tokens_distribution(servers["ar-sync"].url, prompts[0], args.samples)
                record["rows"]["sampled"] = {
                    "samples": args.samples, "ar_sync_vs_ar_sync_tv": total_variation(dists["ar-sync"], again),
                    "ar_sync_vs_ar_sync_marginal_tv": marginal_tv(dists["ar-sync"], again),
                    **{n: {"tv": total_variation(dists[n], dists["ar-sync"]),
                           "marginal_tv": marginal_tv(dists[n], dists["ar-sync"])} for n in names if n != "ar-sync"}}
            else:
                # The row's kernel variants (extend, decode, verify, grammar, logprobs) compile first.
                run_row(servers, greedy_rows[name][:2])
                record["rows"][name] = {"requests": len(greedy_rows[name]),
                                        **compare(run_row(servers, greedy_rows[name]))}
            note_crashes(name)
            save(stage=f"row {name}")
        save(stage="rows done", kv_after={n: kv_loads(s.url) for n, s in servers.items() if n not in crashed},
             dflash={n: server_info(servers[n].url).get("dflash") for n in ours if n not in crashed})
    finally:
        stop_all(list(servers.values()))
    # A row the reference itself failed measures nothing (SGLang 0.5.17's plain decoding crashes on
    # chosen-id logprobs): it is listed, not counted against anyone.
    measured = {n: r for n, r in record["rows"].items() if n == "sampled" or not r["reference_errors"]}
    greedy = [r for n, r in measured.items() if n != "sampled"]
    sampled = measured.get("sampled")
    plugin_ok = all(
        i not in crashed
        and all(r[i]["mismatches"] == 0 and r[i]["errors"] == 0 for r in greedy)
        and max((r[i]["logprob_max_abs_diff"] for r in greedy), default=0.0) <= 0.01
        and (sampled is None or (sampled[i]["tv"] <= 2 * sampled["ar_sync_vs_ar_sync_tv"] + 0.05 and
                                 sampled[i]["marginal_tv"] <= 2 * sampled["ar_sync_vs_ar_sync_marginal_tv"] + 0.05))
        for i in ours)
    idle = all(kv.get("num_used_tokens") == 0 for kv in record["kv_after"].values())
    save(stage="done", plugin_ok=plugin_ok, kv_idle=idle,
         unmeasured={n: "the reference (plain decoding) failed it" for n in record["rows"] if n not in measured})
    for name, row in record["rows"].items():
        print(name, json.dumps({n: v for n, v in row.items() if isinstance(v, dict)}))
    print("crashed", json.dumps(crashed))
    sys.exit(0 if plugin_ok and idle else 1)


if __name__ == "__main__":
    main()
