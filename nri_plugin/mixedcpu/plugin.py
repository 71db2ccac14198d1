"""The mixed-CPU NRI plugin: the policy (`nri_plugin.mixedcpu.policy`) at the I/O edge.

The stub drives one `MixedCpuPlugin`. What it does with the outside world:

* **CreateContainer** of a container that proves a request: the pod's CFS quota is raised in the pod
  cgroup *before* the reply (cgroup v1 refuses a child quota above its parent's, and the runtime
  writes the container's raised quota from our adjustment right after), the books are saved, and
  the adjustment goes back. If anything fails after the pod write, the pod quota is written back and
  the runtime gets an error: nothing is left half-configured.
* **StopContainer / RemoveContainer**: the container's slot is released and the pod quota written
  down to its new target. The container's own quota is the runtime's to change; when the kernel
  refuses the lower pod quota (v1: the stopped container's cgroup still has its raised quota, or
  was deleted a few milliseconds ago and is not released yet), the higher quota stays, and the
  plugin tries again a few times with backoff and at the next event of that pod.
* **UpdateContainer** of a shared container: the requested cpus plus the shared ones, the quota
  kept raised. Any other container: no update at all, so kubelet's request goes through untouched.
* **Synchronize**: the books are rebuilt from the running containers (the saved books only supply
  each pod's baseline and each container's exclusive CPUs), containers that prove a request but lack
  the current shared CPUs get ``ContainerUpdate``s, pod quotas are brought to their targets, and
  containers whose environment shows old values are logged (env cannot change after start).

Pod cgroups are found with `cgroups.pod_cgroup_path` in the configured layout; every path is
validated there. Nothing here runs a shell or a subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Protocol

import structlog

from api.nri import api_pb2 as api
from cgroups import (
    Cgroup,
    CgroupDir,
    CgroupError,
    CgroupLayout,
    CgroupNotFound,
    CgroupWriteRejected,
    CpuQuota,
    CpusetError,
    OpenCgroup,
    format_cpuset,
    open_cgroup,
    parse_cpuset,
    pod_cgroup_path,
    read_cpu_quota,
    write_cpu_quota,
)
from cgroups.files import CFS_QUOTA_US, CPU_MAX, write_value
from cgroups.quota import MIN_CFS_QUOTA_US, format_cfs_quota_us, format_cpu_max
from nri_plugin.daemon.config import Config
from nri_plugin.daemon.logs import EVENT_NAME
from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.mixedcpu.policy import (
    MARKER_ANNOTATION,
    PolicyError,
    RequestCheck,
    baseline_from_pod_resources,
    check_request,
    container_slot,
    describe,
    plan_create,
    plan_sync,
    plan_update,
    pod_key,
)
from nri_plugin.mixedcpu.state import Books, ContainerRecord, PodRecord, Slot, StateStore
from nri_plugin.ttrpc.errors import Code, TtrpcError

__all__ = ["CgroupObserver", "MixedCpuPlugin"]

log = structlog.get_logger("nri_plugin.mixedcpu.plugin")

# After a container cgroup is deleted, the v1 kernel still counts its quota for some 20-30 ms (the
# cgroup is released after an RCU grace period): a lower pod quota refused then is retried.
LOWER_RETRY_DELAYS = (0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)
# Changes to the books that Synchronize can rebuild (which container holds a slot) are written to the
# state file this long after they happen; a new or dropped pod baseline is written at once.
FLUSH_DELAY = 1.0

# At Synchronize, every container but a stopped one keeps (or gets) its share: one in an unknown
# state may well be running, and a pod quota left too high throttles nobody.
_GONE = api.CONTAINER_STOPPED


def _fields(pod: api.PodSandbox, container: api.Container | None = None, *, event: str) -> dict[str, str]:
    """A log line's fields about a pod (and container), and the NRI event (rendered as ``event``)."""
    fields = {EVENT_NAME: event, "namespace": pod.namespace, "pod": pod.name or pod.id}
    if container is not None:
        fields["container"] = container.name
        fields["container_id"] = container.id
    return fields


def _parse_quietly(text: str) -> frozenset[int]:
    try:
        return parse_cpuset(text)
    except CpusetError:
        return frozenset()


