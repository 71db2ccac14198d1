"""A budget for log lines a peer can make us repeat: a few, then a count of the ones left out.

A line logged once per received frame is a lever for the peer: 20,000 unsolicited responses made
20,000 log lines, sixteen times the bytes they came in. Each such line gets a `LogBudget`: a token
bucket of `burst` lines, refilled at one line per `interval` seconds. A line over the budget is not
logged but counted, and the next line logged says how many were left out (`suppressed`); `flush()`
gives the count not yet reported, for a last line when the connection ends.

Plain data and the standard library only (the ttrpc package knows nothing of the rest of the
daemon); the clock is passed in, for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["LogBudget", "suppressed_note"]


class LogBudget:
    """At most `burst` lines at once, then one per `interval` seconds; see the module docstring."""

    __slots__ = ("_clock", "_last", "_suppressed", "_tokens", "burst", "interval")

    def __init__(
        self, *, burst: int = 5, interval: float = 2.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if burst < 1 or interval <= 0:
            raise ValueError(f"a log budget needs burst >= 1 ({burst}) and interval > 0 ({interval})")
        self.burst = burst
        self.interval = interval
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()
        self._suppressed = 0

    def take(self) -> int | None:
        """None: leave this line out (it is counted). A number: log it, and say that this many like
        it were left out since the last one logged."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) / self.interval)
        self._last = now
        if self._tokens < 1:
            self._suppressed += 1
            return None
        self._tokens -= 1
        suppressed, self._suppressed = self._suppressed, 0
        return suppressed

    def flush(self) -> int:
        """The lines left out and not yet reported (then 0)."""
        suppressed, self._suppressed = self._suppressed, 0
        return suppressed


def suppressed_note(count: int) -> str:
    """What a logged line adds when `count` lines like it were left out before it."""
    return f" ({count} more like it suppressed)" if count else ""
