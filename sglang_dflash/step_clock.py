"""Decode step times for the width policy, from CUDA events read without a sync.

A step's cost is the GPU time from the previous decode step's end to its own: what it adds to the
stream, host gaps included (with no draft pass to hide behind, a width-1 step's launch can leave the
GPU waiting). A prefill or an idle turn between two decode steps breaks the chain: the step after it
is not timed. The events are read in step order once the scheduler has the step's results, so a
step's start event, the step before's end, has no reader left afterwards and is recorded again.

torch's ``elapsed_time`` reads a pair with three driver calls (a completeness query on each event
first), 1.3 us in all on the H200 host (``lab/simulate_policy.py --host --cuda``, 2026-11-29): one
``cuEventElapsedTime`` through ctypes took 2.5 us there, its Python wrapping included.
"""

from __future__ import annotations

from typing import Optional

import torch


class StepClock:
    """Stamps each decode step's end (:meth:`stamp`) and reads a step's seconds (:meth:`seconds`)."""

    def __init__(self):
        self.last_end = None  # the decode step before's end event, if nothing ran between
        self.spare: list = []  # events read already, recorded again rather than made anew

    @property
    def times_next(self) -> bool:
        """Whether the next decode step will be timed: a decode step ended last, nothing since."""
        return self.last_end is not None

    def forget(self) -> None:
        """Something other than a decode step ran: the next step is not timed."""
        self.last_end = None

    def stamp(self, stream=None) -> tuple:
        """A decode step's ``(start, end)`` events: the end recorded now on ``stream`` (the
        current stream when None), the start the step before's end (None: not timed)."""
        ended = self.spare.pop() if self.spare else torch.cuda.Event(enable_timing=True)
        ended.record(stream)
        started, self.last_end = self.last_end, ended
        return started, ended

    def seconds(self, timing: tuple) -> Optional[float]:
        """A stamped step's seconds, or None where it was not timed (``timing`` None: not stamped)
        or its end is not reached yet."""
        started, ended = timing or (None, None)
        if started is None:
            return None
        self.spare.append(started)
        try:  # torch checks that both ends were reached
            return started.elapsed_time(ended) / 1000
        except RuntimeError:  # its end is not reached yet
            return None
