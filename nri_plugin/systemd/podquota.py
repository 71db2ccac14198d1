"""Pod quotas set through systemd, for pod cgroups that are systemd units; the cgroup file otherwise.

`SystemdPodQuotaWriter` is the pod quota writer the daemon gives the mixed-CPU plugin (it has the
shape of `nri_plugin.mixedcpu.quota.PodQuotaWriter`). For a pod whose cgroup is a slice
(`units.pod_unit`), the limit is set on the unit with ``SetUnitProperties(unit, runtime=true, ...)``
on the system bus, so that systemd, which writes a unit's recorded values again at every
``daemon-reload`` or change of the unit, keeps it: a value written to the file behind its back would
be put back (docs/runtime-behaviour.md, "systemd puts back cgroup files written behind its back").

**systemd is never waited for on the request path.** A write goes to the cgroup file at once (the
kernel's own answer, a refusal the caller knows how to retry, comes back to the caller), and systemd
is told the same value right after, in the background, by one sender outside every lock of the
plugin's: a slow or hung systemd (a long ``daemon-reload``) costs an NRI handler or a reconcile pass
nothing. Each unit has at most one call in flight; a newer value waits for the answer to the older
one, so systemd receives a unit's values in order.

**Slow calls rest the bus.** A call not answered within `SLOW_CALL` (or not within `call_timeout`,
when the sender stops waiting for it and goes on) takes the bus out of use for a backoff
(`REST_INITIAL`, doubled up to `REST_MAX`) that only a call answered quickly resets, not a reconnect.
A call is still followed after the sender stopped waiting: its answer, however late, is seen.

**Nothing is settled until verified.** A unit is *pending* from a write until systemd has
acknowledged the latest value written for it and the file, read back, shows that value
(`settled`). A late answer carrying an older value (systemd then wrote that older value) is
undone at once: the file is written again and systemd told the latest value. An answer accepting
the latest value that the file, read back, does not show is warned of (at most once per
`WARN_EVERY` per unit, with a count) and the file written again. The plugin keeps a
pod's record while its unit is pending, so that the reconciler's passes keep reading it back.

The cgroup file alone is for pods that are not units (the cgroupfs driver), and for a unit systemd
refuses to change (``NoSuchUnit``, ``AccessDenied``: logged once per kind of refusal). No bus
reachable (no socket mounted, a lost connection) is logged once when it starts and again when the
bus is back; meanwhile the connection is tried again in the background with backoff, and the
pending units are told once it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any, Final

import structlog
from dbus_fast import Message, Variant
from dbus_fast.aio import MessageBus

from cgroups import (
    Cgroup,
    CgroupDir,
    CgroupError,
    CgroupNotFound,
    CpuQuota,
    OpenCgroup,
    read_cpu_quota,
    set_cpu_limit,
)
from nri_plugin.common.backoff import Backoff
from nri_plugin.common.clock import LOOP_CLOCK, Clock, Timer
from nri_plugin.systemd import bus as dbus
from nri_plugin.systemd.units import cpu_quota_properties, pod_unit

__all__ = [
    "CALL_TIMEOUT",
    "REPLY_LIMIT",
    "SLOW_CALL",
    "WARN_EVERY",
    "SystemdPodQuotaWriter",
    "write_quota_file",
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
# A unit whose file does not show what systemd accepted is warned of at most once per this.
WARN_EVERY: Final = 60.0
_MAX_WARNED: Final = 4096  # units remembered for the warnings' pace: more than a node's pods
# Reconnection attempts: soon after a loss (systemd or dbus restarting), then every minute at most.
RECONNECT_INITIAL: Final = 1.0
RECONNECT_MAX: Final = 60.0
_FALLBACK_WHY: Final = (
    "pod quotas of systemd slices are written to their cgroup files, which systemd puts back at its "
    "next daemon-reload (the reconciler then writes them again); mount the host's /run/dbus"
)


def write_quota_file(pod_dir: Cgroup, limit: CpuQuota, current: CpuQuota | None) -> None:
    """Write `limit` to the pod cgroup's files, as the domain's file writer does (`current`: just
    read, None when unknown; `cgroups.set_cpu_limit`). Raises `CgroupError`."""
    set_cpu_limit(pod_dir, limit, current=current)


@dataclass(slots=True)
class _Unit:
    """A pending unit: the latest value written for it (`desired`), what systemd last acknowledged
    (`told`; None: unknown), the value of the call in flight (`sending`), and the value systemd
    refused (`refused`: the file alone holds it)."""

    dir: CgroupDir
    desired: CpuQuota
    told: CpuQuota | None = None
    sending: CpuQuota | None = None
    refused: CpuQuota | None = None

    @property
    def needs_call(self) -> bool:
        return self.sending is None and self.told != self.desired and self.refused != self.desired

    @property
    def acknowledged(self) -> bool:
        """systemd holds the latest value (or refused it, and the file alone does), nothing in flight."""
        return self.sending is None and self.desired in (self.told, self.refused)


class SystemdPodQuotaWriter:
    """Writes pod quotas, and tells systemd on the bus at `bus_path`; see the module docstring.

    A service of the daemon: `start()` connects (bounded by `connect_timeout`; no bus is not an
    error), `close()` disconnects. `clock` paces the reconnection attempts and the rests;
    `call_timeout`: how long the sender waits for one answer before it goes on without it.
    """

    def __init__(
        self,
        bus_path: str = dbus.SYSTEM_BUS,
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
        self._clock = clock
        self._backoff = backoff or Backoff(RECONNECT_INITIAL, RECONNECT_MAX)
        self._rest = rest or Backoff(REST_INITIAL, REST_MAX)
        self._bus: MessageBus | None = None
        self._reconnecting: asyncio.Task[None] | None = None
        self._closed = False
        # Why the bus is not in use ("" while it is); each outage is logged once.
        self.problem = "not started"
        self._refusals_said: set[str] = set()
        self._units: dict[str, _Unit] = {}  # the pending units only
        self._sender: asyncio.Task[None] | None = None
        self._resting_until = 0.0  # on the clock
        self._wake: Timer | None = None
        self._calls: set[asyncio.Future[Any]] = set()
        self._warned: dict[str, tuple[float, int]] = {}  # unit -> (when warned, mismatches not said since)

    @property
    def connected(self) -> bool:
        return self._bus is not None and self._bus.connected

    @property
    def resting(self) -> bool:
        """True while slow answers keep the bus out of use."""
        return self._clock.monotonic() < self._resting_until

    @property
    def pending(self) -> frozenset[str]:
        """The units not settled yet (see `settled`)."""
        return frozenset(self._units)

    def settled(self, cgroup_parent: str) -> bool:
        """False while the pod cgroup named by `cgroup_parent` is a unit whose latest value systemd
        has not acknowledged, or the file has not been read back showing it, since it was written;
        True for a pod cgroup that is no unit."""
        unit = pod_unit(cgroup_parent)
        return unit is None or unit not in self._units

    # -- the service --------------------------------------------------------------------------------

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
        self._units.clear()
        bus, self._bus = self._bus, None
        if bus is not None:
            await dbus.disconnect(bus, timeout=self.connect_timeout)

    async def _connect(self) -> bool:
        try:
            self._bus = await dbus.connect(self.bus_path, timeout=self.connect_timeout)
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
        self._drop_bus()

    def _drop_bus(self) -> None:
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

    # -- the writer ---------------------------------------------------------------------------------

    async def write_pod_quota(
        self, pod_dir: Cgroup, cgroup_parent: str, limit: CpuQuota, *, current: CpuQuota | None
    ) -> None:
        """Make `limit` the pod cgroup's CFS limit: written to the file now, and for a slice, told
        to systemd in the background. Never suspends. Raises `CgroupError` (`CgroupWriteRejected`:
        the kernel refused the value, e.g. a lowering v1 does not allow yet; systemd is not told)."""
        write_quota_file(pod_dir, limit, current)
        unit = pod_unit(cgroup_parent)
        if unit is None:
            return
        entry = self._units.get(unit)
        cgroup = pod_dir.cgroup if isinstance(pod_dir, OpenCgroup) else pod_dir
        if entry is None:
            self._units[unit] = _Unit(cgroup, limit)
        else:
            entry.dir, entry.desired = cgroup, limit
            if entry.acknowledged:
                del self._units[unit]  # systemd has it already, and the file was just written
                return
        self._send_soon()

    # -- the sender ---------------------------------------------------------------------------------

    def _send_soon(self) -> None:
        """Have the pending units told, by the one sender (started unless it runs)."""
        if self._closed or (self._sender is not None and not self._sender.done()):
            return
        if any(entry.needs_call for entry in self._units.values()):
            self._sender = asyncio.ensure_future(self._send_pending())

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

    async def _send_pending(self) -> None:
        """Tell systemd the pending units' values, one call at a time, while the bus is usable."""
        while not self._closed and self._usable():
            name = next((name for name, entry in self._units.items() if entry.needs_call), None)
            if name is None:
                return
            await self._tell(name, self._units[name])

    async def _tell(self, name: str, entry: _Unit) -> None:
        """One call for `entry`'s latest value; waited for `call_timeout` at most (followed after)."""
        bus = self._bus
        assert bus is not None
        value = entry.desired
        entry.sending = value
        properties = [(prop, Variant("t", number)) for prop, number in cpu_quota_properties(value)]
        message = Message(
            destination=dbus.SYSTEMD,
            path=dbus.SYSTEMD_PATH,
            interface=dbus.SYSTEMD_MANAGER,
            member="SetUnitProperties",
            signature="sba(sv)",
            body=[name, True, properties],
        )
        started = time.monotonic()
        call = asyncio.ensure_future(dbus.call_method(bus, message, timeout=REPLY_LIMIT))
        self._calls.add(call)
        call.add_done_callback(functools.partial(self._answered, name, entry, value))
        await asyncio.wait({call}, timeout=self.call_timeout)  # (never cancels the call)
        took = time.monotonic() - started
        if not call.done() or took >= SLOW_CALL:
            self._rest_a_while(name, took, answered=call.done())
        elif self._rest.steps:
            self._rest.reset()
            log.info("systemd answers quickly again: pod quotas are told to systemd", unit=name)

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

    def _answered(self, name: str, entry: _Unit, value: CpuQuota, call: asyncio.Future[Any]) -> None:
        """A call ended (however late): what systemd now holds, and the unit read back."""
        self._calls.discard(call)
        entry.sending = None
        if call.cancelled() or self._closed:
            return
        exc = call.exception()
        if exc is None:
            entry.told = value
        elif isinstance(exc, dbus.BusLost):
            entry.told = None  # delivered or not: unknown, told again on the next connection
            if self._bus is not None:
                self._out_of_use(str(exc))
            self._reconnect_later()
        elif isinstance(exc, dbus.BusTimeout):
            entry.told = None  # no answer at all: unknown, told again
        elif isinstance(exc, dbus.BusError):
            entry.refused = value
            self._refused(name, exc)
        else:
            entry.told = None
            log.error("a call to systemd failed", unit=name, error=repr(exc))
        if self._units.get(name) is entry:
            self._read_back(name, entry)
        self._send_soon()

    def _read_back(self, name: str, entry: _Unit) -> None:
        """After an answer: the file made to show the latest value, and the unit settled once
        systemd has that value too (or refused it)."""
        try:
            now = read_cpu_quota(entry.dir)
            if now != entry.desired:
                if entry.acknowledged and entry.told == entry.desired:
                    self._not_shown(name, entry.desired, now)
                else:
                    log.info(
                        "systemd answered late and wrote an older pod quota: the latest is written again",
                        unit=name,
                        holds=str(now),
                        target=str(entry.desired),
                    )
                write_quota_file(entry.dir, entry.desired, now)
        except CgroupNotFound:
            if entry.sending is None:
                del self._units[name]  # the pod is gone: nothing to watch
            return
        except CgroupError as exc:  # (a lowering the kernel refuses yet: the plugin's retries)
            log.debug("cannot read back or write the pod quota", unit=name, error=str(exc))
            return
        if entry.acknowledged:
            del self._units[name]

    def _not_shown(self, unit: str, value: CpuQuota, now: CpuQuota) -> None:
        """systemd accepted `value` for `unit` and the file shows `now`: warned of once per
        `WARN_EVERY` per unit, with how many times it happened since."""
        clock = self._clock.monotonic()
        said, unsaid = self._warned.get(unit, (None, 0))
        if said is not None and clock - said < WARN_EVERY:
            self._warned[unit] = (said, unsaid + 1)
            return
        if len(self._warned) >= _MAX_WARNED:
            self._warned = {u: w for u, w in self._warned.items() if clock - w[0] < WARN_EVERY}
        self._warned[unit] = (clock, 0)
        log.warning(
            "systemd accepted a pod quota and the cgroup file does not show it: written to the file "
            "(said at most once a minute per unit)",
            unit=unit,
            accepted=f"{value.quota} {value.period}",
            holds=f"{now.quota} {now.period}",
            times_since_last_said=unsaid,
        )

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
