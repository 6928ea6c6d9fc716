#!/usr/bin/env python3
"""Benchmark autoregressive decoding against DFLASH (plugin and built-in) on SGLang servers.

    python benchmark_sglang.py --model-path TARGET --draft-model-path DRAFT \\
        --datasets gsm8k,mt-bench --impls ar,plugin,builtin --concurrencies 1,8,32

For every implementation (and block size) it starts a server on localhost, runs every dataset
at every concurrency (cache flushed, one warm-up wave excluded), stops the server, and writes
``results.json`` (every raw figure), ``report.md`` (tok/s (speedup) grids and accept lengths)
and PNG plots into ``--output-dir``. ``--skip-launch --base-url URL`` measures a running server.
``--interleave`` keeps every server up at once and lets them take turns wave by wave, so a drift in
the machine's speed (host-bound small models vary by tens of percent between runs) falls on all alike.
Standard library only on the client side; matplotlib and tqdm are used when installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

IMPLEMENTATIONS = {
    # name: (extra server flags, extra env)
    "ar": ([], {}),
    "plugin": (["--speculative-algorithm", "DFLASH"], {"SGLANG_DFLASH_IMPL": "plugin"}),
    "builtin": (["--speculative-algorithm", "DFLASH"], {"SGLANG_DFLASH_IMPL": "builtin"}),
    "ngram": (["--speculative-algorithm", "NGRAM"], {}),
}
DFLASH_IMPLS = ("plugin", "builtin")


# ---------------------------------------------------------------------------------------------
# Servers


@dataclass
class ServerSpec:
    impl: str
    model_path: str
    draft_model_path: Optional[str] = None
    block_size: Optional[int] = None
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict = field(default_factory=dict)
    cpus: Optional[tuple[int, ...]] = None  # CPU affinity of the server and all its processes

    def command(self, port: int) -> list[str]:
        if self.impl not in IMPLEMENTATIONS and not self.impl.startswith("spec:"):
            raise ValueError(f"unknown implementation {self.impl!r}")
        flags, _ = IMPLEMENTATIONS.get(self.impl, (["--speculative-algorithm", self.impl[5:].upper()], {}))
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path,
               "--host", "127.0.0.1", "--port", str(port), *flags]
        if self.impl in DFLASH_IMPLS:
            if not self.draft_model_path:
                raise ValueError(f"{self.impl} needs --draft-model-path")
            cmd += ["--speculative-draft-model-path", self.draft_model_path]
            if self.block_size:
                cmd += ["--speculative-num-draft-tokens", str(self.block_size)]
        elif self.impl == "ngram" and self.block_size:
            cmd += ["--speculative-num-draft-tokens", str(self.block_size)]
        return cmd + list(self.extra_args)

    def env(self) -> dict:
        return {**os.environ, **IMPLEMENTATIONS.get(self.impl, ([], {}))[1], **self.extra_env}

    @property
    def label(self) -> str:
        return self.impl if self.block_size is None or self.impl == "ar" else f"{self.impl}-b{self.block_size}"


class ServerError(RuntimeError):
    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


def cpu_slices(cpus: list[int], n_servers: int) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """Disjoint CPU sets for ``n_servers`` servers up at once, and the rest for the client.

    Each server's scheduler loop spins even while it waits its turn; private sets keep the waiting
    servers and the client off the cores of the one being measured.
    """
    per = len(cpus) // (n_servers + 1)
    if per < 2:
        raise ValueError(f"{len(cpus)} CPUs cannot give {n_servers} servers and the client two each")
    slices = [tuple(cpus[i * per:(i + 1) * per]) for i in range(n_servers)]
    return slices, tuple(cpus[n_servers * per:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A launched ``sglang.launch_server`` process; a context manager that always stops it."""

    def __init__(self, spec: ServerSpec, port: Optional[int] = None, log_path: Optional[str] = None,
                 timeout_s: float = 900):
        self.spec = spec
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or tempfile.mktemp(prefix=f"sglang-{spec.label}-", suffix=".log")
        self.timeout_s = timeout_s
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        log = open(self.log_path, "w")
        cpus = self.spec.cpus
        self.proc = subprocess.Popen(self.spec.command(self.port), stdout=log, stderr=subprocess.STDOUT,
                                     env=self.spec.env(), start_new_session=True,
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        deadline = time.time() + self.timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.spec.label} server exited with code {self.proc.returncode}", self.log_tail())
            try:
                if get_json(self.url + "/health_generate", timeout=5) is not None:
                    return
            except OSError:
                pass
            time.sleep(2)
        self.stop()
        raise ServerError(f"{self.spec.label} server not healthy after {self.timeout_s:.0f}s", self.log_tail())

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


