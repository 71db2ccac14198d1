"""The decision trace: at debug, one line per step of a container's decision (issue 15, item 5).

An operator who turns debug on (``log_level = "debug"``, or SIGUSR1 at run time) follows one container
by its id (``jq 'select(.container_id == "...")'``) through its events and reads why it got, kept or
gave back the shared CPUs, or why it did not:

* **CreateContainer**: the request checked and how it was proven (or what evidence was refused or
  ignored), the exclusive CPUs found and the shared ones chosen, the adjustment field by field, and
  the pod quota before and after with the books' view of the pod (baseline, shared CPUs held);
* **UpdateContainer**: passed through untouched (none of ours), or planned (requested, exclusive
  CPUs before and after, cpus and quota kept) and what the books did with it;
* **StopContainer / RemoveContainer**: the slot released (or nothing held), and the pod quota's
  target before and after.

Each line carries the container's fields (`logfields.pod_fields`: namespace, pod, container,
container_id, event) under the plugin's logger name, and ``step`` (proof, eligibility, adjustment,
pod-quota, update, books, release), which no other line has. What the info lines already say (shared CPUs
given, refusals, the pod quota following an update) is not repeated at debug.

Cheap when off: each function first asks the logger whether debug is on (one level check, which
follows SIGUSR1) and builds and formats nothing otherwise. structlog's level filter would drop the
line too, but only after the call's fields had been built and formatted.
"""

from __future__ import annotations

import logging
from typing import Final

import structlog

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import CpuQuota, format_cpuset
from nri_plugin.mixedcpu.books import ContainerRecord, PodRecord, Slot
from nri_plugin.mixedcpu.logfields import LOGGER_NAME, pod_fields, show_quota
from nri_plugin.mixedcpu.policy import CreatePlan, RequestCheck, UpdatePlan

__all__ = [
    "adjustment_chosen",
    "eligible",
    "pod_quota_raised",
    "pod_quota_settled",
    "released",
    "request_checked",
    "tracing",
    "update_books",
    "update_passed_through",
    "update_planned",
]

log = structlog.get_logger(LOGGER_NAME)

# How each trusted source proved a request (the policy's `Proof.source`).
_PROVEN_BY: Final = {
    "device-plugin": "the allocation marker (the device plugin's annotation or the DRA driver's env "
    "entry): signed with this node's key, and no other container presented the same or a newer "
    "allocation of its device id",
    "kubelet": "kubelet's PodResources record: it allocated a device of our resource (device plugin or "
    "DRA) to this pod's container",
    "pod-annotation": "the pod annotation cpu-shared.crio.io/<container>: enable "
    "(trusted_sources.pod_annotation is on)",
}


def tracing() -> bool:
    """Whether the trace is written now (debug on for the plugin's logger)."""
    return bool(log.is_enabled_for(logging.DEBUG))


def _cpus(cpus: frozenset[int]) -> str:
    return format_cpuset(cpus) or "none"


def _pod_books(record: PodRecord | None) -> dict[str, object]:
    """The books' view of a pod: its own quota, and what its shared containers add."""
    if record is None:
        return {"pod_in_books": False}
    return {
        "pod_baseline": show_quota(record.baseline),
        "pod_baseline_source": record.baseline_source,
        "pod_period": record.period,
        "pod_shared_containers": len(record.containers),
        "pod_target": show_quota(record.target()),
    }


# -- CreateContainer (and Synchronize: every container's request is checked) -------------------------


def request_checked(pod: api.PodSandbox, container: api.Container, check: RequestCheck, event: str) -> None:
    """Step 1: whether a trusted source proves the request, and how; the evidence refused or
    ignored (each also logged on its own, at warning or info)."""
    if not tracing():
        return
    proof = check.proof
    log.debug(
        "request checked",
        step="proof",
        proven=proof is not None,
        proof=str(proof) if proof is not None else "none",
        how=_PROVEN_BY[proof.source] if proof is not None else "no trusted source proves a request",
        evidence_refused=list(check.refusals),
        evidence_ignored=list(check.notes),
        **pod_fields(pod, container, event=event),
    )


def eligible(pod: api.PodSandbox, container: api.Container, plan: CreatePlan, event: str) -> None:
    """Step 2: the container may have shared CPUs: its exclusive CPUs, and the shared ones chosen."""
    if not tracing():
        return
    choice = plan.shared
    log.debug(
        "eligible: exclusive CPUs found",
        step="eligibility",
        exclusive=_cpus(plan.exclusive),
        requested_cpus=container.linux.resources.cpu.cpus,
        shared=_cpus(choice.cpus),
        numa_nodes=list(choice.nodes) if choice.nodes else "not considered",
        whole_pool_because=choice.fallback or "n/a",
        **pod_fields(pod, container, event=event),
    )