def _show(quota: CpuQuota | int | None) -> str:
    if isinstance(quota, CpuQuota):
        quota = quota.quota
    return "unlimited" if quota is None else str(quota)


class CgroupObserver(Protocol):
    """Told of every pod cgroup write that failed (`nri_plugin.daemon.metrics`)."""

    def cgroup_write_failed(self, kind: str) -> None:
        """`kind`: ``pod_quota_raise``, ``pod_quota_lower`` or ``pod_quota_restore``."""


class MixedCpuPlugin:
    """The NRI handlers; see the module docstring."""

    def __init__(
        self,
        *,
        shared: frozenset[int],
        layout: CgroupLayout,
        store: StateStore,
        marker_key: HostKey | None,
        trust_pod_annotation: bool = False,
        books: Books | None = None,
        observer: CgroupObserver | None = None,
    ) -> None:
        self.shared = frozenset(shared)
        self.observer = observer
        self.layout = layout
        self.store = store
        self.marker_key = marker_key
        self.trust_pod_annotation = trust_pod_annotation
        self.books = store.load() if books is None else books
        self.runtime = ""
        self._retries: dict[str, asyncio.TimerHandle] = {}
        self._saved_baselines = self._baselines()
        self._flush_timer: asyncio.TimerHandle | None = None

    @classmethod
    def from_config(cls, config: Config, layout: CgroupLayout) -> MixedCpuPlugin:
        """The plugin as `config` describes it. Raises `HostKeyError` for an unusable marker key."""
        key = HostKey.load_or_create(config.state_dir) if config.trust_device_plugin_marker else None
        return cls(
            shared=config.shared_cpuset,
            layout=layout,
            store=StateStore(config.state_dir),
            marker_key=key,
            trust_pod_annotation=config.trust_pod_annotation,
        )

    @property
    def shared_containers(self) -> int:
        """How many containers hold the shared CPUs now (from the books)."""
        return sum(len(pod.containers) for pod in self.books.pods.values())

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
        saved = self.books.pods.get(slot.pod)
        if saved is not None and saved.baseline_source == "unknown":
            self._resolve_unknown(slot.pod, pod.linux.cgroup_parent)
        saved = saved.copy() if saved is not None else None
        displaced = self.books.displace(slot, container.id)
        if displaced is not None:
            log.info(
                "container restarted: the new instance takes its slot",
                previous_id=displaced.id,
                **_fields(pod, container, event="CreateContainer"),
            )
        check = self._check(pod, container, event="CreateContainer")
        if check.proof is None:
            log.debug("no request for shared CPUs", **_fields(pod, container, event="CreateContainer"))
            if displaced is not None:
                self._settle(slot.pod, pod.linux.cgroup_parent, _fields(pod, event="CreateContainer"))
            return None
        try:
            plan = plan_create(self.shared, pod, container)
        except PolicyError as exc:
            log.warning(
                "refused shared CPUs", reason=str(exc), **_fields(pod, container, event="CreateContainer")
            )
            if displaced is not None:
                self._settle(slot.pod, pod.linux.cgroup_parent, _fields(pod, event="CreateContainer"))
            code = Code.INVALID_ARGUMENT if exc.kind == "pod-spec" else Code.FAILED_PRECONDITION
            raise TtrpcError(code, str(exc)) from None

        record = ContainerRecord(
            id=container.id,
            shared_cpus=len(self.shared),
            exclusive=format_cpuset(plan.exclusive),
            device=check.proof.device,
        )
        before, after = self._raise_pod_quota(pod, container, slot, record, saved)
        log.info(
            "shared CPUs given",
            proof=str(check.proof),
            cpus=format_cpuset(plan.cpus),
            quota=_show(plan.quota),
            pod_quota=f"{_show(before)} -> {_show(after)}",
            **_fields(pod, container, event="CreateContainer"),
        )
        return api.CreateContainerResponse(adjust=plan.adjustment)

    async def update_container(
        self, pod: api.PodSandbox, container: api.Container, resources: api.LinuxResources
    ) -> Sequence[api.ContainerUpdate]:
        found = self.books.find(container.id)
        if found is None:
            return ()
        _, record = found
        try:
            update = plan_update(self.shared, pod, container, resources, _parse_quietly(record.exclusive))
        except PolicyError as exc:
            log.warning(
                "cannot keep shared CPUs on update",
                reason=str(exc),
                **_fields(pod, container, event="UpdateContainer"),
            )
            raise TtrpcError(Code.INVALID_ARGUMENT, str(exc)) from None
        cpu = update.linux.resources.cpu
        log.info(
            "kept shared CPUs on update",
            requested=resources.cpu.cpus or "(none)",
            cpus=cpu.cpus,
            quota=cpu.quota.value if cpu.HasField("quota") else "unchanged",
            **_fields(pod, container, event="UpdateContainer"),
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
            self._save_quietly()

    async def remove_pod_sandbox(self, pod: api.PodSandbox) -> None:
        pending = self._retries.pop(pod_key(pod), None)
        if pending is not None:
            pending.cancel()
        unbound = self.books.unbind_pod(pod_key(pod))
        if self.books.pods.pop(pod_key(pod), None) is not None:
            log.info(
                "pod removed: its quota bookkeeping is dropped", **_fields(pod, event="RemovePodSandbox")
            )
            self._save_quietly()
        elif unbound:
            self._save_quietly()

    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        previous = self.books
        books = Books()
        by_sandbox = {pod.id: pod for pod in pods}
        present = {pod_key(pod): pod for pod in pods}
        known = {record.id: record for _, record in previous.slots()}
        # Device ids stay bound to their slots while the slot's pod exists, even with its container
        # stopped: a copy of the marker in another pod must not take the device meanwhile.
        books.devices = {d: s for d, s in previous.device_holders().items() if s.pod in present}
        holders = books.devices
        live = [c for c in containers if c.state != _GONE and c.pod_sandbox_id in by_sandbox]
        # Containers the books already knew first: a replayed marker must not evict its real holder.
        live.sort(key=lambda c: (c.id not in known, c.created_at, c.id))
        applied: dict[str, int] = defaultdict(int)
        # (pod key, CPUs it already had beyond its exclusive ones, update, pod, container)
        pending: list[tuple[str, int, api.ContainerUpdate, api.PodSandbox, api.Container]] = []
        for container in live:
            pod = by_sandbox[container.pod_sandbox_id]
            check = self._check(pod, container, holders, event="Synchronize")
            if check.proof is None:
                continue
            before = known.get(container.id)
            recorded = _parse_quietly(before.exclusive) if before is not None else frozenset()
            try:
                plan = plan_sync(self.shared, pod, container, recorded)
            except PolicyError as exc:
                log.warning(
                    "existing container cannot have shared CPUs",
                    reason=str(exc),
                    **_fields(pod, container, event="Synchronize"),
                )
                continue
            slot = container_slot(pod, container)
            if slot.pod not in books.pods:
                books.pods[slot.pod] = PodRecord(pod.linux.cgroup_parent, None, 1)
            books.hold(
                slot,
                ContainerRecord(
                    container.id, len(self.shared), format_cpuset(plan.exclusive), check.proof.device
                ),
            )
            applied[slot.pod] += plan.applied_shared
            if plan.update is not None:
                pending.append((slot.pod, plan.applied_shared, plan.update, pod, container))
                log.info(
                    "bringing an existing container to the shared CPUs",
                    cpus=plan.update.linux.resources.cpu.cpus or "unchanged",
                    **_fields(pod, container, event="Synchronize"),
                )
            if plan.env_stale:
                log.warning(
                    "container must restart to see the current CPU sets in its environment",
                    OPENSHIFT_SHARED_CPUS=format_cpuset(self.shared),
                    OPENSHIFT_ISOLATED_CPUS=format_cpuset(plan.exclusive),
                    **_fields(pod, container, event="Synchronize"),
                )
        failed: set[str] = set()
        for key in sorted(set(books.pods) | (set(previous.pods) & set(present))):
            pod = present[key]
            record = books.pods.get(key)
            if record is None:
                record = books.pods[key] = PodRecord(pod.linux.cgroup_parent, None, 1)
            if not self._sync_pod(pod, record, previous.pods.get(key), applied[key], books):
                failed.add(key)
        updates: list[api.ContainerUpdate] = []
        for key, given, update, pod, container in pending:
            if key not in failed:
                updates.append(update)
                continue
            # No cpuset or quota change without its pod's quota (v1 refuses the container's quota
            # above the pod's, v2 would throttle the pod); nor a share in the books it does not have.
            if not given:
                books.release(container.id)
            log.warning(
                "container left as it is until the next synchronization: its pod quota cannot be raised",
                **_fields(pod, container, event="Synchronize"),
            )
        self.books = books
        self._save_quietly()
        return updates

    # -- the books and the pod cgroup ----------------------------------------------------------------

    def _check(
        self,
        pod: api.PodSandbox,
        container: api.Container,
        holders: Mapping[str, Slot] | None = None,
        *,
        event: str,
    ) -> RequestCheck:
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
            log.warning("request refused", reason=refusal, **_fields(pod, container, event=event))
        for note in check.notes:
            log.info("request evidence ignored", reason=note, **_fields(pod, container, event=event))
        return check

    def _pod_dir(self, pod: api.PodSandbox) -> CgroupDir:
        return self._cgroup(pod.linux.cgroup_parent)

    def _cgroup(self, cgroup_parent: str) -> CgroupDir:
        return self.layout.cpu.dir(pod_cgroup_path(cgroup_parent))

    def _new_record(self, pod: api.PodSandbox, current: CpuQuota) -> PodRecord:
        if current.unlimited:
            return PodRecord(pod.linux.cgroup_parent, None, current.period)
        baseline = baseline_from_pod_resources(pod, current.period)
        if baseline is not None:
            return PodRecord(pod.linux.cgroup_parent, baseline, current.period, "pod-resources")
        return PodRecord(pod.linux.cgroup_parent, current.quota, current.period, "first-seen")

    def _reconcile(
        self, pod_dir: Cgroup, record: PodRecord, current: CpuQuota, key: str, attempt: int = 0
    ) -> CpuQuota:
        """Write the record's target to the pod cgroup; returns what the pod cgroup now holds.

        Raising failures raise. A lowering the kernel refuses (v1: a child cgroup still has a higher
        quota, or was deleted moments ago and is not released yet) is retried a few times with
        backoff, then at the pod's next event.
        """
        quota = current.quota
        if quota is None:
            record.baseline = None  # unlimited stays unlimited, whoever made it so
            record.period = current.period
            return current
        if record.baseline is None:
            if record.baseline_source == "unknown":
                # The pod cgroup could not be read at synchronization: assume the shares of the
                # containers in the books are already in its quota.
                guess = quota - sum(c.shared_cpus for c in record.containers.values()) * current.period
                record.baseline = guess if guess >= MIN_CFS_QUOTA_US else quota
            else:
                # Unlimited when we first saw it, limited now: that limit is the pod's own.
                record.baseline = quota
            record.baseline_source = "first-seen"
            record.period = current.period
        elif record.period != current.period:
            record.baseline = -(-record.baseline * current.period // record.period)
            record.period = current.period
        target = record.target()
        assert target is not None
        if target == quota:
            return current
        kind = "pod_quota_raise" if target > quota else "pod_quota_lower"
        try:
            write_cpu_quota(pod_dir, target, current=current)
        except CgroupError as exc:
            self._write_failed(kind)
            if target > quota or not isinstance(exc, CgroupWriteRejected):
                raise
            if attempt == 0:
                log.info(
                    "the kernel refuses to lower the pod quota yet (a container cgroup still has a "
                    "higher quota); trying again shortly and at the pod's next event",
                    pod_cgroup=str(pod_dir),
                    target=target,
                    error=str(exc),
                )
            self._retry_later(key, attempt)
            return current
        now = read_cpu_quota(pod_dir)
        if now.quota != target:
            self._write_failed(kind)
            raise CgroupError(
                f"{pod_dir}: wrote quota {target} but read back {_show(now)} (is another agent managing it?)",
                path=pod_dir.fs_path,
            )
        return now

    def _raise_pod_quota(
        self,
        pod: api.PodSandbox,
        container: api.Container,
        slot: Slot,
        record: ContainerRecord,
        saved: PodRecord | None,
    ) -> tuple[CpuQuota, CpuQuota]:
        """Hold the slot and raise the pod's quota, or undo everything and raise a TtrpcError."""
        who = describe(pod)
        before: CpuQuota | None = None
        pod_dir: OpenCgroup | None = None
        devices = dict(self.books.devices)
        try:
            pod_dir = open_cgroup(self._pod_dir(pod))  # one walk for the reads and the write
            before = read_cpu_quota(pod_dir)
            pod_record = self.books.pods.get(slot.pod) or self._new_record(pod, before)
            self.books.pods[slot.pod] = pod_record
            self.books.hold(slot, record)
            after = self._reconcile(pod_dir, pod_record, before, slot.pod)
            self._commit()
        except (CgroupError, OSError) as exc:
            self._restore(slot.pod, saved)
            self.books.devices = devices  # a failed creation binds no device
            undone = self._undo(pod_dir, before)
            if isinstance(exc, CgroupError):
                message = f"cannot raise the CPU quota of pod {who}: {exc}"
                code = Code.FAILED_PRECONDITION
            else:
                message = f"cannot save the plugin's state in {self.store.directory}: {exc}"
                code = Code.INTERNAL
            log.error(
                "creation refused",
                error=message,
                rolled_back=undone,
                **_fields(pod, container, event="CreateContainer"),
            )
            raise TtrpcError(code, f"{message}{'; the pod quota was put back' if undone else ''}") from None
        finally:
            if pod_dir is not None:
                pod_dir.close()
        return before, after

    def _restore(self, key: str, saved: PodRecord | None) -> None:
        if saved is None:
            self.books.pods.pop(key, None)
        else:
            self.books.pods[key] = saved

    def _undo(self, pod_dir: Cgroup | None, before: CpuQuota | None) -> bool:
        """Put the pod quota read before a failed step back; True if something had to be written."""
        if pod_dir is None or before is None:
            return False
        with contextlib.suppress(CgroupError):
            if read_cpu_quota(pod_dir) == before:
                return False
        # Changed, or unreadable (a write cut short): write the whole value back, period included.
        try:
            if pod_dir.version == 2:
                write_value(pod_dir, CPU_MAX, format_cpu_max(before))
            else:
                write_value(pod_dir, CFS_QUOTA_US, format_cfs_quota_us(before.quota))
        except CgroupError as exc:
            self._write_failed("pod_quota_restore")
            log.error("cannot put the pod quota back", pod_cgroup=str(pod_dir), error=str(exc))
        return True

    def _write_failed(self, kind: str) -> None:
        if self.observer is not None:
            self.observer.cgroup_write_failed(kind)

    def _resolve_unknown(self, key: str, cgroup_parent: str) -> None:
        """A pod whose cgroup could not be read at Synchronize: guess its own quota now, while the
        books still count every share that is in it."""
        record = self.books.pods.get(key)
        if record is None or record.baseline_source != "unknown":
            return
        with contextlib.suppress(CgroupError), open_cgroup(self._cgroup(cgroup_parent)) as pod_dir:
            self._reconcile(pod_dir, record, read_cpu_quota(pod_dir), key)

    def _release(self, pod: api.PodSandbox, container: api.Container, why: str) -> None:
        event = "StopContainer" if why == "stopped" else "RemoveContainer"
        self._resolve_unknown(pod_key(pod), pod.linux.cgroup_parent)
        slot = self.books.release(container.id)
        if slot is not None:
            log.info(
                f"shared container {why}: its pod quota share is released",
                **_fields(pod, container, event=event),
            )
        key = pod_key(pod)
        if key in self.books.pods:
            self._settle(key, pod.linux.cgroup_parent, _fields(pod, event=event))

    def _settle(self, key: str, cgroup_parent: str, fields: dict[str, str], attempt: int = 0) -> None:
        """Bring a pod's quota down to its target after a release; never fails the event."""
        record = self.books.pods.get(key)
        if record is None:
            return
        try:
            with open_cgroup(self._cgroup(cgroup_parent)) as pod_dir:
                now = self._reconcile(pod_dir, record, read_cpu_quota(pod_dir), key, attempt)
            if not record.containers and (now.unlimited or now.quota == record.baseline):
                del self.books.pods[key]
        except CgroupError as exc:
            log.warning("cannot lower the pod quota", error=str(exc), **fields)
            if not record.containers and isinstance(exc, CgroupNotFound):
                del self.books.pods[key]  # the pod cgroup is gone: nothing left to lower
        self._save_quietly()

    def _retry_later(self, key: str, attempt: int) -> None:
        if attempt >= len(LOWER_RETRY_DELAYS):
            log.warning(
                "the pod quota stays above its target until the pod's next event",
                pod_key=key,
                attempts=attempt,
            )
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        pending = self._retries.pop(key, None)
        if pending is not None:
            pending.cancel()
        self._retries[key] = loop.call_later(LOWER_RETRY_DELAYS[attempt], self._retry, key, attempt + 1)

    def _retry(self, key: str, attempt: int) -> None:
        self._retries.pop(key, None)
        record = self.books.pods.get(key)
        if record is not None:
            self._settle(key, record.cgroup_parent, {"pod_key": key}, attempt)

    def _sync_pod(
        self, pod: api.PodSandbox, record: PodRecord, previous: PodRecord | None, applied: int, books: Books
    ) -> bool:
        """Bring one pod's quota to its target; False (logged) when its cgroup fails us."""
        key = pod_key(pod)
        established = False
        pod_dir: OpenCgroup | None = None
        try:
            pod_dir = open_cgroup(self._pod_dir(pod))  # one walk for the reads and the write
            current = read_cpu_quota(pod_dir)
            if previous is not None:
                record.baseline, record.period = previous.baseline, previous.period
                record.baseline_source = previous.baseline_source
            else:
                rebuilt = self._new_record(pod, current)
                if rebuilt.baseline is not None and rebuilt.baseline_source == "first-seen" and applied:
                    # Shared CPUs were given before we (re)started: their share is in the pod quota.
                    own = rebuilt.baseline - applied * current.period
                    if own >= MIN_CFS_QUOTA_US:
                        rebuilt.baseline, rebuilt.baseline_source = own, "rebuilt"
                record.baseline, record.period = rebuilt.baseline, rebuilt.period
                record.baseline_source = rebuilt.baseline_source
                established = True
            now = self._reconcile(pod_dir, record, current, key)
            if now != current:
                log.info(
                    "pod quota brought to its target",
                    pod_quota=f"{_show(current)} -> {_show(now)}",
                    **_fields(pod, event="Synchronize"),
                )
            if not record.containers and (now.unlimited or now.quota == record.baseline):
                del books.pods[key]
        except CgroupError as exc:
            log.error(
                "cannot bring the pod quota to its target",
                error=str(exc),
                **_fields(pod, event="Synchronize"),
            )
            if previous is not None:
                # Keep what the books knew: the pod's own quota must outlive an unreadable cgroup.
                record.baseline, record.period = previous.baseline, previous.period
                record.baseline_source = previous.baseline_source
            elif not record.containers:
                del books.pods[key]
            elif not established:
                record.baseline, record.baseline_source = None, "unknown"
            return False
        finally:
            if pod_dir is not None:
                pod_dir.close()
        return True

    # -- the state file ----------------------------------------------------------------------------

    def _baselines(self) -> tuple[dict[str, tuple[int | None, int, str, str]], dict[str, Slot]]:
        """What Synchronize cannot rebuild, written before the reply: baselines, device bindings."""
        baselines = {
            key: (pod.baseline, pod.period, pod.baseline_source, pod.cgroup_parent)
            for key, pod in self.books.pods.items()
        }
        return baselines, dict(self.books.devices)

    def _commit(self) -> None:
        """Persist the books: at once when a pod baseline changed (what Synchronize cannot rebuild;
        raises OSError), else within `FLUSH_DELAY`."""
        if self._baselines() != self._saved_baselines:
            self.flush(force=True)
            return
        if self._flush_timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush(force=True)
                return
            self._flush_timer = loop.call_later(FLUSH_DELAY, self._deferred_flush)

    def flush(self, *, force: bool = False) -> None:
        """Write the books now if anything is waiting (or `force`). Raises OSError."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        elif not force:
            return
        self.store.save(self.books)
        self._saved_baselines = self._baselines()

    def _deferred_flush(self) -> None:
        self._flush_timer = None
        self._save_quietly(force=True)

    def _save_quietly(self, *, force: bool = False) -> None:
        try:
            if force:
                self.flush(force=True)
            else:
                self._commit()
        except OSError as exc:
            log.error("cannot save the plugin's state", path=self.store.path, error=str(exc))
