#!/usr/bin/env python3
"""Issue 27's table in one figure: each server's tok/s over plain decoding, level by level and set by
set, from a six-server SmolLM2 sweep; then the paired ratios against their goals.

    python3 lab/plot_goals.py OUT.png SIX_SERVER/results.json [--zero levels.json] [--random levels.json]
                              [--mt-bench levels.json]

The SmolLM2 panels divide each server's tok/s at a level by plain decoding's (a run's totals, not
paired); ``--zero`` draws the default over fixed 16 on the zero-weight rig and ``--random`` the
default over plain decoding on the random-weight rig, ``--mt-bench`` the default over plain decoding
on SmolLM2's mt-bench (``lab/adaptive_levels.py`` files, pooled paired waves with their 95% intervals).
"""

import argparse
import json
import os

COLORS = {"ar": "gray", "plugin-fixed": "tab:blue", "plugin-fixed-b8": "tab:cyan", "plugin-fixed-b4": "tab:olive",
          "adaptive": "tab:red", "builtin": "tab:purple"}
NAMES = {"ar": "plain decoding", "plugin-fixed": "fixed 16", "plugin-fixed-b8": "fixed 8", "plugin-fixed-b4": "fixed 4",
         "adaptive": "default (adaptive)", "builtin": "built-in"}


def over_ar(rows: list[dict]) -> dict:
    """{dataset: {label: [(concurrency, tok/s over plain decoding's)]}}, from the ``speedup`` the sweep
    wrote into each row (``sglang_dflash.bench.stats.add_speedups``)."""
    out: dict = {}
    for r in sorted(rows, key=lambda r: r["concurrency"]):
        if r.get("speedup"):
            out.setdefault(r["dataset"], {}).setdefault(r["label"], []).append((r["concurrency"], r["speedup"]))
    return out


def pooled_points(doc: dict) -> list[tuple[int, float, float, float, int]]:
    """(concurrency, geomean, low, high, waves) from an adaptive_levels file's pooled levels."""
    return [(int(c[1:]), e["geomean"], e["ci95"][0], e["ci95"][1], e["waves"])
            for c, e in sorted(doc["pooled"]["levels"].items(), key=lambda kv: int(kv[0][1:]))]


def paired_series(zero: str | None, random: str | None, mt_bench: str | None) -> list[tuple[list, float, str]]:
    """(pooled points, goal, what) for each adaptive_levels file given, in the order drawn."""
    series = []
    for path, goal, what in ((zero, 0.98, "rig, zero weights: default / fixed 16"),
                             (random, 0.95, "rig, random weights: default / plain decoding"),
                             (mt_bench, 1.0, "SmolLM2 mt-bench: default / plain decoding")):
        if path:
            with open(path) as f:
                series.append((pooled_points(json.load(f)), goal, what))
    return series


def concurrency_axis(ax, levels: set[int]) -> None:
    """Concurrency on a log-2 axis, one tick per level measured."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(levels), [str(c) for c in sorted(levels)])
    ax.minorticks_off()
    ax.grid(alpha=0.3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output")
    ap.add_argument("six_server", help="results.json of the six-server sweep")
    ap.add_argument("--zero", help="adaptive_levels.py file of the zero-weight rig (default / fixed 16)")
    ap.add_argument("--random", help="adaptive_levels.py file of the random-weight rig (default / plain decoding)")
    ap.add_argument("--mt-bench", help="adaptive_levels.py file of SmolLM2 on mt-bench (default / plain decoding)")
    args = ap.parse_args()
    try:
        with open(args.six_server) as f:
            sets = over_ar(json.load(f)["rows"])
        paired = paired_series(args.zero, args.random, args.mt_bench)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"plot_goals: {e}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(sets) + (1 if paired else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    for ax, (dataset, servers) in zip(axes[0], sets.items()):
        for label, pts in servers.items():
            ax.plot(*zip(*pts), marker="o", ms=4, color=COLORS.get(label), label=NAMES.get(label, label),
                    lw=2.2 if label == "adaptive" else 1.2)
        ax.set(title=f"SmolLM2, {dataset}: tok/s over plain decoding", xlabel="concurrency", ylabel="x plain decoding")
        concurrency_axis(ax, {c for pts in servers.values() for c, _ in pts})
        ax.legend(fontsize=7, loc="best")
    if paired:
        ax = axes[0][-1]
        for k, (pts, goal, what) in enumerate(paired):
            shift = 1.06 ** (2 * k - (len(paired) - 1))  # side by side, centred on the level
            xs = [c * shift for c, *_ in pts]
            ax.errorbar(xs, [g for _, g, *_ in pts], yerr=[[g - lo for _, g, lo, _, _ in pts], [hi - g for _, g, _, hi, _ in pts]],
                        fmt="o", capsize=3, color=f"C{k}", label=what)
            ax.axhline(goal, ls="--", lw=1, color=f"C{k}")
        ax.axhline(1.0, color="black", lw=0.8)
        low = min([goal for _, goal, _ in paired] + [lo for pts, *_ in paired for _, _, lo, _, _ in pts])
        ax.set_ylim(bottom=low - 0.01)
        ax.set(title="paired waves (95%), goals dashed", xlabel="concurrency", ylabel="ratio")
        concurrency_axis(ax, {c for pts, *_ in paired for c, *_ in pts})
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"plot_goals: wrote {os.path.abspath(args.output)}")


if __name__ == "__main__":
    main()
