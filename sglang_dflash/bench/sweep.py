"""Benchmark autoregressive decoding against DFLASH (plugin and built-in) on SGLang servers.

    sglang-dflash-bench --model-path TARGET --draft-model-path DRAFT \\
        --datasets gsm8k,mt-bench --impls ar,plugin,builtin --concurrencies 1,8,32

For every implementation (and block size) it starts a server on localhost, runs every dataset
at every concurrency (cache flushed, one warm-up wave excluded), stops the server, and writes
results.json (every raw figure), report.md (tok/s (speedup) grids and accept lengths) and PNG
plots into --output-dir. A server that fails to start is reported with its log tail and the
sweep goes on. --skip-launch --base-url URL measures a running server. --interleave keeps every
server up at once and lets them take turns wave by wave, so a drift in the machine's speed
(host-bound small models vary by tens of percent between runs) falls on all alike.
The prompt sets come from the cache that sglang-dflash-fetch-datasets fills.

--rig zero|random needs no model at all: it writes a real-shape target and draft (--rig-shape,
default qwen3-8b; sparse safetensors, instant) into --rig-dir and sends token-id requests of
--rig-prompt-len tokens that run to --max-new-tokens. zero weights accept every draft (tau = block
size), random ones (--load-format dummy) almost none (tau ~ 1). The report gives each level's
per-step time and, beside it, the bytes floor of a DFLASH step over a plain one.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import re
import shlex
import sys
import time
from dataclasses import replace
from typing import Optional

from . import rig
from .cli import comma_list, parser
from .client import flush_cache, kv_loads, progress, run_requests, server_info
from .datasets import add_dataset_options, load_dataset_prompts, problem_with_cache, problem_with_names
from .heldout import Prompt, chat_messages
from .report import markdown_report, plot, update_summary
from .server import (
    DFLASH_IMPLS, IMPLEMENTATIONS, Server, ServerError, ServerSpec, busy_gpu_warning, checkpoint_bytes, cpu_slices,
    exit_on_sigterm, gpu_free_bytes, gpu_processes, is_implementation, memory_fraction, split_block_size, stop_all,
)
from .stats import (add_speedups, paired_ratio_stats, paired_wave_cycles, side_by_side, step_table, summarize,
                    ttft_parts_summary)

REPORT_SETTINGS = ("model_path", "draft_model_path", "max_new_tokens", "temperature", "thinking", "num_prompts")
# What --from-results also takes from the first sweep's settings, to rebuild a --rig sweep's step table.
RIG_SETTINGS = ("rig", "rig_shape", "rig_prompt_len", "block_sizes", "server_args", "attention_backend")


# ---------------------------------------------------------------------------------------------
# Prompts


def render_prompts(prompts: list[Prompt], model_path: str, thinking: bool) -> list[dict]:
    """Apply the target's chat template client-side, as the DFlash reference benchmark does; a multi-turn
    prompt (a list of messages) is rendered whole, ending in the prompt for the next assistant turn."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    out = []
    for p in prompts:
        msgs = chat_messages(p)
        try:
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        except (TypeError, ValueError):
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        out.append({"text": text})
    return out


def sampling_params(args) -> dict:
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.temperature == 0:
        params.update(top_k=1)
    return params


# ---------------------------------------------------------------------------------------------
# CLI


def _int_list(ap, flag: str, text: str, minimum: int) -> list[int]:
    try:
        values = [int(v) for v in comma_list(text)]
    except ValueError as e:
        ap.error(f"{flag}: expected comma-separated integers ({e})")
    if any(v < minimum for v in values):
        ap.error(f"{flag} must be >= {minimum}")
    return values


