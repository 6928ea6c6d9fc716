#!/usr/bin/env python3
"""The default against fixed 16, level by level, from two-server sweeps (``IMPLS=plugin-fixed,adaptive``
of ``lab/gpu_smollm2_pair.sh sweep``): paired ratios, host time a step, and what the width policy did.

    python3 lab/adaptive_levels.py OUT.json RUN_DIR [RUN_DIR ...] [--before RUN_DIR ...]
                                   [--code TEXT] [--setup TEXT] [--command RUN=TEXT ...]
                                   [--pair DEFAULT BASELINE]

``--pair plugin ar`` reads the default against plain decoding instead (the random rig's
``IMPLS=ar,plugin``): the keys then say ``over_ar`` where they say ``over_fixed_16``.

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

from sglang_dflash.bench.stats import paired_ratio_stats, paired_wave_cycles, wave_host_per_step

A, B = "adaptive", "plugin-fixed"
COUNTERS = ("decode_steps", "widths_used", "choices", "fallback")


def baseline_key(b: str) -> str:
    return "fixed_16" if b == "plugin-fixed" else b.replace("-", "_")


def since(after, before):
    """A running total's growth: numbers less their earlier value, dicts key by key."""
    if isinstance(after, dict):
        return {k: since(v, (before or {}).get(k)) for k, v in after.items()}
    if isinstance(after, (int, float)) and not isinstance(after, bool):
        return after - (before or 0)
    return after


def brief(stats: dict) -> dict:
    return {"geomean": round(stats["geomean"], 4), "ci95": [round(x, 4) for x in stats["ci95"]], "waves": stats["waves"]}


def counters(row: dict) -> dict:
    return (row.get("server_after") or {}).get("dflash") or {}


def server_level(row: dict, grown: dict, a: str = A) -> dict:
    host = wave_host_per_step(row)
    e = {"tok_s": round(row["output_tok_s"], 1), "accept_length": row["accept_length"],
         "policy_us_per_step": round(statistics.median(h["policy"] for h in host), 1) if host else None,
         "call_plus_gap_us_per_step_median_of_waves": round(statistics.median(h["call"] + h["gap"] for h in host), 1) if host else None}
    if row["label"] == a:
        asleep = sum(v.get("asleep", 0) for v in (grown.get("choices") or {}).values())
        e["asleep_share"] = round(asleep / grown["decode_steps"], 4) if grown.get("decode_steps") else None
        e["widths_used"] = {k: v for k, v in sorted((grown.get("widths_used") or {}).items(), key=lambda kv: -int(kv[0])) if v}
        e["fallback_requests"] = (grown.get("fallback") or {}).get("requests")
    return e


def run_levels(rows: list[dict], a: str = A, b: str = B) -> dict:
    over = baseline_key(b)
    levels = {}
    for label in (a, b):
        before = None
        mine = [r for r in rows if r["label"] == label]  # a label names one server (plugin-fixed-b8)
        # a server that failed reports no counters: its rows read nothing; plain decoding (a baseline)
        # never reports them, so its rows stand on their waves
        served = [r for r in mine if counters(r).get("decode_steps")]
        if not served and label == b:
            served = [r for r in mine if r.get("wave_tok_s")]
        for row in sorted(served, key=lambda r: counters(r).get("decode_steps", 0)):
            now = {k: counters(row).get(k) for k in COUNTERS}
            levels.setdefault((row["dataset"], row["concurrency"]), {})[label] = server_level(row, since(now, before), a)
            before = now
    cycles = paired_wave_cycles(rows, a, b)
    out = {}
    for (dataset, conc), lv in sorted(levels.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if cycles.get((dataset, conc)) and a in lv and b in lv:
            lv[f"over_{over}"] = brief(paired_ratio_stats(cycles[dataset, conc]))
            host_a, host_b = lv[a]["call_plus_gap_us_per_step_median_of_waves"], lv[b]["call_plus_gap_us_per_step_median_of_waves"]
            if host_a and host_b:
                lv[f"host_time_a_step_over_{over}"] = round(host_a / host_b, 4)
                lv[f"policy_share_of_{over}_host_time"] = round(lv[a]["policy_us_per_step"] / host_b, 4)
        out[f"{dataset} c{conc}"] = lv
    return out


def pooled(runs: list[list[dict]], a: str = A, b: str = B) -> dict:
    by_level: dict = {}
    for rows in runs:
        for (dataset, conc), cycles in paired_wave_cycles(rows, a, b).items():
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
    ap.add_argument("--pair", nargs=2, default=[A, B], metavar=("DEFAULT", "BASELINE"),
                    help=f"the two servers' labels (default {A} {B})")
    args = ap.parse_args()
    a, b = args.pair
    over = baseline_key(b)
    commands = dict(c.partition("=")[::2] for c in args.command)
    rows = {os.path.basename(os.path.normpath(d)): load(d) for d in args.runs}
    labels = {r["label"] for run in rows.values() for r in run}
    if a not in labels or b not in labels:
        raise SystemExit(f"adaptive_levels: --pair {a} {b}: the runs hold {', '.join(sorted(labels))}")
    runs = {name: {"command": commands.get(name), "levels": run_levels(r, a, b)} for name, r in rows.items()}
    every = [lv for r in runs.values() for lv in r["levels"].values() if f"host_time_a_step_over_{over}" in lv]
    host = [lv[f"host_time_a_step_over_{over}"] for lv in every]
    share = [lv[f"policy_share_of_{over}_host_time"] for lv in every]
    doc = {"code": args.code, "setup": args.setup, "intervals": "bootstrap over whole rotation cycles", "runs": runs,
           "pooled": {"runs": list(rows), "levels": pooled(list(rows.values()), a, b)}}
    if [a, b] != [A, B]:
        doc["pair"] = [a, b]
    if args.before:
        doc["pooled_with_before"] = {"before": args.before, "levels": pooled(list(rows.values()) + [load(d) for d in args.before], a, b)}
    if host:
        doc["host_time"] = {
            f"default_over_{over}_median_of_levels": round(statistics.median(host), 4), "range": [min(host), max(host)],
            "policy_share_median_of_levels": round(statistics.median(share), 4), "policy_share_range": [min(share), max(share)],
            "note": "per level: the median over waves of each server's host time a decode step (worker call and the scheduler's gap before it)"}
    with open(args.output, "w") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")
    for name, r in runs.items():
        for key, lv in r["levels"].items():
            if f"over_{over}" in lv:
                o, d = lv[f"over_{over}"], lv[a]
                print(f"{name} {key}: {o['geomean']:.3f} ({o['ci95'][0]:.3f}-{o['ci95'][1]:.3f}, {o['waves']} waves), "
                      f"host {lv.get(f'host_time_a_step_over_{over}')}, policy {d['policy_us_per_step']} us, asleep {d.get('asleep_share')}")
    for conc, e in doc["pooled"]["levels"].items():
        print(f"pooled {conc}: {e['geomean']:.3f} ({e['ci95'][0]:.3f}-{e['ci95'][1]:.3f}, {e['waves']} waves)")


if __name__ == "__main__":
    main()
