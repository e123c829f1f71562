"""Deadlines without servers: what is left, in the units the envelope and the stages use (proxy/deadline.py)."""

from __future__ import annotations

from proxy.deadline import Deadline


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_remaining_ms_is_whole_milliseconds_left_and_none_without_a_deadline():
    clock = Clock(100.0)
    deadline = Deadline(101.2345, clock)
    assert deadline.remaining_ms() == 1234  # truncated, as timing.deadline_ms always was
    clock.now = 101.0
    assert deadline.remaining_ms() == 234
    assert Deadline(None, clock).remaining_ms() is None


def test_remaining_ms_never_goes_below_zero_once_the_deadline_passed():
    clock = Clock(10.0)
    deadline = Deadline(9.0, clock)
    assert deadline.remaining_ms() == 0 and deadline.remaining() == 0.0
    assert deadline.budget(5.0, 0.1) < 0  # the budget, unlike what is left, says how late it is


def test_budget_is_the_tool_timeout_capped_by_what_is_left_minus_the_margin():
    clock = Clock(0.0)
    assert Deadline(None, clock).budget(5.0, 0.1) == 5.0
    assert Deadline(2.0, clock).budget(5.0, 0.5) == 1.5
    assert Deadline(20.0, clock).budget(5.0, 0.5) == 5.0