def build_parser():
    ap = parser(__doc__, prog="sglang-dflash-bench")
    ap.add_argument("--model-path", help="target model (folder or hub id); required unless --from-results")
    ap.add_argument("--draft-model-path", help="DFlash draft checkpoint; required for plugin and builtin")
    ap.add_argument("--impls", default="ar,plugin,builtin",
                    help=f"comma list of {', '.join(IMPLEMENTATIONS)}, or spec:NAME for another SGLang algorithm "
                         "(spec:eagle); plugin@8 (any DFLASH one) fixes that server's block size")
    add_dataset_options(ap, "gsm8k,mt-bench")
    ap.add_argument("--num-prompts", type=int, default=64, help="the first N prompts of each dataset (cycled if fewer)")
    ap.add_argument("--max-new-tokens", type=int, default=512, help="output length limit of every request")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (top_k=1)")
    ap.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False,
                    help="render prompts with the chat template's enable_thinking (default: off)")
    ap.add_argument("--concurrencies", default="1,8,32", help="comma list of requests in flight, one level each")
    ap.add_argument("--waves", type=int, default=0,
                    help="at least this many full waves per level: max(num_prompts, waves x concurrency) "
                         "requests, the prompts repeated in order (a level shorter than a few waves is all tail)")
    ap.add_argument("--block-sizes", default="",
                    help="comma list of --speculative-num-draft-tokens for plugin, builtin and ngram, one server "
                         "each; empty: the draft's own block size")
    ap.add_argument("--attention-backend", help="passed to every server (default: SGLang's)")
    ap.add_argument("--tp-size", type=int, help="passed to every server (default: SGLang's)")
    ap.add_argument("--mem-fraction-static", type=float,
                    help="passed to every server (default: SGLang's; with --interleave, sized for each server "
                         "from the GPU's free memory and its weights, see --kv-cache-gb)")
    ap.add_argument("--kv-cache-gb", type=float, default=4.0,
                    help="with --interleave and no --mem-fraction-static: the KV pool each server is sized for")
    ap.add_argument("--server-args", default="", help="extra flags passed to every server, one string")
    rig.add_options(ap)
    ap.add_argument("--interleave", action="store_true",
                    help="all servers up at once, taking turns wave by wave (give each a small KV pool: "
                         "--server-args '--max-total-tokens N')")
    ap.add_argument("--start-together", action="store_true",
                    help="with --interleave: launch every server at once (start-up costs the slowest, not the "
                         "sum); needs --max-total-tokens in --server-args, for models small beside the GPU")
    ap.add_argument("--pin-cpus", action="store_true",
                    help="with --interleave: each server on its own equal set of CPUs, the client on the rest; "
                         "the servers trade their sets wave by wave")
    ap.add_argument("--time-budget", type=float, metavar="SECONDS",
                    help="with --interleave: what the whole sweep may take (below the command's own time limit). "
                         "A server after the first starts only if the slowest start so far would still leave a "
                         "third of the budget to measure in; each level measures in an equal share of what is left "
                         "and keeps the waves it finished (time_budget_cut in results.json); once the budget is "
                         "spent later levels are skipped")
    ap.add_argument("--measure-seconds", type=float, metavar="SECONDS",
                    help="with --time-budget: the time to measure in that a later server must still leave "
                         "(default: a third of the budget). A rig's waves take seconds; its starts take minutes")
    ap.add_argument("--later-start-seconds", type=float, metavar="SECONDS",
                    help="with --time-budget: what a later server's start is expected to take (default: the "
                         "slowest start so far). A fresh machine's first start compiles the target's kernels for "
                         "the later ones: 200-285 s cold at the Qwen3.5-4B rig, then 90-160 s (H200, 2026-12-04)")
    ap.add_argument("--skip-launch", action="store_true", help="measure the server at --base-url (one --impls)")
    ap.add_argument("--base-url", default="http://127.0.0.1:30000", help="the running server for --skip-launch")
    ap.add_argument("--output-dir", default="bench-out", help="results.json, report.md, plots")
    ap.add_argument("--log-dir", help="server logs (default: the output dir)")
    ap.add_argument("--startup-timeout", type=float, default=900, help="seconds a server may take to become healthy")
    ap.add_argument("--summary", help="merge headline figures into this JSON file (results/summary.json)")
    ap.add_argument("--from-results", nargs="+", metavar="RESULTS_JSON",
                    help="measure nothing: rebuild the report, plots and summary from earlier results.json files")
    return ap


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.from_results:
        missing = [p for p in args.from_results if not os.path.isfile(p)]
        if missing:
            ap.error(f"--from-results: no such file {missing[0]!r}")
        return args
    if args.rig:
        rig.resolve_paths(ap, args)
        args.datasets = f"rig-{args.rig}"
    if not args.model_path:
        ap.error("--model-path is required (unless --from-results)")
    args.impls = comma_list(args.impls)
    if not args.impls:
        ap.error("--impls: name at least one implementation")
    for name in args.impls:
        if not is_implementation(name):
            ap.error(f"--impls: unknown implementation {name!r}")
        impl, _ = split_block_size(name)
        if impl in DFLASH_IMPLS and not args.draft_model_path and not args.skip_launch:
            ap.error(f"--impls {name} needs --draft-model-path")
    args.datasets = comma_list(args.datasets)
    problem = None if args.rig else problem_with_names(args.datasets)
    if problem:
        ap.error(f"--datasets: {problem}")
    args.concurrencies = _int_list(ap, "--concurrencies", args.concurrencies, 1)
    if not args.concurrencies:
        ap.error("--concurrencies: name at least one level")
    args.block_sizes = _int_list(ap, "--block-sizes", args.block_sizes, 1) or [None]
    if args.pin_cpus and not args.interleave:
        ap.error("--pin-cpus needs --interleave (it keeps servers that run at once apart)")
    if args.start_together and not (args.interleave and "--max-total-tokens" in args.server_args):
        ap.error("--start-together needs --interleave and --max-total-tokens in --server-args (a server "
                 "sizes its KV pool from the memory free while its neighbours load)")
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        ap.error("--num-prompts and --max-new-tokens must be >= 1")
    if args.waves < 0:
        ap.error("--waves must be >= 0")
    if args.temperature < 0:
        ap.error("--temperature must be >= 0")
    if args.startup_timeout <= 0:
        ap.error("--startup-timeout must be > 0")
    if args.time_budget is not None and not (args.interleave and args.time_budget > 0):
        ap.error("--time-budget needs --interleave and a number of seconds > 0")
    if args.measure_seconds is not None and (args.time_budget is None or args.measure_seconds <= 0):
        ap.error("--measure-seconds needs --time-budget and a number of seconds > 0")
    if args.later_start_seconds is not None and (args.time_budget is None or args.later_start_seconds <= 0):
        ap.error("--later-start-seconds needs --time-budget and a number of seconds > 0")
    if args.tp_size is not None and args.tp_size < 1:
        ap.error("--tp-size must be >= 1")
    if args.mem_fraction_static is not None and not 0 < args.mem_fraction_static <= 1:
        ap.error("--mem-fraction-static must be in (0, 1]")
    if args.kv_cache_gb <= 0:
        ap.error("--kv-cache-gb must be > 0")
    try:
        shlex.split(args.server_args)
    except ValueError as e:
        ap.error(f"--server-args: {e}")
    if args.skip_launch and len(args.impls) != 1:
        ap.error("--skip-launch measures one running server: name exactly one --impls")
    if args.skip_launch and args.interleave:
        ap.error("--interleave launches its servers: it cannot be combined with --skip-launch")
    return args


