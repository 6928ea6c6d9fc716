"""Pauses a serving process takes outside the step code, reported under ``/get_server_info``.

Some waves of a benchmark run far slower than their neighbours, at the same step time. Full garbage
collections and allocator retries would stop the scheduler like that: a run records how many there
were and the longest one, so such a wave can be checked against them.
"""

from __future__ import annotations

import gc
import time
from typing import Optional

import torch


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
