"""Pauses a serving process takes outside the step code, reported under ``/get_server_info``.

Some waves of a benchmark run far slower than their neighbours, at the same step time. Full garbage
collections and allocator retries would stop the scheduler like that: a run records how many there
were and the longest one, so such a wave can be checked against them. :class:`StepStalls` names the
worker calls that took long, or came long after the one before, whatever held them up, and the
host time of decode calls by verify width.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
from collections import Counter, deque
from typing import Optional

import torch

from .adaptive import bucket


class HostPauses:
    """Full (generation 2) garbage collections in this process: how many, the longest, the total;
    overall and since the first request (:meth:`mark_serving`), since start-up collects a lot."""

    def __init__(self):
        self.count, self.longest, self.total = 0, 0.0, 0.0
        self.serving = False
        self.serving_count, self.serving_longest, self.serving_total = 0, 0.0, 0.0
        self._started: Optional[float] = None
        gc.callbacks.append(self._on_gc)

    def mark_serving(self) -> None:
        """The first request arrived: later collections also count as serving ones."""
        self.serving = True

    def _on_gc(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            took, self._started = time.perf_counter() - self._started, None
            self.count += 1
            self.total += took
            self.longest = max(self.longest, took)
            if self.serving:
                self.serving_count += 1
                self.serving_total += took
                self.serving_longest = max(self.serving_longest, took)

    def report(self, device=None) -> dict:
        """Also the CUDA caching allocator's retries: each freed the cache and synchronised."""
        out = {"gc_full_collections": self.count, "gc_longest_ms": round(self.longest * 1e3, 3),
               "gc_total_ms": round(self.total * 1e3, 3), "gc_full_collections_serving": self.serving_count,
               "gc_longest_ms_serving": round(self.serving_longest * 1e3, 3),
               "gc_total_ms_serving": round(self.serving_total * 1e3, 3)}
        if torch.cuda.is_available():
            out["cuda_alloc_retries"] = int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
        return out


_process_pauses: Optional[HostPauses] = None


def process_pauses() -> HostPauses:
    """This process's one recorder, started at first use (the worker's construction)."""
    global _process_pauses
    if _process_pauses is None:
        _process_pauses = HostPauses()
    return _process_pauses


