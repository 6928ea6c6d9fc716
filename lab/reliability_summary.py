"""Reads the reliability group's evidence (tests/gpu/test_reliability_gpu.py) into the summary form.

    python lab/reliability_summary.py DIR [DIR ...] [--out results/reliability/summary.json]

Each DIR holds ``reliability-<release>-{odd,openai,load}.json`` of one GPU run; later DIRs add to
earlier ones. Prints, per release: ``odd`` {case: {ar, builtin, plugin}} (served, refused, crashed
or error) for the cases the servers met differently, ``odd_alike`` {outcome: cases} counting the
others, ``load`` {pair: {seconds, requests, aborts, errors, kv_idle, state_idle, gpu_mem_mb,
host_rss_mb, cancelled_share, late_growth_mb}}, ``empty_prompt_cause`` (what plain decoding died of)
and ``openai_client`` {verdict: count} with the cases not ``same`` under ``not_same``, with the
files each came from under ``evidence``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from collections import Counter

from sglang_dflash.bench.openai_client import verdicts
from sglang_dflash.bench.stress import late_growth

FILE = re.compile(r"reliability-(?P<release>[0-9.]+)-(?P<part>odd|openai|load)\.json$")


def odd_table(report: dict) -> dict:
    table: dict = {}
    for impl, got in report["by_impl"].items():
        for case, o in got.get("outcomes", {}).items():
            table.setdefault(case, {})[impl] = o["outcome"]
    return table


def empty_prompt_causes(report: dict) -> dict:
    """{impl: what its server did with the empty text, and what ended it if it died of it}."""
    causes = {}
    for impl, got in report["by_impl"].items():
        o = got.get("outcomes", {}).get("empty text")
        if o is not None:
            why = o.get("cause") or o.get("message") or ""
            causes[impl] = f"{impl}: {o['outcome']}" + (f" ({why})" if why else "")
    return causes


def load_table(report: dict) -> dict:
    out = {}
    for pair, r in report["pairs"].items():
        start, end = r.get("start", {}), r.get("end", {})
        out[pair] = {
            "seconds": report["seconds"], "requests": r["requests"], "aborts": r["aborted"], "errors": r["errors"],
            "kv_idle": end.get("idle", {}).get("kv_used_tokens") == 0 and end.get("idle", {}).get("running_reqs") == 0,
            "state_idle": end.get("idle", {}).get("state_slots_used") in (0, None),
            "state_slots_used_end": end.get("idle", {}).get("state_slots_used"),
            "gpu_mem_mb": [start.get("memory", {}).get("gpu_mb"), end.get("memory", {}).get("gpu_mb")],
            "host_rss_mb": [start.get("memory", {}).get("host_rss_mb"), end.get("memory", {}).get("host_rss_mb")],
            "output_tok_s": r.get("output_tok_s"),
            "cancelled_share": round(r["aborted"] / r["requests"], 3) if r["requests"] else None,
        }
        if "memory_series" in r:  # readings through the load: what grew after its middle
            out[pair]["late_growth_mb"] = {k: late_growth(r["memory_series"], k) for k in ("gpu_mb", "host_rss_mb")}
    return out


def summarize(dirs: list[str], root: str = ".") -> dict:
    summary: dict = {}
    causes: dict = {}
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "reliability-*.json"))):
            m = FILE.search(os.path.basename(path))
            if not m:
                continue
            with open(path) as f:
                report = json.load(f)
            rel = summary.setdefault(m["release"], {"evidence": []})
            # A later run's servers (an impl, a pair) add to the earlier ones or replace theirs.
            if m["part"] == "odd":
                for case, by_impl in odd_table(report).items():
                    rel.setdefault("odd", {}).setdefault(case, {}).update(by_impl)
                causes.setdefault(m["release"], {}).update(empty_prompt_causes(report))
                rel["empty_prompt_cause"] = "; ".join(causes[m["release"]].values())
            elif m["part"] == "openai":
                rel["openai_client"] = verdicts(report)
            else:
                rel.setdefault("load", {}).update(load_table(report))
            rel["evidence"].append(os.path.relpath(path, root))
    for rel in summary.values():
        compact(rel)
    return summary


def compact(rel: dict) -> None:
    """The cases every server met alike as counts, the rest by name: the per-case tables stay in
    the evidence files, and the summary stays short (tests/test_docs.py caps it)."""
    if "odd" in rel:
        alike = {case: set(by_impl.values()) for case, by_impl in rel["odd"].items()}
        alike = {case: outcomes.pop() for case, outcomes in alike.items() if len(outcomes) == 1}
        # the servers in one order, whichever call measured them first
        rel["odd"] = {case: dict(sorted(by_impl.items())) for case, by_impl in rel["odd"].items() if case not in alike}
        rel["odd_alike"] = dict(sorted(Counter(alike.values()).items()))
    if "openai_client" in rel:
        by_case = rel["openai_client"]
        differs = sorted(case for case, verdict in by_case.items() if verdict != "same")
        rel["openai_client"] = {**dict(sorted(Counter(by_case.values()).items())), **({"not_same": differs} if differs else {})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", help="folders with reliability-<release>-*.json")
    ap.add_argument("--out", help="also write the summary here")
    args = ap.parse_args(argv)
    missing = [d for d in args.dirs if not os.path.isdir(d)]
    if missing:
        ap.error(f"no such folder: {', '.join(missing)}")
    summary = summarize(args.dirs)
    if not summary:
        ap.error("no reliability-<release>-{odd,openai,load}.json in " + ", ".join(args.dirs))
    text = json.dumps(summary, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
