"""Synchronize's first half: the books rebuilt from what the runtime runs.

Which container holds which slot is taken from the running containers, not from the saved books: the
saved books only supply each container's exclusive CPUs (here) and each pod's baseline (in
`nri_plugin.mixedcpu.quota`). Containers that prove a request but lack the current shared CPUs get a
``ContainerUpdate``, sent only if their pod's quota could be raised (`updates_to_send`); containers
whose environment shows old values are logged (env cannot change after start). With NUMA-local shared
CPUs, "the current shared CPUs" of a container are those local to its exclusive ones, and its slot
counts their number: a change of the key or of the pool between restarts brings each container, and
its pod's quota, to its own.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import format_cpuset
from nri_plugin.mixedcpu.books import Books, ContainerRecord, PodRecord
from nri_plugin.mixedcpu.logfields import LOGGER_NAME, pod_fields
from nri_plugin.mixedcpu.policy import (
    NumaNodes,
    PolicyError,
    RequestCheck,
    SharedPool,
    SyncPlan,
    container_slot,
    cpus_or_empty,
    plan_sync,
    pod_key,
    shows_evidence,
)

__all__ = ["CheckRequest", "PendingUpdate", "Rebuilt", "needed_at_sync", "rebuild_books", "updates_to_send"]

log = structlog.get_logger(LOGGER_NAME)

# Every container but a stopped one keeps (or gets) its share: one in an unknown state may well be
# running, and a pod quota left too high throttles nobody.
_GONE = api.CONTAINER_STOPPED

# The plugin's request check (logged), given the books (their device bindings and the allocations
# presented) as rebuilt so far.
CheckRequest = Callable[[api.PodSandbox, api.Container, Books], RequestCheck]


@dataclass(frozen=True, slots=True)
class PendingUpdate:
    """An update for an existing container, to send once its pod's quota is raised."""

    pod_key: str
    given: int  # how many of its CPUs are already beyond its exclusive ones
    update: api.ContainerUpdate
    pod: api.PodSandbox
    container: api.Container


@dataclass(slots=True)
class Rebuilt:
    """The books as the running containers show them, and what they still need."""

    books: Books
    # Pod key -> how many CPUs its shared containers already have beyond their exclusive ones.
    applied: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    pending: list[PendingUpdate] = field(default_factory=list)


def needed_at_sync(
    pod: api.PodSandbox | None, container: api.Container, previous: Books, *, check_all: bool = False
) -> bool:
    """Whether Synchronize must see this container: one that may prove a request
    (`policy.shows_evidence`), one the `previous` books hold (the healer looks up its state), a
    stopped one (its own quota may have to be given back), and any whose pod is not known yet. The
    others change nothing `rebuild_books` or the healer does with them; `check_all`: every one."""
    if check_all or pod is None or container.state == _GONE:
        return True
    return shows_evidence(pod, container) or previous.holds(container.id)


def rebuild_books(
    shared: frozenset[int],
    previous: Books,
    pods: Sequence[api.PodSandbox],
    containers: Sequence[api.Container],
    check: CheckRequest,
    *,
    numa_nodes: NumaNodes | None = None,
    check_all: bool = False,
) -> Rebuilt:
    """New books holding a slot for every live container that proves a request and can have the
    `shared` CPUs (with `numa_nodes`, those local to its exclusive ones); pods get placeholder records
    (`quota.PodQuotas.sync_pods` fills them in).

    Only the containers that show some evidence (`policy.shows_evidence`) are checked: for the others
    `check` could prove and note nothing. `check_all` checks every live container all the same (the
    decision trace writes a line for each)."""
    by_sandbox = {pod.id: pod for pod in pods}
    present = {pod_key(pod): pod for pod in pods}
    known = {record.id: record for record in previous.records()}
    # Device ids stay bound to their slots while the slot's pod exists, even with its container
    # stopped; the allocations presented are kept whatever became of their pods: a copy of a marker
    # in another pod must not take the device, meanwhile or later.
    bound = {device: slot for device, slot in previous.device_holders().items() if slot.pod in present}
    where = {slot.pod: present[slot.pod].linux.cgroup_parent for slot in bound.values()}
    rebuilt = Rebuilt(Books({}, bound, where, previous.spent))
    pool = SharedPool(shared, numa_nodes)
    for container in _live(containers, by_sandbox, known, check_all):
        pod = by_sandbox[container.pod_sandbox_id]
        _adopt(rebuilt, pool, pod, container, known.get(container.id), check)
    return rebuilt


