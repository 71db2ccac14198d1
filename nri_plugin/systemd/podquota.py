"""Pod quotas set through systemd, for pod cgroups that are systemd units; the cgroup file otherwise.

`SystemdPodQuotaWriter` is the pod quota writer the daemon gives the mixed-CPU plugin (it has the
shape of `nri_plugin.mixedcpu.quota.PodQuotaWriter`). For a pod whose cgroup is a slice
(`units.pod_unit`), the limit is set on the unit with ``SetUnitProperties(unit, runtime=true, ...)``
on the system bus, so that systemd, which writes a unit's recorded values again at every
``daemon-reload`` or change of the unit, keeps it: a value written to the file behind its back would
be put back (docs/runtime-behaviour.md, "systemd puts back cgroup files written behind its back").

Two parts, each with one job: this writer owns the files (the write, the read-back after each of
systemd's answers, which units are settled); `nri_plugin.systemd.sender.QuotaSender` owns the bus
(the connection, one call per unit in order, the rests after slow calls) and reports each answer.

**systemd is never waited for on the request path.** A write goes to the cgroup file at once (the
kernel's own answer, a refusal the caller knows how to retry, comes back to the caller), and the
sender is told the same value, which it sends in the background: a slow or hung systemd (a long
``daemon-reload``) costs an NRI handler or a reconcile pass nothing.

**Nothing is settled until verified.** A unit is *pending* from a write until systemd has
acknowledged the latest value written for it and the file, read back, shows that value
(`settled`). A late answer carrying an older value (systemd then wrote that older value) is
undone at once: the file is written again and systemd told the latest value. An answer accepting
the latest value that the file, read back, does not show is warned of (at most once per
`WARN_EVERY` per unit, with a count) and the file written again; so is a read-back or rewrite that
fails (the unit stays pending: the reconciler's next pass writes it again). The plugin keeps a
pod's record while its unit is pending, so that the reconciler's passes keep reading it back.

The cgroup file alone is for pods that are not units (the cgroupfs driver), for a unit systemd
refuses to change (``NoSuchUnit``, ``AccessDenied``), and while no bus is reachable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import structlog

from nri_plugin.cgroups import (
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
from nri_plugin.common.clock import LOOP_CLOCK, Clock
from nri_plugin.systemd import bus as dbus
from nri_plugin.systemd.sender import CALL_TIMEOUT, REPLY_LIMIT, SLOW_CALL, Answer, QuotaSender
from nri_plugin.systemd.units import pod_unit

__all__ = [
    "CALL_TIMEOUT",
    "REPLY_LIMIT",
    "SLOW_CALL",
    "WARN_EVERY",
    "SystemdPodQuotaWriter",
    "write_quota_file",
]

log = structlog.get_logger("nri_plugin.systemd")

# A unit's file found off what it should show is warned of at most once per this (per kind).
WARN_EVERY: Final = 60.0
_MAX_WARNED: Final = 4096  # units remembered for the warnings' pace: more than a node's pods


def write_quota_file(pod_dir: Cgroup, limit: CpuQuota, current: CpuQuota | None) -> None:
    """Write `limit` to the pod cgroup's files, as the domain's file writer does (`current`: just
    read, None when unknown; `cgroups.set_cpu_limit`). Raises `CgroupError`."""
    set_cpu_limit(pod_dir, limit, current=current)


@dataclass(slots=True)
class _Unit:
    """A pending unit: the latest value written for it (`desired`), what systemd last accepted
    (`told`; None: unknown), and the value systemd refused (`refused`: the file alone holds it)."""

    dir: CgroupDir
    desired: CpuQuota
    told: CpuQuota | None = None
    refused: CpuQuota | None = None

    @property
    def held(self) -> bool:
        """systemd holds the latest value, or refused it and the file alone does."""
        return self.desired in (self.told, self.refused)


class _Pace:
    """Says a warning about a unit at most once per `WARN_EVERY`, with how many times it was not
    said since."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._said: dict[str, tuple[float, int]] = {}  # unit -> (when said, times not said since)

    def due(self, unit: str) -> int | None:
        """The times not said since the last time, when it is to be said now; None when not."""
        now = self._clock.monotonic()
        said, unsaid = self._said.get(unit, (None, 0))
        if said is not None and now - said < WARN_EVERY:
            self._said[unit] = (said, unsaid + 1)
            return None
        if len(self._said) >= _MAX_WARNED:
            self._said = {u: w for u, w in self._said.items() if now - w[0] < WARN_EVERY}
        self._said[unit] = (now, 0)
        return unsaid


