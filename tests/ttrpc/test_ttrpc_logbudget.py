"""The log budget for lines a peer can make us repeat: a burst, then one per interval, and a count."""

from __future__ import annotations

import pytest

from nri_plugin.ttrpc.logbudget import LogBudget, suppressed_note


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_one_per_interval_with_the_count_of_what_was_left_out() -> None:
    clock = Clock()
    budget = LogBudget(burst=3, interval=2.0, clock=clock)
    assert [budget.take() for _ in range(3)] == [0, 0, 0]
    assert [budget.take() for _ in range(1000)] == [None] * 1000
    clock.now += 1.9
    assert budget.take() is None
    clock.now += 0.1
    assert budget.take() == 1001, "the next line says how many were left out"
    assert budget.take() is None
    clock.now += 60  # refilled up to the burst, not beyond
    assert [budget.take() for _ in range(4)] == [1, 0, 0, None]
    assert budget.flush() == 1
    assert budget.flush() == 0


def test_the_note_and_the_arguments() -> None:
    assert suppressed_note(0) == ""
    assert suppressed_note(7) == " (7 more like it suppressed)"
    for burst, interval in ((0, 1.0), (1, 0.0), (2, -1.0)):
        with pytest.raises(ValueError, match="log budget"):
            LogBudget(burst=burst, interval=interval)
