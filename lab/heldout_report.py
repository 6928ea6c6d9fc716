#!/usr/bin/env python3
"""Issue 79's final measurement, set by set and level by level: the default against plain decoding and
against the built-in from interleaved sweeps of all three (``IMPLS=ar,adaptive,builtin`` of
``lab/gpu_smollm2_pair.sh sweep``), with the goals checked and one plot line per set.

    python3 -m lab.heldout_report OUT_DIR RUN/results.json [RUN2/results.json ...]
                                  [--default adaptive] [--setup TEXT]

Waves are pooled per set and level over every run given (whole rotation cycles, as
``sglang_dflash.bench.pool`` pools them per level). Writes ``OUT_DIR/heldout.json`` (the keys of
``results/summary.json`` ``adaptive.heldout``: ``levels``, ``default_over_ar``,
``default_over_builtin``, each ``{set: {c: {geomean, ci95, waves}}}``, and ``goals``),
``OUT_DIR/heldout.md`` (a table per set) and ``OUT_DIR/heldout.png``. Goals (issue 79, item 3): the
default over plain decoding at a geometric mean of 1.00 or more with the interval's lower end at
0.97 or more; over the built-in at 1.00 or more. Exit 1 when a goal fails, 2 on bad input.
"""

import argparse
import json
import os
import sys

from sglang_dflash.bench.stats import paired_ratio_stats, paired_wave_cycles

OVER_AR_MEAN, OVER_AR_LOW, OVER_BUILTIN_MEAN = 1.00, 0.97, 1.00


def pooled(runs: list[list[dict]], a: str, b: str) -> dict:
    """{set: {"cN": {geomean, ci95, waves}}} of a / b over every run's paired waves."""
    cycles: dict = {}
    for rows in runs:
        for (dataset, conc), got in paired_wave_cycles(rows, a, b).items():
            cycles.setdefault(dataset, {}).setdefault(conc, []).extend(got)
    out = {}
    for dataset, levels in sorted(cycles.items()):
        for conc, got in sorted(levels.items()):
            if got:
                s = paired_ratio_stats(got)
                out.setdefault(dataset, {})[f"c{conc}"] = {
                    "geomean": round(s["geomean"], 4), "ci95": [round(x, 4) for x in s["ci95"]], "waves": s["waves"]}
    return out


def accept_lengths(runs: list[list[dict]], label: str) -> dict:
    """{set: {"cN": completion tokens over verify steps}} of one server, over every run."""
    sums: dict = {}
    for rows in runs:
        for r in rows:
            if r["label"] == label and r.get("spec_verify_ct"):
                t = sums.setdefault(r["dataset"], {}).setdefault(f"c{r['concurrency']}", [0, 0])
                t[0] += r["output_tokens"]
                t[1] += r["spec_verify_ct"]
    return {d: {c: round(t / v, 3) for c, (t, v) in lv.items()} for d, lv in sums.items()}


def goals(over_ar: dict, over_builtin: dict) -> dict:
    """{set: {"cN": {"over_ar": bool, "over_builtin": bool}}}; a pair that was not run is None."""
    out: dict = {}
    for dataset in sorted(set(over_ar) | set(over_builtin)):
        for c in sorted(set(over_ar.get(dataset, {})) | set(over_builtin.get(dataset, {})), key=lambda c: int(c[1:])):
            ar, bi = over_ar.get(dataset, {}).get(c), over_builtin.get(dataset, {}).get(c)
            out.setdefault(dataset, {})[c] = {
                "over_ar": None if ar is None else (ar["geomean"] >= OVER_AR_MEAN and ar["ci95"][0] >= OVER_AR_LOW),
                "over_builtin": None if bi is None else bi["geomean"] >= OVER_BUILTIN_MEAN}
    return out


