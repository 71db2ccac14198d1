"""Driving a `DevicePluginServer` on virtual time (`ManualClock`).

Only time is virtual: the server's gRPC I/O with the fake kubelet stays real. So the clock is moved
one timer at a time, and before each move the test waits (on the real clock, GUARD against a hang)
until the server is asleep on the virtual clock again, its I/O done. Pacing then holds exactly: an
attempt due at 0.7 s happens when the clock passes 0.7 s, not before, however slow the machine.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Collection

from nri_plugin.common.backoff import Backoff
from nri_plugin.common.clock import ManualClock
from nri_plugin.deviceplugin.registration import RegistrationState
from nri_plugin.deviceplugin.server import BACKOFF_INITIAL, BACKOFF_MAX, DevicePluginServer

GUARD = 15.0  # real seconds; only against a hang (a loaded 2-core CI machine took over 5 s for one wait)
# Virtual time a test stays short of (or goes past) a due time: far above the float rounding of the
# sums the server computes, far below any delay it uses.
EPSILON = 1e-6

# The states in which the server sleeps on its clock between two pieces of I/O.
IDLE = frozenset(
    {
        RegistrationState.DISABLED,
        RegistrationState.WAITING_FOR_KUBELET,
        RegistrationState.REGISTERED,
        RegistrationState.BACKING_OFF,
    }
)


def exact_backoff() -> Backoff:
    """The default pacing (0.1 s doubling to 5 s) without jitter, so that due times are known."""
    return Backoff(BACKOFF_INITIAL, BACKOFF_MAX, jitter=(1.0, 1.0))


async def settle(
    plugin: DevicePluginServer, clock: ManualClock, states: Collection[RegistrationState] = IDLE
) -> RegistrationState:
    """Until `plugin` sleeps on `clock` in one of `states`, its I/O done; that state."""

    async def poll() -> None:
        while True:
            for _ in range(20):  # let cancelled sleepers go and new ones register their timers
                await asyncio.sleep(0)
            if plugin.state in states and clock.pending:
                return
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), GUARD)
    return plugin.state


async def advance(
    plugin: DevicePluginServer,
    clock: ManualClock,
    seconds: float,
    states: Collection[RegistrationState] = IDLE,
) -> None:
    """Move `clock` `seconds` on, one timer at a time, `plugin` settled (see `settle`) before each
    and at the end."""
    target = clock.monotonic() + seconds
    await settle(plugin, clock, states)
    while (due := clock.next_due()) is not None and due <= target:
        await clock.advance(_step_to(clock.monotonic(), due))
        await settle(plugin, clock, states)
    await clock.advance(max(target - clock.monotonic(), 0.0))
    await settle(plugin, clock, states)


def _step_to(now: float, due: float) -> float:
    """The smallest step that takes `now` to `due` or past it (`now + (due - now)` may fall short)."""
    step = max(due - now, 0.0)
    while now + step < due:
        step = math.nextafter(step, math.inf)
    return step