# ---------------------------------------------------------------------------------------------
# Client


def get_json(url: str, timeout: float = 30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = r.read()
        return json.loads(body) if body.strip().startswith((b"{", b"[")) else body.decode()


def post_json(url: str, payload: dict, timeout: float = 600):
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@dataclass
class RequestResult:
    ok: bool
    output_ids: list = field(default_factory=list)
    text: str = ""
    completion_tokens: int = 0
    spec_verify_ct: int = 0
    ttft: Optional[float] = None
    latency: float = 0.0
    error: str = ""
    meta: dict = field(default_factory=dict)
    aborted: bool = False  # the client closed the stream on purpose

    @property
    def tpot(self) -> Optional[float]:
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


def generate_stream(base_url: str, payload: dict, timeout: float = 600,
                    abort_after_chunks: Optional[int] = None) -> RequestResult:
    """POST /generate with streaming, timing the first token; the last chunk carries the counters.

    With ``abort_after_chunks`` the client hangs up after that many chunks, as a user who goes away.
    """
    body = dict(payload, stream=True)
    req = urllib.request.Request(base_url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    res = RequestResult(ok=False)
    last, chunks = None, 0
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"]))
                if res.ttft is None and chunk.get("meta_info", {}).get("completion_tokens", 0) > 0:
                    res.ttft = time.perf_counter() - t0
                last, chunks = chunk, chunks + 1
                if abort_after_chunks is not None and chunks >= abort_after_chunks:
                    res.aborted = True
                    break  # leaving the with-block closes the connection
    except (OSError, RuntimeError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        res.latency = time.perf_counter() - t0
        return res
    res.latency = time.perf_counter() - t0
    if last is None:
        res.error = "empty stream"
        return res
    meta = last.get("meta_info", {})
    res.ok = not res.aborted
    res.meta = meta
    res.output_ids = last.get("output_ids") or []
    res.text = last.get("text", "")
    res.completion_tokens = int(meta.get("completion_tokens", 0))
    res.spec_verify_ct = int(meta.get("spec_verify_ct", 0) or 0)
    return res


def progress(iterable: Iterable, total: int, desc: str):
    try:
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, leave=False, file=sys.stderr)
    except ImportError:
        return iterable


def run_requests(base_url: str, payloads: list[dict], concurrency: int, desc: str = "requests") -> tuple[list[RequestResult], float]:
    """Send payloads with at most ``concurrency`` in flight; returns results in order and wall time."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        results = list(progress(pool.map(lambda p: generate_stream(base_url, p), payloads), len(payloads), desc))
    return results, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# Metrics and reports


def percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    verify = sum(r.spec_verify_ct for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "accept_length": tokens / verify if verify else None,
        "spec_verify_ct": verify,
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "tpot_p50_ms": _ms(percentile(tpot, 50)),
        "tpot_p99_ms": _ms(percentile(tpot, 99)),
        "first_error": next((r.error for r in results if not r.ok), None),
    }


def _ms(x):
    return None if x is None else round(1000 * x, 3)


def add_speedups(rows: list[dict]) -> None:
    """speedup = tok/s / AR tok/s at the same dataset and concurrency."""
    ar = {(r["dataset"], r["concurrency"]): r["output_tok_s"] for r in rows if r["impl"] == "ar"}
    for r in rows:
        base = ar.get((r["dataset"], r["concurrency"]))
        r["speedup"] = r["output_tok_s"] / base if base else None


def paired_wave_table(rows: list[dict], datasets: list, concs: list, a: str = "plugin", b: str = "builtin") -> list[str]:
    """Interleaved runs: ``a`` over ``b`` wave by wave (same prompts, adjacent in time), where
    the totals alone would hide how much single waves swing."""
    ratios = {k: v for k, v in paired_wave_ratios(rows, a, b).items() if v}
    if not ratios:
        return []
    lines = [f"## {a} / {b}, wave by wave (interleaved): median [min, max], waves where {a} >= {b}; "
             "geometric mean (95% bootstrap interval)", "",
             "| concurrency | " + " | ".join(datasets) + " |", "|---|" + "---|" * len(datasets)]
    for c in concs:
        cells = []
        for d in datasets:
            r = ratios.get((d, c))
            if r is None:
                cells.append("-")
                continue
            st = paired_ratio_stats(r)
            cells.append(f"{statistics.median(r):.2f}x [{min(r):.2f}, {max(r):.2f}], {st['at_least_1x']}/{st['waves']}; "
                         f"{st['geomean']:.2f}x ({st['ci95'][0]:.2f}-{st['ci95'][1]:.2f})")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines + [""]


def paired_ratio_stats(ratios: list[float], resamples: int = 4000, seed: int = 0) -> dict:
    """Geometric mean of paired wave ratios with a 95% bootstrap interval (seeded): whether runs
    this noisy tell the two servers apart at all."""
    logs = [math.log(r) for r in ratios if r > 0]
    if not logs:
        raise ValueError("no positive ratios to summarise")
    rng, n = random.Random(seed), len(logs)
    means = sorted(sum(rng.choices(logs, k=n)) / n for _ in range(resamples))
    lo, hi = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    return {"waves": n, "at_least_1x": sum(x >= 0 for x in logs), "geomean": math.exp(sum(logs) / n),
            "ci95": [math.exp(lo), math.exp(hi)]}


def paired_wave_ratios(rows: list[dict], a: str = "plugin", b: str = "builtin") -> dict:
    """(dataset, concurrency) -> ``a``/``b`` tok/s ratios of the waves the two ran in turn."""
    by = {(r["dataset"], r["label"], r["concurrency"]): r for r in rows}
    out = {}
    for (d, lab, c), ra in by.items():
        rb = by.get((d, b, c))
        if lab == a and rb and ra.get("wave_tok_s") and rb.get("wave_tok_s"):
            out[(d, c)] = [x / y for x, y in zip(ra["wave_tok_s"], rb["wave_tok_s"]) if x and y]
    return out


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


def side_by_side(rows: list[dict]) -> dict:
    """Per concurrency: AR, plugin and built-in tok/s and accept lengths (first dataset measured)."""
    out = {}
    for c in sorted({r["concurrency"] for r in rows}):
        by = {}
        for r in rows:
            if r["concurrency"] == c and r["impl"] not in by:
                by[r["impl"]] = r
        if not {"ar", "plugin", "builtin"} <= set(by):
            continue
        out[f"c{c}"] = {
            "ar_tok_s": round(by["ar"]["output_tok_s"], 1),
            "plugin_tok_s": round(by["plugin"]["output_tok_s"], 1),
            "builtin_tok_s": round(by["builtin"]["output_tok_s"], 1),
            "plugin_accept_len": by["plugin"]["accept_length"],
            "builtin_accept_len": by["builtin"]["accept_length"],
            "plugin_kv_after": by["plugin"].get("kv_after", {}).get("num_used_tokens"),
            "builtin_kv_after": by["builtin"].get("kv_after", {}).get("num_used_tokens"),
        }
    return out


# ---------------------------------------------------------------------------------------------
# Prompts


def load_prompts(dataset: str, data_dir: str, n: int) -> list[str]:
    """First user turns of a cached dataset (``scripts/fetch_datasets.py`` fills the cache)."""
    from scripts.fetch_datasets import load_dataset_prompts

    return load_dataset_prompts(dataset, data_dir, n)


def render_prompts(prompts: list[str], model_path: str, thinking: bool) -> list[dict]:
    """Apply the target's chat template client-side, as the DFlash reference benchmark does."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    out = []
    for p in prompts:
        msgs = [{"role": "user", "content": p}]
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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path")
    ap.add_argument("--draft-model-path")
    ap.add_argument("--impls", default="ar,plugin,builtin",
                    help="comma list of ar, plugin, builtin, ngram, or spec:NAME for another SGLang algorithm")
    ap.add_argument("--datasets", default="gsm8k,mt-bench")
    ap.add_argument("--data-dir", default=os.path.expanduser("~/.cache/sglang-dflash/datasets"))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--concurrencies", default="1,8,32")
    ap.add_argument("--waves", type=int, default=0,
                    help="at least this many full waves per level: max(num_prompts, waves x concurrency) "
                         "requests, the prompts repeated in order (a level shorter than a few waves is all tail)")
    ap.add_argument("--block-sizes", default="", help="comma list; empty: the draft's own block size")
    ap.add_argument("--attention-backend")
    ap.add_argument("--tp-size", type=int)
    ap.add_argument("--mem-fraction-static", type=float)
    ap.add_argument("--server-args", default="", help="extra flags passed to every server, one string")
    ap.add_argument("--interleave", action="store_true",
                    help="all servers up at once, taking turns wave by wave (give each a small KV pool: "
                         "--server-args '--max-total-tokens N')")
    ap.add_argument("--pin-cpus", action="store_true",
                    help="with --interleave: each server on its own equal set of CPUs, the client on the rest")
    ap.add_argument("--skip-launch", action="store_true", help="measure the server at --base-url")
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    ap.add_argument("--output-dir", default="bench-out")
    ap.add_argument("--log-dir", help="server logs (default: the output dir)")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--summary", help="merge headline figures into this JSON file (results/summary.json)")
    ap.add_argument("--from-results", nargs="+", metavar="RESULTS_JSON",
                    help="measure nothing: rebuild the report, plots and summary from earlier results.json files")
    args = ap.parse_args(argv)
    if args.from_results:
        missing = [p for p in args.from_results if not os.path.isfile(p)]
        if missing:
            ap.error(f"--from-results: no such file {missing[0]!r}")
        return args
    if not args.model_path:
        ap.error("--model-path is required (unless --from-results)")
    args.impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    for impl in args.impls:
        if impl not in IMPLEMENTATIONS and not impl.startswith("spec:"):
            ap.error(f"--impls: unknown implementation {impl!r}")
        if impl in DFLASH_IMPLS and not args.draft_model_path and not args.skip_launch:
            ap.error(f"--impls {impl} needs --draft-model-path")
    args.datasets = [s.strip() for s in args.datasets.split(",") if s.strip()]
    try:
        args.concurrencies = [int(c) for c in args.concurrencies.split(",") if c.strip()]
        args.block_sizes = [int(b) for b in args.block_sizes.split(",") if b.strip()] or [None]
    except ValueError as e:
        ap.error(f"expected comma-separated integers ({e})")
    if args.pin_cpus and not args.interleave:
        ap.error("--pin-cpus needs --interleave (it keeps servers that run at once apart)")
    if any(c < 1 for c in args.concurrencies):
        ap.error("--concurrencies must be >= 1")
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        ap.error("--num-prompts and --max-new-tokens must be >= 1")
    if args.waves < 0:
        ap.error("--waves must be >= 0")
    if args.skip_launch and len(args.impls) != 1:
        ap.error("--skip-launch measures one running server: name exactly one --impls")
    if args.skip_launch and args.interleave:
        ap.error("--interleave launches its servers: it cannot be combined with --skip-launch")
    return args


def server_flags(args) -> list[str]:
    flags = shlex.split(args.server_args)
    for flag, value in (("--attention-backend", args.attention_backend), ("--tp-size", args.tp_size),
                        ("--mem-fraction-static", args.mem_fraction_static)):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def kv_loads(url: str, flush: bool = True) -> dict:
    """KV-pool and request-slot counters from /v1/loads (after /flush_cache drops the radix cache)."""
    if flush:
        try:
            get_json(url + "/flush_cache")
        except (OSError, ValueError):
            pass
    try:
        loads = get_json(url + "/v1/loads")
    except (OSError, ValueError):
        return {}
    entry = (loads.get("loads") if isinstance(loads, dict) else loads) or [{}]
    entry = entry[0] if isinstance(entry, list) else entry
    keys = ("num_used_tokens", "max_total_num_tokens", "num_running_reqs", "num_waiting_reqs", "token_usage")
    return {k: entry.get(k) for k in keys}


def server_info(url: str) -> dict:
    try:
        info = get_json(url + "/server_info")
    except (OSError, ValueError):
        return {}
    states = info.get("internal_states") or [{}]
    return {k: v for k, v in states[0].items() if isinstance(v, (int, float, str)) or v is None}


def level_workload(payloads: list[dict], concurrency: int, waves: int) -> list[dict]:
    """The prompts, repeated in order until ``waves`` full waves of ``concurrency`` are reached."""
    n = max(len(payloads), waves * concurrency)
    return [payloads[i % len(payloads)] for i in range(n)] if payloads else []


def warm_up(url: str, payloads: list[dict], conc: int, desc: str) -> None:
    """Radix cache flushed, then one wave that is not measured."""
    try:
        get_json(url + "/flush_cache")
    except (OSError, ValueError):
        pass
    run_requests(url, payloads[:conc], conc, desc=f"{desc} warm-up")


def level_row(url: str, spec: "ServerSpec", dataset: str, conc: int, results: list, wall: float) -> dict:
    row = {"impl": spec.impl, "label": spec.label, "dataset": dataset, "concurrency": conc, **summarize(results, wall)}
    # In workload order, so a request can be set beside another implementation's or a reference run's.
    row["per_request"] = [[r.completion_tokens, r.spec_verify_ct] if r.ok else None for r in results]
    row["server_after"] = server_info(url)
    row["kv_after"] = kv_loads(url)
    acc = f" accept={row['accept_length']:.2f}" if row["accept_length"] else ""
    print(f"[{spec.label}] {dataset} c={conc} n={row['requests']} tok/s={row['output_tok_s']:.1f}{acc} "
          f"errors={row['errors']}", flush=True)
    return row


def measure(url: str, spec: "ServerSpec", datasets: dict, args) -> list[dict]:
    rows = []
    for dataset, payloads in datasets.items():
        for conc in args.concurrencies:
            warm_up(url, payloads, conc, f"{spec.label} {dataset} c{conc}")
            work = level_workload(payloads, conc, args.waves)
            results, wall = run_requests(url, work, conc, desc=f"{spec.label} {dataset} c{conc}")
            rows.append(level_row(url, spec, dataset, conc, results, wall))
    return rows


def measure_interleaved(servers: list, datasets: dict, args) -> list[dict]:
    """Every level's requests in waves of ``concurrency``; for each wave every server runs it, the
    order rotating by one from wave to wave. Each server's figures add up its own waves."""
    rows = []
    for dataset, payloads in datasets.items():
        for conc in args.concurrencies:
            for server in servers:
                warm_up(server.url, payloads, conc, f"{server.spec.label} {dataset} c{conc}")
            work = level_workload(payloads, conc, args.waves)
            waves = [work[i:i + conc] for i in range(0, len(work), conc)]
            waves_run = {server.spec.label: [] for server in servers}  # (results, wall) per wave
            for k, wave in enumerate(progress(waves, len(waves), f"{dataset} c{conc} waves")):
                for server in servers[k % len(servers):] + servers[:k % len(servers)]:
                    waves_run[server.spec.label].append(
                        run_requests(server.url, wave, conc, desc=f"{server.spec.label} wave {k}"))
            for server in servers:
                runs = waves_run[server.spec.label]
                results = [r for wave_results, _ in runs for r in wave_results]
                row = level_row(server.url, server.spec, dataset, conc, results, sum(wall for _, wall in runs))
                row["wave_tok_s"] = [round(summarize(*run)["output_tok_s"], 1) for run in runs]
                rows.append(row)
    return rows


def write_results(args, rows: list[dict], failures: list[dict]) -> dict:
    settings = {k: v for k, v in vars(args).items() if k not in ("skip_launch", "from_results")}
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump({"settings": settings, "rows": rows, "server_failures": failures}, f, indent=1, default=str)
    return settings


def server_failure(spec: "ServerSpec", e: "ServerError") -> dict:
    """Say why a server did not start; the record goes into results.json."""
    print(f"[{spec.label}] server failed: {e}\n{e.log_tail}", file=sys.stderr, flush=True)
    return {"label": spec.label, "error": str(e), "log_tail": e.log_tail}


def sweep(args) -> tuple[list[dict], list[dict]]:
    """Launch each server in turn (or use the running one) and measure every dataset and concurrency."""
    payload_template = sampling_params(args)
    datasets = {}
    for d in args.datasets:
        prompts = render_prompts(load_prompts(d, args.data_dir, args.num_prompts), args.model_path, args.thinking)
        datasets[d] = [dict(p, sampling_params=payload_template) for p in prompts]
    rows, failures = [], []
    specs = []
    for impl in args.impls:
        sizes = args.block_sizes if (impl in DFLASH_IMPLS or impl == "ngram") else [None]
        specs += [ServerSpec(impl, args.model_path, args.draft_model_path, b, server_flags(args)) for b in sizes]
    log_dir = args.log_dir or args.output_dir
    os.makedirs(log_dir, exist_ok=True)
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
    the others left), then :func:`measure_interleaved`. A server that fails to start is reported and
    the others are measured."""
    failures = []
    if args.pin_cpus:
        slices, client = cpu_slices(sorted(os.sched_getaffinity(0)), len(specs))
        specs = [replace(spec, cpus=cpus) for spec, cpus in zip(specs, slices)]
        os.sched_setaffinity(0, client)
        print(f"CPUs: {', '.join(f'{s.label} {list(s.cpus)}' for s in specs)}, client {list(client)}", flush=True)
    with contextlib.ExitStack() as stack:
        servers = []
        for spec in specs:
            log = os.path.join(log_dir, f"server-{spec.label}.log")
            server = Server(spec, log_path=log, timeout_s=args.startup_timeout)
            try:
                server.start()
            except ServerError as e:
                failures.append(server_failure(spec, e))
                continue
            stack.callback(server.stop)
            servers.append(server)
        rows = measure_interleaved(servers, datasets, args) if servers else []
    return rows, failures


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


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    if args.from_results:
        rows, failures, earlier = load_results(args.from_results)
        for key in ("model_path", "draft_model_path", "max_new_tokens", "temperature", "thinking", "num_prompts"):
            setattr(args, key, earlier.get(key, getattr(args, key)))
        args.datasets = list(dict.fromkeys(r["dataset"] for r in rows))
        args.concurrencies = sorted({r["concurrency"] for r in rows})
    else:
        rows, failures = sweep(args)
    add_speedups(rows)
    settings = write_results(args, rows, failures)
    report = markdown_report(rows, {k: settings[k] for k in ("model_path", "draft_model_path", "max_new_tokens",
                                                               "temperature", "thinking", "num_prompts")}, failures)
    with open(os.path.join(args.output_dir, "report.md"), "w") as f:
        f.write(report)
    plot(rows, args.output_dir)
    if args.summary:
        updates = {"benchmark": {"datasets": args.datasets, "concurrencies": args.concurrencies,
                                 "implementations": list(dict.fromkeys([r["label"] for r in rows] + [f["label"] for f in failures])),
                                 "report": os.path.join(args.output_dir, "report.md")}}
        comparison = side_by_side(rows)
        if comparison:
            updates["side_by_side"] = comparison
        update_summary(args.summary, updates)
    print(report)
    return 1 if failures or any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
