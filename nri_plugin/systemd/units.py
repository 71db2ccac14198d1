"""Which pod cgroups systemd owns, and the unit properties that set a CFS limit. Pure.

Under kubelet's systemd cgroup driver a pod's cgroup is a slice unit, ``kubepods-pod<uid_>.slice``
(``kubepods-burstable-pod<uid_>.slice`` for a Burstable pod), created by kubelet through systemd.
systemd keeps a record of each unit's cgroup settings and writes them again whenever it re-applies
the unit (``daemon-reload``, any property change of the unit, a change of its controllers): a value
written to the cgroup file behind its back is silently put back. A value set on the unit itself
(``SetUnitProperties``, runtime) is the one re-applied, so that is how a slice's limit is set.

systemd's properties (its ``cgroup.c``): ``CPUQuotaPerSecUSec`` is the quota in microseconds of CPU
time per second of wall time (``UINT64_MAX``: unlimited), ``CPUQuotaPeriodUSec`` the period
(``UINT64_MAX``: its default, 100 ms). It writes ``max(per_sec * period / 1 s, 1 ms)`` as the quota,
rounded down.
"""

from __future__ import annotations

from typing import Final

from nri_plugin.cgroups import CgroupPathError, CpuQuota, pod_cgroup_path

__all__ = [
    "DEFAULT_PERIOD_USEC",
    "PERIOD",
    "PER_SEC",
    "USEC_INFINITY",
    "cpu_quota_properties",
    "per_sec",
    "pod_unit",
]

PER_SEC: Final = "CPUQuotaPerSecUSec"
PERIOD: Final = "CPUQuotaPeriodUSec"
USEC_INFINITY: Final = (1 << 64) - 1
USEC_PER_SEC: Final = 1_000_000
# The period systemd uses when CPUQuotaPeriodUSec is not set (and what kubelet gives every pod).
DEFAULT_PERIOD_USEC: Final = 100_000
_SLICE: Final = ".slice"


def pod_unit(cgroup_parent: str) -> str | None:
    """The systemd unit that owns the pod cgroup named by `cgroup_parent`: its slice, when the name
    is a slice's (systemd driver, short or expanded); None under cgroupfs or for a name we refuse."""
    try:
        path = pod_cgroup_path(cgroup_parent)
    except CgroupPathError:
        return None
    last = path.parts[-1]
    return last if last.endswith(_SLICE) else None


def per_sec(quota: int, period: int) -> int:
    """The smallest ``CPUQuotaPerSecUSec`` systemd turns into exactly `quota` per `period`: it
    computes ``per_sec * period // 1 s``, so this rounds up (and a period is at most 1 s, so the
    next value is already one more microsecond per period)."""
    return -(-quota * USEC_PER_SEC // period)


def cpu_quota_properties(limit: CpuQuota) -> list[tuple[str, int]]:
    """The unit properties (all of D-Bus type ``t``) that make `limit` the unit's CFS limit.

    The period goes only when it is not systemd's default: systemd before 242 (RHEL 8) knows no
    ``CPUQuotaPeriodUSec`` and refuses a call that names it, and kubelet gives pods the default.
    """
    quota = USEC_INFINITY if limit.quota is None else per_sec(limit.quota, limit.period)
    properties = [(PER_SEC, quota)]
    if limit.period != DEFAULT_PERIOD_USEC:
        properties.insert(0, (PERIOD, limit.period))
    return properties