class SystemdPodQuotaWriter:
    """Writes pod quotas, and has systemd told them on the bus at `bus_path`; see the module docstring.

    A service of the daemon: `start()` connects (bounded by `connect_timeout`; no bus is not an
    error), `close()` disconnects. `clock`, the one clock of both parts, paces the warnings, the
    reconnection attempts and the rests, and times the calls; `call_timeout`: how long the sender
    waits for one answer before it goes on without it.
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
        self.sender = QuotaSender(
            bus_path,
            self._answered,
            clock=clock,
            call_timeout=call_timeout,
            connect_timeout=connect_timeout,
            backoff=backoff,
            rest=rest,
        )
        self._units: dict[str, _Unit] = {}  # the pending units only
        self._not_shown_pace = _Pace(clock)
        self._failed_pace = _Pace(clock)

    @property
    def bus_path(self) -> str:
        return self.sender.bus_path

    @bus_path.setter
    def bus_path(self, path: str) -> None:
        self.sender.bus_path = path

    @property
    def problem(self) -> str:
        """Why the bus is not in use ("" while it is)."""
        return self.sender.problem

    @property
    def connected(self) -> bool:
        return self.sender.connected

    @property
    def resting(self) -> bool:
        """True while slow answers keep the bus out of use."""
        return self.sender.resting

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

    async def start(self) -> None:
        """Connect to the bus; when that fails, say so once and keep trying in the background."""
        await self.sender.start()

    async def close(self) -> None:
        await self.sender.close()
        self._units.clear()

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
            entry = self._units[unit] = _Unit(cgroup, limit)
        else:
            entry.dir, entry.desired = cgroup, limit
            if self._acknowledged(unit, entry):
                del self._units[unit]  # systemd has it already, and the file was just written
                return
        self._tell(unit, entry)

    def _acknowledged(self, unit: str, entry: _Unit) -> bool:
        """systemd holds the latest value (or refused it, and the file alone does), nothing on its way."""
        return entry.held and not self.sender.busy(unit)

    def _tell(self, unit: str, entry: _Unit) -> None:
        """Have the sender aim at the latest value: sent unless systemd holds it (or refused it)."""
        if entry.held:
            self.sender.forget(unit)  # an older value still waiting would undo it
        else:
            self.sender.tell(unit, entry.desired)

    # -- the read-back ------------------------------------------------------------------------------

    def _answered(self, unit: str, value: CpuQuota, answer: Answer) -> None:
        """systemd answered a call (however late): what it now holds, and the unit read back."""
        entry = self._units.get(unit)
        if entry is None:
            return
        if answer is Answer.ACCEPTED:
            entry.told = value
        elif answer is Answer.REFUSED:
            entry.refused = value
        else:
            entry.told = None  # unknown: told again
        self._read_back(unit, entry)
        if unit in self._units:
            self._tell(unit, entry)

    def _read_back(self, unit: str, entry: _Unit) -> None:
        """After an answer: the file made to show the latest value, and the unit settled once
        systemd has that value too (or refused it)."""
        try:
            now = read_cpu_quota(entry.dir)
            if now != entry.desired:
                if entry.told == entry.desired and not self.sender.busy(unit):
                    self._not_shown(unit, entry.desired, now)
                else:
                    log.info(
                        "systemd answered late and wrote an older pod quota: the latest is written again",
                        unit=unit,
                        holds=str(now),
                        target=str(entry.desired),
                    )
                write_quota_file(entry.dir, entry.desired, now)
        except CgroupNotFound:
            self.sender.forget(unit)
            del self._units[unit]  # the pod is gone: nothing to watch
            return
        except CgroupError as exc:  # (a lowering the kernel refuses yet, among others)
            unsaid = self._failed_pace.due(unit)
            if unsaid is not None:
                log.warning(
                    "cannot read back or write a pod slice's quota after systemd's answer: the unit "
                    "stays pending and the reconciler's next pass writes it again (said at most once a "
                    "minute per unit)",
                    unit=unit,
                    error=str(exc),
                    times_since_last_said=unsaid,
                )
            return
        if self._acknowledged(unit, entry):
            del self._units[unit]

    def _not_shown(self, unit: str, value: CpuQuota, now: CpuQuota) -> None:
        """systemd accepted `value` for `unit` and the file shows `now`: warned of once per
        `WARN_EVERY` per unit, with how many times it happened since."""
        unsaid = self._not_shown_pace.due(unit)
        if unsaid is None:
            return
        log.warning(
            "systemd accepted a pod quota and the cgroup file does not show it: written to the file "
            "(said at most once a minute per unit)",
            unit=unit,
            accepted=f"{value.quota} {value.period}",
            holds=f"{now.quota} {now.period}",
            times_since_last_said=unsaid,
        )
