"""Pod quotas set through systemd, for pod cgroups that are systemd units; the cgroup file otherwise.

`SystemdPodQuotaWriter` is the pod quota writer the daemon gives the mixed-CPU plugin (it has the
shape of `nri_plugin.mixedcpu.quota.PodQuotaWriter`). For a pod whose cgroup is a slice
(`units.pod_unit`), the limit is set on the unit with ``SetUnitProperties(unit, runtime=true, ...)``
on the system bus: systemd writes the cgroup file itself, and writes the same value again at every
``daemon-reload`` or change of the unit, where a value written to the file behind its back would be
put back (``runtime-observations.md``, "systemd puts back cgroup files written behind its back").
The file is then read back: a value the kernel did not take (cgroup v1 refuses a pod quota below a
child's) is written to the file directly, so the caller sees the kernel's own refusal, retried as
any other.

The cgroup file is the fallback, for pods that are not units (the cgroupfs driver) and whenever no
bus is reachable: no socket (not mounted into the pod), a bus that does not answer, a lost
connection. Each outage is logged once, when it starts, and again when the bus is back; meanwhile
the connection is tried again in the background with backoff, never in an NRI handler's time: a
handler finds the bus connected or writes the file at once. A call that times out or loses the
connection also falls back, and takes the bus out of use until it is reconnected. A unit systemd
refuses to change (``NoSuchUnit``, ``AccessDenied``) gets the file too, logged once per kind of
refusal.

A call is about a millisecond; the NRI handlers' budget is 2 s, and `call_timeout` (0.5 s) keeps a
stalled systemd (a long ``daemon-reload``) within it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from typing import Final

import structlog
from dbus_fast import Message, Variant
from dbus_fast.aio import MessageBus

from cgroups import Cgroup, CgroupWriteRejected, CpuQuota, read_cpu_quota, set_cpu_limit
from nri_plugin.common.backoff import Backoff
from nri_plugin.common.clock import LOOP_CLOCK, Clock
from nri_plugin.systemd import bus as dbus
from nri_plugin.systemd.units import cpu_quota_properties, pod_unit

__all__ = ["CALL_TIMEOUT", "SystemdPodQuotaWriter", "write_quota_file"]

log = structlog.get_logger("nri_plugin.systemd")

CALL_TIMEOUT: Final = 0.5
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


class SystemdPodQuotaWriter:
    """Writes pod quotas through systemd on the bus at `bus_path`; see the module docstring.

    A service of the daemon: `start()` connects (bounded by `connect_timeout`; no bus is not an
    error), `close()` disconnects. `clock` paces the reconnection attempts.
    """

    def __init__(
        self,
        bus_path: str = dbus.SYSTEM_BUS,
        *,
        clock: Clock = LOOP_CLOCK,
        call_timeout: float = CALL_TIMEOUT,
        connect_timeout: float = dbus.CONNECT_TIMEOUT,
        backoff: Backoff | None = None,
    ) -> None:
        self.bus_path = bus_path
        self.call_timeout = call_timeout
        self.connect_timeout = connect_timeout
        self._clock = clock
        self._backoff = backoff or Backoff(RECONNECT_INITIAL, RECONNECT_MAX)
        self._bus: MessageBus | None = None
        self._reconnecting: asyncio.Task[None] | None = None
        self._closed = False
        # Why the bus is not in use ("" while it is); each outage is logged once.
        self.problem = "not started"
        self._refusals_said: set[str] = set()

    @property
    def connected(self) -> bool:
        return self._bus is not None and self._bus.connected

    # -- the service --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to the bus; when that fails, say so once and keep trying in the background."""
        self._closed = False
        if not await self._connect():
            self._reconnect_later()

    async def close(self) -> None:
        self._closed = True
        task, self._reconnecting = self._reconnecting, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        bus, self._bus = self._bus, None
        if bus is not None:
            await dbus.disconnect(bus, timeout=self.connect_timeout)

    async def _connect(self) -> bool:
        try:
            self._bus = await dbus.connect(self.bus_path, timeout=self.connect_timeout)
        except (OSError, dbus.BusError) as exc:
            self._out_of_use(f"cannot connect to the system bus at {self.bus_path}: {exc}")
            return False
        self._backoff.reset()
        if self.problem:
            log.info("connected to the system bus: pod quotas of systemd slices are set through systemd",
                     bus=self.bus_path)  # fmt: skip
        self.problem = ""
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
        """Make `limit` the pod cgroup's CFS limit: through systemd for a slice while the bus is
        there, else in the file. Raises `CgroupError` (`CgroupWriteRejected`: the kernel refused
        the value, e.g. a lowering v1 does not allow yet)."""
        unit = pod_unit(cgroup_parent)
        if unit is None:
            write_quota_file(pod_dir, limit, current)
            return
        if not self.connected:
            if self._bus is not None:  # closed under us: say so, and try again in the background
                self._out_of_use("the connection to the system bus closed")
            self._reconnect_later()
            write_quota_file(pod_dir, limit, current)
            return
        if not await self._set_through_systemd(unit, limit):
            write_quota_file(pod_dir, limit, current)
            return
        now = read_cpu_quota(pod_dir)
        if now != limit:
            # systemd took the value and the kernel did not (it logs why): writing the file ourselves
            # gets the kernel's own answer, a refusal the caller knows how to retry.
            log.debug("systemd's write did not take: writing the file", unit=unit, holds=str(now))
            write_quota_file(pod_dir, limit, now)
            _check(pod_dir, limit)

    async def _set_through_systemd(self, unit: str, limit: CpuQuota) -> bool:
        """True once systemd has the value (and has written it); False when the file must do."""
        bus = self._bus
        assert bus is not None
        properties = [(name, Variant("t", value)) for name, value in cpu_quota_properties(limit)]
        message = Message(
            destination=dbus.SYSTEMD,
            path=dbus.SYSTEMD_PATH,
            interface=dbus.SYSTEMD_MANAGER,
            member="SetUnitProperties",
            signature="sba(sv)",
            body=[unit, True, properties],
        )
        try:
            await dbus.call_method(bus, message, timeout=self.call_timeout)
        except (dbus.BusTimeout, dbus.BusLost) as exc:
            self._out_of_use(str(exc))
            self._reconnect_later()
            return False
        except dbus.BusError as exc:
            self._refused(unit, exc)
            return False
        return True

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


def _check(pod_dir: Cgroup, limit: CpuQuota) -> None:
    now = read_cpu_quota(pod_dir)
    if now != limit:
        raise CgroupWriteRejected(
            f"{pod_dir}: set {limit.quota} {limit.period} through systemd and in the file, and it holds "
            f"{now.quota} {now.period}",
            path=pod_dir.fs_path,
            value=f"{limit.quota} {limit.period}",
            errno=errno.EINVAL,
        )