class StepStalls:
    """Worker calls that took long on the host, or that came long after the call before: a slow
    wave at a level step time lost its time somewhere between the steps.

    With the overlap schedule a call only launches work, so a long call is the host held up (a JIT
    compile, a synchronisation) and a long gap is the scheduler waiting for the GPU or busy with
    something else. :meth:`report` (``/get_server_info``, read between a benchmark's waves)
    forgets the last call's end, so a pause between waves never counts.

    Decode calls are also kept by verify width and batch-size bucket (the last ``per_width``): a
    width whose steps cost more shows whether the host spent it in the call or before it. And
    they are summed since start (``decode_host``): differences between two reads give a wave's
    mean host time per decode step, in the worker call and in the gap before it.

    Every call is summed by mode too (``by_mode``: decode, extend, idle; calls, tokens prefilled,
    call and gap ms since start): between two reads, their call and gap times add up to the wall
    time the scheduler spent, so a slow wave's time is placed in decode steps or admissions. And by
    what came before (``by_transition``: ``extend>decode``, ``decode>decode``, ...): a decode step
    right after an admission is never timed by the width policy (:class:`~sglang_dflash.step_clock.StepClock`),
    and where requests come and go it is most of them.

    A stalled call's entry in ``recent`` names the host time of its own parts (the decode step's
    phases, an admission's target prefill and draft context, the width policy): a long call whose
    parts add up to little was held up outside them, in SGLang's code around the worker.
    """

    def __init__(self, threshold_ms: float = 50.0, keep: int = 32, per_width: int = 64):
        self.threshold = threshold_ms / 1e3
        self.calls, self.count, self.total = 0, 0, 0.0
        self.recent: deque = deque(maxlen=keep)
        self.per_width = per_width
        self.by_width: dict[tuple[int, int], deque] = {}  # (width, bucket) -> (call s, gap s)
        self.decode_calls, self.decode_call_s, self.decode_gap_s = 0, 0.0, 0.0  # since start, gap known
        self.policy_s = 0.0  # since start: the width policy's own calls (the worker adds them, :func:`policy_time`)
        self.phase_s: Counter = Counter()  # seconds since start: each named step of a decode call (:func:`host_phase`)
        self.admission_s: Counter = Counter()  # seconds since start: each named part of an admission (:func:`admission_phase`)
        self.by_mode: dict[str, list] = {}  # mode -> [calls, tokens, call s, gap s] since start
        self.by_transition: dict[str, list] = {}  # "previous>this" mode -> [calls, call s, gap s] since start
        self._call_parts: Counter = Counter()  # seconds: this call's named parts, for its entry in ``recent``
        self._start: Optional[float] = None
        self._last_end: Optional[float] = None
        self._last_mode = ""

    def begin(self) -> None:
        self._call_parts.clear()
        self._start = time.perf_counter()

    def end(self, mode: str, bs: int, tokens: int, width: Optional[int] = None) -> None:
        now = time.perf_counter()
        call = now - self._start if self._start is not None else 0.0
        gap = self._start - self._last_end if self._last_end is not None and self._start is not None else 0.0
        self.calls += 1
        ledger = self.by_mode.setdefault(mode, [0, 0, 0.0, 0.0])
        ledger[0] += 1
        ledger[1] += tokens
        ledger[2] += call
        ledger[3] += gap
        after = self.by_transition.setdefault(f"{self._last_mode or '-'}>{mode}", [0, 0.0, 0.0])
        after[0] += 1
        after[1] += call
        after[2] += gap
        if width is not None and self._last_end is not None:
            self.decode_calls += 1
            self.decode_call_s += call
            self.decode_gap_s += gap
            key = (width, bucket(bs))
            if key not in self.by_width:
                self.by_width[key] = deque(maxlen=self.per_width)
            self.by_width[key].append((call, gap))
        if call > self.threshold or gap > self.threshold:
            self.count += 1
            self.total += (call if call > self.threshold else 0.0) + (gap if gap > self.threshold else 0.0)
            self.recent.append([self.calls, f"{self._last_mode or '-'}>{mode}", bs, tokens,
                                round(call * 1e3, 1), round(gap * 1e3, 1), _ms_by_name(self._call_parts, 1)])
        self._start, self._last_end, self._last_mode = None, now, mode

    def add_phase(self, name: str, seconds: float) -> None:
        self.add("phase_s", name, seconds)

    def add(self, ledger: str, name: str, seconds: float) -> None:
        """``seconds`` of host time in the named part ``name`` of the call in progress, summed since
        start in ``ledger`` (``phase_s``: a decode step's; ``admission_s``: an admission's)."""
        getattr(self, ledger)[name] += seconds
        self._call_parts[name] += seconds

    def add_policy(self, seconds: float) -> None:
        """The width policy's own host time (in the worker call, or learning in the gap before one)."""
        self.policy_s += seconds
        self._call_parts["policy"] += seconds

    def report(self) -> dict:
        self._last_end = None
        by_width = {f"{w}@{b}": {"call": round(statistics.median(c for c, _ in kept) * 1e3, 3),
                                 "gap": round(statistics.median(g for _, g in kept) * 1e3, 3), "n": len(kept)}
                    for (w, b), kept in sorted(self.by_width.items(), key=lambda kv: (-kv[0][0], kv[0][1]))}
        return {"calls": self.calls, "over_ms": round(self.threshold * 1e3, 1), "stalls": self.count,
                "stall_ms": round(self.total * 1e3, 1),
                # [call, previous>this mode, bs, tokens, call ms, gap ms, {the call's part: ms}]
                "recent": list(self.recent),
                "host_ms_by_width": by_width,  # medians of the last decode calls at each width@bucket
                "decode_host": {"calls": self.decode_calls, "call_ms": round(self.decode_call_s * 1e3, 3),
                                "gap_ms": round(self.decode_gap_s * 1e3, 3), "policy_ms": round(self.policy_s * 1e3, 3),
                                "phases_ms": _ms_by_name(self.phase_s)},
                # The admissions' parts (their count: by_mode's extend calls), for what a draft costs outside the step.
                "admission_host": {"phases_ms": _ms_by_name(self.admission_s)},
                "by_mode": {mode: {"calls": n, "tokens": tokens, "call_ms": round(call * 1e3, 3), "gap_ms": round(gap * 1e3, 3)}
                            for mode, (n, tokens, call, gap) in sorted(self.by_mode.items())},
                "by_transition": {key: {"calls": n, "call_ms": round(call * 1e3, 3), "gap_ms": round(gap * 1e3, 3)}
                                  for key, (n, call, gap) in sorted(self.by_transition.items())}}


def call_shape(batch, extend: bool) -> tuple[str, int, int]:
    """(mode, requests, tokens prefilled) of one scheduler call, as :meth:`StepStalls.end` takes them."""
    mode = "extend" if extend else "idle" if batch.forward_mode.is_idle() else "decode"
    seq_lens = getattr(batch, "seq_lens", None)
    tokens = int(getattr(batch, "extend_num_tokens", None) or 0) if extend else 0
    return mode, len(seq_lens) if seq_lens is not None else 0, tokens


def timed_into(add):
    """A decorator for worker methods: each call's host time goes to ``add(self, seconds)``, raised or not."""
    def wrap(method):
        @functools.wraps(method)
        def timed(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                add(self, time.perf_counter() - started)
        return timed
    return wrap


def _ms_by_name(seconds: Counter, digits: int = 3) -> dict:
    return {k: round(v * 1e3, digits) for k, v in sorted(seconds.items())}


def _into_stalls(parts: str, name: str):
    """A method's host time added to ``self.stalls.<parts>[name]``, where the worker has its stalls."""
    def add(self, seconds: float) -> None:
        stalls = getattr(self, "stalls", None)
        if stalls is not None:
            stalls.add(parts, name, seconds)
    return timed_into(add)


def host_phase(name: str):
    """Adds a decode step's named part (draft, verify, accept, state, context) to
    ``self.stalls.phase_s[name]``: with the overlap schedule a part only launches work, so its host
    time is what the scheduler waits on when the step is host-bound."""
    return _into_stalls("phase_s", name)


def admission_phase(name: str):
    """Adds an admission's named part (the target's prefill, the draft context written from it) to
    ``self.stalls.admission_s[name]``: host time, like :func:`host_phase`'s, which is what the
    scheduler waits on where admissions are host-bound."""
    return _into_stalls("admission_s", name)


def _add_policy_time(self, seconds: float) -> None:
    self.stalls.add_policy(seconds)


# The width policy's own share of the steps, in ``self.stalls.policy_s`` (its calls run in the
# worker call and, learning, in the scheduler's gap).
policy_time = timed_into(_add_policy_time)
