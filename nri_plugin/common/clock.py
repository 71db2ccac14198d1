"""Time as something passed in: the daemon's waits and timers go through a `Clock`, so tests can run
them on virtual time (`ManualClock`) instead of sleeping on the real one.

`LoopClock` is the real thing: the running asyncio loop's monotonic time. `ManualClock` stands still
until a test calls `advance()`, which fires every timer and wakes every sleeper that falls due, in
time order, letting the loop run what they wake before moving on.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds from an arbitrary start; never goes back."""

    async def sleep(self, seconds: float) -> None: ...

    def call_later(self, seconds: float, callback: Callable[[], object]) -> Timer:
        """Run `callback` on the running loop in `seconds`; `cancel()` the result to stop it."""


class LoopClock:
    """The running asyncio loop's clock."""

    def monotonic(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_later(self, seconds: float, callback: Callable[[], object]) -> Timer:
        return asyncio.get_running_loop().call_later(seconds, callback)


LOOP_CLOCK = LoopClock()


async def within(clock: Clock, seconds: float, awaitable: Awaitable[T]) -> T:
    """What `awaitable` gives, or TimeoutError (and `awaitable` cancelled) after `seconds` on `clock`.

    Not ``asyncio.wait_for``: that waits on the loop's time, not on the clock given, and from Python
    3.12 it raises when no task runs its caller; this needs neither.
    """
    work = asyncio.ensure_future(awaitable)
    work.add_done_callback(_retrieve_outcome)
    sleeper = asyncio.ensure_future(clock.sleep(seconds))
    try:
        await asyncio.wait((work, sleeper), return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        if not work.done():
            work.cancel()
    if not work.done():
        raise TimeoutError
    return work.result()


def _retrieve_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # an abandoned call's error is no news; asyncio must not report it


async def sleep_unless(clock: Clock, event: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds` on `clock`, cut short when `event` is set; True if it was (or already was)."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    sleeper = asyncio.ensure_future(clock.sleep(seconds))
    try:
        await asyncio.wait((waiter, sleeper), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        sleeper.cancel()
    return event.is_set()


class _ManualTimer:
    def __init__(self, callback: Callable[[], object]) -> None:
        self.callback: Callable[[], object] | None = callback

    def cancel(self) -> None:
        self.callback = None


class ManualClock:
    """Virtual time for tests: nothing falls due until `advance()` moves the clock."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._due: list[tuple[float, int, _ManualTimer]] = []
        self._order = itertools.count()

    def monotonic(self) -> float:
        return self._now

    def call_later(self, seconds: float, callback: Callable[[], object]) -> Timer:
        timer = _ManualTimer(callback)
        heapq.heappush(self._due, (self._now + max(seconds, 0.0), next(self._order), timer))
        return timer

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not future.done():
                future.set_result(None)

        timer = self.call_later(seconds, wake)
        try:
            await future
        finally:
            timer.cancel()

    @property
    def pending(self) -> int:
        """Timers and sleepers not yet due or cancelled."""
        return sum(1 for _, _, timer in self._due if timer.callback is not None)

    def next_due(self) -> float | None:
        """When the earliest live timer falls due, or None."""
        while self._due and self._due[0][2].callback is None:
            heapq.heappop(self._due)
        return self._due[0][0] if self._due else None

    async def advance(self, seconds: float) -> None:
        """Move time `seconds` forward, firing what falls due on the way, each at its own time."""
        await self._settle()
        target = self._now + seconds
        while (due := self.next_due()) is not None and due <= target:
            _, _, timer = heapq.heappop(self._due)
            self._now = max(self._now, due)
            callback, timer.callback = timer.callback, None
            assert callback is not None
            callback()
            await self._settle()
        self._now = target
        await self._settle()

    @staticmethod
    async def _settle() -> None:
        # Let the loop run what the last timer woke (and what that wakes, a few hops deep).
        for _ in range(20):
            await asyncio.sleep(0)
