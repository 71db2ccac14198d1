"""Waiting for a condition instead of sleeping a fixed time: on a loaded machine a fixed sleep is too
short (the test fails) and on an idle one too long (the suite crawls).

`wait_until(predicate, timeout)` checks `predicate()` every few milliseconds and returns as soon as it
holds; `timeout` guards against hangs only, so it is generous. Use it for state that has no event to
await; where there is one (an `asyncio.Event`, a future, a condition), await that instead.

A sleep that is itself the thing under test (letting time pass to show that nothing happens) stays a
sleep, with a comment saying so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

# Against hangs only: what the tests wait for takes milliseconds on an idle machine.
GUARD = 15.0
POLL = 0.005


async def wait_until(predicate: Callable[[], object], timeout: float = GUARD, *, what: str = "") -> None:
    """Return once `predicate()` is true; fail the test if it is not within `timeout` seconds.
    `what` names the condition in the failure message."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() >= deadline:
            name = what or getattr(predicate, "__name__", repr(predicate))
            raise AssertionError(f"not true within {timeout} s: {name}")
        await asyncio.sleep(POLL)
