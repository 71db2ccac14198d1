"""The reconciler: what the books say checked against what exists on the node, not against the
history of events.

The handlers keep the books from the runtime's events, but real runtimes do not report every end
they cause (docs/runtime-behaviour.md, "Ends the runtimes do not report"):

* containerd forgets the pods it ran before its own restart: they are never reported stopped or
  removed, so their books would hold their shares for good. (Their device bindings are not the
  reconciler's business: a binding ends at the runtime's word, or when kubelet allocates the device
  anew and the new holder presents its newer marker, `nri_plugin.mixedcpu.books`; never by a look);
* CRI-O calls NRI CreateContainer before ``runc create``; when that fails, no StopContainer or
  RemoveContainer follows: the container would keep its share of the pod quota, and its place in
  the books and in ``mixed_cpu_shared_containers``, for good;
* a stopped container's cgroup lingers until removal with its raised quota, so cgroup v1 refuses
  the lower pod quota (put right at the stop itself: `quota.PodQuotas.restore_container`).

So the `Healer` checks the books against the node, and takes nothing away on one look:

* a pod whose cgroup directory is missing at two passes a reconcile interval apart (an event of the
  pod in between starts the count again; nothing is decided in the middle of a pod's events) is
  dropped from the books (``pod_gone``): its shares are given back. Its device bindings are left
  alone, whatever kubelet's record says and whether or not it answers: a look cannot tell a
  forgotten pod from one whose cgroup is briefly missing, and a binding dropped on looks would let a
  copy of its marker through. They end when the runtime says the pod is stopped or removed
  (StopPodSandbox, RemovePodSandbox, or a Synchronize without it), or when kubelet allocates the
  device to another pod and that pod's container presents the newer marker; even then the
  allocation stays spent, so a copy of the old marker is refused. A cgroup that cannot be checked (a
  path refused, a symlink, a permission) is never taken for a missing one;
* a container given a share whose creation the runtime never finished gives it back
  (``container_never_created``), but only once the runtime shows the creation over: never on a look
  that finds no cgroup while the creation may still be running (a runtime writes the container's
  raised quota late in its creation, and cgroup v1 refuses it above a lowered pod quota: the
  creation would fail). What shows it depends on the runtime (docs/design.md, Healing):

  - CRI-O calls NRI CreateContainer before its ``runc create``, which makes the cgroup; a failed
    ``runc create`` is followed by no NRI event at all, and its Synchronize does not list a
    container still in ``runc create`` either. So the watch ends at StartContainer with the cgroup
    there, and otherwise is decided `creation_timeout` seconds after CreateContainer: CRI-O abandons
    a ``runc create`` after its ``container_create_timeout`` (240 s by default) and deletes what it
    made, so a container with no cgroup by then was never created, and one with its cgroup was.
    (PostCreateContainer, which CRI-O sends after a ``runc create`` that worked, says nothing the
    cgroup and StartContainer do not: the plugin does not subscribe to it, which would add a round
    trip to every creation);
  - containerd makes the cgroup in its task's creation, just before it tells plugins of
    StartContainer, which kubelet may send any time later: a container not yet started keeps its
    share until its start, its stop or removal, or Synchronize (containerd lists what it created and
    holds Synchronize while a CRI call is in flight). Once started, a cgroup gone `grace` seconds
    later was made and removed by the runtime: the container is over.

  Before either, the runtime's own word ends the watch: StopContainer or RemoveContainer of the
  container, a newer instance in its slot (kubelet's retry: the share passes to it), its pod's end.
  A container whose share was given back and that the runtime starts after all gets it again, its
  pod raised before it runs;
* at Synchronize, a container the books held that the runtime no longer runs has given its share
  back (``container_gone``), but for a CRI-O creation still within its `creation_timeout`: CRI-O lists
  no container still in ``runc create``, so its share is carried over (`carry_creations`); and a pod
  the runtime no longer lists has ended its bindings (``pod_gone``);
* every pod quota is brought to its target, whoever moved it (``pod_quota``).

When: at the events of a pod (its overdue creations are looked at), at Synchronize, and every
`interval` seconds on the clock once the runtime has synchronized us (a whole pass). A pass costs
one cgroup directory walk and one quota read per pod in the books (the pods holding shared
containers); it writes, saves and logs nothing when nothing changed. Each
heal is logged (what, and why) and counted (`HealObserver.healed`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple, Protocol, TypeVar

import structlog

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import CgroupDir, CgroupError, cgroup_exists, container_cgroup_path
from nri_plugin.common.clock import LOOP_CLOCK, Clock, Timer
from nri_plugin.mixedcpu.books import Books, ContainerRecord, PodRecord, Slot, Watch
from nri_plugin.mixedcpu.logfields import EVENT_NAME, LOGGER_NAME, show_quota
from nri_plugin.mixedcpu.policy import pod_key
from nri_plugin.mixedcpu.quota import PodQuotas, PodState
from nri_plugin.mixedcpu.status import RECENT_HEALS, HealNote, Holder, Roster

__all__ = [
    "CREATION_GRACE",
    "CREATION_TIMEOUT",
    "HEAL_KINDS",
    "MIN_CREATION_GRACE",
    "PASS_BUDGET",
    "PASS_SLICE",
    "HealObserver",
    "Healer",
    "PassReport",
]

log = structlog.get_logger(LOGGER_NAME)

# containerd: how long after StartContainer (its task creation has made the cgroup by then) a cgroup
# may be missing before the container is taken for over: at most one reconcile interval, so a
# container gone without a word is healed within one period; but never under MIN_CREATION_GRACE,
# however short the interval.
CREATION_GRACE: Final = 10.0
MIN_CREATION_GRACE: Final = 2.0
# CRI-O: how long after NRI CreateContainer a creation may still be running. CRI-O waits for its
# `runc create` at most its runtime handler's container_create_timeout (240 s by default, never under
# 30 s), then kills and deletes it; the steps around it (storage, mounts, the cleanup) take seconds:
# a minute more is kept for them. Raise it with container_create_timeout (the `creation_timeout` key).
CREATION_TIMEOUT: Final = 300.0
HEAL_KINDS: Final = ("pod_gone", "container_never_created", "container_gone", "pod_quota")
# Wall seconds one reconcile pass may take (its reads and writes of pod cgroups: about 0.1 ms a pod);
# past it the rest waits for the next pass.
PASS_BUDGET: Final = 1.0
# Wall seconds a pass runs at most before it lets the loop handle what came meanwhile.
PASS_SLICE: Final = 0.02

_T = TypeVar("_T")

_WHY_FORGOTTEN = "its cgroup directory is gone, and the runtime never reported the pod stopped or removed"
_KEPT = (
    "pod gone: its books are dropped; its device bindings last until the runtime reports it removed "
    "or kubelet's newer allocation of the device is presented"
)


def _gone(*, books: bool, bindings: bool, kept: bool) -> str:
    """What a pod_gone heal dropped, said of what the pod had: its books, its device bindings (or
    that they are kept: a look never ends them), or both."""
    if bindings and kept:
        return _KEPT
    if bindings:
        return f"pod gone: its {'books and ' if books else ''}device bindings are dropped"
    return "pod gone: its books are dropped"


class HealObserver(Protocol):
    """Told of every heal (`nri_plugin.daemon.metrics`)."""

    def healed(self, kind: str) -> None:
        """`kind`: one of `HEAL_KINDS`."""


class _Creation(NamedTuple):
    """A container given a share whose cgroup has not been seen yet (a named tuple: made in C at
    every asking creation)."""

    slot: Slot
    container_id: str
    cgroups_path: str  # as the runtime sent it: validated when it is looked for, not at creation
    due: float | None  # on the clock: when its creation is over; None: not before its StartContainer
    since: str  # the event `due` counts from: CreateContainer (CRI-O) or StartContainer


@dataclass(frozen=True, slots=True)
class PassReport:
    """What one whole reconcile pass looked at and healed, and its time on the wall clock."""

    pods: int
    healed: int
    seconds: float


def _default_grace(interval: float | None) -> float:
    """`CREATION_GRACE`, shortened to one reconcile `interval` but never below `MIN_CREATION_GRACE`."""
    if interval is None:
        return CREATION_GRACE
    return min(CREATION_GRACE, max(interval, MIN_CREATION_GRACE))


class Healer:
    """Checks the books held by `quotas` against the node; see the module docstring.

    `interval` None: no timer, the checks run at events and Synchronize only. `grace` defaults to
    `CREATION_GRACE`, or the interval when that is shorter, but not under `MIN_CREATION_GRACE`;
    `creation_timeout` (settable) is `CREATION_TIMEOUT`.
    """

    def __init__(
        self,
        quotas: PodQuotas,
        *,
        interval: float | None = None,
        grace: float | None = None,
        observer: HealObserver | None = None,
        clock: Clock = LOOP_CLOCK,
    ) -> None:
        if interval is not None and interval <= 0:
            raise ValueError(f"reconcile interval must be positive, not {interval}")
        self.quotas = quotas
        self.interval = interval
        self.grace = grace if grace is not None else _default_grace(interval)
        self.creation_timeout = CREATION_TIMEOUT
        self.observer = observer
        self._clock = clock
        # Pod key -> slot name -> the latest creation in that slot whose cgroup is yet to be seen.
        self._creations: dict[str, dict[str, _Creation]] = {}
        # Pod key -> slot name -> the record of the instance a newer one displaced (kubelet created
        # its successor first): its own quota is put back when it is reported stopped. One per slot,
        # like the watches: neither grows with a pod's restarts.
        self._displaced: dict[str, dict[str, ContainerRecord]] = {}
        # Pod key -> slot name -> the record of a container whose share was given back: it gets it
        # again if the runtime starts it after all. One per slot, until the slot's next watched
        # creation, the container's end, the pod's end or Synchronize.
        self._given_back: dict[str, dict[str, ContainerRecord]] = {}
        # Whether the runtime makes a container's cgroup inside its creation (CRI-O: `runc create` after
        # NRI CreateContainer), so that a creation is watched from there until its start or
        # `creation_timeout`; otherwise (containerd, or a runtime not named) from StartContainer, for
        # `grace`.
        self.cgroup_at_creation = False
        # Slot -> its CRI-O creation as watched from CreateContainer (saved with the books; entries
        # no longer in `_creations` are dropped by `saved_watches`).
        self._crio: dict[Slot, _Creation] = {}
        # The watches a previous daemon saved, until the first Synchronize takes them up.
        self._restored: dict[Slot, Watch] = {}
        # Ids of the watched CRI-O creations the last Synchronize did not list but carried over.
        self.carried: frozenset[str] = frozenset()
        # Pod key -> when a pass first found its cgroup missing (it is gone at a second look).
        self._missing: dict[str, float] = {}
        self._tick: Timer | None = None
        self._grace_timer: Timer | None = None
        self._running: set[asyncio.Task[None]] = set()  # timer work in flight
        self._grace_due = 0.0
        self._deferred: list[str] = []  # pod keys a pass over its budget left for the next one
        self.recent: deque[HealNote] = deque(maxlen=RECENT_HEALS)  # the latest heals, newest first
        # Who the shared containers are (the plugin's), for the namespace and name of a heal's pod.
        self.roster: Roster | None = None

    @property
    def books(self) -> Books:
        return self.quotas.books

    @property
    def running(self) -> bool:
        """True while the periodic pass is scheduled."""
        return self._tick is not None

    def saved_watches(self) -> dict[Slot, Watch]:
        """The CRI-O creations watched from their CreateContainer, as the books keep them
        (`Bookkeeper.watch_source`): a daemon restarted during their ``runc create`` takes them up
        (`restore_watches`) and its Synchronize carries their shares. Costs the CRI-O creations in
        progress, not the watches (those ended are dropped from the index here)."""
        watches = dict(self._restored)
        for slot, creation in list(self._crio.items()):
            if self._creations.get(slot.pod, {}).get(slot.name) is not creation:
                del self._crio[slot]  # started, ended, due, its pod gone, or Synchronize
            elif creation.due is not None:
                watches[slot] = Watch(creation.container_id, creation.cgroups_path, creation.due)
        return watches

    def restore_watches(self, watches: Mapping[Slot, Watch]) -> None:
        """Take up the watches a previous daemon saved, at the first Synchronize (`carry_creations`;
        saved again meanwhile). One due more than `creation_timeout` from then was not set on this
        boot's clock (a reboot): left out."""
        self._restored = dict(watches)

    def forget_creation(self, slot: Slot, container_id: str) -> None:
        """The creation was refused after all: nothing to watch."""
        creation = self._creations.get(slot.pod, {}).get(slot.name)
        if creation is not None and creation.container_id == container_id:
            _drop(self._creations, slot)

    @property
    def watched(self) -> frozenset[str]:
        """The ids of the containers whose cgroup has yet to be seen."""
        return frozenset(c.container_id for slots in self._creations.values() for c in slots.values())

    # -- the timer --------------------------------------------------------------------------------------

    def start(self) -> None:
        """Run a whole pass every `interval` seconds from now on (nothing without an interval or a
        running loop; nothing more if already running)."""
        if self.interval is None or self._tick is not None:
            return
        try:
            self._tick = self._clock.call_later(self.interval, self._on_tick)
        except RuntimeError:  # no running loop: the events and Synchronize still heal
            return
        self._arm_grace()

    def stop(self) -> None:
        """No more timers (at the end of a run or a test)."""
        for timer in (self._tick, self._grace_timer):
            if timer is not None:
                timer.cancel()
        self._tick = self._grace_timer = None
        for task in self._running:
            task.cancel()

    def _on_tick(self) -> None:
        self._tick = None
        self._spawn(self._tick_now())

    async def _tick_now(self) -> None:
        try:
            await self.reconcile()  # (takes the lock pod by pod)
        except Exception:  # a bug: said, and the next pass still comes
            log.exception("reconcile pass failed")
        finally:
            self.start()

    def _spawn(self, work: Coroutine[None, None, None]) -> None:
        """Run `work` as a task of its own (a timer's callback cannot wait for systemd's replies)."""
        task = asyncio.ensure_future(work)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _arm_grace(self, due: float | None = None) -> None:
        """Have the earliest creation checked when it falls due (only while the timer runs). `due`:
        that of the creation just watched; when the timer falls due before it, nothing changes (and
        the others need no look: a creation after a burst must not cost the burst)."""
        if self._tick is None or not self._creations:
            return
        if due is not None and self._grace_timer is not None and self._grace_due <= due:
            return
        dues = [c.due for slots in self._creations.values() for c in slots.values() if c.due is not None]
        if not dues:
            return
        due = min(dues)
        if self._grace_timer is not None:
            if self._grace_due <= due:
                return
            self._grace_timer.cancel()
        self._grace_timer = self._clock.call_later(max(due - self._clock.monotonic(), 0.0), self._on_grace)
        self._grace_due = due

    def _on_grace(self) -> None:
        self._grace_timer = None
        self._spawn(self._grace_now())

    async def _grace_now(self) -> None:
        try:
            async with self.quotas.lock:
                await self._check_creations()
        except Exception:  # a bug: said, and the next deadline still comes
            log.exception("creation check failed")
        finally:
            self._arm_grace()

    # -- the events ---------------------------------------------------------------------------------------

    def watch_creation(self, slot: Slot, container: api.Container) -> None:
        """A container was given a share: its creation is watched until the runtime shows it over
        (`cgroup_at_creation`: its start, or `creation_timeout` seconds from now; else from its
        StartContainer on, for `grace`). (Its path is checked when it is looked for: most containers
        end the watch by their events first.)"""
        path = container.linux.cgroups_path
        if not path:  # no path: only its events can end it
            return
        _drop(self._given_back, slot)  # a new instance: the one given back is dead
        if self.cgroup_at_creation:
            due: float | None = self._clock.monotonic() + self.creation_timeout
            creation = self._crio[slot] = _Creation(slot, container.id, path, due, "CreateContainer")
        else:
            due, creation = None, _Creation(slot, container.id, path, None, "StartContainer")
        self._creations.setdefault(slot.pod, {})[slot.name] = creation
        if due is not None:
            self._arm_grace(due)

    async def container_started(self, slot: Slot, pod: api.PodSandbox, container: api.Container) -> None:
        """StartContainer: the runtime has made the container's cgroup (containerd makes it here, just
        before it tells plugins). A watched container's `grace` counts from now if its cgroup is not
        there; one whose share was given back gets it again, its pod raised before it runs (a
        `PluginRefusal` if the pod cgroup fails us, as at a creation)."""
        creation = self._creations.get(slot.pod, {}).get(slot.name)
        if creation is not None and creation.container_id == container.id:
            try:
                cgroup = self.quotas.layout.cpu.dir(container_cgroup_path(creation.cgroups_path))
                there = cgroup_exists(cgroup)
            except CgroupError:  # a path we refuse, or cannot tell: never costs it its share
                there = True
            if there:
                _drop(self._creations, slot)
            elif creation.due is None:
                due = self._clock.monotonic() + self.grace
                self._creations[slot.pod][slot.name] = creation._replace(due=due)
                self._arm_grace(due)
        record = self._given_back.get(slot.pod, {}).get(slot.name)
        if record is None or record.id != container.id:
            return
        _drop(self._given_back, slot)
        if self.books.holder(slot) is not None:
            return  # a newer instance holds the slot
        before, after = await self.quotas.raise_for(
            pod, container, slot, record, self.books.pods.get(slot.pod), event="StartContainer"
        )
        log.warning(
            "container started after its share was given back: its share is given again",
            container_id=container.id,
            slot=str(slot),
            pod_quota=f"{show_quota(before)} -> {show_quota(after)}",
        )

    def note_displaced(self, slot: Slot, record: ContainerRecord) -> None:
        """A new instance took `slot` from `record`'s container, which is dead or dying."""
        self._displaced.setdefault(slot.pod, {})[slot.name] = record

    def container_ended(
        self, slot: Slot, container: api.Container, record: ContainerRecord | None, fields: Mapping[str, str]
    ) -> None:
        """The runtime reported the container (of `slot`) stopped or removed; `record`: the slot's
        record if it still held it. Stop means stop: a shared container's own quota is put back."""
        creation = self._creations.get(slot.pod, {}).get(slot.name)
        if creation is not None and creation.container_id == container.id:
            _drop(self._creations, slot)
        given_back = self._given_back.get(slot.pod, {}).get(slot.name)
        if given_back is not None and given_back.id == container.id:
            _drop(self._given_back, slot)
        displaced = self._displaced.get(slot.pod, {}).get(slot.name)
        if displaced is not None and displaced.id == container.id:
            _drop(self._displaced, slot)
            record = record or displaced
        if record is not None:
            self.quotas.restore_container(container.linux.cgroups_path, record.exclusive, fields)

    def forget_pod(self, key: str) -> None:
        """The pod is gone: nothing of it is watched any more."""
        self._creations.pop(key, None)
        self._displaced.pop(key, None)
        self._given_back.pop(key, None)
        self._missing.pop(key, None)

    async def at_pod_event(self, key: str) -> None:
        """An event of the pod: the runtime still knows it (a look that found its cgroup missing is
        forgotten); its creations past their grace are looked at now."""
        self._missing.pop(key, None)
        if key in self._creations:
            await self._check_creations(key)

    # -- Synchronize --------------------------------------------------------------------------------------

    def before_sync(self, previous: Books, containers: Sequence[api.Container]) -> None:
        """Stop means stop for the containers that stopped while we were not told: each one the books
        held (or that was displaced) and the runtime lists stopped gets its own quota back before the
        pod quotas are brought to their targets."""
        stopped = [c for c in containers if c.state == api.CONTAINER_STOPPED]
        if not stopped:
            return
        held = {record.id: record for record in previous.records()}
        held.update((r.id, r) for slots in self._displaced.values() for r in slots.values())
        for container in stopped:
            record = held.get(container.id)
            if record is not None:
                fields = {"container_id": container.id, EVENT_NAME: "Synchronize"}
                self.quotas.restore_container(container.linux.cgroups_path, record.exclusive, fields)

    def carry_creations(
        self, previous: Books, books: Books, pods: Mapping[str, api.PodSandbox], listed: Iterable[str]
    ) -> None:
        """Synchronize on CRI-O: a watched creation not yet due that the runtime does not list may
        still be in its ``runc create`` (CRI-O lists a container only once that is done). Its share
        is carried into the rebuilt `books` (if its pod is listed and its slot free there) and its
        watch kept, so its pod quota is not lowered under it."""
        carried: set[str] = set()
        self._take_up_restored()
        if self.cgroup_at_creation:
            seen = set(listed)
            now = self._clock.monotonic()
            for slots in self._creations.values():
                for creation in slots.values():
                    slot = creation.slot
                    pod = pods.get(slot.pod)
                    record = previous.holder(slot)
                    if pod is None or record is None or creation.container_id in seen:
                        continue
                    if record.id != creation.container_id or books.holder(slot) is not None:
                        continue  # another instance: the books' own word
                    if creation.due is None or creation.due <= now:
                        continue  # over by now: Synchronize says it is gone
                    new_pod = None
                    if slot.pod not in books.pods:
                        new_pod = PodRecord(cgroup_parent=pod.linux.cgroup_parent, baseline=None, period=1)
                    books.hold(slot, record, new_pod=new_pod)
                    carried.add(creation.container_id)
        self.carried = frozenset(carried)

    def _take_up_restored(self) -> None:
        """The watches a previous daemon saved (`restore_watches`), watched from now on."""
        now = self._clock.monotonic()
        for slot, watch in self._restored.items():
            if watch.due - now <= self.creation_timeout:
                creation = _Creation(
                    slot, watch.container_id, watch.cgroups_path, watch.due, "CreateContainer"
                )
                if self._creations.setdefault(slot.pod, {}).setdefault(slot.name, creation) is creation:
                    self._crio[slot] = creation
        self._restored = {}

    def after_sync(
        self, previous: Books, pods: Iterable[api.PodSandbox], containers: Iterable[api.Container]
    ) -> None:
        """Say what Synchronize, the runtime's own view, healed of the previous books; the watches
        end (the runtime lists what it created) but those of the creations `carry_creations` carried;
        the timer starts."""
        present = {pod_key(pod) for pod in pods}
        states = {container.id: container.state for container in containers}
        for slot, record in previous.slots():
            if record.id in self.carried:
                continue
            state = states.get(record.id)
            if state is not None and state != api.CONTAINER_STOPPED:
                continue
            why = "the runtime lists it stopped" if state is not None else "the runtime does not know it"
            self._healed(
                "container_gone",
                "shared container no longer running: its share is given back",
                self._holder(record.id),
                why=f"{why}, and no StopContainer or RemoveContainer reached the plugin",
                container_id=record.id,
                slot=str(slot),
            )
        bound = previous.bound_pods()
        for key in sorted((set(previous.pods) | bound) - present):
            self._healed(
                "pod_gone",
                _gone(books=key in previous.pods, bindings=key in bound, kept=False),
                self._pod_holder(previous.pods.get(key)),
                why="the runtime no longer lists it, and its end was not reported to the plugin",
                pod_key=key,
            )
        kept = {
            key: {name: c for name, c in slots.items() if c.container_id in self.carried}
            for key, slots in self._creations.items()
        }
        self._creations = {key: slots for key, slots in kept.items() if slots}
        self._displaced.clear()
        self._given_back.clear()
        self._missing.clear()
        self.start()
        self._arm_grace()

    # -- the whole pass -----------------------------------------------------------------------------------

    async def reconcile(self) -> PassReport:
        """One whole pass over the books (see the module docstring); saved if anything changed.

        Takes `PodQuotas.lock` for each pod, never for the whole pass, and yields to the loop between
        pods every `PASS_SLICE` seconds: an NRI handler waits for a slice at most. Past
        `PASS_BUDGET` seconds, the pods not looked at yet are left for the next pass, which looks at
        them first."""
        started = time.perf_counter()
        books = self.books
        lock = self.quotas.lock
        async with lock:
            healed = await self._check_creations()
        records = dict(books.pods)
        first = [key for key in self._deferred if key in records]
        left = set(first)
        order = first + [key for key in records if key not in left]
        self._deferred = []
        yielded = started
        for index, key in enumerate(order):
            now = time.perf_counter()
            if now - started > PASS_BUDGET:
                self._deferred = order[index:]
                log.info("reconcile pass over its time budget: the rest next pass",
                         budget_seconds=PASS_BUDGET, deferred=len(self._deferred))  # fmt: skip
                break
            if index and now - yielded > PASS_SLICE:
                await asyncio.sleep(0)  # an event that came meanwhile is handled first
                yielded = time.perf_counter()
            async with lock:
                if key in books.pods:
                    healed += await self._check_pod(key)
        async with lock:
            return self._end_pass(started, records, healed)

    def _end_pass(self, started: float, records: dict[str, PodRecord], healed: int) -> PassReport:
        books = self.books
        bound_only = books.bound_pods() - set(books.pods)
        for key in set(self._missing) - set(books.pods):
            del self._missing[key]  # dropped, or no longer looked at
        for key in set(books.pod_cgroups) - bound_only - set(books.pods):
            del books.pod_cgroups[key]  # an index entry nothing refers to any more
        if healed or _changed(records, books):
            self.quotas.keeper.save_quietly()
        report = PassReport(len(records), healed, time.perf_counter() - started)
        log.debug("reconcile pass", pods=report.pods, healed=report.healed, seconds=round(report.seconds, 6))
        return report

    async def _check_pod(self, key: str) -> int:
        """Is the pod there, its quota at its target? 1 if something was healed."""
        cgroup_parent = self.books.pods[key].cgroup_parent
        check = await self.quotas.check_pod(key)
        if check.state is PodState.GONE:
            if not self._second_look(key):
                return 0
            self._drop_pod(key, _WHY_FORGOTTEN, cgroup_parent)
            return 1
        self._missing.pop(key, None)
        if check.state is PodState.BROUGHT:
            self._healed(
                "pod_quota",
                "pod quota was off its target: brought back",
                self._pod_holder(self.books.pods.get(key)),
                why="changed behind the plugin's back (another agent, systemd re-applying a unit), or a "
                "lowering the kernel refused earlier",
                pod_key=key,
                pod_cgroup=cgroup_parent,
                pod_quota=f"{show_quota(check.before)} -> {show_quota(check.after)}",
            )
            return 1
        if check.state is PodState.FAILED:
            log.debug("cannot check the pod quota", pod_key=key, pod_cgroup=cgroup_parent, error=check.error)
        return 0

    async def _check_creations(self, key: str | None = None) -> int:
        """The creations past their due (of pod `key`, or all): one the runtime finished (its
        cgroup is there) is left alone; one it did not gives its share back. How many did."""
        now = self._clock.monotonic()
        pods = list(self._creations) if key is None else [key]
        watches = [c for pod in pods for c in self._creations.get(pod, {}).values()]
        due = [c for c in watches if c.due is not None and c.due <= now]
        healed = 0
        for creation in due:
            if self._creations.get(creation.slot.pod, {}).get(creation.slot.name) is not creation:
                continue  # its pod was dropped meanwhile
            _drop(self._creations, creation.slot)
            holder = self.books.holder(creation.slot)
            if holder is None or holder.id != creation.container_id:
                continue  # ended, or displaced, meanwhile
            try:
                cgroup = self.quotas.layout.cpu.dir(container_cgroup_path(creation.cgroups_path))
                if cgroup_exists(cgroup):
                    continue
            except CgroupError:  # a path we refuse, or cannot tell: its events still can end it
                continue
            if self._pod_gone(creation.slot.pod):
                # Not a failed creation: its pod's cgroup is missing too. Whether the pod is gone is
                # the passes' to say (two looks); the container is looked at again after a grace.
                later = creation._replace(due=now + self.grace)
                self._creations.setdefault(creation.slot.pod, {})[creation.slot.name] = later
                continue
            await self._give_back(creation, cgroup)
            healed += 1
        return healed

    async def _give_back(self, creation: _Creation, cgroup: CgroupDir) -> None:
        """The container never came to be: its slot is freed and its pod quota lowered (and given
        again if the runtime starts it after all: `container_started`)."""
        released = self.books.release_holder(creation.container_id)
        key = creation.slot.pod
        if released is not None:
            self._given_back.setdefault(key, {})[creation.slot.name] = released[1]
        record = self.books.pods[key]
        # Lowered first, then told: whoever reads the line (or the counter) sees the pod already right.
        await self.quotas.settle(key, record.cgroup_parent, {"pod_key": key, EVENT_NAME: "reconcile"})
        if creation.since == "CreateContainer":
            why = (
                f"no cgroup {self.creation_timeout:g} s after CreateContainer, longer than the runtime "
                "lets a creation run (CRI-O: container_create_timeout): its creation failed after the "
                "plugin's adjustment, and no StopContainer or RemoveContainer follows"
            )
        else:
            why = (
                f"its cgroup, made by the runtime by StartContainer, is gone {self.grace:g} s later, and no "
                "StopContainer or RemoveContainer came"
            )
        self._healed(
            "container_never_created",
            "container never created: its share is given back",
            self._holder(creation.container_id),
            why=why,
            container_id=creation.container_id,
            slot=str(creation.slot),
            container_cgroup=cgroup.fs_path,
        )

    def _pod_gone(self, key: str) -> bool:
        """True when the pod's cgroup directory is known and gone."""
        cgroup_parent = self.books.cgroup_parent(key)
        if cgroup_parent is None:
            return False  # bound before a restart and not listed since: Synchronize decides
        try:
            return not cgroup_exists(self.quotas.pod_dir(cgroup_parent))
        except CgroupError:
            return False

    def _second_look(self, key: str) -> bool:
        """The pod's cgroup was found missing now: True if it was already at a look at least one
        reconcile interval ago (no interval: at an earlier look); else this look is remembered."""
        now = self._clock.monotonic()
        first = self._missing.setdefault(key, now)
        return first != now and now - first >= (self.interval or 0.0)

    def _drop_pod(self, key: str, why: str, cgroup_parent: str | None = None) -> None:
        """The pod is gone by two looks: its books are dropped, its device bindings kept (see the
        module docstring)."""
        books = self.books
        cgroup_parent = cgroup_parent or books.cgroup_parent(key) or "?"
        who = self._pod_holder(books.pods.get(key))
        bound = key in books.bound_pods()
        record = books.pods.pop(key, None)
        self.quotas.cancel_retry(key)
        self.forget_pod(key)
        self._healed(
            "pod_gone",
            _gone(books=record is not None, bindings=bound, kept=True),
            who,
            why=why,
            pod_key=key,
            pod_cgroup=cgroup_parent,
            containers=sorted(record.containers) if record is not None else [],
        )

    def _holder(self, container_id: str) -> Holder | None:
        return self.roster.get(container_id) if self.roster is not None else None

    def _pod_holder(self, record: PodRecord | None) -> Holder | None:
        return self.roster.of_pod(record) if self.roster is not None else None

    def _healed(self, kind: str, message: str, who: Holder | None = None, **fields: object) -> None:
        """Log the heal, keep it for the status, count it; `who`: its pod's namespace and name,
        when the roster knows them."""
        if who is not None:
            fields = {"namespace": who.namespace, "pod": who.pod, **fields}
        log.info(message, heal=kind, **fields)
        self.recent.appendleft(HealNote(time.time(), kind, message, fields))
        if self.observer is not None:
            self.observer.healed(kind)


def _drop(by_pod: dict[str, dict[str, _T]], slot: Slot) -> None:
    """Remove `slot`'s entry from a pod key -> slot name map, and the pod's map once empty."""
    slots = by_pod.get(slot.pod)
    if slots is not None:
        slots.pop(slot.name, None)
        if not slots:
            del by_pod[slot.pod]


def _changed(records: Mapping[str, object], books: Books) -> bool:
    """Whether any pod record changed (records are immutable: a change is a new object)."""
    return len(records) != len(books.pods) or any(books.pods.get(k) is not r for k, r in records.items())
