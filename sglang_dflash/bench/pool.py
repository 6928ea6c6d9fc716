"""Plugin vs built-in over several interleaved runs: every paired wave pooled per concurrency.

One run's waves swing by tens of percent on a host-bound model, so a single run cannot rank two
servers that are close. Pooling the paired waves of several runs (each pair ran the same prompts,
adjacent in time) gives a geometric mean with a 95% bootstrap interval, resampling whole rotation
cycles (one wave per server, each on every CPU slice once: ``stats.paired_ratio_stats``); the
accept length is pooled as all completion tokens over all verify steps.

    python -m sglang_dflash.bench.pool RUN/results.json [RUN2/results.json ...] --output-dir DIR
                                       [--pair plugin-replay-setup builtin]

Each run's results.json comes from sglang-dflash-bench --interleave; the pooled figures go to
DIR/pooled_waves.json and DIR/pooled_waves.md. ``--pair A B`` pools A / B for any two of the
runs' servers (default plugin / builtin): a variant against the built-in, or against the plugin.
``--apart`` pools servers that ran in runs of their own (two that do not fit one GPU side by
side): all of A's waves over all of B's, unpaired (``stats.apart_ratio_stats``).
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

from .cli import parser
from .stats import apart_ratio_stats, paired_ratio_stats, paired_wave_cycles


def _accept_and_rates(rows: list[dict], labels: tuple, tokens: dict, seconds: dict) -> None:
    """Adds the labelled servers' tokens and verify steps, and every server's tokens and seconds,
    per concurrency (every server ran every wave: its tokens over its seconds)."""
    for row in rows:
        if row["label"] in labels and row.get("spec_verify_ct"):
            tokens[row["concurrency"]][row["label"]][0] += row["output_tokens"]
            tokens[row["concurrency"]][row["label"]][1] += row["spec_verify_ct"]
        if row.get("wall_s"):
            seconds[row["concurrency"]][row["label"]][0] += row["output_tokens"]
            seconds[row["concurrency"]][row["label"]][1] += row["wall_s"]


def pool(runs: dict[str, list[dict]], a: str = "plugin", b: str = "builtin") -> dict:
    """runs: name -> rows of a results.json. Returns per concurrency the pooled wave statistics,
    accept lengths and each server's tok/s (all its tokens over all its seconds; a server in only
    some runs, AR say, is pooled over those), and the wave statistics per run and dataset."""
    ratios = defaultdict(list)
    tokens, seconds = (defaultdict(lambda: defaultdict(lambda: [0, 0])) for _ in range(2))
    per_run = []
    for name, rows in runs.items():
        for (dataset, conc), r in sorted(paired_wave_cycles(rows, a, b).items()):
            if r:
                ratios[conc] += r  # whole cycles: none spans two runs
                per_run.append({"run": name, "dataset": dataset, "concurrency": conc, **paired_ratio_stats(r)})
        _accept_and_rates(rows, (a, b), tokens, seconds)
    if not ratios:
        raise SystemExit(f"no run pairs {a} with {b} wave by wave (was it run with --interleave?)")
    pooled = {}
    for conc in sorted(ratios):
        accept = {lab: t / v for lab, (t, v) in tokens[conc].items() if v}
        entry = {**paired_ratio_stats(ratios[conc]), f"{a}_accept_len": accept.get(a), f"{b}_accept_len": accept.get(b),
                 **{f"{lab}_tok_s": t / w for lab, (t, w) in seconds[conc].items() if w}}
        if accept.get(a) and accept.get(b):
            entry["accept_len_ratio"] = accept[a] / accept[b]
        pooled[f"c{conc}"] = entry
    return {"pooled": pooled, "per_run": per_run, "runs": list(runs)}


def pool_apart(runs: dict[str, list[dict]], a: str = "plugin", b: str = "builtin") -> dict:
    """As :func:`pool` for servers measured in runs of their own: per concurrency, every wave of
    ``a`` in any run over every wave of ``b``, resampled apart."""
    waves = defaultdict(lambda: {a: [], b: []})
    tokens, seconds = (defaultdict(lambda: defaultdict(lambda: [0, 0])) for _ in range(2))
    per_run = []
    for name, rows in runs.items():
        for row in rows:
            if row["label"] in (a, b) and row.get("wave_tok_s"):
                waves[row["concurrency"]][row["label"]] += row["wave_tok_s"]
                per_run.append({"run": name, "server": row["label"], "dataset": row["dataset"],
                                "concurrency": row["concurrency"], "waves": len(row["wave_tok_s"]),
                                "tok_s": row.get("output_tok_s"), "step_p50_ms": row.get("step_p50_ms"),
                                "ttft_p50_ms": row.get("ttft_p50_ms")})
        _accept_and_rates(rows, (a, b), tokens, seconds)
    levels = {c: w for c, w in waves.items() if w[a] and w[b]}
    if not levels:
        raise SystemExit(f"no concurrency has waves of both {a} and {b} in these runs")
    pooled = {}
    for conc in sorted(levels):
        accept = {lab: t / v for lab, (t, v) in tokens[conc].items() if v}
        pooled[f"c{conc}"] = {**apart_ratio_stats(levels[conc][a], levels[conc][b]),
                              f"{a}_accept_len": accept.get(a), f"{b}_accept_len": accept.get(b),
                              **{f"{lab}_tok_s": t / w for lab, (t, w) in seconds[conc].items() if w}}
    return {"pooled": pooled, "per_run": per_run, "runs": list(runs), "apart": True}


def table(head: list[str], rows: list[list]) -> list[str]:
    """A markdown table's lines."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(map(str, r)) + " |" for r in rows]


