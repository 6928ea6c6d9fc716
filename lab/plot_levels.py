#!/usr/bin/env python3
"""The default over fixed 16 by level, one series per ``levels.json`` (``lab/adaptive_levels.py``), beside
the width policy's share of the step and the share of steps it slept through, per set and run.

    python3 lab/plot_levels.py OUT.png "LABEL=levels.json" [...] [--pooled-with-before LABEL]

``--pooled-with-before`` adds the last file's ``pooled_with_before`` as one more series.
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LEVELS = ["c1", "c2", "c4", "c8", "c16", "c32", "c64"]
COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output")
    ap.add_argument("series", nargs="+", metavar="LABEL=PATH", help="a series' label and its levels.json")
    ap.add_argument("--pooled-with-before", metavar="LABEL", help="plot the last file's pooled_with_before too")
    args = ap.parse_args()
    docs = [(label, json.load(open(path))) for label, _, path in (s.partition("=") for s in args.series)]
    series = [(label, COLORS[k % len(COLORS)], doc["pooled"]["levels"]) for k, (label, doc) in enumerate(docs)]
    if args.pooled_with_before:
        series.append((args.pooled_with_before, "black", docs[-1][1]["pooled_with_before"]["levels"]))
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(17, 4.8), gridspec_kw={"width_ratios": [2.2, 1, 1]})
    spread = 0.7 / max(len(series), 1)
    for k, (label, color, levels) in enumerate(series):
        xs, ys, lo, hi = [], [], [], []
        for i, c in enumerate(LEVELS):
            if c in levels:
                e = levels[c]
                xs.append(i + spread * (k - (len(series) - 1) / 2))
                ys.append(e["geomean"])
                lo.append(e["geomean"] - e["ci95"][0])
                hi.append(e["ci95"][1] - e["geomean"])
                ax.annotate(f"{e['geomean']:.3f}\n({e['waves']})", (xs[-1], e["ci95"][1]), ha="center", va="bottom",
                            fontsize=5.5, color=color, xytext=(0, 2), textcoords="offset points")
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, color=color, label=label, ms=4)
    top = max(e["ci95"][1] for _, _, levels in series for e in levels.values())
    ax.set_ylim(top=top + 0.02)  # room for the labels above the highest interval
    ax.axhline(0.98, ls="--", color="gray", lw=1)
    ax.axhline(1.0, ls=":", color="gray", lw=1)
    ax.set_xticks(range(len(LEVELS)), LEVELS)
    ax.set_ylabel("default / fixed 16, paired waves (95%; waves)")
    ax.set_title("The default over fixed 16 by level, both sets", fontsize=10)
    ax.legend(fontsize=7, loc="lower left")
    spread = 0.5 / max(len(docs), 1)
    for k, (label, doc) in enumerate(docs):
        shift = spread * (k - (len(docs) - 1) / 2)
        for run in doc["runs"].values():
            for key, e in run["levels"].items():
                i = LEVELS.index("c" + key.split(" c")[1])
                if "policy_share_of_fixed_16_host_time" in e:
                    bx.plot(i + shift, 100 * e["policy_share_of_fixed_16_host_time"], "o", color=COLORS[k % len(COLORS)], ms=4)
                if e.get("adaptive", {}).get("asleep_share") is not None:
                    cx.plot(i + shift, 100 * e["adaptive"]["asleep_share"], "o", color=COLORS[k % len(COLORS)], ms=4)
        bx.plot([], [], "o", color=COLORS[k % len(COLORS)], label=label)
    bx.axhline(2.0, ls="--", color="gray", lw=1)
    bx.text(0, 2.03, "the goal's margin (0.98)", fontsize=7, color="gray")
    bx.set_ylim(0, 2.4)
    bx.set_ylabel("policy's own calls, % of fixed 16's host time a step")
    bx.set_title("The width policy's host time a step, per set and run", fontsize=10)
    bx.legend(fontsize=7, loc="lower right")
    cx.set_ylabel("decode steps asleep, %")
    cx.set_title("Steps the policy slept through, per set and run", fontsize=10)
    for axis in (bx, cx):
        axis.set_xticks(range(len(LEVELS)), LEVELS)
    fig.text(0.01, 0.01, "One host per run, one lease each. Host speed differs by up to 1.5x between leases; "
             "the intervals resample whole rotation cycles.", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(args.output, dpi=110)


if __name__ == "__main__":
    main()
