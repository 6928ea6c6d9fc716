#!/usr/bin/env python3
"""The DFlash model cards' launch commands, with the plugin installed, against the rig of each
card's target shape (zero weights, no download): does each start and serve, and what does it log?

    python3 -m lab.card_commands OUT [--runs 4b-card,4b-hopper,27b-card,35b-card] [--timeout 420]

Runs (``sglang_dflash.card_flags``): ``4b-card``, the Qwen3.5-4B card's B200 command as printed
(Blackwell-only backends: expected to stop at start with one ``sglang-dflash:`` line, no traceback);
``4b-hopper``, its Hopper version from the README; ``27b-card`` and ``35b-card``, the line the 27B and
35B-A3B cards share (it runs on Hopper as it is), on the Qwen3.5-27B and Qwen3.6-35B-A3B rigs. The
cards' renamed flags (``--mamba-scheduler-strategy``) are kept as printed: the plugin maps them.
One server at a time. Writes ``OUT/card_commands.json``: per run ``{"outcome": "serves" | "stopped"
| "failed", "line": the line it stopped with, "mapped": the plugin's card-flag log lines,
"traceback": whether the log holds one, "start_s"}`` and each server's log.
"""

import argparse
import json
import os
import re
import time

from sglang_dflash.bench import rig
from sglang_dflash.bench.client import post_json
from sglang_dflash.bench.server import Server, ServerError, ServerSpec, startup_reason
from sglang_dflash.card_flags import CARD_COMMANDS, HOPPER_COMMANDS

RUNS = {  # name: (rig shape, the card's flags)
    "4b-card": ("qwen3.5-4b", CARD_COMMANDS["4b"]),
    "4b-hopper": ("qwen3.5-4b", HOPPER_COMMANDS["4b"]),
    "27b-card": ("qwen3.5-27b", CARD_COMMANDS["27b"]),
    "35b-card": ("qwen3.6-35b-a3b", CARD_COMMANDS["27b"]),
}
MAPPED = re.compile(r"sglang-dflash: --[\w-]+ (?:\S+ )?is .*; using .*")


def card_spec(name: str, rig_dir: str) -> ServerSpec:
    """The plugin's server for a run: the card's flags after the model paths, as a user types them
    (``--speculative-algorithm DFLASH`` included), on zero weights; the block comes from the card."""
    shape, flags = RUNS[name]
    target, draft = rig.write_rig(os.path.join(rig_dir, shape), shape)
    return ServerSpec("plugin", target, draft, None, list(flags) + rig.server_flags("zero"),
                      rig.server_env("zero", shape))


def read_log(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def run(name: str, rig_dir: str, out_dir: str, timeout_s: float) -> dict:
    spec = card_spec(name, rig_dir)
    log_path = os.path.join(out_dir, f"server-{name}.log")
    server, started = Server(spec, log_path=log_path, timeout_s=timeout_s), time.time()
    got = {"shape": RUNS[name][0], "flags": RUNS[name][1]}
    try:
        server.start()
        got["start_s"] = round(time.time() - started, 1)
        reply = post_json(server.url + "/generate", {"input_ids": list(range(10, 42)),
                                                     "sampling_params": {"max_new_tokens": 32, "temperature": 0}})
        tokens = reply.get("output_ids") or []
        got.update(outcome="serves" if tokens else "failed", output_tokens=len(tokens),
                   line=None if tokens else f"no tokens: {str(reply)[:300]}")
    except ServerError as e:
        exited = server.proc is not None and server.proc.poll() is not None
        got.update(outcome="stopped" if exited else "failed", exit_code=server.proc.returncode if exited else None,
                   line=startup_reason(e.log_tail) or str(e))
    except Exception as e:  # a request that failed on a server that started
        got.update(outcome="failed", line=f"{type(e).__name__}: {e}"[:300])
    finally:
        server.stop()
    log = read_log(log_path)
    got.update(mapped=sorted(set(MAPPED.findall(log))), traceback="Traceback (most recent call last)" in log)
    return got


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--rig-dir", default="/tmp/dflash-rig")
    ap.add_argument("--timeout", type=float, default=420, help="seconds a server may take to start")
    args = ap.parse_args()
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = set(names) - set(RUNS)
    if unknown:
        ap.error(f"--runs: no run {sorted(unknown)} (runs: {', '.join(RUNS)})")
    os.makedirs(args.out, exist_ok=True)
    report = {}
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} ...", flush=True)
        report[name] = run(name, args.rig_dir, args.out, args.timeout)
        print(f"[{i}/{len(names)}] {name}: {report[name]['outcome']} {report[name].get('line') or ''}", flush=True)
        with open(os.path.join(args.out, "card_commands.json"), "w") as f:  # kept as each run ends
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
