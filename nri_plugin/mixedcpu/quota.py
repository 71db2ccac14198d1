"""The pod-quota reconciler: each pod cgroup's CFS quota brought to its target in the books.

A pod's target is its own quota (the baseline) plus n(shared) * period for each live shared container
(`nri_plugin.mixedcpu.books`). `PodQuotas` is the cgroup side of the plugin's handlers:

* `PodQuotas.raise_for` (CreateContainer): holds the slot and raises the pod's quota *before* the
  reply (cgroup v1 refuses a child quota above its parent's, and the runtime writes the container's
  raised quota from the adjustment right after), and has the books saved. If anything fails after
  the pod write, the pod quota is written back and the books restored: nothing is left
  half-configured, and the refusal says so.
* `PodQuotas.settle` (a container stopped, removed or displaced): the pod's quota comes down to its
  new target; this never fails the event. The container's own quota is the runtime's to change: when
  the kernel refuses the lower pod quota (v1: the stopped container's cgroup still has its raised
  quota, or was deleted a few milliseconds ago and is not released yet), the higher quota stays, and
  the lowering is tried again after each of `LOWER_RETRY_DELAYS` on the clock, then at the pod's
  next event.
* `PodQuotas.sync_pods` (Synchronize): each pod's baseline from the saved books, else rebuilt from
  its cgroup, and its quota brought to its target.
* `PodQuotas.restore_container` (a shared container stopped): *stop means stop*. The container's
  own cgroup quota goes back to n(exclusive) * its period, before its pod's quota is lowered. A
  stopped container's cgroup lingers until its removal (CRI-O always, containerd for exited
  containers, and kubelet keeps a pod's last dead container), still holding the raised quota, and
  cgroup v1 refuses a pod quota below a child's: without this the pod would keep the share. The
  value is the quota kubelet gives a Guaranteed container with those exclusive CPUs (the only kind
  that gets shared CPUs), which is what the pod's own quota counts for it; read from the books'
  exclusive CPUs, so it needs no record of what the container had before. A restart raises both
  again (a new container, a new CreateContainer).
* `PodQuotas.check_pod` (the reconciler, `nri_plugin.mixedcpu.heal`): does the pod's cgroup still
  exist, and is its quota at its target? Brought there if not.
* `PodQuotas.resize` (UpdatePodSandbox: kubelet resized the pod in place): the pod's own quota from
  its new resources, and its quota raised to that plus the shares again.

**In-place resize.** kubelet writes the pod's new own quota to its cgroup, dropping the shares. A
runtime with NRI v0.10+ then sends UpdatePodSandbox (`resize`); for the others, a pod quota found
off its target at any later reconcile (the pod's next container event, or the reconciler's pass)
holding neither its target nor the value last written here was written by kubelet (or by systemd
re-applying kubelet's value): that value is the pod's own quota now (`adopt_resize`).

**Who writes.** The write itself goes through a `PodQuotaWriter`: the cgroup file (`FILE_WRITER`),
or, in the daemon, `nri_plugin.systemd.podquota.SystemdPodQuotaWriter`, which writes the file and
tells systemd the same value in the background for a pod cgroup that is a systemd unit, so that
systemd's re-applying keeps it. No writer waits for systemd: everything that changes the books and
the pod quotas holds `PodQuotas.lock` (the plugin's handlers, the retries, each pod of the
reconciler's passes), and no D-Bus call is awaited under it. A pod the writer has not settled yet
(`PodQuotaWriter.settled`) is written again at its next reconcile even at its target.

Pod cgroups are found with `cgroups.pod_cgroup_path` in the configured layout; every path is
validated there. Nothing here runs a shell or a subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Protocol

import structlog

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import (
    Cgroup,
    CgroupDir,
    CgroupError,
    CgroupLayout,
    CgroupNotFound,
    CgroupOpener,
    CgroupPathError,
    CgroupWriteRejected,
    CpuQuota,
    OpenCgroup,
    container_cgroup_path,
    open_cgroup,
    pod_cgroup_path,
    read_cpu_quota,
    set_cpu_limit,
    write_cpu_quota,
)
from nri_plugin.common.clock import LOOP_CLOCK, Clock, Timer
from nri_plugin.mixedcpu import baselines
from nri_plugin.mixedcpu.bookkeeper import Bookkeeper
from nri_plugin.mixedcpu.books import Books, ContainerRecord, PodRecord, Slot
from nri_plugin.mixedcpu.bounds import above_runtime_limit
from nri_plugin.mixedcpu.logfields import LOGGER_NAME, pod_fields, show_quota
from nri_plugin.mixedcpu.policy import (
    baseline_from_resources,
    cpus_or_empty,
    describe,
    pod_key,
)
from nri_plugin.nri.errors import PluginFailure, PluginRefusal, PreconditionFailed

__all__ = [
    "FILE_WRITER",
    "LOWER_RETRY_DELAYS",
    "CgroupObserver",
    "FileQuotaWriter",
    "PodCheck",
    "PodQuotaWriter",
    "PodQuotas",
    "PodState",
]

log = structlog.get_logger(LOGGER_NAME)

# After a container cgroup is deleted, the v1 kernel still counts its quota for some 20-30 ms (the
# cgroup is released after an RCU grace period): a lower pod quota refused then is retried.
LOWER_RETRY_DELAYS = (0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)
# Validated pod cgroup paths kept: more than a node's pods, few enough that churn cannot grow it.
_MAX_CACHED_DIRS = 16384


class CgroupObserver(Protocol):
    """Told of every cgroup write that failed (`nri_plugin.daemon.metrics`)."""

    def cgroup_write_failed(self, kind: str) -> None:
        """`kind`: ``pod_quota_raise``, ``pod_quota_lower``, ``pod_quota_restore`` or
        ``container_quota_lower``."""


class PodQuotaWriter(Protocol):
    """Who writes a pod cgroup's CFS limit (see the module docstring)."""

    async def write_pod_quota(
        self, pod_dir: Cgroup, cgroup_parent: str, limit: CpuQuota, *, current: CpuQuota | None
    ) -> None:
        """Make `limit` (quota and period) the CFS limit of the pod cgroup `pod_dir` (named by
        `cgroup_parent`); `current`: what it holds, just read (None: unknown). Raises `CgroupError`
        (`CgroupWriteRejected`: the kernel refused the value)."""

    def settled(self, cgroup_parent: str) -> bool:
        """False while a value written for the pod may not hold yet everywhere it must (systemd
        has not acknowledged it, or a late answer may still change it): the pod is then written
        again at its next reconcile even if its file shows its target, and its record kept."""


