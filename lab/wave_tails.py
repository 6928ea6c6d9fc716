"""How much of a paired wave ratio its slowest requests decide: a speculative server against plain
decoding, level by level, from interleaved sweeps' ``results.json``.

A wave lasts as long as its slowest request. Plain decoding takes a step a token, so its requests
finish together; a speculative server's finish at their own accept lengths, and its wave ends with
the request that accepts least, while the batch has shrunk to a few requests. Per level this prints
the paired wave ratio A / B, the ratio of B's decode steps to A's for the slowest request and for the
mean request, and the step cost of A over B that the slowest request's steps and the ratio imply
(the steps ratio by the slowest request over the wave ratio). Beside it, to check that reading, the
step cost as measured (each request's p50 time between its steps, as the client saw it, A's over
B's), and what A's width policy timed at that batch size for the full block and for width 1
(``/get_server_info`` ``step_ms``, the policy's own clock): where implied and measured agree, the
slowest request's steps and the loop's step account for the whole ratio.

    python3 lab/wave_tails.py RESULTS.json [RESULTS.json ...] [--pair adaptive ar]
"""

import argparse
import json
from statistics import geometric_mean
from typing import Optional

from sglang_dflash.adaptive import bucket
from sglang_dflash.bench.stats import wave_tails


def level_reading(a: dict, b: dict) -> Optional[dict]:
    """One level's waves of ``a`` beside the same waves of ``b`` (interleaved rows, same prompts);
    None where either row has no waves to read."""
    tails_a, tails_b = wave_tails(a), wave_tails(b)
    if not tails_a or not tails_b:
        return None
    n = min(len(tails_a), len(tails_b), len(a["wave_tok_s"]), len(b["wave_tok_s"]))
    ratio = geometric_mean(a["wave_tok_s"][i] / b["wave_tok_s"][i] for i in range(n))
    by_slowest = geometric_mean(tails_b[i]["slowest"] / tails_a[i]["slowest"] for i in range(n))
    by_mean = geometric_mean(tails_b[i]["mean"] / tails_a[i]["mean"] for i in range(n))
    measured = a["step_p50_ms"] / b["step_p50_ms"] if a.get("step_p50_ms") and b.get("step_p50_ms") else None
    return {"waves": n, "ratio": round(ratio, 3), "steps_ratio_slowest": round(by_slowest, 3),
            "steps_ratio_mean": round(by_mean, 3), "step_cost_a_over_b": round(by_slowest / ratio, 3),
            "step_cost_measured": None if measured is None else round(measured, 3),
            "policy_step_ms": policy_step_ms(a), "accept_length": a.get("accept_length")}


def policy_step_ms(row: dict) -> dict:
    """What the server's width policy timed at the level's batch size, ms: ``{"full": .., "1": ..}``
    from ``/get_server_info`` after the level (``dflash.step_ms``, keys ``WIDTH@BUCKET``), where it has them."""
    found = ((row.get("server_after") or {}).get("dflash") or {}).get("step_ms")
    if not found:
        return {}
    at = bucket(row["concurrency"])
    widths = {int(k.split("@")[0]): v for k, v in found.items() if k.endswith(f"@{at}")}
    return {key: widths[w] for key, w in (("full", max(widths, default=None)), ("1", 1)) if w in widths}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--pair", nargs=2, default=["adaptive", "ar"], metavar=("A", "B"))
    args = ap.parse_args()
    a_label, b_label = args.pair
    print("| set | conc | paired waves | A / B | B's steps / A's: slowest request | mean request "
          "| A's step / B's (implied) | (measured) | A's policy: full width, width 1 (ms) | A's accept length |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in args.results:
        with open(path) as f:
            rows = json.load(f)["rows"]
        by = {(r["label"], r["dataset"], r["concurrency"]): r for r in rows}
        for (label, dataset, conc), a in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
            b = by.get((b_label, dataset, conc))
            r = level_reading(a, b) if label == a_label and b is not None else None
            if r is None:
                continue
            tau = f"{r['accept_length']:.2f}" if r["accept_length"] else "-"
            measured = f"{r['step_cost_measured']:.2f}" if r["step_cost_measured"] else "-"
            timed = r["policy_step_ms"]
            policy = ", ".join(f"{timed[k]:.2f}" if k in timed else "-" for k in ("full", "1")) if timed else "-"
            print(f"| {dataset} | {conc} | {r['waves']} | {r['ratio']:.3f} | {r['steps_ratio_slowest']:.2f} "
                  f"| {r['steps_ratio_mean']:.2f} | {r['step_cost_a_over_b']:.2f} | {measured} | {policy} | {tau} |")


if __name__ == "__main__":
    main()