def server_flags(args) -> list[str]:
    flags = shlex.split(args.server_args) + (rig.server_flags(args.rig) if getattr(args, "rig", None) else [])
    for flag, value in (("--attention-backend", args.attention_backend), ("--tp-size", args.tp_size),
                        ("--mem-fraction-static", args.mem_fraction_static)):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def server_env(args) -> dict:
    return rig.server_env(args.rig, args.rig_shape) if getattr(args, "rig", None) else {}


def hybrid_state(args, impl: str, block_size: Optional[int], flags: list[str]) -> tuple[list[str], int]:
    """On a hybrid rig, the flags that size each server's recurrent-state pool for the sweep's top
    level (or its ``--max-running-requests``), and the bytes that pool takes
    (:func:`rig_hybrid.state_pool`); nothing where the server ``flags`` size it already."""
    if not getattr(args, "rig", None):
        return [], 0
    block = (block_size or args.block_sizes[0] or 16) if impl in DFLASH_IMPLS else None
    return rig.rig_hybrid.state_pool_for(args.rig_shape, flags, max(args.concurrencies), block)


# ---------------------------------------------------------------------------------------------
# Sweep


def level_workload(payloads: list[dict], concurrency: int, waves: int) -> list[dict]:
    """The prompts, repeated in order until ``waves`` full waves of ``concurrency`` are reached."""
    n = max(len(payloads), waves * concurrency)
    return [payloads[i % len(payloads)] for i in range(n)] if payloads else []


def full_wave(payloads: list[dict], concurrency: int) -> list[dict]:
    """One wave of ``concurrency`` requests, prompts repeated as the timed waves repeat them: a
    wave of fewer requests than the level never brings the batch to the level's size."""
    return level_workload(payloads, concurrency, 1)[:concurrency]


def warm_up(url: str, payloads: list[dict], conc: int, desc: str) -> None:
    """Radix cache flushed, then one full wave that is not measured."""
    flush_cache(url)
    run_requests(url, full_wave(payloads, conc), conc, desc=f"{desc} warm-up")


def compile_every_level(url: str, label: str, datasets: dict, concurrencies: list[int]) -> None:
    """One unmeasured full wave at every level before anything is timed: each CUDA-graph size,
    buffer and JIT kernel a level will use is built now, not inside a timed wave (flashinfer's JIT
    cache is shared by every server on the machine, so a later server would otherwise find it warm)."""
    for dataset, payloads in datasets.items():
        for conc in concurrencies:
            run_requests(url, full_wave(payloads, conc), conc, desc=f"{label} {dataset} c{conc} compile")


# What a wave keeps of the worker calls' ledger (the plugin's ``dflash.stalls``, a plain server's ``scheduler_ledger``).
STALL_KEYS = ("stalls", "stall_ms", "recent", "decode_host", "admission_host", "by_mode", "by_transition")


def host_pauses(url: str) -> Optional[dict]:
    """The plugin's counts so far of full GCs, allocator retries, stalled worker calls, decode steps
    and steps whose draft or verify ran outside CUDA graphs; a plain or built-in server's worker
    calls by mode with ``SGLANG_DFLASH_LEDGER=1``; None from other servers."""
    info = server_info(url)
    dflash = info.get("dflash") or {}
    if "host_pauses" not in dflash:  # a plain or built-in server's ledger (SGLANG_DFLASH_LEDGER=1): its calls by mode
        ledger = info.get("scheduler_ledger")
        return {k: ledger[k] for k in STALL_KEYS if k in ledger} if ledger else None
    graphs = {k: dflash[k] for k in ("decode_steps", "eager_drafts") if k in dflash}
    if "eager_verifies" in dflash:
        graphs["eager_verifies"] = sum(dflash["eager_verifies"].values())
    if "stalls" in dflash:  # worker calls, and gaps between them, over the threshold: the last few named;
        # the decode calls' host time summed since start (a wave's mean per step from two reads)
        graphs.update({k: dflash["stalls"][k] for k in STALL_KEYS if k in dflash["stalls"]})
    return {**dflash["host_pauses"], **graphs}


def last_stalls_once(waves: list) -> list:
    """A level's per-wave pause reads, the ledger's ``recent`` ring (its last stalled calls, up to 32)
    kept from the last read only: every read repeats most of it, and only ``name_stalls`` reads it,
    live."""
    kept = [{k: v for k, v in w.items() if k != "recent"} if w else w for w in waves]
    if kept and waves[-1] and "recent" in waves[-1]:
        kept[-1]["recent"] = waves[-1]["recent"]
    return kept


def name_stalls(label: str, where: str, before: Optional[dict], now: Optional[dict]) -> None:
    """Print the worker calls that stalled during a wave (the plugin's counts grew), as the sweep
    names a wave's compiles."""
    if not now or "stalls" not in now:
        return
    added = now["stalls"] - ((before or {}).get("stalls") or 0)
    if added > 0:
        shown = "; ".join(stalled_call(entry) for entry in now["recent"][-min(added, 4):])
        print(f"[{label}] {where}: {added} stalled worker call(s) ({shown})", flush=True)


def stalled_call(entry: list) -> str:
    """One entry of the ledger's ``recent`` ring in words, with the call's named parts (an entry
    from an older plugin has none)."""
    _, mode, bs, tokens, call, gap = entry[:6]
    parts = entry[6] if len(entry) > 6 else {}
    named = f" ({', '.join(f'{name} {ms} ms' for name, ms in parts.items())})" if parts else ""
    return f"{mode} bs={bs} tokens={tokens}: call {call} ms{named}, gap {gap} ms"