class FileQuotaWriter:
    """Writes the pod cgroup's files (what systemd puts back, for a pod cgroup that is its unit)."""

    async def write_pod_quota(
        self, pod_dir: Cgroup, cgroup_parent: str, limit: CpuQuota, *, current: CpuQuota | None
    ) -> None:
        set_cpu_limit(pod_dir, limit, current=current)

    def settled(self, cgroup_parent: str) -> bool:
        return True  # the write was the whole of it


FILE_WRITER: PodQuotaWriter = FileQuotaWriter()


class PodState(enum.Enum):
    """What `PodQuotas.check_pod` found."""

    GONE = "gone"  # the pod's cgroup directory no longer exists
    AT_TARGET = "at-target"  # its quota is what the books say (or unlimited)
    BROUGHT = "brought"  # its quota was off its target, and is at it now
    PENDING = "pending"  # a lowering the kernel refuses yet (a retry is on it, or the next pass)
    FAILED = "failed"  # its cgroup cannot be read or written: left as it is


@dataclass(frozen=True, slots=True)
class PodCheck:
    """The outcome of one `PodQuotas.check_pod`: the state, the pod's limit before and after (when
    read), and the error that stopped it (FAILED)."""

    state: PodState
    before: CpuQuota | None = None
    after: CpuQuota | None = None
    error: str = ""


# -- the cgroup side -----------------------------------------------------------------------------------------


