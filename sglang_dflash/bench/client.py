"""Talking to a running SGLang server: streamed ``/generate`` requests and its counters.

Standard library only; tqdm draws progress bars when it is installed.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Optional


def _decode(body: bytes):
    """JSON where the server answered JSON, else the text (some endpoints answer plain text)."""
    return json.loads(body) if body.strip().startswith((b"{", b"[")) else body.decode()


def get_json(url: str, timeout: float = 30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return _decode(r.read())


def post_json(url: str, payload: dict, timeout: float = 600):
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return _decode(r.read())


def flush_cache(url: str) -> None:
    """Drop the server's radix cache; a server that cannot is measured as it is."""
    try:
        get_json(url + "/flush_cache")
    except (OSError, ValueError):
        pass


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
    sent_at: float = 0.0  # wall clock (time.time) at the request's send, beside the server's timestamps

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
    res = RequestResult(ok=False, sent_at=time.time())
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


def run_requests(base_url: str, payloads: list[dict], concurrency: int,
                 desc: str = "requests") -> tuple[list[RequestResult], float]:
    """Send payloads with at most ``concurrency`` in flight; returns results in order and wall time."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        results = list(progress(pool.map(lambda p: generate_stream(base_url, p), payloads), len(payloads), desc))
    return results, time.perf_counter() - t0


def kv_loads(url: str, flush: bool = True) -> dict:
    """KV-pool and request-slot counters from /v1/loads (after /flush_cache drops the radix cache,
    unless ``flush`` is False)."""
    if flush:
        flush_cache(url)
    try:
        loads = get_json(url + "/v1/loads")
    except (OSError, ValueError):
        return {}
    entry = (loads.get("loads") if isinstance(loads, dict) else loads) or [{}]
    entry = entry[0] if isinstance(entry, list) else entry
    keys = ("num_used_tokens", "max_total_num_tokens", "num_running_reqs", "num_waiting_reqs", "token_usage")
    return {k: entry.get(k) for k in keys}


# What a benchmark keeps of the first scheduler's internal state. The rest is mostly the server's
# arguments (about 540 entries on 0.5.23), which the run's settings already name.
SERVER_INFO_KEPT = ("avg_spec_accept_length", "last_gen_throughput", "dflash", "scheduler_ledger")


def server_info(url: str) -> dict:
    """The first scheduler's :data:`SERVER_INFO_KEPT` entries: its acceptance and throughput, the
    plugin's ``dflash`` and a plain or built-in server's ``scheduler_ledger``."""
    try:
        info = get_json(url + "/server_info")
    except (OSError, ValueError):
        return {}
    states = info.get("internal_states") or [{}]
    return {k: states[0][k] for k in SERVER_INFO_KEPT if k in states[0]}
