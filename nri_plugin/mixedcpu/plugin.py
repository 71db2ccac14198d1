"""The mixed-CPU NRI plugin's handlers: the policy (`nri_plugin.mixedcpu.policy`) applied at each event.

The stub drives one `MixedCpuPlugin`. Each handler decides with the policy, then delegates: the pod
cgroup's quota to `quota.PodQuotas`, the books and their database to `bookkeeper.Bookkeeper`,
Synchronize's rebuilding of the books to `resync`. What it does per event:

* **CreateContainer** of a container that proves a request (with an allocation marker: kubelet's
  own record is asked first, `allocations`): the pod's quota is raised before the
  reply, the books saved, and the adjustment goes back; its info line is written right after the
  reply (`logfields.LaterLines`), before anything of the next event. A request that cannot be
  honoured, or a pod cgroup or state file that fails us, is refused with a `nri_plugin.nri.errors`
  refusal (the stub answers the runtime with its status code): nothing is left half-configured.
* **StartContainer**: told to the healer (`heal.Healer.container_started`): on containerd the
  container's cgroup is made only now, so a watched creation's grace counts from here; a container
  whose share was given back gets it again, its pod raised before it runs.
* **StopContainer / RemoveContainer**: the container's slot is released, its own cgroup quota put
  back to its own value (stop means stop: its cgroup may linger until removal), and the pod quota
  written down to its new target (retried when the kernel refuses it yet).
* **UpdateContainer** of a shared container: the requested cpus plus the shared ones, the quota
  kept raised. Any other container: no update at all, so kubelet's request goes through untouched.
  With NUMA-local shared CPUs, new exclusive CPUs on other nodes bring other shared CPUs: the books
  and the pod quota follow (the pod's raised before the reply).
* **Synchronize**: the books are rebuilt from the running containers (and, on CRI-O, the creations
  still within their time, which CRI-O does not list: `heal.Healer.carry_creations`), containers that
  prove a request but lack the current shared CPUs get ``ContainerUpdate``s, and pod quotas are
  brought to their targets.
* **UpdatePodSandbox** (kubelet resized the pod in place; NRI v0.10+): the pod's own quota from
  its new resources, and its quota raised to that plus the shares again (`quota.PodQuotas.resize`).
  Runtimes that do not send it: the pod quota kubelet rewrote is noticed at the pod's next
  container event, or by the reconciler.
* **StopPodSandbox / RemovePodSandbox**: the pod's device bindings end; at removal its books too. A
  container refused only because one of those devices was bound to this pod (a DRA claim reserved
  for both pods) gets the shared CPUs now: its pod quota raised in the handler, its cpuset and quota
  by an UpdateContainers sent right after the reply (`send_updates`; its environment cannot change
  after creation).
* **Shutdown**: the books are written.

Each handler holds `PodQuotas.lock` throughout, as the retries do and the reconciler's passes do
pod by pod, so that nothing else changes the books meanwhile; no handler waits for systemd (the
pod quota writer, `nri_plugin.systemd`, tells systemd in the background).

Beside the events, `heal.Healer` checks the books against the node (pods whose cgroup is gone,
containers the runtime shows never created, pod quotas off their target): at each pod's events, at
Synchronize, and every `reconcile_interval` seconds once synchronized.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import structlog

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import CgroupLayout, CpuQuota
from nri_plugin.common.clock import LOOP_CLOCK, Clock
from nri_plugin.mixedcpu import trace
from nri_plugin.mixedcpu.allocations import AllocationRecord, ContainerDevices, PodRef, devices_of
from nri_plugin.mixedcpu.bookkeeper import Bookkeeper
from nri_plugin.mixedcpu.books import Books, ContainerRecord, Slot
from nri_plugin.mixedcpu.heal import Healer, HealObserver
from nri_plugin.mixedcpu.logfields import LOGGER_NAME, LaterLines, pod_fields, show_quota
from nri_plugin.mixedcpu.policy import (
    CreatePlan,
    MarkerKey,
    PolicyError,
    Proof,
    RequestCheck,
    SharedChoice,
    SharedPool,
    UpdatePlan,
    check_pod_resources,
    check_request,
    container_slot,
    cpus_or_empty,
    format_cpuset,
    plan_create,
    plan_sync,
    plan_update,
    pod_key,
    presents_marker,
)
from nri_plugin.mixedcpu.quota import CgroupObserver, PodQuotas
from nri_plugin.mixedcpu.resync import needed_at_sync, rebuild_books, updates_to_send
from nri_plugin.mixedcpu.status import Holder, Roster
from nri_plugin.mixedcpu.store import StateStore
from nri_plugin.nri import handlers
from nri_plugin.nri.errors import InvalidRequest, PluginFailure, PluginRefusal, PreconditionFailed

__all__ = [
    "AllocationRecord",
    "CgroupObserver",
    "CreationObserver",
    "MixedCpuPlugin",
    "PluginObserver",
    "TrustedSources",
]

log = structlog.get_logger(LOGGER_NAME)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _holding_the_books(
    handler: Callable[Concatenate[MixedCpuPlugin, _P], Coroutine[Any, Any, _R]],
) -> Callable[Concatenate[MixedCpuPlugin, _P], Coroutine[Any, Any, _R]]:
    """Run the handler holding `PodQuotas.lock` (free, with no suspension, when nobody holds it),
    after the log lines of the previous events (`LaterLines`)."""

    @functools.wraps(handler)
    async def locked(self: MixedCpuPlugin, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        self.later.flush()
        async with self.quotas.lock:
            return await handler(self, *args, **kwargs)

    return locked


class PluginObserver(CgroupObserver, HealObserver, Protocol):
    """Told of failed cgroup writes and of heals (`nri_plugin.daemon.metrics.Metrics` is one)."""


class CreationObserver(Protocol):
    """Told how each creation that proved a request ended (`nri_plugin.daemon.metrics.Metrics`)."""

    def creation_decided(self, outcome: str) -> None:
        """`outcome`: ``granted``, or why it was refused: ``pod_spec`` or ``node`` (the policy's
        `PolicyError.kind`), ``cgroup`` (the pod cgroup could not be opened, read or raised),
        ``state_file``."""


def _refusal(exc: PolicyError) -> PluginRefusal:
    """A pod spec to fix is an invalid request; a node to fix, a failed precondition."""
    return InvalidRequest(str(exc)) if exc.kind == "pod-spec" else PreconditionFailed(str(exc))


@dataclass(frozen=True)
class TrustedSources:
    """What may prove that a container asked for shared CPUs (the config's ``[trusted_sources]``).

    `marker_key` checks the device plugin's allocation markers (None: markers prove nothing);
    `pod_annotation` trusts ``cpu-shared.crio.io/<container>: enable`` on the pod; `allocations` is
    kubelet's record of device allocations, asked for every container that presents a marker (None:
    the marker binding alone proves, as when kubelet cannot be asked).
    """

    marker_key: MarkerKey | None = None
    pod_annotation: bool = False
    allocations: AllocationRecord | None = None


class MixedCpuPlugin(
    handlers.Configure,
    handlers.Synchronize,
    handlers.Shutdown,
    handlers.CreateContainer,
    handlers.StartContainer,
    handlers.UpdateContainer,
    handlers.StopContainer,
    handlers.RemoveContainer,
    handlers.UpdatePodSandbox,
    handlers.StopPodSandbox,
    handlers.RemovePodSandbox,
):
    """The NRI handlers; see the module docstring.

    `shared`: the node's shared CPUs, or a `SharedPool` that also gives their NUMA nodes when each
    container is to get only those local to its exclusive CPUs. `trusted`: what may prove a request
    (`TrustedSources`); `clock` runs the retry, deferred-save and reconcile
    timers; `reconcile_interval` (seconds) paces the reconciler's whole passes once the runtime has
    synchronized us (None: at events only). Replace the books `store` holds through the `books`
    property (tests).
    """

    def __init__(
        self,
        *,
        shared: frozenset[int] | SharedPool,
        layout: CgroupLayout,
        store: StateStore,
        trusted: TrustedSources,
        observer: PluginObserver | None = None,
        clock: Clock = LOOP_CLOCK,
        reconcile_interval: float | None = None,
    ) -> None:
        self.pool = shared if isinstance(shared, SharedPool) else SharedPool(frozenset(shared))
        self.shared = self.pool.cpus
        self.marker_key = trusted.marker_key
        self.trust_pod_annotation = trusted.pod_annotation
        self.allocations = trusted.allocations
        self.runtime = ""
        self.keeper = Bookkeeper(store)
        self.quotas = PodQuotas(layout, self.keeper, observer=observer, clock=clock)
        self.healer = Healer(self.quotas, interval=reconcile_interval, observer=observer, clock=clock)
        self.later = LaterLines()  # the info line of each creation, written after its reply
        # Device id -> container id -> (pod, container): containers refused only because a pod the
        # same claim is reserved for holds the device (`RequestCheck.waits_for`), given the shared
        # CPUs when that binding ends (`_grant_waiting`).
        self.waiting: dict[str, dict[str, tuple[api.PodSandbox, api.Container]]] = {}
        # Sends updates to the runtime outside any handler (the stub's `update_containers`, set by
        # whoever runs the stub); None: such a grant waits for the next Synchronize's updates.
        self.send_updates: Callable[[list[api.ContainerUpdate]], asyncio.Future[Any]] | None = None
        self.creations: CreationObserver | None = None  # settable, as `observer` is
        self.roster = Roster()  # who the shared containers are, for the status
        self.healer.roster = self.roster  # a heal names its pod by namespace and name
        # CRI-O creations in progress are kept with the books: a restart during one still knows it.
        self.healer.restore_watches(self.keeper.watches)
        self.keeper.watch_source = self.healer.saved_watches

    @property
    def books(self) -> Books:
        return self.keeper.books

    @books.setter
    def books(self, books: Books) -> None:
        self.keeper.books = books

    @property
    def store(self) -> StateStore:
        return self.keeper.store

    @property
    def layout(self) -> CgroupLayout:
        return self.quotas.layout

    @layout.setter
    def layout(self, layout: CgroupLayout) -> None:
        self.quotas.layout = layout

    @property
    def observer(self) -> CgroupObserver | None:
        return self.quotas.observer

    @observer.setter
    def observer(self, observer: PluginObserver | None) -> None:
        self.quotas.observer = observer
        self.healer.observer = observer

    @property
    def shared_containers(self) -> int:
        """How many containers hold the shared CPUs now (from the books)."""
        return self.books.shared_containers

    def flush(self) -> None:
        """Write the books now if a change waits, and fold the database's WAL in. Raises OSError."""
        self.keeper.flush()

    # -- NRI handlers ------------------------------------------------------------------------------

    async def configure(self, request: api.ConfigureRequest) -> None:
        self.runtime = request.runtime_name
        # CRI-O makes a container's cgroup in its runc create, after NRI CreateContainer; containerd
        # only at StartContainer: what the healer watches a creation by.
        self.healer.cgroup_at_creation = request.runtime_name == "cri-o"
        if request.runtime_name == "cri-o" and self.trust_pod_annotation:
            # CRI-O (1.30 and later) runs its own shared-CPU hook, after NRI, for a pod that names a
            # runtime handler and carries cpu-shared.crio.io: it would add the CPUs a second time, or
            # fail the container when its own shared_cpuset is empty. docs/deploy.md, OpenShift.
            log.warning(
                "on CRI-O, a pod with a runtimeClassName and a cpu-shared.crio.io annotation also gets "
                "CRI-O's own shared-CPU hook; let the annotation through with a CRI-O workload "
                "(packaging/runtime/openshift), not a runtime handler's allowed_annotations, and give such "
                "pods no runtimeClassName"
            )

    @_holding_the_books
    async def create_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> api.CreateContainerResponse | None:
        tracing = trace.tracing()  # debug on: the decision trace, asked once per event
        kubelet = await self._kubelet_devices(pod, container)  # first: no await once the books change
        slot = container_slot(pod, container)
        await self.healer.at_pod_event(slot.pod)
        books = self.books
        saved = books.pods.get(slot.pod)
        if saved is not None and saved.baseline_source == "unknown":
            await self.quotas.resolve_unknown(slot.pod, pod.linux.cgroup_parent)
            saved = books.pods.get(slot.pod)
        displaced = books.displace(slot, container.id)
        if displaced is not None:
            self.healer.note_displaced(slot, displaced)
            log.info(
                "container restarted: the new instance takes its slot",
                previous_id=displaced.id,
                **pod_fields(pod, container, event="CreateContainer"),
            )
        check = self._check(pod, container, event="CreateContainer", kubelet=kubelet, tracing=tracing)
        if check.waits_for is not None:
            self._wait(check.waits_for, pod, container)
        if check.proof is None:
            if tracing:
                log.debug("no request for shared CPUs", **pod_fields(pod, container, event="CreateContainer"))
            await self._settle_displaced(displaced, pod)
            return None
        try:
            plan = plan_create(self.shared, pod, container, numa_nodes=self.pool.numa_nodes)
            check_pod_resources(pod)
        except PolicyError as exc:
            log.warning(
                "refused shared CPUs", reason=str(exc), **pod_fields(pod, container, event="CreateContainer")
            )
            await self._settle_displaced(displaced, pod)
            self._creation_decided(exc.kind.replace("-", "_"))
            raise _refusal(exc) from None
        _log_fallback(plan.shared, pod, container, "CreateContainer")
        if tracing:
            trace.eligible(pod, container, plan, "CreateContainer")
            trace.adjustment_chosen(pod, container, plan, "CreateContainer")
        record = ContainerRecord(
            id=container.id,
            shared_cpus=len(plan.shared.cpus),
            exclusive=format_cpuset(plan.exclusive),
            device=check.proof.device,
        )
        self.healer.watch_creation(slot, container)  # (saved with the books, by the raise's commit)
        try:
            quotas = await self.quotas.raise_for(
                pod, container, slot, record, saved, allocation=check.proof.allocation
            )
        except PluginRefusal as exc:
            self.healer.forget_creation(slot, container.id)
            self.keeper.save_quietly()
            self._creation_decided("state_file" if isinstance(exc, PluginFailure) else "cgroup")
            raise
        self._creation_decided("granted")
        if tracing:
            trace.pod_quota_raised(pod, container, quotas, books.pods.get(slot.pod), "CreateContainer")
        holder = Holder(pod.namespace, pod.name, check.proof.source, time.time())
        self.roster.given(container.id, holder, books)
        self.later.add(functools.partial(_log_given, pod, container, check.proof, plan, quotas))
        return api.CreateContainerResponse(adjust=plan.adjustment)

    @_holding_the_books
    async def start_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        await self.healer.container_started(container_slot(pod, container), pod, container)

    @_holding_the_books
    async def update_container(
        self, pod: api.PodSandbox, container: api.Container, resources: api.LinuxResources
    ) -> Sequence[api.ContainerUpdate]:
        found = self.books.find(container.id)
        if found is None:
            trace.update_passed_through(pod, container)
            return ()
        slot, record = found
        try:
            plan = plan_update(
                self.shared,
                pod,
                container,
                resources,
                cpus_or_empty(record.exclusive),
                numa_nodes=self.pool.numa_nodes,
            )
        except PolicyError as exc:
            log.warning(
                "cannot keep shared CPUs on update",
                reason=str(exc),
                **pod_fields(pod, container, event="UpdateContainer"),
            )
            # Whatever its kind: the update request itself carries what cannot be honoured.
            raise InvalidRequest(str(exc)) from None
        _log_fallback(plan.shared, pod, container, "UpdateContainer")
        trace.update_planned(pod, container, resources, record, plan)
        await self._follow_update(pod, container, slot, record, plan)
        # An in-place resize rewrote the pod's own quota first when it grows: the pod quota follows
        # before the container's own is raised (cgroup v1 refuses a child above its parent).
        await self.quotas.resize(pod)
        update = plan.update
        cpu = update.linux.resources.cpu
        log.info(
            "kept shared CPUs on update",
            requested=resources.cpu.cpus or "(none)",
            cpus=cpu.cpus,
            quota=cpu.quota.value if cpu.HasField("quota") else "unchanged",
            **pod_fields(pod, container, event="UpdateContainer"),
        )
        return (update,)

    @_holding_the_books
    async def stop_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> Sequence[api.ContainerUpdate]:
        await self._release(pod, container, "stopped")
        return ()

    @_holding_the_books
    async def remove_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        await self._release(pod, container, "removed")

    async def shutdown(self) -> None:
        self.later.flush()
        self.flush()

    def after_reply(self) -> None:
        """The stub's `AfterReply`: called right after each reply is written, it writes the lines
        queued for then (`LaterLines`), which from then on need no turn of the loop of their own,
        and checkpoints the books' database when one is due (`StateStore.checkpoint_if_due`)."""
        self.later.followed = True
        self.later.flush()
        self.keeper.store.checkpoint_if_due()

    @_holding_the_books
    async def update_pod_sandbox(
        self, pod: api.PodSandbox, overhead: api.LinuxResources, resources: api.LinuxResources
    ) -> None:
        moved = await self.quotas.resize(pod, resources, overhead)
        if moved is not None and moved[0] != moved[1]:
            log.info(
                "pod resized: its quota follows its new resources plus the shares",
                pod_quota=f"{show_quota(moved[0])} -> {show_quota(moved[1])}",
                **pod_fields(pod, event="UpdatePodSandbox"),
            )

    @_holding_the_books
    async def stop_pod_sandbox(self, pod: api.PodSandbox) -> None:
        # kubelet's device allocations to the pod end with it: the device ids are free for others.
        unbound = self.books.unbind_pod(pod_key(pod))
        self._forget_waiting(pod_key(pod))
        if unbound:
            self.keeper.save_quietly()
            await self._grant_waiting(unbound, "StopPodSandbox")

    @_holding_the_books
    async def remove_pod_sandbox(self, pod: api.PodSandbox) -> None:
        key = pod_key(pod)
        self.quotas.cancel_retry(key)
        self.healer.forget_pod(key)
        self._forget_waiting(key)
        unbound = self.books.unbind_pod(key)
        if self.books.pods.pop(key, None) is not None:
            log.info(
                "pod removed: its quota bookkeeping is dropped", **pod_fields(pod, event="RemovePodSandbox")
            )
            self.keeper.save_quietly()
        elif unbound:
            self.keeper.save_quietly()
        await self._grant_waiting(unbound, "RemovePodSandbox")

    def sync_filter(self) -> Callable[[api.PodSandbox | None, api.Container], bool]:
        """Which containers of a Synchronize chunk `synchronize` is to see (the stub's
        `SyncSelector`): those `resync.needed_at_sync` names, every one while tracing."""
        return functools.partial(needed_at_sync, previous=self.books, check_all=trace.tracing())

    @_holding_the_books
    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        node = await self._node_allocations(containers)
        previous = self.books
        self.waiting = {}  # the containers still waiting are found again below
        pods = [_without_hostile_pod_resources(pod) for pod in pods]
        tracing = trace.tracing()  # asked once, not for each of thousands of containers
        found: dict[str, Holder] = {}  # who the proven containers are, for the roster

        def check_at_sync(pod: api.PodSandbox, container: api.Container, books: Books) -> RequestCheck:
            kubelet = None if node is None else devices_of(node, pod.namespace, pod.name, container.name)
            check = self._check(pod, container, books, event="Synchronize", kubelet=kubelet, tracing=tracing)
            if check.waits_for is not None:
                self._wait(check.waits_for, pod, container)
            if check.proof is not None:
                created = container.created_at / 1e9 if container.created_at > 0 else None
                found[container.id] = Holder(pod.namespace, pod.name, check.proof.source, created)
            return check

        rebuilt = rebuild_books(
            self.shared,
            previous,
            pods,
            containers,
            check_at_sync,
            numa_nodes=self.pool.numa_nodes,
            check_all=tracing,
        )
        present = {pod_key(pod): pod for pod in pods}
        self.healer.carry_creations(previous, rebuilt.books, present, (c.id for c in containers))
        self.healer.before_sync(previous, containers)
        failed = await self.quotas.sync_pods(present, rebuilt.books, previous, rebuilt.applied)
        updates = updates_to_send(rebuilt, failed)
        self.books = rebuilt.books
        self.roster.rebuild(rebuilt.books, found)
        self.healer.after_sync(previous, pods, containers)
        self.keeper.save_quietly()
        return updates

    # -- containers waiting for a device's binding to end -----------------------------------------

    def _wait(self, device: str, pod: api.PodSandbox, container: api.Container) -> None:
        """Keep a copy of a container that gets the shared CPUs once `device`'s binding ends."""
        copies = (
            api.PodSandbox.FromString(pod.SerializeToString()),
            api.Container.FromString(container.SerializeToString()),
        )
        self.waiting.setdefault(device, {})[container.id] = copies

    def _forget_waiting(self, key: str, container_id: str | None = None) -> None:
        """The pod `key` (or its container `container_id`) is gone: it waits for nothing any more."""
        for device, waiting in list(self.waiting.items()):
            for cid, (pod, _) in list(waiting.items()):
                if pod_key(pod) == key and container_id in (None, cid):
                    del waiting[cid]
            if not waiting:
                del self.waiting[device]

    async def _grant_waiting(self, devices: Sequence[str], event: str) -> None:
        """The bindings of `devices` ended: the containers waiting for one of them get the shared
        CPUs: their pod quota raised now, their cpuset and quota by an UpdateContainers sent once the
        runtime's current request is answered (their environment cannot change after creation)."""
        updates: list[api.ContainerUpdate] = []
        for device in devices:
            for pod, container in list(self.waiting.pop(device, {}).values()):
                update = await self._grant_late(pod, container, event)
                if update is not None:
                    updates.append(update)
        if not updates:
            return
        if self.send_updates is None:
            log.warning(
                "shared CPUs given in the books only: no runtime connection to update the container "
                "through; the next Synchronize brings its cpuset and quota",
                event_name=event,
            )
            return
        self.send_updates(updates).add_done_callback(_say_if_not_applied)

    async def _grant_late(
        self, pod: api.PodSandbox, container: api.Container, event: str
    ) -> api.ContainerUpdate | None:
        """A waiting container checked again; its update if it now gets the shared CPUs."""
        check = self._check(pod, container, event=event)
        if check.proof is None:
            if check.waits_for is not None:
                self._wait(check.waits_for, pod, container)
            return None
        try:
            check_pod_resources(pod)
            plan = plan_sync(self.shared, pod, container, numa_nodes=self.pool.numa_nodes)
        except PolicyError as exc:
            log.warning("refused shared CPUs", reason=str(exc), **pod_fields(pod, container, event=event))
            return None
        slot = container_slot(pod, container)
        record = ContainerRecord(container.id, len(plan.shared.cpus), plan.exclusive_text, check.proof.device)
        saved = self.books.pods.get(slot.pod)
        try:
            before, after = await self.quotas.raise_for(
                pod, container, slot, record, saved, event=event, allocation=check.proof.allocation
            )
        except PluginRefusal:
            return None  # (said by the pod quota's writer; the container stays as it is)
        self.roster.given(
            container.id, Holder(pod.namespace, pod.name, check.proof.source, time.time()), self.books
        )
        log.info(
            "shared CPUs given once the device's binding ended; the container's environment does not "
            "show them (it cannot change after creation)",
            proof=str(check.proof),
            cpus=format_cpuset(plan.cpus),
            pod_quota=f"{show_quota(before)} -> {show_quota(after)}",
            **pod_fields(pod, container, event=event),
        )
        return plan.update

    # -- steps -------------------------------------------------------------------------------------

    def _creation_decided(self, outcome: str) -> None:
        if self.creations is not None:
            self.creations.creation_decided(outcome)

    def _check(
        self,
        pod: api.PodSandbox,
        container: api.Container,
        books: Books | None = None,
        *,
        event: str,
        kubelet: frozenset[str] | None = None,
        tracing: bool | None = None,
    ) -> RequestCheck:
        """The policy's verdict on the container's request (`kubelet`: the device ids kubelet's record
        gives it, None when it did not answer) against `books` (None: the plugin's), its refusals and
        notes logged; traced when `tracing` (None: `trace.tracing`)."""
        books = self.books if books is None else books
        # The bindings matter only where a marker can prove something (untrusted: no env scan).
        marker = self.marker_key is not None and presents_marker(container)
        check = check_request(
            pod,
            container,
            marker_key=self.marker_key,
            trust_pod_annotation=self.trust_pod_annotation,
            device_holders=books.device_holders() if marker else {},
            kubelet_devices=kubelet,
            spent=books.spent if marker else None,
        )
        for refusal in check.refusals:
            log.warning("request refused", reason=refusal, **pod_fields(pod, container, event=event))
        for note in check.notes:
            log.info("request evidence ignored", reason=note, **pod_fields(pod, container, event=event))
        if tracing or (tracing is None and trace.tracing()):
            trace.request_checked(pod, container, check, event)
        return check

    async def _kubelet_devices(self, pod: api.PodSandbox, container: api.Container) -> frozenset[str] | None:
        """What kubelet's record says it allocated to a container that presents a marker; None when
        there is nothing to ask (no marker, markers not trusted, no record) or kubelet cannot answer."""
        if self.allocations is None or self.marker_key is None or not presents_marker(container):
            return None
        found = await self.allocations.pod_allocations(pod.namespace, pod.name)
        return None if found is None else found.get(container.name, frozenset())

    async def _node_allocations(
        self, containers: Sequence[api.Container]
    ) -> Mapping[PodRef, ContainerDevices] | None:
        """kubelet's record for the whole node, when some container presents a marker to check."""
        if self.allocations is None or self.marker_key is None:
            return None
        if not any(presents_marker(container) for container in containers):
            return None
        return await self.allocations.node_allocations()

    async def _follow_update(
        self,
        pod: api.PodSandbox,
        container: api.Container,
        slot: Slot,
        record: ContainerRecord,
        plan: UpdatePlan,
    ) -> None:
        """The books follow an update that moves the container's exclusive CPUs; when its share
        changes with them (NUMA-local shared CPUs on other nodes), so does the pod quota, raised
        before the reply. Raises a `PluginRefusal` (nothing changed) when the pod cgroup fails us."""
        now = replace(record, shared_cpus=len(plan.shared.cpus), exclusive=format_cpuset(plan.exclusive))
        if now == record:
            trace.update_books(pod, container, "unchanged (same exclusive CPUs, same share)")
            return
        if now.shared_cpus == record.shared_cpus:
            self.books.hold(slot, now)
            self.keeper.save_quietly()
            trace.update_books(pod, container, "its exclusive CPUs moved; same share, the pod quota stays")
            return
        before, after = await self.quotas.raise_for(
            pod, container, slot, now, self.books.pods.get(slot.pod), event="UpdateContainer"
        )
        log.info(
            "the pod quota follows the container's shared CPUs",
            shared_cpus=format_cpuset(plan.shared.cpus),
            pod_quota=f"{show_quota(before)} -> {show_quota(after)}",
            **pod_fields(pod, container, event="UpdateContainer"),
        )

    async def _settle_displaced(self, displaced: ContainerRecord | None, pod: api.PodSandbox) -> None:
        """A refused or unproven new instance of a container: the old one's share is gone."""
        if displaced is not None:
            key = pod_key(pod)
            await self.quotas.settle(key, pod.linux.cgroup_parent, pod_fields(pod, event="CreateContainer"))

    async def _release(self, pod: api.PodSandbox, container: api.Container, why: str) -> None:
        event = "StopContainer" if why == "stopped" else "RemoveContainer"
        key = pod_key(pod)
        if self.waiting:
            self._forget_waiting(key, container.id)
        await self.quotas.resolve_unknown(key, pod.linux.cgroup_parent)
        pod_before = self.books.pods.get(key)  # immutable: the books' pod as it was, for the trace
        held = self.books.release_holder(container.id)
        trace.released(pod, container, held, event)
        if held is not None:
            self.roster.released(container.id)
            log.info(
                f"shared container {why}: its pod quota share is released",
                **pod_fields(pod, container, event=event),
            )
        # The container's own quota first: cgroup v1 refuses a pod quota below a child's.
        fields = pod_fields(pod, container, event=event)
        self.healer.container_ended(
            container_slot(pod, container), container, held[1] if held else None, fields
        )
        await self.healer.at_pod_event(key)
        if key in self.books.pods:
            await self.quotas.settle(key, pod.linux.cgroup_parent, pod_fields(pod, event=event))
        trace.pod_quota_settled(pod, container, (pod_before, self.books.pods.get(key)), event)


