"""What a sweep writes: ``report.md``, the plots and the headline figures in ``summary.json``."""

from __future__ import annotations

import json
import os
import statistics

from .stats import (paired_ratio_stats, paired_wave_cycles, wave_admission_host, wave_host_per_step,
                    wave_steps_by_what_came_before, wave_tails, wave_time_by_mode)


def paired_wave_table(rows: list[dict], datasets: list, concs: list, a: str = "plugin", b: str = "builtin") -> list[str]:
    """Interleaved runs: ``a`` over ``b`` wave by wave (same prompts, adjacent in time), where
    the totals alone would hide how much single waves swing."""
    cycles = {k: v for k, v in paired_wave_cycles(rows, a, b).items() if v}
    if not cycles:
        return []
    lines = [f"## {a} / {b}, wave by wave (interleaved): median [min, max], waves where {a} >= {b}; "
             "geometric mean (95% bootstrap interval)", "",
             "| concurrency | " + " | ".join(datasets) + " |", "|---|" + "---|" * len(datasets)]
    for c in concs:
        cells = []
        for d in datasets:
            if (d, c) not in cycles:
                cells.append("-")
                continue
            r = [x for cycle in cycles[d, c] for x in cycle]
            st = paired_ratio_stats(cycles[d, c])
            cells.append(f"{statistics.median(r):.2f}x [{min(r):.2f}, {max(r):.2f}], {st['at_least_1x']}/{st['waves']}; "
                         f"{st['geomean']:.2f}x ({st['ci95'][0]:.2f}-{st['ci95'][1]:.2f})")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines + [""]


def waves_table(rows: list[dict], waves_of, cells_of, title: str, columns: list[str]) -> list[str]:
    """A line per row with waves: its label, dataset, level and wave count, then ``cells_of(waves)``
    under ``columns``; nothing where no row has waves."""
    lines = []
    for r in rows:
        waves = waves_of(r)
        if waves:
            lines.append(f"| {r['label']} | {r['dataset']} | {r['concurrency']} | {len(waves)} | "
                         + " | ".join(cells_of(waves)) + " |")
    if not lines:
        return []
    head = ["impl", "dataset", "conc", "waves", *columns]
    return [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head), *lines, ""]


# In the worker call's order; "set-up" holds the width policy's choice, "wrap-up" its timing stamp.
HOST_PHASES = ("set-up", "draft", "verify", "accept", "state", "wrap-up", "context")


def host_time_table(rows: list[dict]) -> list[str]:
    """Plugin servers' host time per decode step, medians over a level's waves: where a server whose
    steps take longer spends it (the worker call or the scheduler's gap, the width policy's share,
    and the worker call's named parts; "-" where the server did not report them)."""
    def cells(waves):
        def phase(name):
            got = [w["phases"].get(name, 0.0) for w in waves if "phases" in w]
            return f"{statistics.median(got):.1f}" if got else "-"

        return [f"{statistics.median(w[k] for w in waves):.1f}" for k in ("call", "gap", "policy")] + [
            phase(name) for name in HOST_PHASES]

    return waves_table(rows, wave_host_per_step, cells,
                       "## Host time per decode step (us): medians over waves (set-up to context: parts of the worker call)",
                       ["worker call", "gap before it", "width policy", *HOST_PHASES])


def time_by_mode_table(rows: list[dict]) -> list[str]:
    """Scheduler time by mode of the plugin's servers, plain decoding's and the built-in's (their
    ledgers), medians over a level's waves: the share of a wave in decode steps and in admissions
    (prefills, and the plugin's draft context), each in the worker call and in the gap before it, so
    step-cost arithmetic can be set against a level's measured throughput; and an admission call's ms."""
    def cells(waves):
        def median(mode, part):
            return statistics.median(w.get(mode, {}).get(part, 0) for w in waves)

        admission_ms = [w["extend"]["call_ms"] for w in waves if "call_ms" in w.get("extend", {})]
        return [f"{median('decode', 'calls'):g}", f"{median('extend', 'calls'):g}",
                *(f"{100 * median(m, p):.1f}%" for m in ("decode", "extend") for p in ("call", "gap")),
                f"{statistics.median(admission_ms):.2f}" if admission_ms else "-"]

    return waves_table(rows, wave_time_by_mode, cells, "## Scheduler time by mode: medians over waves",
                       ["decode steps", "admissions", "decode call", "decode gap", "admission call", "admission gap",
                        "ms an admission call"])


ADMISSION_PHASES = ("target", "draft context")


def admission_host_table(rows: list[dict]) -> list[str]:
    """Host time per admission, medians over a level's waves: the worker call and, for the plugin,
    its parts, the target's prefill and the draft context written from it (what a draft costs outside
    the decode step; plain decoding's admission, from its ledger, is its prefill alone)."""
    def cells(waves):
        def median(get):
            got = [x for x in map(get, waves) if x is not None]
            return f"{statistics.median(got):.2f}" if got else "-"

        return [median(lambda w: w["admissions"]), median(lambda w: w["call"])] + [
            median(lambda w, k=k: w["phases"].get(k)) for k in ADMISSION_PHASES]

    return waves_table(rows, wave_admission_host, cells,
                       "## Host time per admission (ms): medians over waves (the target's prefill and the draft context: parts of the worker call)",
                       ["admissions", "worker call", *ADMISSION_PHASES])