def compile_count(server, where: str, seen: dict) -> list:
    """``[count, seconds]`` of the server's serving-time Triton compiles so far. A wave that added
    some is named: its stall is a compile, which the machine's other servers then find cached."""
    found = server.serving_compiles()
    label = server.spec.label
    if len(found) > seen[label]:
        print(f"[{label}] {where}: {len(found) - seen[label]} Triton compile(s) after serving started "
              f"({', '.join(f'{k} {t:.2f} s' for k, t in found[seen[label]:])})", flush=True)
        seen[label] = len(found)
    return [len(found), round(sum(t for _, t in found), 2)]


def kv_pool_short(results: list, conc: int, pool_tokens: Optional[int]) -> Optional[dict]:
    """``{pool, needed}`` when ``conc`` of the level's longest requests (prompt and output, as
    SGLang counted them) would not fit the KV pool at once, else None."""
    lengths = sorted((int(r.meta.get("prompt_tokens") or 0) + r.completion_tokens for r in results if r.ok),
                     reverse=True)
    needed = sum(lengths[:conc])
    return {"pool": pool_tokens, "needed": needed} if pool_tokens and needed > pool_tokens else None


def level_row(url: str, spec: ServerSpec, dataset: str, conc: int, results: list, wall: float) -> dict:
    row = {"impl": spec.impl, "label": spec.label, "dataset": dataset, "concurrency": conc, **summarize(results, wall)}
    # In workload order, so a request can be set beside another implementation's or a reference run's.
    row["per_request"] = [[r.completion_tokens, r.spec_verify_ct] if r.ok else None for r in results]
    parts = ttft_parts_summary(results)  # servers started with --enable-metrics
    if parts is not None:
        row["ttft_parts_ms"] = parts
    row["server_after"] = server_info(url)
    row["kv_after"] = kv_loads(url)
    short = kv_pool_short(results, conc, row["kv_after"].get("max_total_num_tokens"))
    if short:
        row["kv_pool_short"] = short
        print(f"[{spec.label}] {dataset} c={conc}: the KV pool holds {short['pool']} tokens, fewer than "
              f"{short['needed']} for {conc} of this level's longest requests: some waited for room, and their "
              "first tokens count the wait (raise --kv-cache-gb)", flush=True)
    acc = f" accept={row['accept_length']:.2f}" if row["accept_length"] else ""
    print(f"[{spec.label}] {dataset} c={conc} n={row['requests']} tok/s={row['output_tok_s']:.1f}{acc} "
          f"errors={row['errors']}", flush=True)
    return row


def measure(url: str, spec: ServerSpec, datasets: dict, args) -> list[dict]:
    compile_every_level(url, spec.label, datasets, args.concurrencies)
    rows = []
    for dataset, payloads in datasets.items():
        for conc in args.concurrencies:
            warm_up(url, payloads, conc, f"{spec.label} {dataset} c{conc}")
            work = level_workload(payloads, conc, args.waves)
            results, wall = run_requests(url, work, conc, desc=f"{spec.label} {dataset} c{conc}")
            rows.append(level_row(url, spec, dataset, conc, results, wall))
    return rows


class TimeBudget:
    """``--time-budget``: the sweep's deadline. A fresh machine's first server start can take
    minutes (kernel builds, JIT), and a sweep killed by its command's time limit while the last
    server starts measures nothing at all; this one measures what fits and says what it left out."""

    MEASURE_SHARE = 1 / 3  # of the budget, still left once a later server would be up

    def __init__(self, seconds: float, clock=None, measure_seconds: Optional[float] = None,
                 later_start: Optional[float] = None):
        self.seconds, self.clock = seconds, clock or time.monotonic
        self.measure_seconds = measure_seconds if measure_seconds is not None else seconds * self.MEASURE_SHARE
        self.later_start = later_start  # a later server's expected start; None: the slowest so far
        self.deadline = self.clock() + seconds
        self.slowest_start = 0.0
        self.outcome = {"seconds": seconds, "servers_not_started": [], "levels_cut": [], "levels_not_run": []}

    def spent(self) -> bool:
        return self.clock() >= self.deadline

    def share(self, levels_left: int) -> float:
        """The deadline of the level starting now: an equal share of what is left among the levels
        still to run, so every level asked for is measured (what one leaves flows to the next)."""
        now = self.clock()
        return now + max(self.deadline - now, 0.0) / max(levels_left, 1)

    def skip_level(self, level: str, why: str = "not run") -> None:
        print(f"[sweep] time budget spent: {level} {why}", flush=True)
        self.outcome["levels_not_run"].append(level)

    def started(self, seconds: float) -> None:
        self.slowest_start = max(self.slowest_start, seconds)

    def refuse_start(self, label: str) -> Optional[str]:
        """Why ``label`` is not started, or None: its start (the slowest so far, or ``later_start``)
        would leave less than ``measure_seconds`` (:attr:`MEASURE_SHARE` of the budget unless given)
        to measure in."""
        expected = self.slowest_start if self.later_start is None else self.later_start
        left = self.deadline - self.clock() - expected
        if left >= self.measure_seconds:
            return None
        self.outcome["servers_not_started"].append(label)
        after = (f"the slowest start so far ({expected:.0f} s)" if self.later_start is None
                 else f"the {expected:.0f} s a later start is expected to take")
        return (f"not started: after {after} {max(left, 0):.0f} s "
                f"of the {self.seconds:.0f} s time budget would be left to measure in")


