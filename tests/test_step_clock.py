"""StepClock: a decode step's seconds from the CUDA events that stamp its end and the step's before."""

import pytest

import sglang_dflash.step_clock as clock_mod
from sglang_dflash.step_clock import StepClock


class Event:
    """As torch's: ``elapsed_time`` raises for an end not reached."""

    made = 0

    def __init__(self, enable_timing=True, t=0.0, done=True):
        assert enable_timing
        self.t, self.done, self.stream = t, done, None
        Event.made += 1

    def record(self, stream=None):
        self.stream = stream

    def elapsed_time(self, end):
        if not (self.done and end.done):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return end.t - self.t


def test_a_step_reads_from_the_step_befores_end_to_its_own_and_an_end_not_reached_reads_untimed():
    clock = StepClock()
    first, second, third = Event(t=5.0), Event(t=17.5), Event(t=20.0, done=False)
    assert clock.seconds((None, first)) is None  # the first after a prefill: not timed
    assert clock.seconds((first, second)) == pytest.approx(0.0125)
    assert clock.seconds((second, third)) is None  # not reached: learned untimed, no error
    assert clock.spare == [first, second]  # each start, once read, is recorded again later


def test_stamps_chain_the_steps_reuse_read_events_and_break_at_anything_else(monkeypatch):
    monkeypatch.setattr(clock_mod.torch.cuda, "Event", Event)
    clock = StepClock()
    start0, end0 = clock.stamp("the step's stream")
    start1, end1 = clock.stamp()
    assert start0 is None and start1 is end0 and clock.last_end is end1 and end0.stream == "the step's stream"
    made = Event.made
    clock.seconds((start1, end1))
    assert clock.stamp()[1] is end0 and Event.made == made  # a read start is recorded again, not made anew
    assert clock.times_next
    clock.forget()  # a prefill ran
    assert not clock.times_next  # the width policy keeps its probes for a step that will be timed
    assert clock.stamp()[0] is None and clock.times_next
