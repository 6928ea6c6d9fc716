"""Decode step times for the width policy, from CUDA events read without a sync.

A step's cost is the GPU time from the previous decode step's end to its own: what it adds to the
stream, host gaps included (with no draft pass to hide behind, a width-1 step's launch can leave the
GPU waiting). A prefill or an idle turn between two decode steps breaks the chain: the step after it
is not timed. The events are read in step order once the scheduler has the step's results, so a
step's start event, the step before's end, has no reader left afterwards and is recorded again.

Reading goes through the driver's ``cuEventElapsedTime``: one call, which answers "not ready" for an
end not reached. torch's ``elapsed_time`` makes three (a completeness query on each event first), at
about 4 us each in a busy server (session 51's trace), every decode step.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Callable, Optional

import torch

logger = logging.getLogger("sglang_dflash")

CUDA_SUCCESS, CUDA_ERROR_NOT_READY = 0, 600


def driver_elapsed_ms() -> Optional[Callable]:
    """The driver's ``cuEventElapsedTime(float *ms, CUevent start, CUevent end)``, or None where no
    driver library loads (torch's events are the driver's, so it reads them as they are)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    elapsed = getattr(driver, "cuEventElapsedTime_v2", None) or getattr(driver, "cuEventElapsedTime", None)
    if elapsed is None:
        return None
    elapsed.restype = ctypes.c_int
    elapsed.argtypes = (ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p)
    return elapsed


class StepClock:
    """Stamps each decode step's end (:meth:`stamp`) and reads a step's seconds (:meth:`seconds`)."""

    def __init__(self, elapsed_ms: Optional[Callable] = None):
        self.last_end = None  # the decode step before's end event, if nothing ran between
        self.spare: list = []  # events read already, recorded again rather than made anew
        self.elapsed_ms = elapsed_ms  # the driver's call; None: torch's ``elapsed_time``
        self._ms = ctypes.c_float()

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
        """A stamped step's seconds, or None where it was not timed or its end is not reached yet."""
        started, ended = timing
        if started is None:
            return None
        self.spare.append(started)
        if self.elapsed_ms is not None:
            code = self.elapsed_ms(ctypes.byref(self._ms), started, ended)
            if code == CUDA_SUCCESS:
                return self._ms.value / 1000
            if code == CUDA_ERROR_NOT_READY:
                return None
            logger.warning("DFLASH step timing: cuEventElapsedTime returned CUDA error %d; "
                           "reading steps through torch from now on", code)
            self.elapsed_ms = None
        try:  # torch checks that both ends were reached
            return started.elapsed_time(ended) / 1000
        except RuntimeError:  # its end is not reached yet
            return None