def measure_interleaved(servers: list, datasets: dict, args, on_level=None,
                        budget: Optional[TimeBudget] = None) -> list[dict]:
    """Every level's requests in waves of ``concurrency``; for each wave every server runs it, the
    order rotating by one from wave to wave. Each server's figures add up its own waves.
    ``on_level(rows)`` runs after each level (results.json then keeps what a cut-off run measured).
    With a ``budget`` each level measures in its share of what is left (:meth:`TimeBudget.share`)
    and keeps the waves every server finished; once the budget is spent no later level runs."""
    for server in servers:
        compile_every_level(server.url, server.spec.label, datasets, args.concurrencies)
    # Pinned servers trade CPU slices wave by wave: a slice's cores are not all alike (on one H100
    # machine the same pair moved c8 and c32 by 2-4% when the two swapped slices), so each server
    # runs its waves on every slice in turn.
    home = [server.spec.cpus for server in servers]
    rotate = len(servers) > 1 and all(home)
    rows = []
    later_levels = len(datasets) * len(args.concurrencies)  # after the level under way
    for dataset, payloads in datasets.items():
        for conc in args.concurrencies:
            later_levels -= 1
            if budget is not None and budget.spent():
                budget.skip_level(f"{dataset} c{conc}")
                continue
            until = budget.share(later_levels + 1) if budget is not None else None  # this one and the later
            for server in servers:
                warm_up(server.url, payloads, conc, f"{server.spec.label} {dataset} c{conc}")
            work = level_workload(payloads, conc, args.waves)
            waves = [work[i:i + conc] for i in range(0, len(work), conc)]
            waves_run = {server.spec.label: [] for server in servers}  # (results, wall) per wave
            pauses = {server.spec.label: [] for server in servers}  # the plugin's host pauses after each wave
            compiles = {server.spec.label: [] for server in servers}  # serving-time Triton compiles so far
            seen = {server.spec.label: len(server.serving_compiles()) for server in servers}  # before the waves
            last = {server.spec.label: host_pauses(server.url) for server in servers}
            slices = {server.spec.label: [] for server in servers}  # the CPU slice (first CPU) of each wave
            for k, wave in enumerate(progress(waves, len(waves), f"{dataset} c{conc} waves")):
                if until is not None and budget.clock() >= until:
                    break
                if rotate:
                    for i, server in enumerate(servers):
                        cpus = home[(i + k) % len(servers)]
                        server.pin(cpus)
                        slices[server.spec.label].append(min(cpus))
                for server in servers[k % len(servers):] + servers[:k % len(servers)]:
                    waves_run[server.spec.label].append(
                        run_requests(server.url, wave, conc, desc=f"{server.spec.label} wave {k}"))
                    now = host_pauses(server.url)
                    pauses[server.spec.label].append(now)
                    name_stalls(server.spec.label, f"{dataset} c{conc} wave {k}", last[server.spec.label], now)
                    last[server.spec.label] = now
                    compiles[server.spec.label].append(compile_count(server, f"{dataset} c{conc} wave {k}",
                                                                     seen))
            ran = len(waves_run[servers[0].spec.label])  # every server ran the same waves
            if ran < len(waves):  # only the budget stops a level early
                if not ran:
                    budget.skip_level(f"{dataset} c{conc}", f"keeps 0 of {len(waves)} waves")
                    continue
                print(f"[sweep] time budget: {dataset} c{conc} keeps {ran} of {len(waves)} waves", flush=True)
                budget.outcome["levels_cut"].append(
                    {"level": f"{dataset} c{conc}", "waves_run": ran, "waves_planned": len(waves)})
            for server in servers:
                runs = waves_run[server.spec.label]
                results = [r for wave_results, _ in runs for r in wave_results]
                row = level_row(server.url, server.spec, dataset, conc, results, sum(wall for _, wall in runs))
                per_wave = [summarize(*run) for run in runs]
                row["wave_tok_s"] = [round(w["output_tok_s"], 1) for w in per_wave]
                # A slow wave's first tokens, and what the server paused for meanwhile (full GCs,
                # allocator retries, steps outside CUDA graphs: cumulative counts, so a wave's
                # share is the step from the last).
                row["wave_ttft_p99_ms"] = [w["ttft_p99_ms"] for w in per_wave]
                if any(pauses[server.spec.label]):
                    row["wave_host_pauses"] = last_stalls_once(pauses[server.spec.label])
                if any(n for n, _ in compiles[server.spec.label]):
                    row["wave_serving_compiles"] = compiles[server.spec.label]
                if rotate:
                    row["wave_first_cpu"] = slices[server.spec.label]
                if ran < len(waves):
                    row["time_budget_cut"] = {"waves_run": ran, "waves_planned": len(waves)}
                rows.append(row)
            if on_level:
                on_level(rows)
    return rows


def write_results(args, rows: list[dict], failures: list[dict]) -> dict:
    settings = {k: v for k, v in vars(args).items() if k not in ("skip_launch", "from_results")}
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        # Unindented: every wave's figures make it hundreds of KB; report.md is the file to read.
        json.dump({"settings": settings, "rows": rows, "server_failures": failures}, f, separators=(",", ":"),
                  default=str)
    return settings


def server_failure(spec: ServerSpec, e: ServerError) -> dict:
    """Say why a server did not start; the record goes into results.json."""
    print(f"[{spec.label}] server failed: {e}\n{e.log_tail}", file=sys.stderr, flush=True)
    return {"label": spec.label, "error": str(e), "log_tail": e.log_tail}