def markdown(report: dict) -> str:
    mark = {True: "yes", False: "**no**", None: "-"}

    def cell(e):
        return "-" if e is None else f"{e['geomean']:.3f} ({e['ci95'][0]:.3f}-{e['ci95'][1]:.3f}), {e['waves']} waves"

    lines = [f"# The default against plain decoding and the built-in, per set ({report['setup']})", "",
             f"Goals: over plain decoding a geometric mean >= {OVER_AR_MEAN:.2f} with the interval's lower end "
             f">= {OVER_AR_LOW:.2f}; over the built-in >= {OVER_BUILTIN_MEAN:.2f}.", ""]
    for dataset, levels in report["goals"].items():
        lines += [f"## {dataset}", "", "| level | default / plain decoding | goal | default / built-in | goal | accept length |",
                  "|---|---|---|---|---|---|"]
        for c, ok in levels.items():
            acc = report["accept_length"].get(dataset, {}).get(c)
            lines.append(f"| {c} | {cell(report['default_over_ar'].get(dataset, {}).get(c))} | {mark[ok['over_ar']]} | "
                         f"{cell(report['default_over_builtin'].get(dataset, {}).get(c))} | {mark[ok['over_builtin']]} | "
                         f"{'-' if acc is None else f'{acc:.2f}'} |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    from lab.plot_pooled import level_points  # sets matplotlib's Agg backend first

    import matplotlib.pyplot as plt

    levels = report["levels"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, key, title in ((axes[0], "default_over_ar", "default / plain decoding"),
                           (axes[1], "default_over_builtin", "default / built-in")):
        for dataset, got in sorted(report[key].items()):
            conc, mean, low, high = level_points(got)
            ax.errorbar([levels.index(f"c{c}") for c in conc], mean, yerr=[low, high], marker="o", capsize=3,
                        label=dataset)
        ax.axhline(1.0, color="black", lw=0.8)
        if key == "default_over_ar":
            ax.axhline(OVER_AR_LOW, color="grey", lw=0.8, ls="--", label=f"interval floor {OVER_AR_LOW}")
        ax.set_xticks(range(len(levels)), levels)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("paired waves, geometric mean (95% interval)")
    axes[0].legend(fontsize=8)
    fig.suptitle(report["setup"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output_dir")
    ap.add_argument("results", nargs="+", help="results.json of sweeps run with --interleave, ar, the default and builtin")
    ap.add_argument("--default", default="adaptive", help="the default server's label (default adaptive)")
    ap.add_argument("--setup", default="", help="model, release, GPU, backend, date and commit, for the titles")
    args = ap.parse_args(argv)
    runs = []
    for path in args.results:
        try:
            with open(path) as f:
                runs.append(json.load(f)["rows"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"heldout_report: {path} is not a benchmark results.json ({e.__class__.__name__})", file=sys.stderr)
            return 2
    over_ar, over_builtin = pooled(runs, args.default, "ar"), pooled(runs, args.default, "builtin")
    if not over_ar and not over_builtin:
        print(f"heldout_report: no waves of {args.default} paired with ar or builtin (run with --interleave)",
              file=sys.stderr)
        return 2
    levels = sorted({c for d in (over_ar, over_builtin) for lv in d.values() for c in lv}, key=lambda c: int(c[1:]))
    report = {"setup": args.setup or "setup not given", "levels": levels, "default_over_ar": over_ar,
              "default_over_builtin": over_builtin, "accept_length": accept_lengths(runs, args.default),
              "goals": goals(over_ar, over_builtin)}
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "heldout.json"), "w") as f:
        json.dump(report, f, indent=1)
    text = markdown(report)
    with open(os.path.join(args.output_dir, "heldout.md"), "w") as f:
        f.write(text)
    plot(report, os.path.join(args.output_dir, "heldout.png"))
    print(text, end="")
    failed = [f"{d} {c}" for d, lv in report["goals"].items() for c, ok in lv.items() if False in ok.values()]
    if failed:
        print(f"heldout_report: goals missed at {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