def _say_if_not_applied(task: asyncio.Future[Any]) -> None:
    """Log an UpdateContainers of containers given their shares late that the runtime did not apply
    (the next Synchronize sends it again)."""
    if task.cancelled():
        return
    error = task.exception()
    failed = [] if error is not None else task.result()
    if error is not None or failed:
        log.warning(
            "the runtime did not apply the update of containers given their shares late; the next "
            "Synchronize sends it again",
            error=str(error) if error is not None else None,
            containers=[update.container_id for update in failed],
        )


def _without_hostile_pod_resources(pod: api.PodSandbox) -> api.PodSandbox:
    """`pod`, or at Synchronize a copy without its ``pod_resources`` and ``pod_overhead`` when they are
    outside the kernel's ranges (logged): its baseline then comes from its cgroup, as for a runtime
    that sends none."""
    try:
        check_pod_resources(pod)
    except PolicyError as exc:
        log.error("pod_resources ignored", reason=str(exc), **pod_fields(pod, event="Synchronize"))
        pod = api.PodSandbox.FromString(pod.SerializeToString())
        pod.linux.ClearField("pod_resources")
        pod.linux.ClearField("pod_overhead")
    return pod


def _log_given(
    pod: api.PodSandbox,
    container: api.Container,
    proof: Proof,
    plan: CreatePlan,
    quotas: tuple[CpuQuota, CpuQuota],
) -> None:
    """The info line of a container given shared CPUs (written after the reply: `LaterLines`)."""
    before, after = quotas
    log.info(
        "shared CPUs given",
        proof=str(proof),
        cpus=format_cpuset(plan.cpus),
        quota=show_quota(plan.quota),
        pod_quota=f"{show_quota(before)} -> {show_quota(after)}",
        **pod_fields(pod, container, event="CreateContainer"),
    )


def _log_fallback(choice: SharedChoice, pod: api.PodSandbox, container: api.Container, event: str) -> None:
    """Say why a container gets the whole shared pool although NUMA-local shared CPUs are on."""
    if choice.fallback is not None:
        log.warning(
            "no NUMA-local shared CPU: the container gets the whole shared pool",
            reason=choice.fallback,
            **pod_fields(pod, container, event=event),
        )