def sweep(args) -> tuple[list[dict], list[dict]]:
    """Launch each server in turn (or use the running one) and measure every dataset and concurrency."""
    datasets = {}
    if args.rig:
        rig.write_rig(os.path.dirname(args.model_path), args.rig_shape, args.block_sizes[0] or 16, args.rig_layout)
        datasets[args.datasets[0]] = rig.rig_payloads(args.num_prompts, args.rig_prompt_len, args.max_new_tokens,
                                                      rig.vocab(args.rig_shape))
    else:
        problem = problem_with_cache(args.datasets, args.data_dir)
        if problem:  # before any tokenizer is loaded or server started
            raise SystemExit(problem)
        payload_template = sampling_params(args)
        for d in args.datasets:
            prompts = render_prompts(load_dataset_prompts(d, args.data_dir, args.num_prompts), args.model_path,
                                     args.thinking)
            datasets[d] = [dict(p, sampling_params=payload_template) for p in prompts]
    rows, failures = [], []
    specs = []
    flags = server_flags(args)
    for name in args.impls:
        impl, size = split_block_size(name)
        sizes = [size] if size else args.block_sizes if (impl in DFLASH_IMPLS or impl == "ngram") else [None]
        for b in sizes:
            state_flags, state = hybrid_state(args, impl, b, flags)
            specs.append(ServerSpec(impl, args.model_path, args.draft_model_path, b, flags + state_flags,
                                    server_env(args), state_bytes=state))
    log_dir = args.log_dir or args.output_dir
    os.makedirs(log_dir, exist_ok=True)
    busy = None if args.skip_launch else busy_gpu_warning(gpu_processes())
    if busy:
        print(busy, file=sys.stderr, flush=True)
    if args.interleave:
        return sweep_interleaved(args, specs, datasets, log_dir)
    for spec in specs:
        if args.skip_launch:
            rows += measure(args.base_url, spec, datasets, args)
            continue
        log = os.path.join(log_dir, f"server-{spec.label}.log")
        try:
            with Server(spec, log_path=log, timeout_s=args.startup_timeout) as server:
                rows += measure(server.url, spec, datasets, args)
        except ServerError as e:
            failures.append(server_failure(spec, e))
        write_results(args, rows, failures)  # after every server, so a cut-off sweep keeps what it measured
    return rows, failures


def sweep_interleaved(args, specs: list, datasets: dict, log_dir: str) -> tuple[list[dict], list[dict]]:
    """All servers up together (started one after another: each sizes its KV pool from the memory
    the others left; or, with ``--start-together``, launched at once), then
    :func:`measure_interleaved`. A server that fails to start is reported and the others are
    measured."""
    failures = []
    if args.pin_cpus:
        slices, client = cpu_slices(sorted(os.sched_getaffinity(0)), len(specs))
        specs = [replace(spec, cpus=cpus) for spec, cpus in zip(specs, slices)]
        os.sched_setaffinity(0, client)
        print(f"CPUs: {', '.join(f'{s.label} {list(s.cpus)}' for s in specs)}, client {list(client)} "
              f"(the servers trade slices wave by wave)", flush=True)
    sized = "--mem-fraction-static" not in server_flags(args)
    if sized:
        short = memory_shortfall(specs, args.kv_cache_gb, gpu_free_bytes())
        if short:  # before any server loads: each would wait minutes for the one that cannot fit
            raise SystemExit(short)
    budget = (TimeBudget(args.time_budget, measure_seconds=args.measure_seconds, later_start=args.later_start_seconds)
              if args.time_budget else None)
    with contextlib.ExitStack() as stack:
        servers, launched = [], []
        stack.callback(lambda: stop_all(launched))  # together: one drain window, not one per server
        # Launched at once, each server loads while its neighbours do: its share must also hold theirs.
        everyone = sum(server_bytes(spec, args.kv_cache_gb) for spec in specs) if args.start_together else 0
        for spec in specs:
            # Only starts one after another are refused: servers started together are all launched first.
            refused = budget.refuse_start(spec.label) if budget is not None and servers else None
            if refused:
                print(f"[{spec.label}] {refused}", flush=True)
                failures.append({"label": spec.label, "error": refused, "log_tail": ""})
                continue
            if sized:
                others = everyone - server_bytes(spec, args.kv_cache_gb) if everyone else 0
                spec = with_memory_fraction(spec, args.kv_cache_gb, others)
            log = os.path.join(log_dir, f"server-{spec.label}.log")
            server = Server(spec, log_path=log, timeout_s=args.startup_timeout)
            launched.append(server)
            if not args.start_together:
                took = start_or_report(server, servers, failures)
                if budget is not None:
                    budget.started(took)
        if args.start_together:
            for server in launched:
                server.launch()
            for server in launched:
                start_or_report(server, servers, failures, launch=False)
        if budget is not None:
            args.time_budget_outcome = budget.outcome  # written with the settings
        rows = measure_interleaved(servers, datasets, args, lambda rows: write_results(args, rows, failures),
                                   budget) if servers else []
    return rows, failures


def start_or_report(server: Server, started: list, failures: list, launch: bool = True) -> float:
    """Bring ``server`` up and add it to ``started``, or record why it did not start. Says how long
    the start took (and returns it): a first start on a fresh machine compiles kernels and can take
    minutes."""
    began = time.time()
    try:
        server.start() if launch else server.wait_healthy()
    except ServerError as e:
        failures.append(server_failure(server.spec, e))
        return time.time() - began
    took = time.time() - began
    print(f"[{server.spec.label}] up in {took:.0f} s", flush=True)
    started.append(server)
    return took