def markdown_apart(result: dict, a: str, b: str) -> str:
    pooled = [[conc[1:], f"{e['waves'][0]} / {e['waves'][1]}", f"{e['geomean']:.3f}x",
               f"{e['ci95'][0]:.3f}-{e['ci95'][1]:.3f}",
               f"{e[f'{a}_accept_len'] or 0:.3f} / {e[f'{b}_accept_len'] or 0:.3f}",
               f"{e[f'{a}_tok_s']:.0f} / {e[f'{b}_tok_s']:.0f}"] for conc, e in result["pooled"].items()]
    runs = [[e["run"], e["server"], e["dataset"], e["concurrency"], e["waves"], f"{e['tok_s'] or 0:.0f}",
             f"{e['step_p50_ms'] or 0:.2f}", f"{e['ttft_p50_ms'] or 0:.1f}"] for e in result["per_run"]]
    lines = [f"# {a} / {b}, waves of runs apart (one server a run), unpaired, over {len(result['runs'])} runs", "",
             *table(["concurrency", f"waves {a} / {b}", "geometric mean", "95% interval (each side resampled)",
                     f"accept length {a} / {b}", f"tok/s {a} / {b}"], pooled),
             "", "Per run:", "",
             *table(["run", "server", "dataset", "concurrency", "waves", "tok/s", "step p50 ms", "TTFT p50 ms"], runs)]
    return "\n".join(lines) + "\n"


def markdown(result: dict, a: str = "plugin", b: str = "builtin") -> str:
    if result.get("apart"):
        return markdown_apart(result, a, b)
    pooled = []
    for conc, e in result["pooled"].items():
        acc = (f"{e[f'{a}_accept_len']:.3f} / {e[f'{b}_accept_len']:.3f} ({100 * (e['accept_len_ratio'] - 1):+.1f}%)"
               if "accept_len_ratio" in e else "-")
        ar = f" ({e['ar_tok_s']:.0f})" if e.get("ar_tok_s") else ""
        pooled.append([conc[1:], e["waves"], e["at_least_1x"], f"{e['geomean']:.3f}x",
                       f"{e['ci95'][0]:.3f}-{e['ci95'][1]:.3f} ({e['resampled']})", acc,
                       f"{e[f'{a}_tok_s']:.0f} / {e[f'{b}_tok_s']:.0f}{ar}"])
    runs = [[e["run"], e["dataset"], e["concurrency"], e["waves"], f"{e['geomean']:.3f}x",
             f"{e['ci95'][0]:.3f}-{e['ci95'][1]:.3f} ({e['resampled']})"] for e in result["per_run"]]
    lines = [f"# {a} / {b}, paired waves pooled over {len(result['runs'])} interleaved runs", "",
             *table(["concurrency", "waves", "waves >= 1x", "geometric mean", "95% interval (resampled)",
                     f"accept length {a} / {b}", f"tok/s {a} / {b} (AR)"], pooled),
             "", "Per run and dataset:", "",
             *table(["run", "dataset", "concurrency", "waves", "geometric mean", "95% interval (resampled)"], runs)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = parser(__doc__, prog="python -m sglang_dflash.bench.pool")
    ap.add_argument("results", nargs="+", help="results.json of runs made with --interleave (one folder each)")
    ap.add_argument("--output-dir", required=True, help="where pooled_waves.json and pooled_waves.md go")
    ap.add_argument("--pair", nargs=2, default=("plugin", "builtin"), metavar=("A", "B"),
                    help="the two servers (labels of the runs' rows) to pool A / B for")
    ap.add_argument("--apart", action="store_true",
                    help="the servers ran in runs of their own (one at a time): pool all of A's waves over "
                         "all of B's, unpaired")
    args = ap.parse_args(argv)
    runs = {}
    for path in args.results:
        if not os.path.isfile(path):
            ap.error(f"no such file: {path}")
        try:
            with open(path) as f:
                rows = json.load(f)["rows"]
        except (ValueError, KeyError, TypeError):
            ap.error(f"{path} is not a benchmark results.json (no rows)")
        runs[os.path.basename(os.path.dirname(os.path.abspath(path)))] = rows
    a, b = args.pair
    result = pool_apart(runs, a, b) if args.apart else pool(runs, a, b)
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "pooled_waves.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = markdown(result, a, b)
    with open(os.path.join(args.output_dir, "pooled_waves.md"), "w") as f:
        f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