def adjustment_chosen(pod: api.PodSandbox, container: api.Container, plan: CreatePlan, event: str) -> None:
    """Step 3: what the container gets, and which fields the adjustment sets (the others are
    already right)."""
    if not tracing():
        return
    adjustment = plan.adjustment
    cpu = adjustment.linux.resources.cpu
    log.debug(
        "adjustment chosen",
        step="adjustment",
        cpus=_cpus(plan.cpus),
        quota=show_quota(plan.quota) if plan.quota is not None else "unlimited, left alone",
        period=plan.period,
        env={entry.key: entry.value for entry in adjustment.env},
        sets=[
            name
            for name, changed in (
                ("cpus", bool(cpu.cpus)),
                ("quota", cpu.HasField("quota")),
                ("env", bool(adjustment.env)),
            )
            if changed
        ],
        **pod_fields(pod, container, event=event),
    )


def pod_quota_raised(
    pod: api.PodSandbox,
    container: api.Container,
    quotas: tuple[CpuQuota, CpuQuota],
    record: PodRecord | None,
    event: str,
) -> None:
    """Step 4: the pod cgroup's quota before and after (`quotas`), written before the reply, and the
    books' view of the pod that made it."""
    if not tracing():
        return
    before, after = quotas
    log.debug(
        "pod quota raised before the reply",
        step="pod-quota",
        pod_quota_before=show_quota(before),
        pod_quota_after=show_quota(after),
        **_pod_books(record),
        **pod_fields(pod, container, event=event),
    )


# -- UpdateContainer ------------------------------------------------------------------------------------


def update_passed_through(pod: api.PodSandbox, container: api.Container) -> None:
    """Not a shared container: no update, so kubelet's request goes through untouched."""
    if not tracing():
        return
    log.debug(
        "update passed through: the container holds no shared CPUs",
        step="update",
        **pod_fields(pod, container, event="UpdateContainer"),
    )


def update_planned(
    pod: api.PodSandbox,
    container: api.Container,
    requested: api.LinuxResources,
    record: ContainerRecord,
    plan: UpdatePlan,
) -> None:
    """A shared container's update: what was asked, and what it keeps."""
    if not tracing():
        return
    cpu = plan.update.linux.resources.cpu
    log.debug(
        "update planned: the shared CPUs are kept",
        step="update",
        requested_cpus=requested.cpu.cpus or "(none)",
        exclusive_before=record.exclusive or "unknown",
        exclusive_after=_cpus(plan.exclusive),
        shared=_cpus(plan.shared.cpus),
        cpus=cpu.cpus,
        quota=str(cpu.quota.value) if cpu.HasField("quota") else "unchanged",
        **pod_fields(pod, container, event="UpdateContainer"),
    )


def update_books(pod: api.PodSandbox, container: api.Container, change: str) -> None:
    """What the books did after an update (`change`: e.g. nothing moved)."""
    if not tracing():
        return
    log.debug(
        f"books after the update: {change}",
        step="books",
        **pod_fields(pod, container, event="UpdateContainer"),
    )


# -- StopContainer / RemoveContainer ---------------------------------------------------------------------


def released(
    pod: api.PodSandbox, container: api.Container, held: tuple[Slot, ContainerRecord] | None, event: str
) -> None:
    """The container's slot given back (its share leaves the pod quota), or nothing held."""
    if not tracing():
        return
    fields = pod_fields(pod, container, event=event)
    if held is None:
        log.debug("nothing to release: the container holds no shared CPUs", step="release", **fields)
        return
    slot, record = held
    log.debug(
        "slot released",
        step="release",
        slot=slot.name,
        shared_cpus=record.shared_cpus,
        exclusive=record.exclusive or "unknown",
        device=record.device or "none",
        **fields,
    )


def pod_quota_settled(
    pod: api.PodSandbox,
    container: api.Container,
    records: tuple[PodRecord | None, PodRecord | None],
    event: str,
) -> None:
    """The pod quota's target before and after the release (`records`: the books' pod then and now;
    None: not in the books). A pod left with no shared container, back at its own quota, leaves the
    books. The write itself, and its retries, log on their own when they fail."""
    if not tracing():
        return
    before, after = records
    if after is not None:
        target_after, books = show_quota(after.target()), "kept: the pod still holds shared containers"
    elif before is not None:
        target_after, books = show_quota(before.baseline), "dropped: no shared container left, own quota back"
    else:
        target_after, books = "not in the books", "nothing to settle"
    log.debug(
        "pod quota settled",
        step="pod-quota",
        pod_target_before=show_quota(before.target()) if before is not None else "not in the books",
        pod_target_after=target_after,
        pod_books=books,
        **pod_fields(pod, container, event=event),
    )
