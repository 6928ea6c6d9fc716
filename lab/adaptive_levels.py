#!/usr/bin/env python3
"""The default against fixed 16, level by level, from two-server sweeps (``IMPLS=plugin-fixed,adaptive``
of ``lab/gpu_smollm2_pair.sh sweep``): paired ratios, host time a step, and what the width policy did.

    python3 lab/adaptive_levels.py OUT.json RUN_DIR [RUN_DIR ...] [--before RUN_DIR ...]
                                   [--code TEXT] [--setup TEXT] [--command RUN=TEXT ...]

Per run and level (``runs``): each server's tok/s and accept length, the medians over waves of its
host time a decode step and of the policy's share of it (``stats.wave_host_per_step``), and for the
default the share of steps asleep, the widths used and the requests that fell back. Those counters
are running totals on each server, so a level's figures are its totals less the level measured
before it on that server (by ``decode_steps``). ``pooled``: the paired waves of all RUN_DIRs, per
level and set; ``pooled_with_before``: with the ``--before`` runs' waves too.
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sglang_dflash.bench.stats import paired_ratio_stats, paired_wave_cycles, wave_host_per_step  # noqa: E402

A, B = "adaptive", "plugin-fixed"
COUNTERS = ("decode_steps", "widths_used", "choices", "fallback")


def since(after, before):
    """A running total's growth: numbers less their earlier value, dicts key by key."""
    if isinstance(after, dict):
        return {k: since(v, (before or {}).get(k)) for k, v in after.items()}
    if isinstance(after, (int, float)) and not isinstance(after, bool):
        return after - (before or 0)
    return after


def brief(stats: dict) -> dict:
    return {"geomean": round(stats["geomean"], 4), "ci95": [round(x, 4) for x in stats["ci95"]], "waves": stats["waves"]}


def server_level(row: dict, grown: dict) -> dict:
    host = wave_host_per_step(row)
    e = {"tok_s": round(row["output_tok_s"], 1), "accept_length": row["accept_length"],
         "policy_us_per_step": round(statistics.median(h["policy"] for h in host), 1) if host else None,
         "call_plus_gap_us_per_step_median_of_waves": round(statistics.median(h["call"] + h["gap"] for h in host), 1) if host else None}
    if row["impl"] == A:
        asleep = sum(v.get("asleep", 0) for v in (grown.get("choices") or {}).values())
        e["asleep_share"] = round(asleep / grown["decode_steps"], 4) if grown.get("decode_steps") else None
        e["widths_used"] = {k: v for k, v in sorted((grown.get("widths_used") or {}).items(), key=lambda kv: -int(kv[0])) if v}
        e["fallback_requests"] = (grown.get("fallback") or {}).get("requests")
    return e


def run_levels(rows: list[dict]) -> dict:
    levels = {}
    for impl in (A, B):
        before = None
        # a server that failed reports no counters: its rows read nothing
        served = [r for r in rows if r["impl"] == impl and ((r.get("server_after") or {}).get("dflash") or {}).get("decode_steps")]
        for row in sorted(served, key=lambda r: r["server_after"]["dflash"]["decode_steps"]):
            now = {k: row["server_after"]["dflash"].get(k) for k in COUNTERS}
            levels.setdefault((row["dataset"], row["concurrency"]), {})[impl] = server_level(row, since(now, before))
            before = now
    cycles = paired_wave_cycles(rows, A, B)
    out = {}
    for (dataset, conc), lv in sorted(levels.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if cycles.get((dataset, conc)) and A in lv and B in lv:
            lv["over_fixed_16"] = brief(paired_ratio_stats(cycles[dataset, conc]))
            a, b = lv[A]["call_plus_gap_us_per_step_median_of_waves"], lv[B]["call_plus_gap_us_per_step_median_of_waves"]
            if a and b:
                lv["host_time_a_step_over_fixed_16"] = round(a / b, 4)
                lv["policy_share_of_fixed_16_host_time"] = round(lv[A]["policy_us_per_step"] / b, 4)
        out[f"{dataset} c{conc}"] = lv
    return out


def pooled(runs: list[list[dict]]) -> dict:
    by_level: dict = {}
    for rows in runs:
        for (dataset, conc), cycles in paired_wave_cycles(rows, A, B).items():
            by_level.setdefault(conc, {}).setdefault(dataset, []).extend(cycles)
    out = {}
    for conc in sorted(by_level):
        sets = by_level[conc]
        out[f"c{conc}"] = {**brief(paired_ratio_stats([c for cycles in sets.values() for c in cycles])),
                           **{d: brief(paired_ratio_stats(sets[d])) for d in sorted(sets)}}
    return out


def load(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "results.json")
    try:
        with open(path) as f:
            return json.load(f)["rows"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"adaptive_levels: {path}: not a sweep's results.json ({e})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output")
    ap.add_argument("runs", nargs="+", help="sweep output folders (each with results.json)")
    ap.add_argument("--before", nargs="+", default=[], help="earlier runs to pool with these as well")
    ap.add_argument("--code", default="", help="the commit the runs measured, in words")
    ap.add_argument("--setup", default="", help="release, device, model and server flags, in words")
    ap.add_argument("--command", action="append", default=[], metavar="RUN=TEXT", help="the command that made a run")
    args = ap.parse_args()
    commands = dict(c.partition("=")[::2] for c in args.command)
    rows = {os.path.basename(os.path.normpath(d)): load(d) for d in args.runs}
    runs = {name: {"command": commands.get(name), "levels": run_levels(r)} for name, r in rows.items()}
    every = [lv for r in runs.values() for lv in r["levels"].values() if "host_time_a_step_over_fixed_16" in lv]
    host = [lv["host_time_a_step_over_fixed_16"] for lv in every]
    share = [lv["policy_share_of_fixed_16_host_time"] for lv in every]
    doc = {"code": args.code, "setup": args.setup, "intervals": "bootstrap over whole rotation cycles", "runs": runs,
           "pooled": {"runs": list(rows), "levels": pooled(list(rows.values()))}}
    if args.before:
        doc["pooled_with_before"] = {"before": args.before, "levels": pooled(list(rows.values()) + [load(d) for d in args.before])}
    if host:
        doc["host_time"] = {
            "default_over_fixed_16_median_of_levels": round(statistics.median(host), 4), "range": [min(host), max(host)],
            "policy_share_median_of_levels": round(statistics.median(share), 4), "policy_share_range": [min(share), max(share)],
            "note": "per level: the median over waves of each server's host time a decode step (worker call and the scheduler's gap before it)"}
    with open(args.output, "w") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")
    for name, r in runs.items():
        for key, lv in r["levels"].items():
            if "over_fixed_16" in lv:
                o, a = lv["over_fixed_16"], lv[A]
                print(f"{name} {key}: {o['geomean']:.3f} ({o['ci95'][0]:.3f}-{o['ci95'][1]:.3f}, {o['waves']} waves), "
                      f"host {lv.get('host_time_a_step_over_fixed_16')}, policy {a['policy_us_per_step']} us, asleep {a.get('asleep_share')}")
    for conc, e in doc["pooled"]["levels"].items():
        print(f"pooled {conc}: {e['geomean']:.3f} ({e['ci95'][0]:.3f}-{e['ci95'][1]:.3f}, {e['waves']} waves)")


if __name__ == "__main__":
    main()
