"""The shared building blocks: backoff, clocks, atomic file writes."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest

from nri_plugin.common.atomicfile import write_atomically
from nri_plugin.common.backoff import Backoff
from nri_plugin.common.clock import LOOP_CLOCK, ManualClock, sleep_unless


def test_backoff_doubles_to_its_maximum_and_resets() -> None:
    backoff = Backoff(0.1, 1.0, jitter=(1.0, 1.0))
    assert [round(backoff.next(), 3) for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    backoff.reset()
    assert backoff.next() == pytest.approx(0.1)


def test_backoff_jitter_stays_in_its_range_and_varies() -> None:
    backoff = Backoff(1.0, 1.0, jitter=(0.8, 1.2), rng=random.Random(7))
    delays = [backoff.next() for _ in range(200)]
    assert all(0.8 <= d <= 1.2 for d in delays)
    assert len({round(d, 6) for d in delays}) > 100


def test_backoff_never_overflows() -> None:
    backoff = Backoff(0.1, 5.0, jitter=(1.0, 1.0))
    for _ in range(5000):
        backoff.next()
    assert backoff.next() == 5.0


@pytest.mark.parametrize(("initial", "maximum", "jitter"), [(0, 1, (1, 1)), (2, 1, (1, 1)), (1, 1, (0, 1))])
def test_backoff_refuses_nonsense(initial: float, maximum: float, jitter: tuple[float, float]) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(initial, maximum, jitter=jitter)


@pytest.mark.asyncio
async def test_manual_clock_fires_in_time_order_only_when_advanced() -> None:
    clock = ManualClock()
    fired: list[tuple[str, float]] = []
    clock.call_later(2.0, lambda: fired.append(("b", clock.monotonic())))
    clock.call_later(1.0, lambda: fired.append(("a", clock.monotonic())))
    cancelled = clock.call_later(1.5, lambda: fired.append(("x", clock.monotonic())))
    cancelled.cancel()
    await asyncio.sleep(0.01)  # real time passes: nothing fires until the manual clock is advanced
    assert fired == []
    await clock.advance(1.0)
    assert fired == [("a", 1.0)]
    await clock.advance(5.0)
    assert fired == [("a", 1.0), ("b", 2.0)]
    assert clock.monotonic() == 6.0
    assert clock.pending == 0


@pytest.mark.asyncio
async def test_manual_clock_wakes_sleepers_and_what_they_schedule() -> None:
    clock = ManualClock()
    woke: list[float] = []

    async def sleeper() -> None:
        for _ in range(3):
            await clock.sleep(1.0)
            woke.append(clock.monotonic())

    task = asyncio.create_task(sleeper())
    await clock.advance(2.5)
    assert woke == [1.0, 2.0]
    await clock.advance(1.0)
    assert woke == [1.0, 2.0, 3.0]
    await task


@pytest.mark.asyncio
async def test_sleep_unless_is_cut_short_by_the_event() -> None:
    clock = ManualClock()
    event = asyncio.Event()
    task = asyncio.create_task(sleep_unless(clock, event, 10.0))
    await clock.advance(1.0)
    assert not task.done()
    event.set()
    assert await task is True
    assert clock.pending == 0  # the cut-short sleep left no timer behind


@pytest.mark.asyncio
async def test_sleep_unless_times_out_on_the_real_clock() -> None:
    assert await sleep_unless(LOOP_CLOCK, asyncio.Event(), 0.01) is False
    assert LOOP_CLOCK.monotonic() == pytest.approx(asyncio.get_running_loop().time(), abs=1.0)


def test_write_atomically_replaces_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    assert write_atomically(target, b"one")
    assert write_atomically(target, b"two", mode=0o640)
    assert target.read_bytes() == b"two"
    assert os.stat(target).st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_write_atomically_without_replace_keeps_the_first(tmp_path: Path) -> None:
    target = tmp_path / "key"
    assert write_atomically(target, b"first", replace=False)
    assert not write_atomically(target, b"second", replace=False)
    assert target.read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key"]


def test_write_atomically_failure_leaves_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    write_atomically(target, b"old")
    (tmp_path / "sub").mkdir()
    with pytest.raises(IsADirectoryError):
        write_atomically(tmp_path / "sub", b"new")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "sub"]
