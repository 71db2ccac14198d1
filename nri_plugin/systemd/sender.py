"""Telling systemd the CFS limits of its units, over one connection to the system bus, paced.

`QuotaSender` is the bus side of `nri_plugin.systemd.podquota.SystemdPodQuotaWriter`: it is told
"unit U is to hold value V" (`tell`) and says, for each call, what systemd answered (`Answered`:
accepted, refused, or unknown). It never touches a cgroup file; what the answers mean for the files
is the writer's.

**One sender, one call per unit.** The calls are made one at a time by one background task, outside
every lock of the plugin's, with ``SetUnitProperties(unit, runtime=true, ...)``. A unit has at most
one call in flight; a newer value waits for the answer to the older one (only the latest value
waiting is sent), so systemd receives a unit's values in order.

**Slow calls rest the bus.** A call not answered within `SLOW_CALL` (or not within `call_timeout`,
when the sender stops waiting for it and goes on) takes the bus out of use for a backoff
(`REST_INITIAL`, doubled up to `REST_MAX`) that only a call answered quickly resets, not a reconnect.
A call is still followed after the sender stopped waiting: its answer, however late, is reported.

**No bus** (no socket mounted, a lost connection) is logged once when it starts and again when the
bus is back; meanwhile the connection is tried again in the background with backoff, and the values
waiting are sent once it is back. A refusal (``NoSuchUnit``, ``AccessDenied``) is logged once per
kind of refusal.

Every wait and every measure of time is on the one injected `Clock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
from collections.abc import Callable
from typing import Any, Final

import structlog
from dbus_fast import Message, Variant
from dbus_fast.aio import MessageBus

from nri_plugin.cgroups import CpuQuota
from nri_plugin.common.backoff import Backoff
from nri_plugin.common.clock import LOOP_CLOCK, Clock, Timer
from nri_plugin.systemd import bus as dbus
from nri_plugin.systemd.units import cpu_quota_properties

__all__ = [
    "CALL_TIMEOUT",
    "RECONNECT_INITIAL",
    "RECONNECT_MAX",
    "REPLY_LIMIT",
    "REST_INITIAL",
    "REST_MAX",
    "SLOW_CALL",
    "Answer",
    "Answered",
    "QuotaSender",
]

log = structlog.get_logger("nri_plugin.systemd")

# How long the sender waits for an answer before it goes on without it (the call is still followed).
CALL_TIMEOUT: Final = 0.5
# An answer slower than this rests the bus: systemd is busy (a call takes about a millisecond).
SLOW_CALL: Final = 0.25
# How long a call's answer is waited for at all; none by then: systemd's view of the unit is unknown.
REPLY_LIMIT: Final = 120.0
# Rest after a slow call: soon tried again, then at most every minute while calls stay slow.
REST_INITIAL: Final = 1.0
REST_MAX: Final = 60.0
# Reconnection attempts: soon after a loss (systemd or dbus restarting), then every minute at most.
RECONNECT_INITIAL: Final = 1.0
RECONNECT_MAX: Final = 60.0
_FALLBACK_WHY: Final = (
    "pod quotas of systemd slices are written to their cgroup files, which systemd puts back at its "
    "next daemon-reload (the reconciler then writes them again); mount the host's /run/dbus"
)


class Answer(enum.Enum):
    """What one call left systemd holding for the unit."""

    ACCEPTED = "accepted"  # systemd holds the value sent
    REFUSED = "refused"  # systemd refused it (the unit's file alone can hold it)
    UNKNOWN = "unknown"  # no answer (lost bus, no reply at all, an unforeseen failure)


# Called once per call, when it ends (however late): the unit, the value sent, what became of it.
Answered = Callable[[str, CpuQuota, Answer], None]


class QuotaSender:
    """Sends units' CFS limits to systemd on the bus at `bus_path`; see the module docstring.

    `answered` is called (on the loop, never while closed) for each call that ends. `start()`
    connects (bounded by `connect_timeout`; no bus is not an error), `close()` disconnects. `clock`
    times the calls and paces the rests and the reconnection attempts; `call_timeout`: how long the
    sender waits for one answer before it goes on without it.
    """

    def __init__(
        self,
        bus_path: str,
        answered: Answered,
        *,
        clock: Clock = LOOP_CLOCK,
        call_timeout: float = CALL_TIMEOUT,
        connect_timeout: float = dbus.CONNECT_TIMEOUT,
        backoff: Backoff | None = None,
        rest: Backoff | None = None,
    ) -> None:
        self.bus_path = bus_path
        self.call_timeout = call_timeout
        self.connect_timeout = connect_timeout
        self._answered = answered
        self._clock = clock
        self._backoff = backoff or Backoff(RECONNECT_INITIAL, RECONNECT_MAX)
        self._rest = rest or Backoff(REST_INITIAL, REST_MAX)
        self._bus: MessageBus | None = None
        self._reconnecting: asyncio.Task[None] | None = None
        self._closed = False
        # Why the bus is not in use ("" while it is); each outage is logged once.
        self.problem = "not started"
        self._refusals_said: set[str] = set()
        self._waiting: dict[str, CpuQuota] = {}  # unit -> the latest value to send
        self._in_flight: dict[str, CpuQuota] = {}  # unit -> the value of its call not answered yet
        self._sender: asyncio.Task[None] | None = None
        self._resting_until = 0.0  # on the clock
        self._wake: Timer | None = None
        self._calls: set[asyncio.Future[Any]] = set()

    @property
    def connected(self) -> bool:
        return self._bus is not None and self._bus.connected

    @property
    def resting(self) -> bool:
        """True while slow answers keep the bus out of use."""
        return self._clock.monotonic() < self._resting_until

    def tell(self, unit: str, value: CpuQuota) -> None:
        """Have systemd told that `unit` is to hold `value`, after the unit's call in flight (a value
        already waiting is replaced: only the latest is sent)."""
        if self._in_flight.get(unit) == value:
            self._waiting.pop(unit, None)  # on its way already
        else:
            self._waiting[unit] = value
        self._send_soon()

    def forget(self, unit: str) -> None:
        """Send nothing more for `unit` (a call in flight is still followed and reported)."""
        self._waiting.pop(unit, None)

    def busy(self, unit: str) -> bool:
        """Whether a value for `unit` waits to be sent or has been sent and not answered."""
        return unit in self._waiting or unit in self._in_flight

    # -- the connection -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to the bus; when that fails, say so once and keep trying in the background."""
        self._closed = False
        if not await self._connect():
            self._reconnect_later()

    async def close(self) -> None:
        self._closed = True
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        tasks: list[asyncio.Future[Any]] = [*self._calls]
        tasks += (task for task in (self._reconnecting, self._sender) if task is not None)
        self._reconnecting = self._sender = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        self._waiting.clear()
        self._in_flight.clear()
        bus, self._bus = self._bus, None
        if bus is not None:
            await dbus.disconnect(bus, timeout=self.connect_timeout, clock=self._clock)

    async def _connect(self) -> bool:
        try:
            self._bus = await dbus.connect(self.bus_path, timeout=self.connect_timeout, clock=self._clock)
        except (OSError, dbus.BusError) as exc:
            self._out_of_use(f"cannot connect to the system bus at {self.bus_path}: {exc}")
            return False
        self._backoff.reset()  # (the rest after slow answers is not: only a quick answer ends it)
        if self.problem:
            log.info("connected to the system bus: pod quotas of systemd slices are set through systemd",
                     bus=self.bus_path)  # fmt: skip
        self.problem = ""
        self._send_soon()
        return True

    def _out_of_use(self, problem: str) -> None:
        """The bus cannot be used: said once per outage (not again at each failed attempt)."""
        if not self.problem or self.problem == "not started":
            log.warning("no system bus: " + _FALLBACK_WHY, problem=problem, bus=self.bus_path)
        else:
            log.debug("still no system bus", problem=problem, bus=self.bus_path)
        self.problem = problem
        bus, self._bus = self._bus, None
        if bus is not None:
            bus.disconnect()

    def _reconnect_later(self) -> None:
        if self._closed or (self._reconnecting is not None and not self._reconnecting.done()):
            return
        self._reconnecting = asyncio.ensure_future(self._reconnect())

    async def _reconnect(self) -> None:
        while not self._closed:
            await self._clock.sleep(self._backoff.next())
            if await self._connect():
                return

    # -- the sender ---------------------------------------------------------------------------------

    def _next(self) -> str | None:
        return next((unit for unit in self._waiting if unit not in self._in_flight), None)

    def _send_soon(self) -> None:
        """Have the values waiting sent, by the one sender (started unless it runs)."""
        if self._closed or (self._sender is not None and not self._sender.done()):
            return
        if self._next() is not None:
            self._sender = asyncio.ensure_future(self._send_waiting())

    def _usable(self) -> bool:
        """Whether a call may go now; if not, the sender is woken when it may."""
        if not self.connected:
            if self._bus is not None:  # closed under us: say so, and try again in the background
                self._out_of_use("the connection to the system bus closed")
            self._reconnect_later()  # (its success wakes the sender)
            return False
        wait = self._resting_until - self._clock.monotonic()
        if wait > 0:
            if self._wake is None:
                self._wake = self._clock.call_later(wait, self._woken)
            return False
        return True

    def _woken(self) -> None:
        self._wake = None
        self._send_soon()

    async def _send_waiting(self) -> None:
        """Send the values waiting, one call at a time, while the bus is usable."""
        while not self._closed and self._usable():
            unit = self._next()
            if unit is None:
                return
            await self._send(unit, self._waiting.pop(unit))

    async def _send(self, unit: str, value: CpuQuota) -> None:
        """One call; waited for `call_timeout` at most (followed after)."""
        bus = self._bus
        assert bus is not None
        self._in_flight[unit] = value
        properties = [(prop, Variant("t", number)) for prop, number in cpu_quota_properties(value)]
        message = Message(
            destination=dbus.SYSTEMD,
            path=dbus.SYSTEMD_PATH,
            interface=dbus.SYSTEMD_MANAGER,
            member="SetUnitProperties",
            signature="sba(sv)",
            body=[unit, True, properties],
        )
        started = self._clock.monotonic()
        call = asyncio.ensure_future(dbus.call_method(bus, message, timeout=REPLY_LIMIT, clock=self._clock))
        self._calls.add(call)
        call.add_done_callback(functools.partial(self._ended, unit, value))
        waited = asyncio.ensure_future(self._clock.sleep(self.call_timeout))
        try:
            await asyncio.wait(
                {call, waited}, return_when=asyncio.FIRST_COMPLETED
            )  # (never cancels the call)
        finally:
            waited.cancel()
        took = self._clock.monotonic() - started
        if not call.done() or took >= SLOW_CALL:
            self._rest_a_while(unit, took, answered=call.done())
        elif self._rest.steps:
            self._rest.reset()
            log.info("systemd answers quickly again: pod quotas are told to systemd", unit=unit)

    def _rest_a_while(self, unit: str, took: float, *, answered: bool) -> None:
        """Said at warning when systemd turns slow, at debug while it stays so."""
        say = log.warning if not self._rest.steps else log.debug
        rest = self._rest.next()
        self._resting_until = self._clock.monotonic() + rest
        answer = f"answered in {took:.2f} s" if answered else f"no answer within {took:.2f} s"
        say(
            "systemd answers slowly: pod quotas are written to their cgroup files and systemd is told "
            "once it answers quickly again",
            unit=unit,
            answer=answer,
            rest_seconds=round(rest, 1),
        )

    def _ended(self, unit: str, value: CpuQuota, call: asyncio.Future[Any]) -> None:
        """A call ended (however late): what systemd now holds, reported."""
        self._calls.discard(call)
        self._in_flight.pop(unit, None)
        if call.cancelled() or self._closed:
            return
        exc = call.exception()
        if exc is None:
            answer = Answer.ACCEPTED
        elif isinstance(exc, dbus.BusLost):
            answer = Answer.UNKNOWN  # delivered or not: unknown, told again on the next connection
            if self._bus is not None:
                self._out_of_use(str(exc))
            self._reconnect_later()
        elif isinstance(exc, dbus.BusTimeout):
            answer = Answer.UNKNOWN  # no answer at all
        elif isinstance(exc, dbus.BusError):
            answer = Answer.REFUSED
            self._refused(unit, exc)
        else:
            answer = Answer.UNKNOWN
            log.error("a call to systemd failed", unit=unit, error=repr(exc))
        self._answered(unit, value, answer)
        self._send_soon()

    def _refused(self, unit: str, exc: dbus.BusError) -> None:
        kind = exc.name or str(exc)
        if kind in self._refusals_said:
            log.debug("systemd refused a pod quota: written to the file", unit=unit, error=str(exc))
            return
        self._refusals_said.add(kind)
        log.warning(
            "systemd refused to set a pod slice's CPU quota: written to its cgroup file instead (said once "
            "per kind of refusal); systemd puts such a value back at its next daemon-reload",
            unit=unit,
            error=str(exc),
        )
