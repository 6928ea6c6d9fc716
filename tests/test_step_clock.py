"""StepClock: a decode step's seconds from its CUDA events, through one driver call."""

import ctypes

import pytest

import sglang_dflash.step_clock as clock_mod
from sglang_dflash.step_clock import CUDA_ERROR_NOT_READY, StepClock, driver_elapsed_ms

DRIVER_SIGNATURE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p)


class Event:
    """As torch's: the driver handle through ``_as_parameter_``; ``elapsed_time`` raises for an end not reached."""

    def __init__(self, handle, t, done=True):
        self.handle, self.t, self.done = handle, t, done

    @property
    def _as_parameter_(self):
        return ctypes.c_void_p(self.handle)

    def elapsed_time(self, end):
        if not (self.done and end.done):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return end.t - self.t


def fake_driver(events, fail_with=None):
    """A ``cuEventElapsedTime`` over ``events`` (handle -> Event), called as ctypes calls the driver."""
    calls = []

    def elapsed(ms, start, end):
        calls.append((start, end))
        if fail_with is not None:
            return fail_with
        started, ended = events[start], events[end]
        if not (started.done and ended.done):
            return CUDA_ERROR_NOT_READY
        ms[0] = ended.t - started.t
        return 0

    return DRIVER_SIGNATURE(elapsed), calls


def test_a_step_is_read_with_one_driver_call_and_an_end_not_reached_reads_as_untimed():
    events = {h: Event(h, t) for h, t in ((0x10, 5.0), (0x20, 17.5))}
    events[0x30] = Event(0x30, 20.0, done=False)
    driver, calls = fake_driver(events)
    clock = StepClock(driver)
    assert clock.seconds((None, events[0x10])) is None and not calls  # the first after a prefill: not timed
    assert clock.seconds((events[0x10], events[0x20])) == pytest.approx(0.0125)
    assert clock.seconds((events[0x20], events[0x30])) is None  # not ready: learned untimed, no error
    assert calls == [(0x10, 0x20), (0x20, 0x30)]  # the events' own handles, one call a step
    assert clock.spare == [events[0x10], events[0x20]]  # each start, once read, is recorded again later
    assert clock.elapsed_ms is driver


def test_a_driver_error_other_than_not_ready_reads_through_torch_from_then_on(caplog):
    events = {0x10: Event(0x10, 1.0), 0x20: Event(0x20, 3.0), 0x30: Event(0x30, 4.0)}
    driver, calls = fake_driver(events, fail_with=201)  # CUDA_ERROR_INVALID_CONTEXT
    clock = StepClock(driver)
    with caplog.at_level("WARNING", logger="sglang_dflash"):
        assert clock.seconds((events[0x10], events[0x20])) == pytest.approx(0.002)
        assert clock.seconds((events[0x20], events[0x30])) == pytest.approx(0.001)
    assert len(calls) == 1 and clock.elapsed_ms is None
    assert [r.getMessage() for r in caplog.records] == [
        "DFLASH step timing: cuEventElapsedTime returned CUDA error 201; reading steps through torch from now on"]


def test_without_a_driver_library_steps_are_read_through_torch(monkeypatch):
    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(clock_mod.ctypes, "CDLL", no_library)
    assert driver_elapsed_ms() is None
    clock = StepClock(None)
    late = Event(0x20, 9.0, done=False)
    assert clock.seconds((Event(0x10, 1.0), Event(0x30, 2.5))) == pytest.approx(0.0015)
    assert clock.seconds((Event(0x10, 1.0), late)) is None


def test_the_driver_call_is_looked_up_by_name_with_its_signature(monkeypatch):
    class Library:
        def __init__(self, name):
            assert name == "libcuda.so.1"
            self.cuEventElapsedTime = DRIVER_SIGNATURE(lambda ms, start, end: 0)

    monkeypatch.setattr(clock_mod.ctypes, "CDLL", Library)
    found = driver_elapsed_ms()
    assert found.restype is ctypes.c_int and found.argtypes[1:] == (ctypes.c_void_p, ctypes.c_void_p)
