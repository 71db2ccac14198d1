"""A pod record's baseline: the arithmetic of a pod's own quota and its record in the books, pure.

What `nri_plugin.mixedcpu.quota.PodQuotas` does with what it reads from a pod cgroup, apart from
the reading and writing: the record of a pod first seen (`new_pod_record`), its baseline in the
terms of the cgroup's current limit (`rebase`), a resize kubelet wrote (`adopt_resize`), the
baseline of a pod Synchronize finds (`rebuilt`, `known`), and what the books keep of a pod once
its shares are gone or its cgroup failed (`forget_if_done`, `restore`, `sync_failed`). No I/O:
records and `CpuQuota` values in, records out.
"""

from __future__ import annotations

from collections.abc import MutableMapping

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups.quota import MIN_CFS_QUOTA_US, CpuQuota
from nri_plugin.mixedcpu.books import PodRecord
from nri_plugin.mixedcpu.policy import baseline_from_pod_resources

__all__ = [
    "adopt_resize",
    "forget_if_done",
    "known",
    "new_pod_record",
    "rebase",
    "rebuilt",
    "restore",
    "sync_failed",
]


def new_pod_record(pod: api.PodSandbox, current: CpuQuota) -> PodRecord:
    """The record of a pod first seen with `current` in its cgroup (`_first_seen_baseline`)."""
    baseline, source = _first_seen_baseline(pod, current)
    return PodRecord(
        cgroup_parent=pod.linux.cgroup_parent,
        baseline=baseline,
        period=current.period,
        baseline_source=source,
    )


def _first_seen_baseline(pod: api.PodSandbox, current: CpuQuota) -> tuple[int | None, str]:
    """The own quota of a pod first seen with `current` in its cgroup, and where it comes from: the
    runtime's ``pod_resources`` when sent, else the quota it has now (None: unlimited)."""
    if current.quota is None:
        return None, "first-seen"
    baseline = baseline_from_pod_resources(pod, current.period)
    if baseline is not None:
        return baseline, "pod-resources"
    return current.quota, "first-seen"


def rebase(record: PodRecord, current: CpuQuota) -> PodRecord:
    """The record with its baseline in the terms of the pod cgroup's `current` limit (the record
    itself when nothing changes).

    Unlimited now: unlimited stays unlimited, whoever made it so. Limited now but no baseline yet:
    that limit is the pod's own (minus the books' shares when the cgroup could not be read at
    Synchronize). Another period: the baseline scaled to it, rounded up.
    """
    quota = current.quota
    if current.period == record.period and (quota is None) == (record.baseline is None):
        return record  # the same period, and limited as the books say (the common case)
    if quota is None:
        baseline, source = None, record.baseline_source
    elif record.baseline is None:
        baseline, source = _first_baseline(record, quota, current.period), "first-seen"
    else:
        baseline = -(-record.baseline * current.period // record.period)
        source = record.baseline_source
    if (baseline, current.period, source) == (record.baseline, record.period, record.baseline_source):
        return record
    return record.with_baseline(baseline, source, current.period)


def adopt_resize(record: PodRecord, current: CpuQuota, written: int | None) -> PodRecord:
    """The record with the pod's own quota as kubelet rewrote it at an in-place resize: `current`
    (the record rebased on it) holds neither the pod's target nor `written`, the quota last written
    (or found at its target) here; None when nothing was since the start, and then there is no
    telling whose a value is. Unlimited stays with `rebase`."""
    quota = current.quota
    if written is None or quota is None or record.baseline is None:
        return record
    if quota in (written, record.target(), record.baseline):  # ours, or the pod's own (re-applied)
        return record
    return record.with_baseline(quota, "resized")


def _first_baseline(record: PodRecord, quota: int, period: int) -> int:
    if record.baseline_source != "unknown":
        return quota  # unlimited when we first saw it, limited now: that limit is the pod's own
    # The pod cgroup could not be read at Synchronize: assume the shares of the containers in the
    # books are already in its quota.
    guess = quota - sum(c.shared_cpus for c in record.containers.values()) * period
    return guess if guess >= MIN_CFS_QUOTA_US else quota


def rebuilt(pod: api.PodSandbox, record: PodRecord, current: CpuQuota, applied: int) -> PodRecord:
    """`record` with the baseline of a pod the saved books did not know, from its cgroup now.
    `applied`: how many CPUs its shared containers already have beyond their exclusive ones."""
    baseline, source = _first_seen_baseline(pod, current)
    if baseline is not None and source == "first-seen" and applied:
        # Shared CPUs were given before we (re)started: their share is in the pod quota.
        own = baseline - applied * current.period
        if own >= MIN_CFS_QUOTA_US:
            baseline, source = own, "rebuilt"
    return record.with_baseline(baseline, source, current.period)


def known(record: PodRecord, previous: PodRecord) -> PodRecord:
    """`record` with the baseline the saved books knew."""
    return record.with_baseline(previous.baseline, previous.baseline_source, previous.period)


def forget_if_done(pods: MutableMapping[str, PodRecord], key: str, now: CpuQuota, settled: bool) -> None:
    """Drop a pod with no shared container left once its quota is back to its own, and `settled`
    (the writer has nothing pending for it: `PodQuotaWriter.settled`). Kept until then, so that the
    reconciler reads it back: a late answer of systemd's may yet put an older value there."""
    record = pods[key]
    if settled and not record.containers and (now.unlimited or now.quota == record.baseline):
        del pods[key]


def restore(pods: MutableMapping[str, PodRecord], key: str, saved: PodRecord | None) -> None:
    if saved is None:
        pods.pop(key, None)
    else:
        pods[key] = saved


def sync_failed(
    pods: MutableMapping[str, PodRecord], key: str, previous: PodRecord | None, established: bool
) -> None:
    """What the books keep of a pod whose cgroup failed us at Synchronize."""
    record = pods[key]
    if previous is not None:
        # Keep what the books knew: the pod's own quota must outlive an unreadable cgroup.
        pods[key] = known(record, previous)
    elif not record.containers:
        del pods[key]
    elif not established:
        pods[key] = record.with_baseline(None, "unknown")
