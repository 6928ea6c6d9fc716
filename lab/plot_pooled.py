#!/usr/bin/env python3
"""Pooled paired ratios against concurrency, one panel per title, one line per pair, each point the
geometric mean with its 95% interval (from ``python -m sglang_dflash.bench.pool``).

    python3 lab/plot_pooled.py OUT.png --panel "gsm8k" "default / fixed 16=DIR/pooled_waves.json" ...
        [--panel TITLE LABEL=PATH ...] [--line 0.98]
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def points(path: str) -> tuple[list[int], list[float], list[float], list[float]]:
    return level_points(json.load(open(path))["pooled"])


def level_points(pooled: dict) -> tuple[list[int], list[float], list[float], list[float]]:
    """(concurrencies, geomeans, distance down to the interval, up to it) of ``{"cN": {geomean, ci95}}``."""
    levels = sorted(pooled, key=lambda k: int(k.lstrip("c")))
    conc = [int(k.lstrip("c")) for k in levels]
    mean = [pooled[k]["geomean"] for k in levels]
    low = [pooled[k]["geomean"] - pooled[k]["ci95"][0] for k in levels]
    high = [pooled[k]["ci95"][1] - pooled[k]["geomean"] for k in levels]
    return conc, mean, low, high


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output")
    ap.add_argument("--panel", nargs="+", action="append", required=True, metavar="TITLE LABEL=PATH",
                    help="a panel's title, then its lines as label=pooled_waves.json")
    ap.add_argument("--line", type=float, action="append", default=[], help="a dashed reference ratio")
    args = ap.parse_args()
    fig, axes = plt.subplots(1, len(args.panel), figsize=(5.5 * len(args.panel), 4.2), squeeze=False)
    for ax, (title, *lines) in zip(axes[0], args.panel):
        levels = set()
        for k, spec in enumerate(lines):
            label, _, path = spec.partition("=")
            conc, mean, low, high = points(path)
            levels.update(conc)
            shift = [c * 2 ** (0.08 * (k - (len(lines) - 1) / 2)) for c in conc]  # keep intervals apart
            ax.errorbar(shift, mean, yerr=[low, high], marker="o", capsize=3, label=label)
        for y in [1.0, *args.line]:
            ax.axhline(y, color="grey", lw=0.8, ls="-" if y == 1.0 else "--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(levels), [str(c) for c in sorted(levels)])  # the levels measured, not powers of 2
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylabel("tok/s ratio (paired waves)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)


if __name__ == "__main__":
    main()