def _live(
    containers: Iterable[api.Container],
    by_sandbox: Mapping[str, api.PodSandbox],
    known: Mapping[str, object],
    check_all: bool,
) -> list[api.Container]:
    """The containers to look at, those the books already knew first: a replayed marker must not
    evict its real holder."""
    live = []
    for container in containers:
        pod = by_sandbox.get(container.pod_sandbox_id)
        if pod is not None and container.state != _GONE and (check_all or shows_evidence(pod, container)):
            live.append(container)
    live.sort(key=lambda c: (c.id not in known, c.created_at, c.id))
    return live


def _adopt(
    rebuilt: Rebuilt,
    pool: SharedPool,
    pod: api.PodSandbox,
    container: api.Container,
    before: ContainerRecord | None,
    check: CheckRequest,
) -> None:
    """Give one running container its slot in the rebuilt books, if it proves a request."""
    books = rebuilt.books
    proof = check(pod, container, books).proof
    if proof is None:
        return
    recorded = cpus_or_empty(before.exclusive) if before is not None else frozenset()
    try:
        plan = plan_sync(pool.cpus, pod, container, recorded, numa_nodes=pool.numa_nodes)
    except PolicyError as exc:
        log.warning(
            "existing container cannot have shared CPUs",
            reason=str(exc),
            **pod_fields(pod, container, event="Synchronize"),
        )
        return
    slot = container_slot(pod, container)
    given = plan.shared
    books.hold(
        slot,
        ContainerRecord(container.id, len(given.cpus), plan.exclusive_text, proof.device),
        allocation=proof.allocation if proof.device is not None else None,
        new_pod=(
            None
            if slot.pod in books.pods
            else PodRecord(cgroup_parent=pod.linux.cgroup_parent, baseline=None, period=1)
        ),
    )
    rebuilt.applied[slot.pod] += plan.applied_shared
    _note_plan(rebuilt, plan, pod, container)


def _note_plan(rebuilt: Rebuilt, plan: SyncPlan, pod: api.PodSandbox, container: api.Container) -> None:
    """Keep the container's update for later, and log what it will (and will not) see."""
    if plan.update is not None:
        rebuilt.pending.append(PendingUpdate(pod_key(pod), plan.applied_shared, plan.update, pod, container))
        log.info(
            "bringing an existing container to the shared CPUs",
            cpus=plan.update.linux.resources.cpu.cpus or "unchanged",
            **pod_fields(pod, container, event="Synchronize"),
        )
    if plan.shared.fallback is not None:
        log.warning(
            "no NUMA-local shared CPU: the container gets the whole shared pool",
            reason=plan.shared.fallback,
            **pod_fields(pod, container, event="Synchronize"),
        )
    if plan.env_stale:
        log.warning(
            "container must restart to see the current CPU sets in its environment",
            OPENSHIFT_SHARED_CPUS=format_cpuset(plan.shared.cpus),
            OPENSHIFT_ISOLATED_CPUS=plan.exclusive_text,
            **pod_fields(pod, container, event="Synchronize"),
        )


def updates_to_send(rebuilt: Rebuilt, failed: set[str]) -> list[api.ContainerUpdate]:
    """The pending updates whose pod quota was raised. The others are dropped: no cpuset or quota
    change without its pod's quota (v1 refuses the container's quota above the pod's, v2 would
    throttle the pod); nor a share in the books that the container does not have."""
    updates: list[api.ContainerUpdate] = []
    for pending in rebuilt.pending:
        if pending.pod_key not in failed:
            updates.append(pending.update)
            continue
        if not pending.given:
            rebuilt.books.release(pending.container.id)
        log.warning(
            "container left as it is until the next synchronization: its pod quota cannot be raised",
            **pod_fields(pending.pod, pending.container, event="Synchronize"),
        )
    return updates
