"""The mixed-CPU NRI plugin's handlers: the policy (`nri_plugin.mixedcpu.policy`) applied at each event.

The stub drives one `MixedCpuPlugin`. Each handler decides with the policy, then delegates: the pod
cgroup's quota to `quota.PodQuotas`, the books and their state file to `store.Bookkeeper`,
Synchronize's rebuilding of the books to `resync`. What it does per event:

* **CreateContainer** of a container that proves a request: the pod's quota is raised before the
  reply, the books saved, and the adjustment goes back. A request that cannot be honoured, or a pod
  cgroup or state file that fails us, is refused with a `nri_plugin.nri.errors` refusal (the stub
  answers the runtime with its status code): nothing is left half-configured.
* **StopContainer / RemoveContainer**: the container's slot is released, its own cgroup quota put
  back to its own value (stop means stop: its cgroup may linger until removal), and the pod quota
  written down to its new target (retried when the kernel refuses it yet).
* **UpdateContainer** of a shared container: the requested cpus plus the shared ones, the quota
  kept raised. Any other container: no update at all, so kubelet's request goes through untouched.
  With NUMA-local shared CPUs, new exclusive CPUs on other nodes bring other shared CPUs: the books
  and the pod quota follow (the pod's raised before the reply).
* **Synchronize**: the books are rebuilt from the running containers, containers that prove a
  request but lack the current shared CPUs get ``ContainerUpdate``s, and pod quotas are brought to
  their targets.
* **StopPodSandbox / RemovePodSandbox**: the pod's device bindings end; at removal its books too.
* **Shutdown**: the books are written.

Beside the events, `heal.Healer` checks the books against the node (pods whose cgroup is gone,
containers whose cgroup never appeared, pod quotas off their target): at each pod's events, at
Synchronize, and every `reconcile_interval` seconds once synchronized.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol

import structlog

from api.nri import api_pb2 as api
from cgroups import CgroupLayout
from nri_plugin.common.clock import LOOP_CLOCK, Clock
from nri_plugin.mixedcpu.books import Books, ContainerRecord, Slot
from nri_plugin.mixedcpu.heal import Healer, HealObserver
from nri_plugin.mixedcpu.logfields import LOGGER_NAME, pod_fields, show_quota
from nri_plugin.mixedcpu.policy import (
    MARKER_ANNOTATION,
    MarkerKey,
    PolicyError,
    RequestCheck,
    SharedChoice,
    SharedPool,
    UpdatePlan,
    check_request,
    container_slot,
    cpus_or_empty,
    format_cpuset,
    plan_create,
    plan_update,
    pod_key,
)
from nri_plugin.mixedcpu.quota import CgroupObserver, PodQuotas
from nri_plugin.mixedcpu.resync import rebuild_books, updates_to_send
from nri_plugin.mixedcpu.store import Bookkeeper, StateStore
from nri_plugin.nri import handlers
from nri_plugin.nri.errors import InvalidRequest, PluginRefusal, PreconditionFailed

__all__ = ["CgroupObserver", "MixedCpuPlugin", "PluginObserver"]

log = structlog.get_logger(LOGGER_NAME)


class PluginObserver(CgroupObserver, HealObserver, Protocol):
    """Told of failed cgroup writes and of heals (`nri_plugin.daemon.metrics.Metrics` is one)."""


def _refusal(exc: PolicyError) -> PluginRefusal:
    """A pod spec to fix is an invalid request; a node to fix, a failed precondition."""
    return InvalidRequest(str(exc)) if exc.kind == "pod-spec" else PreconditionFailed(str(exc))


class MixedCpuPlugin(
    handlers.Configure,
    handlers.Synchronize,
    handlers.Shutdown,
    handlers.CreateContainer,
    handlers.UpdateContainer,
    handlers.StopContainer,
    handlers.RemoveContainer,
    handlers.StopPodSandbox,
    handlers.RemovePodSandbox,
):
    """The NRI handlers; see the module docstring.

    `shared`: the node's shared CPUs, or a `SharedPool` that also gives their NUMA nodes when each
    container is to get only those local to its exclusive CPUs. `marker_key` checks device-plugin
    markers (None: markers are not a trusted source); `clock` runs the retry, deferred-save and
    reconcile timers; `reconcile_interval` (seconds) paces the reconciler's whole passes once the
    runtime has synchronized us (None: at events only).
    """

    def __init__(
        self,
        *,
        shared: frozenset[int] | SharedPool,
        layout: CgroupLayout,
        store: StateStore,
        marker_key: MarkerKey | None,
        trust_pod_annotation: bool = False,
        observer: PluginObserver | None = None,
        clock: Clock = LOOP_CLOCK,
        reconcile_interval: float | None = None,
    ) -> None:
        self.pool = shared if isinstance(shared, SharedPool) else SharedPool(frozenset(shared))
        self.shared = self.pool.cpus
        self.marker_key = marker_key
        self.trust_pod_annotation = trust_pod_annotation
        self.runtime = ""
        self.keeper = Bookkeeper(store, clock=clock)
        self.quotas = PodQuotas(layout, self.keeper, observer=observer, clock=clock)
        self.healer = Healer(self.quotas, interval=reconcile_interval, observer=observer, clock=clock)

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

    def flush(self, *, force: bool = False) -> None:
        """Write the books now if a change waits (or `force`). Raises OSError."""
        self.keeper.flush(force=force)

    # -- NRI handlers ------------------------------------------------------------------------------

    async def configure(self, request: api.ConfigureRequest) -> None:
        self.runtime = request.runtime_name
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

    async def create_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> api.CreateContainerResponse | None:
        slot = container_slot(pod, container)
        self.healer.at_pod_event(slot.pod)
        if self.marker_key is not None and MARKER_ANNOTATION in container.annotations:
            self.healer.free_stale_holder(
                self.marker_key.verify(container.annotations[MARKER_ANNOTATION]), slot
            )
        saved = self.books.pods.get(slot.pod)
        if saved is not None and saved.baseline_source == "unknown":
            self.quotas.resolve_unknown(slot.pod, pod.linux.cgroup_parent)
            saved = self.books.pods.get(slot.pod)
        displaced = self.books.displace(slot, container.id)
        if displaced is not None:
            self.healer.note_displaced(slot, displaced)
            log.info(
                "container restarted: the new instance takes its slot",
                previous_id=displaced.id,
                **pod_fields(pod, container, event="CreateContainer"),
            )
        check = self._check(pod, container, event="CreateContainer")
        if check.proof is None:
            log.debug("no request for shared CPUs", **pod_fields(pod, container, event="CreateContainer"))
            self._settle_displaced(displaced, pod)
            return None
        try:
            plan = plan_create(self.shared, pod, container, numa_nodes=self.pool.numa_nodes)
        except PolicyError as exc:
            log.warning(
                "refused shared CPUs", reason=str(exc), **pod_fields(pod, container, event="CreateContainer")
            )
            self._settle_displaced(displaced, pod)
            raise _refusal(exc) from None
        _log_fallback(plan.shared, pod, container, "CreateContainer")
        record = ContainerRecord(
            id=container.id,
            shared_cpus=len(plan.shared.cpus),
            exclusive=format_cpuset(plan.exclusive),
            device=check.proof.device,
        )
        before, after = self.quotas.raise_for(pod, container, slot, record, saved)
        self.healer.watch_creation(slot, container)
        log.info(
            "shared CPUs given",
            proof=str(check.proof),
            cpus=format_cpuset(plan.cpus),
            quota=show_quota(plan.quota),
            pod_quota=f"{show_quota(before)} -> {show_quota(after)}",
            **pod_fields(pod, container, event="CreateContainer"),
        )
        return api.CreateContainerResponse(adjust=plan.adjustment)

    async def update_container(
        self, pod: api.PodSandbox, container: api.Container, resources: api.LinuxResources
    ) -> Sequence[api.ContainerUpdate]:
        found = self.books.find(container.id)
        if found is None:
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
        self._follow_update(pod, container, slot, record, plan)
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

    async def stop_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> Sequence[api.ContainerUpdate]:
        self._release(pod, container, "stopped")
        return ()

    async def remove_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        self._release(pod, container, "removed")

    async def shutdown(self) -> None:
        self.flush()

    async def stop_pod_sandbox(self, pod: api.PodSandbox) -> None:
        # kubelet's device allocations to the pod end with it: the device ids are free for others.
        if self.books.unbind_pod(pod_key(pod)):
            self.keeper.save_quietly()

    async def remove_pod_sandbox(self, pod: api.PodSandbox) -> None:
        key = pod_key(pod)
        self.quotas.cancel_retry(key)
        self.healer.forget_pod(key)
        unbound = self.books.unbind_pod(key)
        if self.books.pods.pop(key, None) is not None:
            log.info(
                "pod removed: its quota bookkeeping is dropped", **pod_fields(pod, event="RemovePodSandbox")
            )
            self.keeper.save_quietly()
        elif unbound:
            self.keeper.save_quietly()

    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        previous = self.books
        rebuilt = rebuild_books(
            self.shared, previous, pods, containers, self._check_at_sync, numa_nodes=self.pool.numa_nodes
        )
        present = {pod_key(pod): pod for pod in pods}
        self.healer.before_sync(previous, containers)
        failed = self.quotas.sync_pods(present, rebuilt.books, previous, rebuilt.applied)
        updates = updates_to_send(rebuilt, failed)
        self.books = rebuilt.books
        self.healer.after_sync(previous, pods, containers)
        self.keeper.save_quietly()
        return updates

    # -- steps -------------------------------------------------------------------------------------

    def _check(
        self,
        pod: api.PodSandbox,
        container: api.Container,
        holders: Mapping[str, Slot] | None = None,
        *,
        event: str,
    ) -> RequestCheck:
        """The policy's verdict on the container's request, its refusals and notes logged."""
        if holders is None:
            holders = self.books.device_holders() if MARKER_ANNOTATION in container.annotations else {}
        check = check_request(
            pod,
            container,
            marker_key=self.marker_key,
            trust_pod_annotation=self.trust_pod_annotation,
            device_holders=holders,
        )
        for refusal in check.refusals:
            log.warning("request refused", reason=refusal, **pod_fields(pod, container, event=event))
        for note in check.notes:
            log.info("request evidence ignored", reason=note, **pod_fields(pod, container, event=event))
        return check

    def _check_at_sync(
        self, pod: api.PodSandbox, container: api.Container, holders: Mapping[str, Slot]
    ) -> RequestCheck:
        return self._check(pod, container, holders, event="Synchronize")

    def _follow_update(
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
            return
        if now.shared_cpus == record.shared_cpus:
            self.books.hold(slot, now)
            self.keeper.save_quietly()
            return
        before, after = self.quotas.raise_for(
            pod, container, slot, now, self.books.pods.get(slot.pod), event="UpdateContainer"
        )
        log.info(
            "the pod quota follows the container's shared CPUs",
            shared_cpus=format_cpuset(plan.shared.cpus),
            pod_quota=f"{show_quota(before)} -> {show_quota(after)}",
            **pod_fields(pod, container, event="UpdateContainer"),
        )

    def _settle_displaced(self, displaced: ContainerRecord | None, pod: api.PodSandbox) -> None:
        """A refused or unproven new instance of a container: the old one's share is gone."""
        if displaced is not None:
            key = pod_key(pod)
            self.quotas.settle(key, pod.linux.cgroup_parent, pod_fields(pod, event="CreateContainer"))

    def _release(self, pod: api.PodSandbox, container: api.Container, why: str) -> None:
        event = "StopContainer" if why == "stopped" else "RemoveContainer"
        key = pod_key(pod)
        self.quotas.resolve_unknown(key, pod.linux.cgroup_parent)
        held = self.books.release_holder(container.id)
        if held is not None:
            log.info(
                f"shared container {why}: its pod quota share is released",
                **pod_fields(pod, container, event=event),
            )
        # The container's own quota first: cgroup v1 refuses a pod quota below a child's.
        fields = pod_fields(pod, container, event=event)
        self.healer.container_ended(
            container_slot(pod, container), container, held[1] if held else None, fields
        )
        self.healer.at_pod_event(key)
        if key in self.books.pods:
            self.quotas.settle(key, pod.linux.cgroup_parent, pod_fields(pod, event=event))


def _log_fallback(choice: SharedChoice, pod: api.PodSandbox, container: api.Container, event: str) -> None:
    """Say why a container gets the whole shared pool although NUMA-local shared CPUs are on."""
    if choice.fallback is not None:
        log.warning(
            "no NUMA-local shared CPU: the container gets the whole shared pool",
            reason=choice.fallback,
            **pod_fields(pod, container, event=event),
        )