class PodQuotas:
    """Writes pod quotas to their targets in the books `keeper` holds; see the module docstring.

    `observer` (settable) hears of every failed write; retries run on `clock`; `writer` writes.
    """

    def __init__(
        self,
        layout: CgroupLayout,
        keeper: Bookkeeper,
        *,
        observer: CgroupObserver | None = None,
        clock: Clock = LOOP_CLOCK,
        writer: PodQuotaWriter = FILE_WRITER,
    ) -> None:
        self.layout = layout
        self.keeper = keeper
        self.observer = observer
        self.writer = writer
        # Held by whatever changes the books or writes a pod quota: the plugin's handlers, the
        # retries, the reconciler. Taken free (no suspension) when nobody holds it.
        self.lock = asyncio.Lock()
        self._clock = clock
        self._retries: dict[str, Timer] = {}
        self._retrying: set[asyncio.Task[None]] = set()
        self._dirs: dict[str, CgroupDir] = {}  # cgroup parent -> its validated pod cgroup
        self._opener = CgroupOpener()  # holds the pod cgroups' parent directories
        # Pod key -> the quota last written to (or found at its target in) the pod cgroup here: a
        # value off the target and not this one was written by someone else (`adopt_resize`).
        self._written: dict[str, int | None] = {}

    @property
    def books(self) -> Books:
        return self.keeper.books

    @property
    def retries_pending(self) -> frozenset[str]:
        """The pod keys whose lowering waits for a retry."""
        return frozenset(self._retries)

    def pod_dir(self, cgroup_parent: str) -> CgroupDir:
        """The pod's cgroup in the cpu hierarchy; `CgroupPathError` for a parent we refuse. Validated
        once per parent and layout: the reconciler asks again for every pod at every pass."""
        hierarchy = self.layout.cpu
        found = self._dirs.get(cgroup_parent)
        if found is None or found.hierarchy != hierarchy:
            if len(self._dirs) >= _MAX_CACHED_DIRS:
                self._dirs.clear()
            found = self._dirs[cgroup_parent] = hierarchy.dir(pod_cgroup_path(cgroup_parent))
        return found

    def open_pod(self, cgroup_parent: str) -> OpenCgroup:
        """The pod's cgroup held open (one ``openat`` below its held parent: `CgroupOpener`), its
        CFS limit file held from its read to its write. Raises `CgroupError`."""
        return self._opener.open(self.pod_dir(cgroup_parent))

    # -- CreateContainer -------------------------------------------------------------------------------

    async def raise_for(
        self,
        pod: api.PodSandbox,
        container: api.Container,
        slot: Slot,
        record: ContainerRecord,
        saved: PodRecord | None,
        *,
        event: str = "CreateContainer",
        allocation: int | None = None,
    ) -> tuple[CpuQuota, CpuQuota]:
        """Hold the slot and raise the pod's quota; the pod's limit before and after. `event`: the NRI
        event it is done for (CreateContainer; UpdateContainer when a container's share changes);
        `allocation`: the number of the allocation the record's marker presents (`Books.bind`).

        On failure everything is undone (the pod's record back to `saved`, no device bound, the pod
        quota written back) and a `PreconditionFailed` (cgroup) or `PluginFailure` (state file) raised.
        """
        books = self.books
        bindings = books.bindings_at(slot, record.device)
        before: CpuQuota | None = None
        pod_dir: OpenCgroup | None = None
        try:
            pod_dir = self.open_pod(pod.linux.cgroup_parent)  # one walk for reads and write
            before = read_cpu_quota(pod_dir)
            books.hold(
                slot,
                record,
                new_pod=None if slot.pod in books.pods else baselines.new_pod_record(pod, before),
                allocation=allocation,
            )
            # Committed ahead of the raise: killed right after it, the next start knows the pod's own
            # quota (and there is one transaction per creation, not two).
            after = await self._reconcile(pod_dir, books.pods, slot.pod, before, ahead=self.keeper.commit)
        except (CgroupError, OSError) as exc:
            baselines.restore(books.pods, slot.pod, saved)
            books.restore_bindings(bindings)  # a failed creation binds no device
            undone = await self._undo(pod_dir, pod.linux.cgroup_parent, slot.pod, before)
            self.keeper.save_quietly()  # the books as they were, where the database has the new ones
            raise self._creation_refused(exc, pod, container, undone, event) from None
        except asyncio.CancelledError:
            # The runtime gave up waiting (a write through systemd never answered): the books forget
            # the creation; the pod quota, if it moved, is brought to its target by the next check.
            baselines.restore(books.pods, slot.pod, saved)
            books.restore_bindings(bindings)
            raise
        finally:
            if pod_dir is not None:
                pod_dir.close()
        return before, after

    def _creation_refused(
        self, exc: Exception, pod: api.PodSandbox, container: api.Container, undone: bool, event: str
    ) -> PluginRefusal:
        refusal: type[PluginRefusal]
        if isinstance(exc, CgroupError):
            message = f"cannot raise the CPU quota of pod {describe(pod)}: {exc}"
            refusal = PreconditionFailed
        else:
            message = f"cannot save the plugin's state in {self.keeper.store.directory}: {exc}"
            refusal = PluginFailure
        log.error(
            "creation refused" if event == "CreateContainer" else "update refused",
            error=message,
            rolled_back=undone,
            **pod_fields(pod, container, event=event),
        )
        return refusal(f"{message}{'; the pod quota was put back' if undone else ''}")

    async def _undo(
        self, pod_dir: Cgroup | None, cgroup_parent: str, key: str, before: CpuQuota | None
    ) -> bool:
        """Put the pod quota read before a failed step back; True if something had to be written."""
        if pod_dir is None or before is None:
            return False
        with contextlib.suppress(CgroupError):
            if read_cpu_quota(pod_dir) == before:
                return False
        # Changed, or unreadable (a write cut short): write the whole value back, period included.
        try:
            await self.writer.write_pod_quota(pod_dir, cgroup_parent, before, current=None)
            self._written[key] = before.quota
        except CgroupError as exc:
            self._write_failed("pod_quota_restore")
            log.error("cannot put the pod quota back", pod_cgroup=str(pod_dir), error=str(exc))
        return True

    # -- releases ----------------------------------------------------------------------------------------

    async def resolve_unknown(self, key: str, cgroup_parent: str) -> None:
        """A pod whose cgroup could not be read at Synchronize: guess its own quota now, while the
        books still count every share that is in it."""
        record = self.books.pods.get(key)
        if record is None or record.baseline_source != "unknown":
            return
        with contextlib.suppress(CgroupError), self.open_pod(cgroup_parent) as pod_dir:
            await self._reconcile(pod_dir, self.books.pods, key, read_cpu_quota(pod_dir))

    async def settle(self, key: str, cgroup_parent: str, fields: Mapping[str, str], attempt: int = 0) -> None:
        """Bring a pod's quota down to its target after a release, and have the books saved; never
        fails the event. `fields` say which pod (and event) for the log."""
        pods = self.books.pods
        if key not in pods:
            return
        try:
            with self.open_pod(cgroup_parent) as pod_dir:
                now = await self._reconcile(pod_dir, pods, key, read_cpu_quota(pod_dir), attempt)
            self._forget_if_done(key, now)
        except CgroupError as exc:
            log.warning("cannot lower the pod quota", error=str(exc), **fields)
            record = pods.get(key)
            if record is not None and not record.containers and isinstance(exc, CgroupNotFound):
                del pods[key]  # the pod cgroup is gone: nothing left to lower
                self._written.pop(key, None)
        self.keeper.save_quietly()

    def restore_container(self, cgroups_path: str, exclusive: str, fields: Mapping[str, str]) -> bool:
        """Stop means stop: put a stopped shared container's own cgroup quota back to n(exclusive) *
        its period (see the module docstring), before its pod's is lowered. True if it was written.

        Never fails the event: a cgroup already gone has nothing to put back; any other failure is
        logged and counted (the pod's lowering may then be refused on v1, and retried)."""
        cpus = len(cpus_or_empty(exclusive))
        if not cpus or not cgroups_path:
            return False  # a record from before the books kept exclusive CPUs, or no path given
        try:
            cgroup = self.layout.cpu.dir(container_cgroup_path(cgroups_path))  # validated, as every path
            with open_cgroup(cgroup) as held:
                current = read_cpu_quota(held)
                own = cpus * current.period
                if current.quota is None or current.quota <= own:
                    return False  # unlimited (never raised), or already its own
                write_cpu_quota(held, own, current=current)
        except CgroupNotFound:
            return False  # removed already: nothing lingers
        except CgroupPathError as exc:
            log.warning("cannot put the stopped container's own quota back", error=str(exc), **fields)
            return False
        except CgroupError as exc:
            self._write_failed("container_quota_lower")
            log.warning("cannot put the stopped container's own quota back", error=str(exc), **fields)
            return False
        log.info(
            "stopped container's own quota put back",
            quota=f"{show_quota(current)} -> {show_quota(current.with_quota(own))}",
            **fields,
        )
        return True

    def cancel_retry(self, key: str) -> None:
        """The pod is gone: no more tries to lower its quota (and nothing more to know of it)."""
        self._written.pop(key, None)
        pending = self._retries.pop(key, None)
        if pending is not None:
            pending.cancel()

    def cancel_retries(self) -> None:
        """Stop every pending retry (at the end of a test or a run)."""
        for key in list(self._retries):
            self.cancel_retry(key)
        for task in self._retrying:
            task.cancel()

    def _retry_later(self, key: str, attempt: int) -> None:
        if attempt >= len(LOWER_RETRY_DELAYS):
            log.warning(
                "the pod quota stays above its target until the pod's next event",
                pod_key=key,
                attempts=attempt,
            )
            return
        retry = functools.partial(self._retry, key, attempt + 1)
        try:
            timer = self._clock.call_later(LOWER_RETRY_DELAYS[attempt], retry)
        except RuntimeError:  # no running loop: the pod's next event will try again
            return
        pending = self._retries.pop(key, None)
        if pending is not None:
            pending.cancel()
        self._retries[key] = timer

    def _retry(self, key: str, attempt: int) -> None:
        self._retries.pop(key, None)
        task = asyncio.ensure_future(self._retry_now(key, attempt))
        self._retrying.add(task)
        task.add_done_callback(self._retrying.discard)

    async def _retry_now(self, key: str, attempt: int) -> None:
        async with self.lock:
            record = self.books.pods.get(key)
            if record is not None and key not in self._retries:  # not dropped, nor rescheduled meanwhile
                await self.settle(key, record.cgroup_parent, {"pod_key": key}, attempt)

    # -- in-place resize -----------------------------------------------------------------------------------

    async def resize(
        self,
        pod: api.PodSandbox,
        resources: api.LinuxResources | None = None,
        overhead: api.LinuxResources | None = None,
    ) -> tuple[CpuQuota, CpuQuota] | None:
        """The pod may have been resized in place (UpdatePodSandbox; a shared container's update):
        its own quota from `resources` (+ `overhead`) when they carry a limited quota, else as
        kubelet wrote it to the cgroup (`adopt_resize`), and its quota brought to its new target
        before the reply. The pod's limit before and after; None for a pod the books do not hold,
        or whose cgroup fails us (logged: the reconciler tries again, the event does not fail)."""
        key = pod_key(pod)
        record = self.books.pods.get(key)
        if record is None:
            return None
        try:
            with self.open_pod(pod.linux.cgroup_parent) as pod_dir:
                current = read_cpu_quota(pod_dir)
                baseline = None
                if resources is not None:
                    baseline = baseline_from_resources(resources, overhead, current.period)
                if baseline is not None and current.quota is not None:
                    record = baselines.rebase(record, current).with_baseline(baseline, "pod-resources")
                    self.books.pods[key] = record
                now = await self._reconcile(pod_dir, self.books.pods, key, current)
        except CgroupError as exc:
            log.error("cannot bring the resized pod's quota to its target", error=str(exc), pod_key=key)
            return None
        self.keeper.save_quietly()
        return current, now

    # -- the reconciler's check ----------------------------------------------------------------------------

    async def check_pod(self, key: str) -> PodCheck:
        """Does the pod's cgroup directory still exist, and is its quota at its target? A quota off
        its target is written back (a lowering the kernel refuses is left to a pending retry or the
        next check; none is scheduled here). A pod back at its own quota with no shared container
        left is dropped from the books, as after a release. Nothing is logged: the caller says what
        was healed."""
        record = self.books.pods[key]
        try:
            pod_dir = self.open_pod(record.cgroup_parent)
        except CgroupNotFound:
            return PodCheck(PodState.GONE)
        except CgroupError as exc:  # an invalid path, a permission: nothing to say about the pod
            return PodCheck(PodState.FAILED, error=str(exc))
        with pod_dir:
            try:
                current = read_cpu_quota(pod_dir)
                if key in self._retries:
                    return PodCheck(PodState.PENDING, current, current)  # the retry is on it
                now = await self._reconcile(pod_dir, self.books.pods, key, current, None)
            except CgroupError as exc:
                return PodCheck(PodState.FAILED, error=str(exc))
        target = self.books.pods[key].target()
        self._forget_if_done(key, now)
        if target is not None and now.quota is not None and now.quota != target:
            return PodCheck(PodState.PENDING, current, now)
        return PodCheck(PodState.AT_TARGET if now == current else PodState.BROUGHT, current, now)

    # -- Synchronize ---------------------------------------------------------------------------------------

    async def sync_pods(
        self, present: Mapping[str, api.PodSandbox], books: Books, previous: Books, applied: Mapping[str, int]
    ) -> set[str]:
        """Bring the quota of every pod in `books` (rebuilt, not yet the plugin's), and of every pod of
        `previous` still `present`, to its target; the keys of the pods whose cgroup failed us.
        `applied`: per pod key, how many CPUs its shared containers already have beyond their
        exclusive ones."""
        failed: set[str] = set()
        for key in sorted(set(books.pods) | (set(previous.pods) & set(present))):
            pod = present[key]
            if key not in books.pods:
                books.pods[key] = PodRecord(cgroup_parent=pod.linux.cgroup_parent, baseline=None, period=1)
            if not await self._sync_pod(pod, books.pods, previous.pods.get(key), applied.get(key, 0)):
                failed.add(key)
        return failed

    async def _sync_pod(
        self,
        pod: api.PodSandbox,
        pods: MutableMapping[str, PodRecord],
        previous: PodRecord | None,
        applied: int,
    ) -> bool:
        """Bring one pod's quota to its target; False (logged) when its cgroup fails us."""
        key = pod_key(pod)
        established = False
        if previous is not None and above_runtime_limit(pod, previous):
            previous = None  # set aside: rebuilt as a pod the saved books did not know
        try:
            with self.open_pod(pod.linux.cgroup_parent) as pod_dir:  # one walk for all
                current = read_cpu_quota(pod_dir)
                if previous is not None:
                    pods[key] = baselines.known(pods[key], previous)
                else:
                    pods[key] = baselines.rebuilt(pod, pods[key], current, applied)
                    established = True
                # A new baseline is written ahead of the raise: killed before the books are saved,
                # the next start would take the raised quota for the pod's own.
                ahead = functools.partial(self._write_ahead, pods, key) if established else None
                now = await self._reconcile(pod_dir, pods, key, current, ahead=ahead)
            if now is not current and now != current:  # (`_reconcile` returns `current` when at target)
                log.info(
                    "pod quota brought to its target",
                    pod_quota=f"{show_quota(current)} -> {show_quota(now)}",
                    **pod_fields(pod, event="Synchronize"),
                )
            baselines.forget_if_done(pods, key, now, self.writer.settled(pod.linux.cgroup_parent))
        except CgroupError as exc:
            log.error(
                "cannot bring the pod quota to its target",
                error=str(exc),
                **pod_fields(pod, event="Synchronize"),
            )
            baselines.sync_failed(pods, key, previous, established)
            return False
        return True

    # -- the write -----------------------------------------------------------------------------------------

    def _forget_if_done(self, key: str, now: CpuQuota) -> None:
        record = self.books.pods.get(key)
        if record is None:
            return
        baselines.forget_if_done(self.books.pods, key, now, self.writer.settled(record.cgroup_parent))
        if key not in self.books.pods:
            self._written.pop(key, None)

    async def _reconcile(
        self,
        pod_dir: Cgroup,
        pods: MutableMapping[str, PodRecord],
        key: str,
        current: CpuQuota,
        attempt: int | None = 0,
        *,
        ahead: Callable[[], None] | None = None,
    ) -> CpuQuota:
        """Rebase the pod's record on `current` (kept in `pods` even if the write then fails), with
        the pod's own quota kubelet wrote at a resize adopted, and write its target to the pod cgroup
        (through the `writer`); returns what the pod cgroup now holds. `ahead` runs before the write
        (the books written ahead of the pod cgroup; it raises OSError to stop the write).

        Raising failures raise. A lowering the kernel refuses (v1: a child cgroup still has a higher
        quota, or was deleted moments ago and is not released yet) is retried a few times with
        backoff, then at the pod's next event; `attempt` None (the reconciler's check) schedules no
        retry and logs nothing: its next check tries again.
        """
        held = pods[key]
        record = self._adopted(baselines.rebase(held, current), current, key, pod_dir)
        if record is not held:  # (the same record written again would only mark the pod as changed)
            pods[key] = record
        if ahead is not None:
            ahead()
        target = record.target()
        if current.quota is None or target is None:
            self._written[key] = current.quota
            return current
        if target == current.quota:
            self._written[key] = target
            if self.writer.settled(record.cgroup_parent):
                return current
            # At its target in the file, with an older value of ours still pending (systemd's answer
            # to it may yet land): written again, so that the writer's latest value is the target.
        limit = current.with_quota(target)
        try:
            await self.writer.write_pod_quota(pod_dir, record.cgroup_parent, limit, current=current)
        except CgroupError as exc:
            self._write_failed("pod_quota_raise" if target > current.quota else "pod_quota_lower")
            if target > current.quota or not isinstance(exc, CgroupWriteRejected):
                raise
            if attempt is None:
                return current
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
        # Not read back: a write(2) the kernel accepted set the value (a writer through systemd reads
        # it back itself); a value someone changes later is the reconciler's to see.
        self._written[key] = target
        return limit

    def _adopted(self, record: PodRecord, current: CpuQuota, key: str, pod_dir: Cgroup) -> PodRecord:
        """`adopt_resize`, logged when it finds a resize."""
        written = self._written.get(key)
        if written is None:
            return record  # nothing written here yet: no telling whose a value is
        if not self.writer.settled(record.cgroup_parent):
            return record  # an older value of ours may be landing late (systemd's answer): not a resize
        resized = baselines.adopt_resize(record, current, written)
        if resized is not record:
            log.info(
                "the pod's own quota changed (an in-place resize): its target follows",
                pod_key=key,
                pod_cgroup=str(pod_dir),
                baseline=f"{record.baseline} -> {resized.baseline}",
            )
        return resized

    def _write_ahead(self, pods: Mapping[str, PodRecord], key: str) -> None:
        """A new pod's own quota to the database before Synchronize raises its cgroup
        (`Bookkeeper.write_ahead`). A failure is logged and the write goes on: the books are saved
        again at the end of Synchronize."""
        try:
            self.keeper.write_ahead(key, pods[key])
        except OSError as exc:
            log.error("cannot save the plugin's state", path=self.keeper.store.path, error=str(exc))

    def _write_failed(self, kind: str) -> None:
        if self.observer is not None:
            self.observer.cgroup_write_failed(kind)
