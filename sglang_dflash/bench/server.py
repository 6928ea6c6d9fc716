"""Launching and stopping ``sglang.launch_server``: AR, the plugin's DFLASH, the built-in, others."""

from __future__ import annotations

import contextlib
import glob
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from .client import get_json

IMPLEMENTATIONS = {
    # name: (extra server flags, extra env)
    "ar": ([], {"SGLANG_DFLASH_LEDGER": "1"}),  # its worker calls by mode, beside the plugin's (a profile's other half)
    "plugin": (["--speculative-algorithm", "DFLASH"], {"SGLANG_DFLASH_IMPL": "plugin"}),
    # Its worker calls by mode too (the ledger), as the plugin's worker always reports them.
    "builtin": (["--speculative-algorithm", "DFLASH"], {"SGLANG_DFLASH_IMPL": "builtin", "SGLANG_DFLASH_LEDGER": "1"}),
    # The built-in with ReplaySSM's verify (hybrid targets): SGLang 0.5.17-0.5.23 refuse it for
    # DFLASH on models without KDA layers (docs/design/hybrid-adaptive-width.md); a rig run checks.
    "builtin-replayssm": (["--speculative-algorithm", "DFLASH", "--enable-linear-replayssm-spec"],
                          {"SGLANG_DFLASH_IMPL": "builtin", "SGLANG_DFLASH_LEDGER": "1"}),
    # The plugin's default is adaptive verify width wherever it serves; "adaptive" insists on it
    # (a server where it cannot serve fails to start), "plugin-fixed" verifies the whole block every step.
    # (SGLANG_DFLASH_WIDTH_POLICY set for the run, e.g. cycle:8, applies to "plugin" alone).
    "adaptive": (["--speculative-algorithm", "DFLASH"], {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_WIDTHS": "auto",
                                                         "SGLANG_DFLASH_WIDTH_POLICY": "throughput"}),
    "plugin-fixed": (["--speculative-algorithm", "DFLASH"], {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_WIDTHS": "fixed"}),
    # A/B of what the default spends where full width is best: the policy, the fallback and the step
    # timing, without the narrower drafting widths (block 16 or plain decode), and every width in
    # turn, 8 steps each, whose costs nothing chose (/get_server_info's step_ms).
    "adaptive-16-1": (["--speculative-algorithm", "DFLASH"], {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_WIDTHS": "16,1",
                                                              "SGLANG_DFLASH_WIDTH_POLICY": "throughput"}),
    # The plugin's loop at width 1 every step (a plain DECODE, no draft pass, no fallback): its step
    # against plain decoding's at the same batch, what bounds the default where drafts land poorly.
    "plugin-width1": (["--speculative-algorithm", "DFLASH"], {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_WIDTHS": "auto",
                                                              "SGLANG_DFLASH_WIDTH_POLICY": "hold:1",
                                                              "SGLANG_DFLASH_FALLBACK": "off"}),
    "adaptive-cycle8": (["--speculative-algorithm", "DFLASH"], {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_WIDTHS": "auto",
                                                                "SGLANG_DFLASH_WIDTH_POLICY": "cycle:8"}),
    # Where the default's longer steps at full width come from (2026-11-28: 1-5% a step at c32 on
    # SmolLM2): every width's graphs and the step timing, but a policy that always picks full width
    # and no fallback; and the default without its per-request fallback.
    "adaptive-hold16": (["--speculative-algorithm", "DFLASH"], {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_WIDTHS": "auto",
                                                                "SGLANG_DFLASH_WIDTH_POLICY": "cycle:1000000000",
                                                                "SGLANG_DFLASH_FALLBACK": "off"}),
    "adaptive-nofallback": (["--speculative-algorithm", "DFLASH"], {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_WIDTHS": "auto",
                                                                    "SGLANG_DFLASH_WIDTH_POLICY": "throughput",
                                                                    "SGLANG_DFLASH_FALLBACK": "off"}),
    # The default on a hybrid target with width 1 as a 1-token verify and its state commit, not a DECODE.
    "adaptive-verify1": (["--speculative-algorithm", "DFLASH"], {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_WIDTHS": "auto",
                                                                 "SGLANG_DFLASH_WIDTH_POLICY": "throughput",
                                                                 "SGLANG_DFLASH_HYBRID_DECODE": "0"}),
    # The default with the draft pass replayed by SGLang's graph runner, not the plugin's own graphs
    # (A/B of SGLANG_DFLASH_DRAFT_GRAPHS: the same drafts, the runner's host set-up each step). On an
    # fa3 server the draft then attends on FA3, as SGLang chooses (config.draft_attention_default).
    "adaptive-runner-drafts": (["--speculative-algorithm", "DFLASH"], {"SGLANG_DFLASH_IMPL": "plugin",
                                                                       "SGLANG_DFLASH_WIDTHS": "auto",
                                                                       "SGLANG_DFLASH_WIDTH_POLICY": "throughput",
                                                                       "SGLANG_DFLASH_DRAFT_GRAPHS": "0"}),
    # The default with its draft on Triton where the server's attention is another (flashinfer; fa3
    # servers' drafts attend on Triton by default): the draft pass then goes by the block kernel and
    # the plugin's own graphs (draft_graph.py).
    "adaptive-triton-draft": (["--speculative-algorithm", "DFLASH", "--speculative-draft-attention-backend", "triton"],
                              {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_WIDTHS": "auto",
                               "SGLANG_DFLASH_WIDTH_POLICY": "throughput"}),
    # The default with buckets that never sleep (A/B of WidthPolicy.sleeping, 2026-11-29).
    "adaptive-awake": (["--speculative-algorithm", "DFLASH"], {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_WIDTHS": "auto",
                                                               "SGLANG_DFLASH_WIDTH_POLICY": "awake"}),
    # The default on a gated-delta-net hybrid with each request's state kept in the verify's snapshot
    # rows, no commit copy (sglang_dflash/gdn_state.py; A/B of SGLANG_DFLASH_GDN_STATE's default).
    "adaptive-snapshot": (["--speculative-algorithm", "DFLASH"], {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_WIDTHS": "auto",
                                                                  "SGLANG_DFLASH_GDN_STATE": "snapshot"}),
    # The default on a hybrid target with the block kernel behind the wrapper at query tiles past
    # those timed (over 128 x 256, a GQA group over 8 at block 16; A/B of
    # block_attention_route.HYBRID_TILE_LIMIT).
    "adaptive-every-tile": (["--speculative-algorithm", "DFLASH"], {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_WIDTHS": "auto",
                                                                    "SGLANG_DFLASH_BLOCK_ATTENTION": "all"}),
    # The same with each request's own width in one verify (SGLang's compact ragged verify, fa3).
    "adaptive-ragged": (["--speculative-algorithm", "DFLASH"],
                        {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_WIDTHS": "auto", "SGLANG_DFLASH_RAGGED": "1"}),
    # The plugin writing each step's draft context with eager launches after the accept (A/B of
    # the write inside the target's verify graphs).
    "plugin-eager-context": (["--speculative-algorithm", "DFLASH"],
                             {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_CONTEXT_IN_GRAPH": "0"}),
    # The plugin carrying SGLang's own draft input, whose per-step KV reservation writes the host
    # lengths one by one (A/B of SGLANG_DFLASH_BULK_PREPARE's default).
    "plugin-sglang-prepare": (["--speculative-algorithm", "DFLASH"],
                              {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_BULK_PREPARE": "0"}),
    # The plugin's DFLASH passes on Triton and FlashInfer through SGLang's own attention kernels (A/B
    # of SGLANG_DFLASH_BLOCK_ATTENTION's default).
    "plugin-sglang-attention": (["--speculative-algorithm", "DFLASH"],
                                {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_BLOCK_ATTENTION": "0"}),
    # The plugin with SGLang setting up its attention metadata (FlashInfer's plans, Triton's kv
    # indices) before every replay of the DFLASH passes the block kernel serves (A/B of
    # SGLANG_DFLASH_SKIP_UNUSED_PLANS's default); "plugin-flashinfer-plans" was its name on 2026-11-26.
    "plugin-replay-setup": (["--speculative-algorithm", "DFLASH"],
                            {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_SKIP_UNUSED_PLANS": "0"}),
    # The plugin's Triton passes through SGLang's forward_extend, which copies each layer's K/V for a
    # kernel the block kernel replaces (A/B of SGLANG_DFLASH_SKIP_KV_COPIES's default).
    "plugin-kv-copies": (["--speculative-algorithm", "DFLASH"],
                         {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_SKIP_KV_COPIES": "0"}),
    # The plugin with SGLang's prefill graph buckets, the smallest 4 tokens: a one-token prefill (a
    # radix-cache hit on the whole prompt) runs eagerly (A/B of SGLANG_DFLASH_ONE_TOKEN_PREFILL_GRAPH).
    "plugin-eager-1-token": (["--speculative-algorithm", "DFLASH"],
                             {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_ONE_TOKEN_PREFILL_GRAPH": "0"}),
    # The plugin while the scheduler still copies each step's lengths to the host for FlashInfer (A/B
    # of SGLANG_DFLASH_SKIP_HOST_LENGTHS's default).
    "plugin-host-lengths": (["--speculative-algorithm", "DFLASH"],
                            {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_SKIP_HOST_LENGTHS": "0"}),
    # The target's verify logits cast to float32 in every verify, as SGLang does (A/B of
    # SGLANG_DFLASH_HALF_VERIFY_LOGITS's default).
    "plugin-fp32-logits": (["--speculative-algorithm", "DFLASH"],
                           {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_HALF_VERIFY_LOGITS": "0"}),
    # The plugin's draft head reading every lm_head row (A/B of SGLANG_DFLASH_DRAFT_VOCAB's default).
    "plugin-full-vocab": (["--speculative-algorithm", "DFLASH"],
                          {"SGLANG_DFLASH_IMPL": "plugin", "SGLANG_DFLASH_DRAFT_VOCAB": "full"}),
    # The draft's linears quantised to fp8 at load (SGLang's own flag), each implementation as it
    # takes it: the plugin's draft head reads an fp8 copy of the target's lm_head as well.
    "plugin-fp8": (["--speculative-algorithm", "DFLASH", "--speculative-draft-model-quantization", "fp8"],
                   {"SGLANG_DFLASH_IMPL": "plugin"}),
    "builtin-fp8": (["--speculative-algorithm", "DFLASH", "--speculative-draft-model-quantization", "fp8"],
                    {"SGLANG_DFLASH_IMPL": "builtin", "SGLANG_DFLASH_LEDGER": "1"}),
    "ngram": (["--speculative-algorithm", "NGRAM"], {}),
}
IMPLEMENTATIONS["plugin-flashinfer-plans"] = IMPLEMENTATIONS["plugin-replay-setup"]
# The implementations that serve DFLASH, read off their flags (a new A/B entry needs no second list).
DFLASH_IMPLS = tuple(name for name, (flags, _) in IMPLEMENTATIONS.items() if "DFLASH" in flags)


def is_implementation(name: str) -> bool:
    """One of :data:`IMPLEMENTATIONS`, or ``spec:NAME`` for another SGLang speculative algorithm;
    a DFLASH one may name its block size, ``plugin@8``."""
    try:
        name, _ = split_block_size(name)
    except ValueError:
        return False
    return name in IMPLEMENTATIONS or (name.startswith("spec:") and len(name) > 5)


def split_block_size(name: str) -> tuple[str, Optional[int]]:
    """``plugin@8`` -> (``plugin``, 8); a name without ``@`` -> (name, None)."""
    impl, sep, size = name.partition("@")
    if not sep:
        return name, None
    if impl not in DFLASH_IMPLS or not size.isdigit() or int(size) < 1:
        raise ValueError(f"{name!r}: only {', '.join(DFLASH_IMPLS)} take @BLOCK_SIZE, a positive integer")
    return impl, int(size)


@dataclass
class ServerSpec:
    impl: str
    model_path: str
    draft_model_path: Optional[str] = None
    block_size: Optional[int] = None
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict = field(default_factory=dict)
    cpus: Optional[tuple[int, ...]] = None  # CPU affinity of the server and all its processes
    state_bytes: int = 0  # what SGLang takes inside the static fraction besides weights and KV (a hybrid's recurrent state)

    def command(self, port: int) -> list[str]:
        if not is_implementation(self.impl):
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
        reason = startup_reason(log_tail)
        super().__init__(f"{message}: {reason}" if reason else message)
        self.log_tail = log_tail


def startup_reason(log_tail: str) -> str:
    """Why a server died, in one line: the plugin's own refusal (a bare ``sglang-dflash:`` line), else
    the last exception line of its log, else argparse's ``error:`` line."""
    lines = [line.strip() for line in log_tail.splitlines()]
    for pattern in (r"^sglang-dflash: ", r"^[\w.]*(Error|Exception)\b.*:", r"^[\w. -]+: error: "):
        found = [line for line in lines if re.match(pattern, line)]
        if found:
            return found[-1]
    return ""


def prefill_graph_flags(mode: str, name: str = "prefill graphs") -> list[str]:
    """Server flags for prefills run eagerly (``off``), from SGLang's default breakable prefill graphs
    (``on``, what a user passing no graph flag gets on 0.5.17-0.5.23), or from graphs captured up to
    ``N`` tokens; ValueError, naming ``name`` (the option or variable it came from), for anything else."""
    if mode == "off":
        return ["--disable-prefill-cuda-graph"]
    if mode == "on":
        return []
    if mode.isdigit():
        return ["--cuda-graph-max-bs-prefill", mode]
    raise ValueError(f"{name} {mode!r}: off, on or a token count")


def checkpoint_bytes(path: Optional[str]) -> int:
    """Bytes of a local checkpoint's weight files (0 for a hub id or no path)."""
    if not path or not os.path.isdir(path):
        return 0
    return sum(os.path.getsize(f) for pattern in ("*.safetensors", "*.bin", "*.pt")
               for f in glob.glob(os.path.join(path, pattern)))


def nvidia_smi(query: str) -> Optional[str]:
    """``nvidia-smi --QUERY`` on the first GPU as bare CSV (no CUDA context in this process); None
    where it cannot run."""
    try:
        out = subprocess.run(["nvidia-smi", f"--{query}", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def gpu_free_bytes() -> Optional[int]:
    """Free memory of the first GPU now."""
    out = nvidia_smi("query-gpu=memory.free")
    try:
        return int(out.split()[0]) << 20 if out is not None else None
    except (ValueError, IndexError):
        return None


def memory_fraction(weights_bytes: int, free_bytes: int, kv_bytes: int) -> float:
    """``--mem-fraction-static`` that leaves a server ``kv_bytes`` of KV pool after its weights.

    SGLang (0.5.17 to 0.5.23 alike) sizes the pool as ``f x free_before_load - weights``, draft
    included, and leaves the rest of what it found free to activations and CUDA graphs; a server
    started after it sizes itself from what is free then. Rounded up, so the pool is never short.
    """
    return min(math.ceil(1000 * (weights_bytes + kv_bytes) / free_bytes) / 1000, 0.95)


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


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it."""
    import psutil  # SGLang's own dependency

    try:
        return [root] + [child.pid for child in psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def process_role(cmdline: list[str], name: str, is_root: bool) -> str:
    """What a server process is: SGLang titles its workers (``sglang::scheduler``,
    ``sglang::detokenizer``); the launched process serves HTTP and tokenizes."""
    if is_root:
        return "server"
    title = cmdline[0].split()[0] if cmdline and cmdline[0].strip() else name
    return title if title.startswith("sglang::") else name


def pin_process_tree(root: int, cpus: tuple) -> None:
    """Every thread of ``root`` and its descendants onto ``cpus`` (threads made later inherit it)."""
    import psutil

    for pid in process_tree(root):
        try:
            tids = [thread.id for thread in psutil.Process(pid).threads()]
        except psutil.NoSuchProcess:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:  # the thread ended meanwhile
                pass


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def server_preexec(cpus: Optional[tuple] = None):
    """What a server's process does between fork and exec: take its CPUs, and on Linux get SIGTERM
    when the launching process dies. A server runs in a session of its own (so a Ctrl-C meant for
    the client does not reach it), so without this a client killed outright (SIGKILL, a run's time
    limit) leaves it holding the GPU, and the next run's servers fail to start beside it.
    SGLang's own children die with the server. Launched from another thread, the signal would
    come when that thread ends, so only the main thread asks for it."""
    parent = os.getpid()
    prctl = None
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child must not import

    def preexec() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the parent died before the request took hold
                os._exit(1)

    return preexec if cpus or prctl is not None else None


def gpu_processes() -> list[tuple[int, int]]:
    """(pid, MiB) of every process holding memory on the first GPU ([] without nvidia-smi)."""
    rows = []
    for line in (nvidia_smi("query-compute-apps=pid,used_memory") or "").splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            rows.append((int(pid), int(mib)))
    return rows


def busy_gpu_warning(processes: list[tuple[int, int]]) -> Optional[str]:
    """One line when the GPU already holds memory before a benchmark's servers start: they would
    share it with those processes (often servers left by an earlier, killed run)."""
    if not processes:
        return None
    held = ", ".join(f"pid {pid} ({mib / 1024:.1f} GiB)" for pid, mib in processes)
    return (f"warning: the GPU already holds {sum(m for _, m in processes) / 1024:.1f} GiB before any server of "
            f"this run starts ({held}); the servers get less memory and share the GPU with them")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# SGLang's warning (srt/utils/triton_load_watch.py, 0.5.23) for a compile after serving started.
SERVING_COMPILE = re.compile(r"Triton kernel '([^']+)' took ([0-9.]+) s to compile after serving started")


class Server:
    """A launched ``sglang.launch_server`` process; a context manager that always stops it."""

    def __init__(self, spec: ServerSpec, port: Optional[int] = None, log_path: Optional[str] = None,
                 timeout_s: float = 900, health_path: str = "/health_generate"):
        self.spec = spec
        self.health_path = health_path  # a PD prefill server cannot answer /health_generate alone
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or tempfile.mktemp(prefix=f"sglang-{spec.label}-", suffix=".log")
        self.timeout_s = timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.deadline = 0.0

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.launch()
        self.wait_healthy()

    def launch(self) -> None:
        """Start the process and return at once (:meth:`wait_healthy` waits for it)."""
        with open(self.log_path, "w") as log:  # the server keeps its own handle
            self.proc = subprocess.Popen(self.spec.command(self.port), stdout=log, stderr=subprocess.STDOUT,
                                         env=self.spec.env(), start_new_session=True,
                                         preexec_fn=server_preexec(self.spec.cpus))
        self.deadline = time.time() + self.timeout_s

    def wait_healthy(self) -> None:
        while time.time() < self.deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.spec.label} server exited with code {self.proc.returncode}", self.log_tail())
            try:
                if get_json(self.url + self.health_path, timeout=5) is not None:
                    return
            except OSError:
                pass
            time.sleep(2)
        self.stop()
        raise ServerError(f"{self.spec.label} server not healthy after {self.timeout_s:.0f}s", self.log_tail())

    def stop(self, grace_s: float = 30) -> None:
        """SIGTERM (SGLang drains its requests), then SIGKILL after ``grace_s``."""
        self.terminate()
        self.reap(time.time() + grace_s)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def reap(self, deadline: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def pin(self, cpus: tuple) -> None:
        """Move the running server, SGLang's processes under it and all their threads onto ``cpus``."""
        if self.proc is not None and self.proc.poll() is None:
            pin_process_tree(self.proc.pid, cpus)

    def serving_compiles(self) -> list[tuple[str, float]]:
        """The Triton compiles SGLang logged after the server began serving (kernel, seconds):
        each stalls the engine, and Triton's cache is shared by the machine's servers, so the
        first server to meet a kernel variant pays for the others."""
        try:
            with open(self.log_path, errors="replace") as f:
                return [(m[1], float(m[2])) for m in SERVING_COMPILE.finditer(f.read())]
        except OSError:
            return []

    def memory(self) -> dict:
        """GPU memory (MiB, as nvidia-smi counts it) and resident host memory (MiB) of the server
        and every process under it: a leak shows as growth between two readings at idle."""
        import psutil  # SGLang's own dependency

        pids = set(process_tree(self.proc.pid)) if self.proc is not None else set()
        gpu = sum(mib for pid, mib in gpu_processes() if pid in pids)
        by_process: dict = {}
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                role = process_role(proc.cmdline(), proc.name(), pid == self.proc.pid)
                by_process[role] = by_process.get(role, 0) + proc.memory_info().rss
            except psutil.Error:  # ended meanwhile
                pass
        return {"gpu_mb": gpu, "host_rss_mb": sum(by_process.values()) // 2**20,
                "host_rss_mb_by_process": {k: v // 2**20 for k, v in sorted(by_process.items())}}

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


def start_together(servers: list[Server]) -> None:
    """Launch every server at once and wait until all are healthy; on any failure stop them all.

    Only for servers whose KV pool is fixed by ``--max-total-tokens`` under a ``--mem-fraction-static``
    that leaves room for their neighbours: SGLang sizes the pool from the memory free before and after
    its own load, so a neighbour's allocation during that window shrinks an unfixed pool (or fails the
    start). Start-up then costs the slowest server, not the sum (float32 CUDA-graph capture compiles
    Triton kernels for a minute or more on 0.5.23).
    """
    missing = [s.spec.label for s in servers if "--max-total-tokens" not in s.spec.extra_args]
    if missing:
        raise ValueError(f"start_together needs --max-total-tokens on every server (not on {missing})")
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_healthy()
    except BaseException:
        stop_all(servers)
        raise


def stop_all(servers: list[Server], grace_s: float = 30) -> None:
    """Stop every server at once: one drain window for all, not one after another. A SIGTERM that
    comes meanwhile (``timeout``) waits until they are down instead of cutting the stop short."""
    with sigterm_deferred():
        for server in servers:
            server.terminate()
        deadline = time.time() + grace_s
        for server in servers:
            server.reap(deadline)


@contextlib.contextmanager
def sigterm_deferred():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if pending and callable(previous):
            previous(pending[0], None)
        elif pending and previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGTERM)


def exit_on_sigterm() -> None:
    """Turn SIGTERM (``timeout``, a scheduler) into SystemExit, so ``finally`` blocks stop the servers:
    they run in sessions of their own and would otherwise outlive the killed client."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