# What SGLang holds after quantizing online beyond the fp8 estimate: the Qwen3.5-27B rig's two
# checkpoints took 31.3 GiB where it gave 29.0 (H100, 0.5.23, 2026-12-06), so a fraction sized on
# the estimate left its recurrent state no room and neither server started.
ONLINE_FP8_SLACK = 0.10


def weights_bytes(spec: ServerSpec) -> int:
    """What the server's checkpoints take on the GPU. Under ``--quantization fp8`` (which the draft
    follows unless told otherwise) the linears load at one byte, so a bf16 checkpoint's file size
    would size the first of two servers to crowd out the second; the estimate gets
    ``ONLINE_FP8_SLACK`` on top."""
    args = list(spec.extra_args)
    fp8 = "--quantization" in args and args[args.index("--quantization") + 1:][:1] == ["fp8"]
    paths = [spec.model_path] + ([spec.draft_model_path] if spec.impl in DFLASH_IMPLS else [])
    if fp8:
        return int(sum(quantized_bytes(p) for p in paths) * (1 + ONLINE_FP8_SLACK))
    return sum(checkpoint_bytes(p) for p in paths)


def quantized_bytes(path: Optional[str]) -> int:
    """A checkpoint's weights under ``--quantization fp8`` (estimated from its safetensors headers;
    its file size where it has none)."""
    shapes = rig.read_shapes(path) if path and os.path.isdir(path) else {}
    return rig.rig_hybrid.fp8_bytes(shapes) if shapes else checkpoint_bytes(path)


def pool_bytes(spec: ServerSpec, kv_cache_gb: float) -> int:
    """What a server's static fraction holds besides its weights: the KV pool and any recurrent state."""
    return int(kv_cache_gb * (1 << 30)) + spec.state_bytes


def server_bytes(spec: ServerSpec, kv_cache_gb: float) -> int:
    return weights_bytes(spec) + pool_bytes(spec, kv_cache_gb)


def memory_shortfall(specs: list, kv_cache_gb: float, free: Optional[int]) -> Optional[str]:
    """Why ``specs`` cannot all be up on one GPU with ``free`` bytes, or None. What each needs inside
    its static fraction (weights, KV, recurrent state) is a floor: SGLang also keeps activations and
    CUDA graphs outside it, so servers that pass may still not start."""
    needs = [server_bytes(spec, kv_cache_gb) for spec in specs]
    if not free or sum(needs) <= free:
        return None
    parts = ", ".join(f"{spec.label} {need / 1e9:.1f} (weights {weights_bytes(spec) / 1e9:.1f}"
                      + (f", recurrent state {spec.state_bytes / 1e9:.1f}" if spec.state_bytes else "") + ")"
                      for spec, need in zip(specs, needs))
    return (f"sweep: the servers need {sum(needs) / 1e9:.1f} GB with {kv_cache_gb:g} GiB of KV each: {parts}; "
            f"the GPU has {free / 1e9:.1f} GB free: start fewer servers a call, or lower --concurrencies "
            f"(a hybrid's recurrent state grows with the top level), --kv-cache-gb or the weights (--quantization fp8)")


def with_memory_fraction(spec: ServerSpec, kv_cache_gb: float, neighbours_bytes: int = 0) -> ServerSpec:
    """The spec with a ``--mem-fraction-static`` that fits its weights and ``kv_cache_gb`` of KV into
    the memory free now: servers started one after another then all fit, on any release. Servers
    launched at once also count what their neighbours take while they load (``neighbours_bytes``):
    SGLang sizes the pool from the memory free before and after its own load."""
    free = gpu_free_bytes()
    weights = weights_bytes(spec)
    if not free or not weights:
        return spec
    fraction = memory_fraction(weights + neighbours_bytes, free, pool_bytes(spec, kv_cache_gb))
    beside = f", {neighbours_bytes / 1e9:.1f} GB for neighbours loading alongside" if neighbours_bytes else ""
    state = f", {spec.state_bytes / (1 << 30):.1f} GiB of recurrent state" if spec.state_bytes else ""
    print(f"[{spec.label}] --mem-fraction-static {fraction} ({weights / 1e9:.1f} GB of weights, "
          f"{kv_cache_gb:g} GiB of KV{state}{beside}, {free / 1e9:.1f} GB free)", flush=True)
    return replace(spec, extra_args=[*spec.extra_args, "--mem-fraction-static", str(fraction)])


