"""The numbers the state dir gives back, checked before any of them reaches a cgroup file.

The books' database (`nri_plugin.mixedcpu.store`) is the plugin's own, but whoever can
write the state dir (or a disk error) can put any integer there, and a pod's record goes straight
into the quota written to its cgroup: a baseline of 10^30 was written to ``cpu.cfs_quota_us`` as
100000000000200000, one of 6,400,000 for a 2-CPU pod gave it 66 CPUs of quota. So every loaded
record is checked (`set_aside_out_of_range`) against

* the kernel's CFS ranges: a period of 1 ms to 1 s, a quota of 1 ms to 2^44 - 1 us (none: unlimited),
  the pod's target (its own quota plus the shares) included;
* the node: a pod's own quota at most the online CPUs x its period (a Guaranteed pod, the only kind
  that gets shared CPUs, cannot ask for more), a container's shared CPUs and exclusive CPUs at most
  the online CPUs, each (the quota `nri_plugin.mixedcpu.quota` gives back to a stopped container
  counts its exclusive CPUs);

and, at Synchronize, the pod's own quota against its limit as the runtime sends it
(`above_runtime_limit`). A record that fails is *set aside*: dropped from the books with one warning
naming the pod, the value and the range, and the pod is rebuilt from the runtime's view (its running
containers and its cgroup), as a pod the books never knew.
"""

from __future__ import annotations

from typing import Final

import structlog

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups.cpuset import MAX_CPUS, CpusetError
from nri_plugin.cgroups.cpuset import parse as parse_cpuset
from nri_plugin.mixedcpu.books import Books, ContainerRecord, PodRecord
from nri_plugin.mixedcpu.logfields import LOGGER_NAME, pod_fields
from nri_plugin.mixedcpu.policy import (
    MAX_CFS_PERIOD,
    MAX_CFS_QUOTA,
    MIN_CFS_PERIOD,
    MIN_CFS_QUOTA,
    PolicyError,
    baseline_from_pod_resources,
    pod_key,
)

__all__ = ["OutOfRange", "above_runtime_limit", "out_of_range", "set_aside_out_of_range"]

log = structlog.get_logger(LOGGER_NAME)

_SET_ASIDE: Final = "saved pod record out of range: set aside, the pod is rebuilt from the runtime's view"


class OutOfRange:
    """What is wrong with a record: the field, its value, and the range it must be in."""

    __slots__ = ("allowed", "field", "value")

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed

    def __str__(self) -> str:
        return f"{self.field} {self.value!r} is outside {self.allowed}"


def out_of_range(record: PodRecord, online: int | None = None) -> OutOfRange | None:
    """The first number of `record` outside the kernel's ranges, or (given the number of `online`
    CPUs) beyond what the node can hold; None when all are in range."""
    problem = _own_quota(record, online)
    cpus = MAX_CPUS if online is None else online
    for name, container in record.containers.items():
        problem = problem or _slot(name, container, cpus, online)
    target = record.target()
    if problem is None and target is not None and target > MAX_CFS_QUOTA:
        return OutOfRange("target", target, f"{MIN_CFS_QUOTA} to {MAX_CFS_QUOTA} us (the kernel's range)")
    return problem


def _own_quota(record: PodRecord, online: int | None) -> OutOfRange | None:
    period = record.period
    if not MIN_CFS_PERIOD <= period <= MAX_CFS_PERIOD:
        return OutOfRange("period", period, f"{MIN_CFS_PERIOD} to {MAX_CFS_PERIOD} us (the kernel's range)")
    baseline = record.baseline
    if baseline is None:
        return None
    top = MAX_CFS_QUOTA if online is None else min(MAX_CFS_QUOTA, online * period)
    if not MIN_CFS_QUOTA <= baseline <= top:
        return OutOfRange("baseline", baseline, _quota_range(top, online, period))
    return None


def _slot(name: str, container: ContainerRecord, cpus: int, online: int | None) -> OutOfRange | None:
    if not 0 <= container.shared_cpus <= cpus:
        return OutOfRange(f"container {name}: shared_cpus", container.shared_cpus, _cpus_range(cpus, online))
    try:
        exclusive = len(parse_cpuset(container.exclusive))
    except CpusetError:
        return OutOfRange(f"container {name}: exclusive", container.exclusive, "a list of CPUs")
    if exclusive > cpus:
        return OutOfRange(f"container {name}: exclusive", container.exclusive, _cpus_range(cpus, online))
    return None


def _quota_range(top: int, online: int | None, period: int) -> str:
    if online is None or top == MAX_CFS_QUOTA:
        return f"{MIN_CFS_QUOTA} to {top} us (the kernel's range)"
    return f"{MIN_CFS_QUOTA} to {top} us ({online} online CPUs x the period of {period} us)"


def _cpus_range(cpus: int, online: int | None) -> str:
    return f"0 to {cpus} CPUs" + ("" if online is None else " (the online CPUs)")


def set_aside_out_of_range(books: Books, online: int | None, source: str) -> list[str]:
    """Drop from `books` (just loaded from `source`) every pod whose record has a number out of range
    (`out_of_range`), each with one warning; the keys of those dropped. Their device bindings stay:
    the runtime has not said the pods ended."""
    dropped: list[str] = []
    for key, record in list(books.pods.items()):
        problem = out_of_range(record, online)
        if problem is None:
            continue
        log.warning(
            _SET_ASIDE,
            pod_key=key,
            cgroup_parent=record.cgroup_parent,
            field=problem.field,
            value=str(problem.value),
            allowed=problem.allowed,
            path=source,
        )
        del books.pods[key]
        dropped.append(key)
    return dropped


def above_runtime_limit(pod: api.PodSandbox, record: PodRecord) -> bool:
    """Whether the saved `record`'s own quota is above the pod's limit as the runtime sends it
    (``pod_resources``, with its overhead); then logged as set aside (Synchronize rebuilds the pod).
    False when the runtime sends no limit."""
    if record.baseline is None:
        return False
    try:
        limit = baseline_from_pod_resources(pod, record.period)
    except PolicyError:  # (Synchronize has already left such values out)
        return False
    if limit is None or record.baseline <= limit:
        return False
    log.warning(
        _SET_ASIDE,
        pod_key=pod_key(pod),
        field="baseline",
        value=str(record.baseline),
        allowed=f"{MIN_CFS_QUOTA} to {limit} us (the pod's limit from the runtime)",
        **pod_fields(pod, event="Synchronize"),
    )
    return True