def steps_by_what_came_before_table(rows: list[dict]) -> list[str]:
    """Decode steps right after an admission against those after another decode step, medians over
    a level's waves: where requests come and go, the first kind (which the width policy never
    times) can be most steps, and a different cost."""
    def cells(waves):
        def median(key, part):
            got = [w[key][part] for w in waves if key in w]
            return f"{statistics.median(got):g}" if got else "-"

        return [median(k, p) for k in ("extend>decode", "decode>decode") for p in ("steps", "ms")]

    return waves_table(rows, wave_steps_by_what_came_before, cells,
                       "## Decode steps after an admission and after a decode step: medians over waves",
                       ["steps after an admission", "ms each", "steps after a decode step", "ms each"])


def wave_tails_table(rows: list[dict]) -> list[str]:
    """Decode steps per request of each wave's slowest request against the wave's mean, medians over
    a level's waves: the share of a wave its slowest request adds, which a paired ratio carries and a
    step's cost and the mean accept length do not."""
    def cells(waves):
        return [f"{statistics.median(w[k] for w in waves):g}" for k in ("slowest", "mean", "slowest_over_mean")]

    return waves_table(rows, wave_tails, cells, "## Each wave's slowest request: decode steps, medians over waves",
                       ["slowest request", "mean request", "slowest / mean"])


def markdown_report(rows: list[dict], settings: dict, failures: list[dict]) -> str:
    lines = ["# DFLASH benchmark", ""]
    lines += [f"- {k}: `{v}`" for k, v in settings.items()] + [""]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    concs = sorted({r["concurrency"] for r in rows})
    by = {(r["dataset"], r["label"], r["concurrency"]): r for r in rows}
    for c in concs:
        lines += [f"## Output tok/s (speedup vs AR), concurrency {c}", "",
                  "| impl | " + " | ".join(datasets) + " |", "|---|" + "---|" * len(datasets)]
        for lab in labels:
            cells = []
            for d in datasets:
                r = by.get((d, lab, c))
                if r is None:
                    cells.append("-")
                else:
                    sp = f" ({r['speedup']:.2f}x)" if r.get("speedup") else ""
                    err = f" [{r['errors']} err]" if r["errors"] else ""
                    cells.append(f"{r['output_tok_s']:.1f}{sp}{err}")
            lines.append(f"| {lab} | " + " | ".join(cells) + " |")
        lines.append("")
    spec_labels = [lab for lab in labels if any(r["accept_length"] for r in rows if r["label"] == lab)]
    if spec_labels:
        lines += ["## Mean accept length (completion tokens / verify steps)", "",
                  "| impl | concurrency | " + " | ".join(datasets) + " |", "|---|---|" + "---|" * len(datasets)]
        for lab in spec_labels:
            for c in concs:
                cells = [f"{by[(d, lab, c)]['accept_length']:.2f}" if by.get((d, lab, c)) and by[(d, lab, c)]["accept_length"] else "-" for d in datasets]
                lines.append(f"| {lab} | {c} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += paired_wave_table(rows, datasets, concs)
    lines += host_time_table(rows)
    lines += time_by_mode_table(rows)
    lines += admission_host_table(rows)
    lines += steps_by_what_came_before_table(rows)
    lines += wave_tails_table(rows)
    lines += ["## Latency (ms): TTFT p50/p99, TPOT p50/p99", "", "| impl | dataset | conc | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['dataset']} | {r['concurrency']} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} | {r['tpot_p50_ms']} | {r['tpot_p99_ms']} |")
    if failures:
        lines += ["", "## Servers that failed to start", ""]
        for f in failures:
            lines += [f"### {f['label']}: {f['error']}", "", "```", f["log_tail"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out_dir: str) -> list[str]:
    """``throughput.png`` and ``accept_length.png`` of what was measured; nothing when nothing was
    (every server failed) or matplotlib is missing. Returns the files written."""
    if not rows:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.5 * len(datasets), 3.6), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        for lab in labels:
            pts = sorted((r["concurrency"], r["output_tok_s"]) for r in rows if r["dataset"] == d and r["label"] == lab)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=lab)
        concs = sorted({r["concurrency"] for r in rows})
        ax.set(title=d, xlabel="concurrency", ylabel="output tok/s")
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "throughput.png")
    fig.savefig(path, dpi=110)
    written.append(path)
    spec = [lab for lab in labels if any(r["accept_length"] for r in rows if r["label"] == lab)]
    if spec:
        fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(datasets), 3.6))
        width = 0.8 / len(spec)
        for i, lab in enumerate(spec):
            vals = [statistics.mean([r["accept_length"] for r in rows if r["dataset"] == d and r["label"] == lab and r["accept_length"]] or [0]) for d in datasets]
            ax.bar([j + i * width for j in range(len(datasets))], vals, width, label=lab)
        ax.set_xticks([j + width * (len(spec) - 1) / 2 for j in range(len(datasets))], datasets)
        ax.set(ylabel="mean accept length", title="accept length per dataset")
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, "accept_length.png")
        fig.savefig(path, dpi=110)
        written.append(path)
    plt.close("all")
    return written


def update_summary(path: str, updates: dict) -> None:
    """Merge headline figures into ``results/summary.json``, keeping every other key."""
    data = {}
    if os.path.isfile(path):
        with open(path) as f:
            data = json.load(f)
    data.update(updates)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