def load_results(paths: list[str]) -> tuple[list[dict], list[dict], dict]:
    """Rows and failures of earlier sweeps (their results.json), in order; settings of the first."""
    rows, failures, settings = [], [], {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        rows += data["rows"]
        failures += data.get("server_failures", [])
        settings = settings or data.get("settings", {})
    return rows, failures, settings


def scale_section(args, rows: list[dict]) -> dict:
    block = args.block_sizes[0] or 16
    return {"shape": args.rig_shape, "weights": args.rig, "backend": attention_backend(args), "block_size": block,
            "prompt_len": args.rig_prompt_len, "max_new_tokens": args.max_new_tokens,
            **rig.floor_ratio(args.rig_shape, block), "steps": step_table(rows)}


def attention_backend(args) -> str:
    """The backend the servers were asked for (flag or --server-args), else SGLang's default."""
    flags = shlex.split(args.server_args)
    given = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--attention-backend"]
    return args.attention_backend or (given[-1] if given else "default")


def installed_sglang() -> str:
    """The SGLang release the servers run: the one installed beside this benchmark."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def evidence_path(path: str, summary: str) -> str:
    """How a summary names a file it cites: from the current directory where the file lies under it
    (``results/summary.json`` names files from the checkout's root), else from the summary's own
    folder (an output folder elsewhere, as on a GPU machine): never a path of the machine it ran on."""
    here = os.path.abspath(path)
    if here.startswith(os.getcwd() + os.sep):
        return os.path.relpath(here)
    return os.path.relpath(here, os.path.dirname(os.path.abspath(summary)))


def scale_entry(scale: dict, rows: list[dict], evidence: str) -> dict:
    """One release and backend in summary.json's scale: step times per level, each over AR's, and
    plugin over built-in throughput from the paired waves with its 95% interval."""
    steps = scale["steps"]
    entry = {"weights": scale["weights"]}
    for label in ("ar", "plugin", "builtin"):
        if label in steps:
            entry[f"{label}_step_ms"] = {f"c{c}": cell["step_ms"] for c, cell in steps[label].items()}
    entry["step_over_ar"] = {label: {f"c{c}": cell["over_ar"] for c, cell in by_conc.items()}
                             for label, by_conc in steps.items() if label != "ar"}
    ratios = {c: paired_ratio_stats(r) for (_, c), r in paired_wave_cycles(rows).items() if r}
    if ratios:
        entry["plugin_over_builtin"] = {f"c{c}": round(st["geomean"], 3) for c, st in sorted(ratios.items())}
        entry["interval"] = {f"c{c}": [round(x, 3) for x in st["ci95"]] for c, st in sorted(ratios.items())}
    entry["evidence"] = evidence
    return entry


def merge_scale(current: dict, key: str, entry: dict, scale: dict) -> dict:
    """summary.json's scale: one entry per release and backend (``0.5.23/fa3``; other weights than
    zero add theirs: ``0.5.23/fa3/random``), the floor beside them, and the c1 step over AR's on
    the newest release's fa3 with every draft accepted (``step_ratio_c1``)."""
    merged = {**current, key: entry, "shape": scale["shape"], "floor_ratio_c1": round(scale["floor_ratio_c1"], 3)}
    fa3 = [k for k in merged if k.endswith("/fa3") and isinstance(merged[k], dict)]
    newest = max(fa3, key=lambda k: tuple(int(x) for x in re.findall(r"\d+", k.split("/")[0])), default=None)
    if newest and "c1" in merged[newest].get("step_over_ar", {}).get("plugin", {}):
        merged["step_ratio_c1"] = merged[newest]["step_over_ar"]["plugin"]["c1"]
    return merged


def scale_report(scale: dict) -> str:
    concs = sorted({int(c) for by_conc in scale["steps"].values() for c in by_conc})
    lines = [f"## Step time at scale: {scale['shape']}, {scale['weights']} weights", "",
             f"A DFLASH step must read {scale['floor_ratio_c1']:.2f}x the weight bytes of a plain step at "
             f"concurrency 1 (target {scale['target_gb']:.1f} GB, draft {scale['draft_gb']:.1f} GB, "
             f"lm_head again {scale['lm_head_gb']:.1f} GB).", "",
             "| impl | " + " | ".join(f"c{c} ms (x AR)" for c in concs) + " |", "|---|" + "---|" * len(concs)]
    for label, by_conc in scale["steps"].items():
        cells = []
        for c in concs:
            cell = by_conc.get(str(c))
            ratio = f" ({cell['over_ar']:.2f}x)" if cell and cell["over_ar"] else ""
            cells.append(f"{cell['step_ms']:.2f}{ratio}" if cell else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def current_summary(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def main(argv=None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()  # a killed sweep still stops its servers
    os.makedirs(args.output_dir, exist_ok=True)
    if args.from_results:
        rows, failures, earlier = load_results(args.from_results)
        for key in REPORT_SETTINGS + RIG_SETTINGS:
            setattr(args, key, earlier.get(key, getattr(args, key)))
        args.datasets = list(dict.fromkeys(r["dataset"] for r in rows))
        args.concurrencies = sorted({r["concurrency"] for r in rows})
    else:
        rows, failures = sweep(args)
    add_speedups(rows)
    settings = write_results(args, rows, failures)
    report = markdown_report(rows, {k: settings[k] for k in REPORT_SETTINGS}, failures)
    scale = scale_section(args, rows) if getattr(args, "rig", None) else None
    if scale:
        with open(os.path.join(args.output_dir, "scale.json"), "w") as f:
            json.dump(scale, f, indent=1)
        report += scale_report(scale)
    with open(os.path.join(args.output_dir, "report.md"), "w") as f:
        f.write(report)
    if args.summary:
        report_path = evidence_path(os.path.join(args.output_dir, "report.md"), args.summary)
        updates = {"benchmark": {"datasets": args.datasets, "concurrencies": args.concurrencies,
                                 "implementations": list(dict.fromkeys([r["label"] for r in rows] + [f["label"] for f in failures])),
                                 "report": report_path}}
        comparison = side_by_side(rows)
        if comparison:
            updates["side_by_side"] = comparison
        if scale:  # the rig's figures go under scale alone: the headline benchmark is a real model's
            updates = {}
            key = f"{installed_sglang()}/{scale['backend']}" + ("" if scale["weights"] == "zero" else f"/{scale['weights']}")
            entry = scale_entry(scale, rows, report_path)
            updates["scale"] = merge_scale(current_summary(args.summary).get("scale", {}), key, entry, scale)
        update_summary(args.summary, updates)
    print(report)
    plot(rows, args.output_dir)  # after the report: whatever the plot meets, the report is out
    return 1 if failures or any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
