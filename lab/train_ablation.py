"""What limits a trained draft (issue 81): variants of one training recipe, each on the same examples
and the same time budget, scored on the same held-out examples.

    python -m lab.train_ablation OUT --target T --examples EX.jsonl[.xz] --minutes 8 \\
        --variant "base=" --variant "deep=--draft-layers 5" --variant "anchors128=--anchors 128" \\
        --variant "half-data=--examples-share 0.5" [-- ARGS FOR EVERY RUN]

Each variant is one ``sglang-dflash-train`` run into ``OUT/NAME`` (resumed if its folder holds a saved
state), trained on ``--examples`` (``--examples-share F``: its first F of them) with ``--max-minutes``
and a save every ``--save-every`` steps. The held-out examples are the same for every variant: at
least ``--eval-examples`` of them, whole prompts drawn with seed 0 (``OUT/held-out.jsonl``, the
trainer's ``--eval-file``); no response to a held-out prompt is trained on. Variants are ranked by
the accept length greedy serving would count on them (``eval_served_accept_len``,
``sglang_dflash/train/held_out.py``), not by the mean at random positions, which runs higher.
Writes ``OUT/ablation.json`` and ``OUT/ablation.md`` (variant, its arguments, steps, training
minutes, both accept lengths at the end) and ``OUT/ablation.png`` (the served accept length at each
save against training minutes, one line per variant).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

from sglang_dflash.train.data import load_examples, save_examples
from sglang_dflash.train.held_out import split_eval

SHARE_FLAG = "--examples-share"


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, args = text.partition("=")
    if not sep or not name or "/" in name:
        raise argparse.ArgumentTypeError(f"{text!r}: a variant is NAME=ARGS (ARGS may be empty)")
    return name, shlex.split(args)


def split_share(args: list[str]) -> tuple[float, list[str]]:
    """(share of the examples to train on, the rest of the arguments)."""
    if SHARE_FLAG not in args:
        return 1.0, args
    i = args.index(SHARE_FLAG)
    try:
        share = float(args[i + 1])
    except (IndexError, ValueError):
        raise SystemExit(f"{SHARE_FLAG} takes a fraction in (0, 1]") from None
    if not 0 < share <= 1:
        raise SystemExit(f"{SHARE_FLAG} takes a fraction in (0, 1], got {share}")
    return share, args[:i] + args[i + 2:]


def eval_rows(out: str) -> list[dict]:
    path = os.path.join(out, "eval_log.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_minutes(out: str) -> float:
    """Training minutes over all resumes, as the trainer's saved state counts them."""
    path = os.path.join(out, "trainer_state.pt")
    if not os.path.isfile(path):
        return 0.0
    import torch

    return float(torch.load(path, map_location="cpu", weights_only=False).get("train_seconds", 0.0)) / 60


def run_variant(out_dir: str, name: str, args: list[str], common: list, pool: list, held_file: str,
                target: str, minutes: float, save_every: int) -> dict:
    share, args = split_share(args)
    out = os.path.join(out_dir, name)
    os.makedirs(out, exist_ok=True)
    kept = pool[:max(1, round(share * len(pool)))]
    data = os.path.join(out, "ablation-examples.jsonl")
    save_examples(kept, data)
    cmd = [sys.executable, "-m", "sglang_dflash.train", "--target", target, "--out", out, "--datasets", "",
           "--extra-examples", data, "--eval-file", held_file, "--max-minutes", str(minutes),
           "--save-every", str(save_every), *common, *args]
    if os.path.isfile(os.path.join(out, "trainer_state.pt")):
        cmd.append("--resume")
    print(f"[{name}] {shlex.join(cmd[3:])}", flush=True)
    rc = subprocess.run(cmd).returncode
    rows = eval_rows(out)
    return {"name": name, "args": shlex.join(args) + (f" {SHARE_FLAG} {share}" if share < 1 else ""), "rc": rc,
            "trained_examples": len(kept), "steps": rows[-1]["step"] if rows else 0,
            "minutes": round(train_minutes(out), 2),
            "accept_length": rows[-1]["eval_served_accept_len"] if rows else None,
            "accept_length_random_positions": rows[-1]["eval_accept_len"] if rows else None,
            "curve": [(r["step"], r["eval_served_accept_len"]) for r in rows]}


def markdown(results: list[dict], settings: dict) -> str:
    lines = ["# Draft training ablation", ""] + [f"- {k}: `{v}`" for k, v in settings.items()] + [""]
    lines += ["| variant | arguments | examples | steps | minutes | held-out accept length, served "
              "| at random positions |", "|---|---|---|---|---|---|---|"]
    for r in results:
        if r["accept_length"] is None:
            accept = f"failed (exit {r['rc']}) | -"
        else:
            accept = f"{r['accept_length']:.2f} | {r['accept_length_random_positions']:.2f}"
        lines.append(f"| {r['name']} | `{r['args'] or '-'}` | {r['trained_examples']} | {r['steps']} | {r['minutes']} | {accept} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        if r["curve"] and r["steps"]:
            per_step = r["minutes"] / r["steps"]
            ax.plot([s * per_step for s, _ in r["curve"]], [a for _, a in r["curve"]], marker="o", label=r["name"])
    ax.set_xlabel("training minutes")
    ax.set_ylabel("held-out accept length, as serving counts it")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    common = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m lab.train_ablation", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="one folder per variant, and the ablation's table and plot")
    ap.add_argument("--target", required=True, help="the target model folder")
    ap.add_argument("--examples", required=True, help="examples.jsonl[.xz] the target regenerated earlier")
    ap.add_argument("--variant", action="append", type=parse_variant, required=True, help="NAME=ARGS, repeatable")
    ap.add_argument("--minutes", type=float, default=8.0, help="training minutes a variant")
    ap.add_argument("--eval-examples", type=int, default=256,
                    help="at least this many, whole prompts, held out of every variant: the same ones")
    ap.add_argument("--save-every", type=int, default=250, help="steps between checkpoints (each scored)")
    args = ap.parse_args(argv)
    names = [n for n, _ in args.variant]
    if len(set(names)) != len(names):
        ap.error(f"variant names repeat: {names}")
    if not os.path.isfile(args.examples):
        ap.error(f"--examples {args.examples}: no such file")
    examples = load_examples(args.examples)
    if len(examples) <= args.eval_examples:
        ap.error(f"--examples holds {len(examples)} examples, not more than --eval-examples {args.eval_examples}")
    pool, held = split_eval(examples, args.eval_examples, seed=0)
    for _, variant_args in args.variant:
        split_share(variant_args)  # a bad share stops here, before any training
    os.makedirs(args.out, exist_ok=True)
    held_file = os.path.join(args.out, "held-out.jsonl")
    save_examples(held, held_file)
    results = []
    for name, variant_args in args.variant:
        results.append(run_variant(args.out, name, variant_args, common, pool, held_file,
                                   args.target, args.minutes, args.save_every))
        settings = {"target": args.target, "examples": args.examples, "minutes a variant": args.minutes,
                    "held-out examples": len(held), "common arguments": shlex.join(common) or "-"}
        with open(os.path.join(args.out, "ablation.json"), "w") as f:  # after each variant: a cut run keeps them
            json.dump({"settings": settings, "variants": results}, f, indent=1)
        with open(os.path.join(args.out, "ablation.md"), "w") as f:
            f.write(markdown(results, settings))
        plot(results, os.path.join(args.out, "ablation.png"))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
