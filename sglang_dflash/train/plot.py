"""Plot loss and draft-token accuracy from one or more ``train_log.jsonl`` files, run after run.

    python -m sglang_dflash.train.plot results/smollm2-draft/train_log_phase1.jsonl \\
        results/smollm2-draft/train_log_phase2.jsonl --labels "from scratch" "warm start" \\
        --out results/smollm2-draft/training.png

The runs are drawn one after another on one step axis (a resumed or warm-started run goes on
where the one before it stopped). Needs matplotlib.
"""

from __future__ import annotations

import json
import os
import sys

from ..bench.cli import parser


def read_log(path: str) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows or not all({"step", "loss", "acc"} <= r.keys() for r in rows):
        raise SystemExit(f"{path}: not a train_log.jsonl (rows of step, loss, acc)")
    return rows


def moving_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def main(argv=None) -> int:
    ap = parser(__doc__, prog="python -m sglang_dflash.train.plot")
    ap.add_argument("logs", nargs="+", help="train_log.jsonl files, in the order the runs ran")
    ap.add_argument("--labels", nargs="*", help="one per log (default: the file names)")
    ap.add_argument("--smooth", type=int, default=100, help="moving-mean window in steps")
    ap.add_argument("--out", required=True, help="PNG to write")
    args = ap.parse_args(argv)
    labels = args.labels or args.logs
    if len(labels) != len(args.logs):
        ap.error(f"{len(args.logs)} logs but {len(labels)} labels")
    missing = [p for p in args.logs if not os.path.isfile(p)]
    if missing:
        ap.error(f"no such file: {missing[0]}")
    if args.smooth < 1:
        ap.error("--smooth must be >= 1")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 3.8))
    offset = 0
    for path, label in zip(args.logs, labels):
        rows = read_log(path)
        steps = [offset + r["step"] for r in rows]
        ax_loss.plot(steps, moving_mean([r["loss"] for r in rows], args.smooth), label=label)
        ax_acc.plot(steps, moving_mean([r["acc"] for r in rows], args.smooth), label=label)
        offset = steps[-1]
    for ax, name in ((ax_loss, "weighted loss"), (ax_acc, "draft-token accuracy")):
        ax.set_xlabel("optimizer step (runs one after another)")
        ax.set_ylabel(f"{name} ({args.smooth}-step mean)")
        ax.grid(alpha=0.3)
    ax_loss.set_yscale("log")  # the first steps sit an order of magnitude above the rest
    ax_loss.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
