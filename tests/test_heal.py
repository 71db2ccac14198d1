"""The reconciler (`nri_plugin.mixedcpu.heal`) in process, on virtual time: what real runtimes leave
behind is put right from what the node shows, at events, at Synchronize and on the timer; and stop
means stop (a stopped container's own quota back, then its pod's).

The plugin's handlers are called directly; a fake cgroup tree plays the node (the test does the
runtime's and kubelet's part on it: container cgroups made after creation, pod cgroups deleted).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sqlite3
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog
from mixedcpu_support import (
    GUARD,
    PERIOD,
    FakeCgroups,
    FakeKubeletRecord,
    Naming,
    apply_adjustment,
    make_container,
    make_plugin,
    make_pod,
    marker,
    new_allocation,
    plugin_running,
    saved_books,
    saved_state,
)

from nri_plugin import cgroups
from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import Cgroup, CpuQuota, read_cpu_quota, write_cpu_limit, write_cpu_quota
from nri_plugin.common.clock import ManualClock
from nri_plugin.daemon import config as config_module
from nri_plugin.daemon.wiring import build_plugin
from nri_plugin.mixedcpu import quota
from nri_plugin.mixedcpu.books import Books, Slot
from nri_plugin.mixedcpu.heal import CREATION_GRACE, CREATION_TIMEOUT, MIN_CREATION_GRACE, Healer, PassReport
from nri_plugin.mixedcpu.store import StateStore
from nri_plugin.nri.simulator import CreationFailed, RuntimeSimulator

SHARED = frozenset({0, 1})
BASELINE = 2 * PERIOD  # the pod's own quota: its container's 2 exclusive CPUs
RAISED = BASELINE + len(SHARED) * PERIOD
OWN = 2 * PERIOD  # a shared container's own quota: n(exclusive) x period
INTERVAL = 30.0
NAMING = {1: Naming("containerd", "cgroupfs"), 2: Naming("cri-o", "systemd")}


class Seen:
    """The plugin's observer: heals and failed writes, counted by kind; when each heal came on
    `clock`."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.heals: Counter[str] = Counter()
        self.healed_at: list[float] = []
        self.failures: Counter[str] = Counter()

    def healed(self, kind: str) -> None:
        self.heals[kind] += 1
        self.healed_at.append(self.clock.monotonic())

    def cgroup_write_failed(self, kind: str) -> None:
        self.failures[kind] += 1


class Node:
    """A plugin on a fake tree and a manual clock; the test plays the runtime and kubelet."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        version: int = 1,
        interval: float | None = INTERVAL,
        allocations: FakeKubeletRecord | None = None,
    ) -> None:
        self.clock = ManualClock()
        self.naming = NAMING[version]
        self.tree = FakeCgroups(tmp_path / "cgroup", version)
        self.seen = Seen(self.clock)
        self.plugin, self.key = make_plugin(
            tmp_path / "state",
            self.tree.layout,
            SHARED,
            observer=self.seen,
            clock=self.clock,
            reconcile_interval=interval,
            allocations=allocations,
        )

    def pod(self, uid: str, name: str = "app") -> api.PodSandbox:
        pod = make_pod(self.naming, uid, name=name)
        self.tree.add_pod(pod, BASELINE)
        return pod

    async def create(
        self, pod: api.PodSandbox, cid: str, name: str = "fwd", *, device: str = "dev-1", run: bool = True
    ) -> api.Container:
        """kubelet's CreateContainer; with `run`, the runtime then makes its cgroup (adjusted) and
        kubelet's StartContainer follows."""
        container = make_container(self.naming, pod, cid, name, annotations=marker(self.key, device))
        response = await self.plugin.create_container(pod, container)
        apply_adjustment(container, response.adjust if response is not None else None)
        if run:
            await self.start(pod, container)
        return container

    async def start(self, pod: api.PodSandbox, container: api.Container) -> None:
        """The runtime makes the container's cgroup, then tells StartContainer (containerd's order)."""
        self.tree.run_container(container)
        container.state = api.CONTAINER_RUNNING
        await self.plugin.start_container(pod, container)

    async def runtime_is(self, name: str) -> None:
        """The runtime's Configure: "cri-o" makes a container's cgroup in CreateContainer."""
        await self.plugin.configure(api.ConfigureRequest(runtime_name=name))

    def container_quota(self, container: api.Container) -> int | None:
        return read_cpu_quota(self.tree.container_dir(container)).quota

    def delete_pod(self, pod: api.PodSandbox) -> None:
        """kubelet removes the pod's cgroup (its containers' with it)."""
        shutil.rmtree(self.tree.pod_dir(pod).fs_path)

    def saved(self) -> Books:
        return saved_books(Path(self.plugin.store.directory))


def heals(logs: list[MutableMapping[str, Any]], kind: str) -> list[MutableMapping[str, Any]]:
    return [entry for entry in logs if entry.get("heal") == kind]


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


# -- pods the runtime never reported gone -------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("answers", [True, False], ids=["kubelet-answers", "kubelet-configured-but-silent"])
async def test_a_pod_gone_at_two_looks_keeps_its_bindings_and_kubelets_newest_allocation_wins(
    tmp_path: Path, answers: bool
) -> None:
    """containerd after its restart: the pod's end is never reported; its cgroup is gone all the same.
    Its books go at the second look, its binding does not, whether kubelet's record answers or not
    (issue 29, item 3: two looks must not let a copy of its marker through). The device's next
    allocation by kubelet takes it at its first creation; a copy of the old marker stays refused."""
    kubelet = FakeKubeletRecord()
    kubelet.reachable = answers
    node = Node(tmp_path, allocations=kubelet)
    plugin = node.plugin
    forgotten = node.pod("1-1", "forgotten")
    kubelet.allocate(forgotten, "fwd", "dev-1")
    await plugin.synchronize([forgotten], [])  # synchronized: the timer runs
    await node.create(forgotten, "c1")
    node.delete_pod(forgotten)  # and its running container: no StopPodSandbox, no RemovePodSandbox
    kubelet.forget(forgotten)
    with structlog.testing.capture_logs() as logs:
        await node.clock.advance(2 * INTERVAL)
    [gone] = heals(logs, "pod_gone")
    assert gone["event"].startswith("pod gone: its books are dropped; its device bindings last")
    assert gone["pod_key"] == forgotten.uid
    assert "never reported the pod stopped or removed" in gone["why"]
    assert plugin.books.pods == {}
    await node.clock.advance(10 * INTERVAL)
    assert plugin.books.devices == {"dev-1": Slot(forgotten.uid, "fwd")}
    assert node.saved().devices == {"dev-1": Slot(forgotten.uid, "fwd")}
    # A copy of its marker in a pod kubelet gave nothing: refused.
    thief = node.pod("3-3", "thief")
    copied = make_container(node.naming, thief, "c9", "fwd", annotations=marker(node.key, "dev-1"))
    with structlog.testing.capture_logs() as logs:
        assert await plugin.create_container(thief, copied) is None
    [refused] = [e for e in logs if e["event"] == "request refused"]
    assert ("kubelet's record shows no" if answers else "a replayed marker") in refused["reason"]
    # kubelet gives the device to a new pod: its fresh marker is granted at its first creation.
    successor = node.pod("2-2", "successor")
    kubelet.allocate(successor, "fwd", "dev-1")
    fresh = make_container(node.naming, successor, "c2", "fwd", annotations=new_allocation(node.key, "dev-1"))
    response = await plugin.create_container(successor, fresh)
    assert response is not None
    assert response.adjust.linux.resources.cpu.cpus == "0-1,4-5"
    assert node.tree.pod_quota(successor) == RAISED
    assert plugin.books.devices == {"dev-1": Slot(successor.uid, "fwd")}
    # ... and the old allocation is spent: a copy of it is refused, here as after a restart.
    kubelet.reachable = False
    again = make_container(node.naming, thief, "c10", "fwd", annotations=marker(node.key, "dev-1"))
    assert await plugin.create_container(thief, again) is None
    plugin.store.close()  # (as a restart: the old process's lock on the database goes with it)
    restarted, _ = make_plugin(tmp_path / "state", node.tree.layout, SHARED, allocations=kubelet)
    assert await restarted.create_container(thief, again) is None
    plugin.healer.stop()


@pytest.mark.asyncio
async def test_a_pod_cgroup_missing_for_a_look_costs_no_binding_in_the_marker_fallback(node: Node) -> None:
    """Issue 25, break 3: the holder's pod cgroup is missing at a pass (moved away a moment); another
    pod presenting the holder's marker is refused, and the holder's own restart is granted."""
    plugin = node.plugin
    holder = node.pod("1-1", "holder")
    await plugin.synchronize([holder], [])
    first = await node.create(holder, "c1")
    pod_dir = node.tree.pod_dir(holder).fs_path
    aside = os.path.join(os.path.dirname(pod_dir), "aside")
    os.rename(pod_dir, aside)  # missing for one look
    await node.clock.advance(INTERVAL)
    assert plugin.books.devices == {"dev-1": Slot(holder.uid, "fwd")}
    thief = node.pod("2-2", "thief")
    with structlog.testing.capture_logs() as logs:
        assert (
            await plugin.create_container(
                thief, make_container(node.naming, thief, "c9", "fwd", annotations=marker(node.key, "dev-1"))
            )
            is None
        )
    [refused] = [e for e in logs if e["event"] == "request refused"]
    assert "a replayed marker" in refused["reason"]
    os.rename(aside, pod_dir)  # back
    await node.clock.advance(INTERVAL)
    await plugin.stop_container(holder, first)
    node.tree.remove_container(first)
    again = await node.create(holder, "c2")  # the holder's restart
    assert again.linux.resources.cpu.cpus == "0-1,4-5"
    assert plugin.books.devices == {"dev-1": Slot(holder.uid, "fwd")}
    assert node.tree.pod_quota(holder) == RAISED
    assert node.seen.heals == {}
    plugin.healer.stop()


@pytest.mark.asyncio
async def test_in_the_marker_fallback_a_binding_outlives_a_missing_cgroup_until_a_newer_allocation(
    tmp_path: Path,
) -> None:
    """No kubelet record: a pod whose cgroup is gone for good keeps its bindings (its books go); a copy
    of its marker is refused before and after the runtime says the pod is gone, and the device's next
    allocation by kubelet is granted at its first creation."""
    node = Node(tmp_path)
    plugin = node.plugin
    vanished = node.pod("1-1", "vanished")
    await plugin.synchronize([vanished], [])
    await node.create(vanished, "c1")
    node.delete_pod(vanished)  # and its running container, with no event of either
    with structlog.testing.capture_logs() as logs:
        await node.clock.advance(2 * INTERVAL)
    [gone] = heals(logs, "pod_gone")
    assert "its device bindings last until the runtime reports it removed" in gone["event"]
    assert gone["containers"] == ["fwd"]
    assert plugin.books.pods == {}
    await node.clock.advance(10 * INTERVAL)
    assert plugin.books.devices == {"dev-1": Slot(vanished.uid, "fwd")}
    copier = node.pod("2-2", "copier")
    copy = make_container(node.naming, copier, "c2", "fwd", annotations=marker(node.key, "dev-1"))
    assert await plugin.create_container(copier, copy) is None, "a copy of the holder's allocation"
    await plugin.synchronize([copier], [])  # the runtime's word: the holder's pod is no more
    assert plugin.books.devices == {}
    with structlog.testing.capture_logs() as logs:
        assert await plugin.create_container(copier, copy) is None, "its holder gone: still a copy"
    [refused] = [e for e in logs if e["event"] == "request refused"]
    assert "a marker is good for one allocation, also once its holder is gone" in refused["reason"]
    successor = node.pod("3-3", "successor")
    fresh = make_container(node.naming, successor, "c3", "fwd", annotations=new_allocation(node.key, "dev-1"))
    response = await plugin.create_container(successor, fresh)
    assert response is not None
    assert response.adjust.linux.resources.cpu.cpus == "0-1,4-5"
    assert plugin.books.devices == {"dev-1": Slot(successor.uid, "fwd")}
    plugin.healer.stop()


@pytest.mark.asyncio
async def test_without_a_timer_a_vanished_holder_keeps_its_device(tmp_path: Path) -> None:
    """A creation presenting a bound device never decides that the holder's pod is gone; the
    runtime's word ends the binding, but the allocation stays spent: only a newer one is granted."""
    node = Node(tmp_path, interval=None)
    plugin = node.plugin
    holder = node.pod("1-1", "holder")
    await node.create(holder, "c1")
    node.delete_pod(holder)  # and its running container, with no event of either
    successor = node.pod("2-2", "successor")
    copy = make_container(node.naming, successor, "c2", "fwd", annotations=marker(node.key, "dev-1"))
    with structlog.testing.capture_logs() as logs:
        assert await plugin.create_container(successor, copy) is None
    assert heals(logs, "pod_gone") == []
    assert list(plugin.books.pods) == [holder.uid]
    await plugin.remove_pod_sandbox(holder)  # the runtime's word
    assert await plugin.create_container(successor, copy) is None
    fresh = make_container(node.naming, successor, "c3", "fwd", annotations=new_allocation(node.key, "dev-1"))
    response = await plugin.create_container(successor, fresh)
    assert response is not None
    assert response.adjust.linux.resources.cpu.cpus == "0-1,4-5"


# -- creations that failed after our adjustment ------------------------------------------------------


@pytest.mark.asyncio
async def test_a_creation_that_never_finishes_gives_back_its_share_at_its_timeout(node: Node) -> None:
    """CRI-O: runc create failed after NRI CreateContainer, and nothing more is ever said of it: no
    event, no cgroup. Its share goes back once CRI-O's own bound on a creation has passed, not at
    any earlier look (issue 29)."""
    plugin = node.plugin
    await node.runtime_is("cri-o")
    pod = node.pod("1-1")
    await plugin.synchronize([pod], [])
    await node.create(pod, "c1", run=False)
    assert node.tree.pod_quota(pod) == RAISED
    assert plugin.healer.watched == {"c1"}
    await node.clock.advance(CREATION_TIMEOUT - 0.01)  # ten reconcile passes came and went
    assert node.tree.pod_quota(pod) == RAISED, "it may still be in its runc create"
    assert node.seen.heals == {}
    with structlog.testing.capture_logs() as logs:
        await node.clock.advance(0.01)  # its own timer, not the next pass
    [phantom] = heals(logs, "container_never_created")
    assert phantom["container_id"] == "c1"
    assert phantom["why"].startswith(f"no cgroup {CREATION_TIMEOUT:g} s after CreateContainer")
    assert (phantom["namespace"], phantom["pod"]) == (pod.namespace, pod.name)
    assert (
        phantom["container_cgroup"] == node.tree.container_dir(make_container(node.naming, pod, "c1")).fs_path
    )
    assert node.tree.pod_quota(pod) == BASELINE
    assert plugin.shared_containers == 0
    assert node.saved().pods == {}
    assert node.seen.heals == {"container_never_created": 1}
    assert plugin.healer.watched == frozenset()
    plugin.healer.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("interval", [1.0, 5.0, INTERVAL])
async def test_a_runc_create_slower_than_every_grace_keeps_its_share(tmp_path: Path, interval: float) -> None:
    """CRI-O with a 60 s runc create (issue 29, item 1): every pass and every grace of the old rule
    passes with no cgroup; the pod keeps its share, the cgroup comes, StartContainer ends the watch,
    and nothing is healed then or later."""
    node = Node(tmp_path, interval=interval)
    plugin = node.plugin
    await node.runtime_is("cri-o")
    pod = node.pod("1-1")
    await plugin.synchronize([pod], [])
    container = await node.create(pod, "c1", run=False)
    await node.clock.advance(60.0)
    assert node.tree.pod_quota(pod) == RAISED
    assert plugin.healer.watched == {"c1"}
    await node.start(pod, container)  # runc create at last (the cgroup, quota raised), then its start
    assert plugin.healer.watched == frozenset()
    await node.clock.advance(2 * CREATION_TIMEOUT)
    assert node.tree.pod_quota(pod) == RAISED
    assert node.container_quota(container) == RAISED
    assert node.seen.heals == {}
    assert plugin.shared_containers == 1
    plugin.healer.stop()


@pytest.mark.asyncio
async def test_a_creation_never_started_is_kept_by_its_cgroup(node: Node) -> None:
    """Created but not started (``crictl create`` alone): at the timeout its cgroup is there, so
    the runtime made the container; it keeps its share."""
    plugin = node.plugin
    await node.runtime_is("cri-o")
    pod = node.pod("1-1")
    await plugin.synchronize([pod], [])
    container = await node.create(pod, "c1", run=False)
    node.tree.run_container(container)
    await node.clock.advance(CREATION_TIMEOUT)
    assert plugin.healer.watched == frozenset()
    assert node.tree.pod_quota(pod) == RAISED
    assert node.seen.heals == {}
    plugin.healer.stop()


@pytest.mark.asyncio
async def test_synchronize_in_a_slow_runc_create_carries_its_share(node: Node) -> None:
    """CRI-O lists no container still in its runc create: a Synchronize then (a reconnect) does not
    take the unlisted creation for gone. Its share is carried, its watch kept: its start after the
    Synchronize ends it; one that never finishes is healed at its own timeout."""
    plugin = node.plugin
    await node.runtime_is("cri-o")
    pod = node.pod("1-1")
    await plugin.synchronize([pod], [])
    slow = await node.create(pod, "c1", run=False)
    await node.create(pod, "c2", "side", device="dev-2", run=False)  # its runc create will fail
    await node.clock.advance(10.0)
    with structlog.testing.capture_logs() as logs:
        await plugin.synchronize([pod], [])  # neither listed: both still in runc create
    assert heals(logs, "container_gone") == []
    assert plugin.healer.carried == {"c1", "c2"}
    assert plugin.healer.watched == {"c1", "c2"}
    assert node.tree.pod_quota(pod) == BASELINE + 2 * len(SHARED) * PERIOD
    assert plugin.shared_containers == 2
    await node.start(pod, slow)
    assert plugin.healer.watched == {"c2"}
    await node.clock.advance(CREATION_TIMEOUT - 10.0 - 0.01)
    assert node.seen.heals == {}
    await node.clock.advance(0.01)
    assert node.seen.heals == {"container_never_created": 1}
    assert node.tree.pod_quota(pod) == RAISED  # c1's share only
    assert [r.id for r in plugin.books.pods[pod.uid].containers.values()] == ["c1"]
    # Past its timeout, an unlisted creation is gone at Synchronize.
    await node.create(pod, "c3", "side", device="dev-2", run=False)
    await node.clock.advance(CREATION_TIMEOUT - 0.01)
    plugin.healer.stop()  # its timer must not fire: the Synchronize below is the one to look
    await node.clock.advance(0.02)
    with structlog.testing.capture_logs() as logs:
        await plugin.synchronize([pod], [slow])
    assert [e["container_id"] for e in heals(logs, "container_gone")] == ["c3"]
    assert node.tree.pod_quota(pod) == RAISED
    plugin.healer.stop()


@pytest.mark.asyncio
async def test_a_daemon_restarted_in_a_slow_runc_create_still_carries_its_share(node: Node) -> None:
    """The watch of a CRI-O creation is saved with the books: a new daemon, started while the
    creation is still in its runc create, takes it up; its Synchronize (which does not list the
    container) carries the share instead of lowering the pod, and the watch ends at the start."""
    old = node.plugin
    await node.runtime_is("cri-o")
    pod = node.pod("1-1")
    await old.synchronize([pod], [])
    slow = await node.create(pod, "c1", run=False)
    assert node.tree.pod_quota(pod) == RAISED
    old.healer.stop()  # killed: nothing more of it runs
    old.store.close()  # (and its lock on the database goes with it)
    await node.clock.advance(10.0)
    new, _ = make_plugin(
        Path(old.store.directory),
        node.tree.layout,
        SHARED,
        observer=node.seen,
        clock=node.clock,
        reconcile_interval=INTERVAL,
    )
    node.plugin = new
    await node.runtime_is("cri-o")
    with structlog.testing.capture_logs() as logs:
        await new.synchronize([pod], [])  # c1 still in its runc create: not listed
    assert heals(logs, "container_gone") == []
    assert new.healer.carried == new.healer.watched == {"c1"}
    assert node.tree.pod_quota(pod) == RAISED
    await node.start(pod, slow)
    assert new.healer.watched == frozenset()
    await node.clock.advance(CREATION_TIMEOUT)
    assert node.seen.heals == {}
    assert node.tree.pod_quota(pod) == RAISED
    assert node.saved().find("c1") is not None
    # The watch ended: its row goes with the next commit (it was read from a fresh, unloaded
    # store before, which holds no watches whatever the database holds).
    new.keeper.commit()
    assert saved_state(Path(node.plugin.store.directory))[1] == {}, "the watch ended: its row deleted"
    new.healer.stop()


@pytest.mark.asyncio
async def test_a_saved_watch_not_of_this_boot_is_left_out(node: Node) -> None:
    """A due further than creation_timeout away was set on another boot's clock: not taken up, so
    the unlisted container's share is given back at Synchronize as without a watch."""
    old = node.plugin
    await node.runtime_is("cri-o")
    pod = node.pod("1-1")
    await old.synchronize([pod], [])
    await node.create(pod, "c1", run=False)
    old.healer.stop()
    old.store.close()  # (stopped: its lock on the database goes with it)
    [watch] = old.keeper.watches.values()
    with contextlib.closing(sqlite3.connect(old.store.path)) as db, db:
        db.execute("UPDATE watches SET due = ?", (watch.due + 2 * CREATION_TIMEOUT,))
    new, _ = make_plugin(Path(old.store.directory), node.tree.layout, SHARED, clock=node.clock)
    await new.configure(api.ConfigureRequest(runtime_name="cri-o"))
    with structlog.testing.capture_logs() as logs:
        await new.synchronize([pod], [])
    assert [e["container_id"] for e in heals(logs, "container_gone")] == ["c1"]
    assert node.tree.pod_quota(pod) == BASELINE
    new.healer.stop()


def test_the_default_grace_is_one_interval_between_its_floor_and_its_ceiling(node: Node) -> None:
    quotas = node.plugin.quotas
    graces = {interval: Healer(quotas, interval=interval).grace for interval in (None, 1, 1.5, 2, 5, 10, 30)}
    assert graces == {None: 10, 1: 2, 1.5: 2, 2: 2, 5: 5, 10: 10, 30: 10}
    assert (CREATION_GRACE, MIN_CREATION_GRACE) == (10, 2)
    assert Healer(quotas, interval=1, grace=0.5).grace == 0.5, "one given is taken as it is"
    assert node.plugin.healer.creation_timeout == CREATION_TIMEOUT == config_module.DEFAULT_CREATION_TIMEOUT


@pytest.mark.asyncio
async def test_a_container_whose_cgroup_appears_is_left_alone(node: Node) -> None:
    plugin = node.plugin
    pod = node.pod("1-1")
    await plugin.synchronize([pod], [])
    await node.create(pod, "c1")
    await node.clock.advance(INTERVAL * 3)
    assert node.tree.pod_quota(pod) == RAISED
    assert plugin.healer.watched == frozenset()
    assert node.seen.heals == {}
    assert plugin.shared_containers == 1
    plugin.healer.stop()


@pytest.mark.asyncio
async def test_without_a_timer_an_overdue_creation_is_looked_at_the_pods_next_event(tmp_path: Path) -> None:
    node = Node(tmp_path, interval=None)
    await node.runtime_is("cri-o")
    pod = node.pod("1-1")
    await node.plugin.synchronize([pod], [])
    await node.create(pod, "c1", run=False)
    await node.clock.advance(CREATION_TIMEOUT * 2)
    assert node.tree.pod_quota(pod) == RAISED, "no timer: nothing happens by itself"
    assert node.clock.pending == 0
    await node.create(pod, "c2", "side", device="dev-2")  # the pod's next event
    assert node.tree.pod_quota(pod) == RAISED  # c2's share only: c1's is back
    assert [record.id for record in node.plugin.books.pods[pod.uid].containers.values()] == ["c2"]
    assert node.seen.heals == {"container_never_created": 1}


# -- containerd: the cgroup is made at StartContainer, any time after the creation ---------------------


class StartFailed(Exception):
    """runc's task creation failed (containerd's StartContainer fails; no plugin hears of it)."""


class RuncOnV1(RuntimeSimulator):
    """A runtime whose runc makes a container's cgroup on a fake v1 tree: as on cgroup v1, the
    container's quota is refused above its pod's, and the creation or start that made it fails."""

    def __init__(self, socket: Path, tree: FakeCgroups, runtime_name: str) -> None:
        super().__init__(socket, runtime_name=runtime_name)
        self.tree = tree

    def make_resources(self, container: api.Container) -> None:
        pod = self.pods[container.pod_sandbox_id]
        quota, pod_quota = container.linux.resources.cpu.quota.value, self.tree.pod_quota(pod)
        if pod_quota is not None and quota > pod_quota:
            raise StartFailed(f'failed to write "{quota}": cpu.cfs_quota_us: invalid argument')
        self.tree.run_container(container)

    def release_resources(self, container: api.Container) -> None:
        self.tree.remove_container(container)


class Containerd(RuncOnV1):
    """containerd's order: a container's cgroup is made at StartContainer, before plugins hear of
    the start."""

    def __init__(self, socket: Path, tree: FakeCgroups) -> None:
        super().__init__(socket, tree, "containerd")
        self.modes.cgroup_made_at_start = True


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="mcpu-h-", dir="/tmp"))  # a unix socket's path is short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def containerd_node(root: Path, interval: float) -> AsyncIterator[tuple[Node, Containerd]]:
    """The plugin (its timers on the node's manual clock) served on a socket, and containerd."""
    node = Node(root, interval=interval)
    runtime = Containerd(root / "nri.sock", node.tree)
    async with runtime, plugin_running(node.plugin, root / "nri.sock"):
        await runtime.wait_for_plugins(1, GUARD)
        try:
            yield node, runtime
        finally:
            node.plugin.healer.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("interval", "gap"),
    [(30, 15), (30, 60), (30, 300), (5, 8), (5, 60), (1, 8)],
    ids=["default-15s", "default-60s", "default-5min", "5-8s", "5-60s", "1-8s"],
)
async def test_a_slow_start_on_containerd_keeps_its_share(
    short_dir: Path, interval: float, gap: float
) -> None:
    """containerd makes the cgroup only at StartContainer: however late kubelet starts the container,
    the pod keeps its share meanwhile, and runc's write of the raised quota is accepted (v1 refuses it
    above the pod's: issue 25, break 2)."""
    async with containerd_node(short_dir, interval) as (node, runtime):
        pod = make_pod(node.naming, "1-1", name="slow")
        node.tree.add_pod(pod, BASELINE)
        await runtime.run_pod_sandbox(pod)
        container = make_container(node.naming, pod, "c1", "fwd", annotations=marker(node.key, "dev-1"))
        started = asyncio.ensure_future(runtime.create_and_start(container, gap=gap, clock=node.clock))
        try:
            while "c1" not in runtime.containers:  # created: kubelet waits `gap` on the clock
                await asyncio.wait_for(asyncio.shield(asyncio.sleep(0.01)), GUARD)
            assert not started.done()
            await node.clock.advance(gap - 0.5)  # every pass and grace deadline of the gap
            assert node.tree.pod_quota(pod) == RAISED
            assert node.plugin.healer.watched == {"c1"}
            await node.clock.advance(0.5)
            result = await asyncio.wait_for(started, GUARD)
        finally:
            started.cancel()
        assert result.container.linux.resources.cpu.quota.value == RAISED
        assert node.container_quota(runtime.containers["c1"]) == RAISED  # runc's write went through
        assert node.plugin.healer.watched == frozenset()
        await node.clock.advance(3 * interval + CREATION_GRACE)
        assert node.tree.pod_quota(pod) == RAISED
        assert node.seen.heals == {}
        assert node.plugin.shared_containers == 1


# -- CRI-O: runc create (which makes the cgroup) after CreateContainer ---------------------------------


class Crio(RuncOnV1):
    """CRI-O's order: NRI CreateContainer, then its runc create taking `seconds` on the node's clock
    (the NRI lock let go), which makes the cgroup and writes the raised quota, then
    PostCreateContainer."""

    def __init__(self, socket: Path, tree: FakeCgroups, clock: ManualClock, seconds: float) -> None:
        super().__init__(socket, tree, "cri-o")
        self.clock = clock
        self.modes.runc_create_seconds = seconds


@pytest.mark.asyncio
@pytest.mark.parametrize("fails", [False, True], ids=["slow", "failed"])
async def test_crio_with_the_default_settings_a_30s_runc_create_starts_and_a_failed_one_heals(
    short_dir: Path, fails: bool
) -> None:
    """Issue 29's measure, on the default settings (reconcile_interval 30, grace 10 s, creation
    timeout 300 s) and the node's virtual clock: a 30 s runc create keeps its pod's share all along
    and starts; a failed one (no event after it, ever) gives its share back 300 s after
    CreateContainer, and not a look earlier."""
    node = Node(short_dir, interval=INTERVAL)
    runtime = Crio(short_dir / "nri.sock", node.tree, node.clock, 30.0)
    runtime.modes.create_fails_after_adjustment = fails
    async with runtime, plugin_running(node.plugin, short_dir / "nri.sock"):
        await runtime.wait_for_plugins(1, GUARD)
        pod = make_pod(node.naming, "1-1", name="slow")
        node.tree.add_pod(pod, BASELINE)
        await runtime.run_pod_sandbox(pod)
        container = make_container(node.naming, pod, "c1", "fwd", annotations=marker(node.key, "dev-1"))
        created_at = node.clock.monotonic()
        creating = asyncio.ensure_future(runtime.create_container(container))
        try:
            while node.plugin.healer.watched != {"c1"}:  # NRI CreateContainer answered
                await asyncio.wait_for(asyncio.shield(asyncio.sleep(0.01)), GUARD)
            await node.clock.advance(30.0 - 0.01)  # a pass at 30 s is yet to come
            assert node.tree.pod_quota(pod) == RAISED
            await node.clock.advance(0.01)
            if fails:
                with pytest.raises(CreationFailed):
                    await asyncio.wait_for(creating, GUARD)
            else:
                await asyncio.wait_for(creating, GUARD)
        finally:
            creating.cancel()
        if not fails:
            await runtime.start_container("c1")
            await node.clock.advance(2 * CREATION_TIMEOUT)
            assert node.tree.pod_quota(pod) == RAISED
            assert node.container_quota(runtime.containers["c1"]) == RAISED  # runc's write went through
            assert node.seen.heals == {}
            return
        while not node.seen.healed_at:
            await node.clock.advance(1.0)
        assert node.seen.heals == {"container_never_created": 1}
        assert node.seen.healed_at[0] - created_at == CREATION_TIMEOUT == 300.0
        assert node.tree.pod_quota(pod) == BASELINE
        assert node.plugin.shared_containers == 0
        node.plugin.healer.stop()


@pytest.mark.asyncio
async def test_a_container_never_started_keeps_its_share_until_the_runtime_says_otherwise(node: Node) -> None:
    """containerd: no StartContainer yet is no failure; its removal ends the share."""
    plugin = node.plugin
    await node.runtime_is("containerd")
    pod = node.pod("1-1")
    await plugin.synchronize([pod], [])
    container = await node.create(pod, "c1", run=False)
    await node.clock.advance(20 * INTERVAL)
    assert node.tree.pod_quota(pod) == RAISED
    assert plugin.healer.watched == {"c1"}
    assert node.seen.heals == {}
    await plugin.remove_container(pod, container)
    assert node.tree.pod_quota(pod) == BASELINE
    assert plugin.healer.watched == frozenset()
    # Another that starts with no cgroup: its grace counts from StartContainer.
    late = await node.create(pod, "c2", device="dev-2", run=False)
    await node.clock.advance(5 * INTERVAL)
    await plugin.start_container(pod, late)  # the runtime said it started; its cgroup is not there
    await node.clock.advance(CREATION_GRACE - 0.01)
    assert node.tree.pod_quota(pod) == RAISED
    with structlog.testing.capture_logs() as logs:
        await node.clock.advance(0.01)
    [phantom] = heals(logs, "container_never_created")
    assert f"made by the runtime by StartContainer, is gone {CREATION_GRACE:g} s later" in phantom["why"]
    assert node.tree.pod_quota(pod) == BASELINE
    plugin.healer.stop()


@pytest.mark.asyncio
async def test_a_container_started_after_its_share_was_given_back_gets_it_again(tmp_path: Path) -> None:
    """CRI-O with a runc create slower even than the creation timeout (v2 takes a child quota above
    its pod's): the share is given back, and the StartContainer that follows raises the pod again
    before it runs."""
    node = Node(tmp_path, version=2)
    plugin = node.plugin
    await node.runtime_is("cri-o")
    pod = node.pod("1-1")
    await plugin.synchronize([pod], [])
    container = await node.create(pod, "c1", run=False)
    await node.clock.advance(CREATION_TIMEOUT)
    assert node.seen.heals == {"container_never_created": 1}
    assert node.tree.pod_quota(pod) == BASELINE
    with structlog.testing.capture_logs() as logs:
        await node.start(pod, container)  # the cgroup at last, then StartContainer
    [again] = [e for e in logs if e["event"].startswith("container started after its share was given back")]
    assert again["pod_quota"] == f"{BASELINE} -> {RAISED}"
    assert node.tree.pod_quota(pod) == RAISED
    assert plugin.shared_containers == 1
    assert node.saved().pods[pod.uid].containers["fwd"].id == "c1"
    await node.clock.advance(3 * INTERVAL)
    assert node.tree.pod_quota(pod) == RAISED
    await plugin.stop_container(pod, container)
    assert node.tree.pod_quota(pod) == BASELINE
    plugin.healer.stop()


# -- pod quotas off their target ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_pass_brings_a_pod_quota_moved_behind_our_back_to_its_target(node: Node) -> None:
    plugin = node.plugin
    pod = node.pod("1-1")
    await plugin.synchronize([pod], [])
    await node.create(pod, "c1")
    write_cpu_quota(node.tree.pod_dir(pod), BASELINE)  # systemd re-applied the slice's own value
    with structlog.testing.capture_logs() as logs:
        await node.clock.advance(INTERVAL)
    [brought] = heals(logs, "pod_quota")
    assert brought["pod_quota"] == f"{BASELINE} -> {RAISED}"
    # Named as an operator knows the pod (the log line, and the status's heals).
    assert (brought["namespace"], brought["pod"], brought["pod_key"]) == (pod.namespace, pod.name, pod.uid)
    assert plugin.healer.recent[0].fields["pod"] == pod.name
    assert node.tree.pod_quota(pod) == RAISED
    assert node.seen.heals == {"pod_quota": 1}
    plugin.healer.stop()


@pytest.mark.asyncio
async def test_a_pass_over_an_unchanged_node_writes_saves_and_says_nothing(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin = node.plugin
    pods = [node.pod(f"{i}-{i}", f"app{i}") for i in range(5)]
    for i, pod in enumerate(pods):
        await node.create(pod, f"c{i}", device=f"dev-{i}")
    plugin.flush()
    writes: list[object] = []
    saves: list[object] = []

    def write(cgroup: Cgroup, value: int | None, *, current: CpuQuota | None = None) -> CpuQuota:
        writes.append(cgroup)
        return write_cpu_quota(cgroup, value, current=current)

    def write_limit(cgroup: Cgroup, limit: CpuQuota) -> None:
        writes.append(cgroup)
        write_cpu_limit(cgroup, limit)

    def save(_store: StateStore, books: Books) -> None:
        saves.append(books)

    monkeypatch.setattr(quota, "write_cpu_quota", write)
    monkeypatch.setattr(cgroups.files, "write_cpu_limit", write_limit)
    monkeypatch.setattr(StateStore, "save", save)
    with structlog.testing.capture_logs() as logs:
        report = await plugin.healer.reconcile()
    assert (report.pods, report.healed) == (5, 0)
    assert writes == saves == []
    assert [e["event"] for e in logs if e["log_level"] != "debug"] == []
    assert node.clock.pending == 0


# -- stop means stop ------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
async def test_stop_puts_the_container_quota_back_then_lowers_the_pod(tmp_path: Path, version: int) -> None:
    node = Node(tmp_path, version=version, interval=None)
    plugin = node.plugin
    pod = node.pod("1-1")
    container = await node.create(pod, "c1")
    assert node.container_quota(container) == len(SHARED | {4, 5}) * PERIOD
    with structlog.testing.capture_logs() as logs:
        await plugin.stop_container(pod, container)  # its cgroup lingers until removal
    assert node.container_quota(container) == OWN
    assert node.tree.pod_quota(pod) == BASELINE
    [put_back] = [e for e in logs if e["event"] == "stopped container's own quota put back"]
    assert put_back["quota"] == f"{4 * PERIOD} -> {OWN}"
    # A restart raises both again: the new instance's pod quota before the reply, its own by the runtime.
    again = await node.create(pod, "c2")
    assert node.container_quota(again) == 4 * PERIOD
    assert node.tree.pod_quota(pod) == RAISED


@pytest.mark.asyncio
async def test_a_displaced_instance_gets_its_own_quota_back_at_its_stop(tmp_path: Path) -> None:
    """kubelet created the successor first: the old instance holds no slot when it is reported stopped."""
    node = Node(tmp_path, interval=None)
    plugin = node.plugin
    pod = node.pod("1-1")
    old = await node.create(pod, "c1")
    new = await node.create(pod, "c2")  # same name: it takes the slot
    await plugin.stop_container(pod, old)
    assert node.container_quota(old) == OWN
    assert node.tree.pod_quota(pod) == RAISED  # the new instance holds the share
    await plugin.stop_container(pod, new)
    assert node.container_quota(new) == OWN
    assert node.tree.pod_quota(pod) == BASELINE


@pytest.mark.asyncio
async def test_stop_leaves_an_unlimited_or_already_lowered_container_alone(tmp_path: Path) -> None:
    node = Node(tmp_path, interval=None)
    plugin = node.plugin
    pod = node.pod("1-1")
    container = await node.create(pod, "c1")
    write_cpu_quota(node.tree.container_dir(container), None)  # someone made it unlimited
    await plugin.stop_container(pod, container)
    assert node.container_quota(container) is None
    assert node.tree.pod_quota(pod) == BASELINE
    plain = make_container(node.naming, pod, "c9", "plain")  # never shared: not ours to touch
    node.tree.run_container(plain)
    await plugin.stop_container(pod, plain)
    assert node.container_quota(plain) == 200_000
    assert node.seen.failures == {}


# -- behaviours pinned against mutations (issue 24) -----------------------------------------------------


def planted_symlink(node: Node, pod: api.PodSandbox) -> tuple[str, str]:
    """The pod's cgroup directory moved aside and a symlink left in its place: a cgroup that cannot be
    checked (refused, never followed), neither there nor gone. Returns (the symlink, the directory)."""
    pod_dir = node.tree.pod_dir(pod).fs_path
    aside = os.path.join(os.path.dirname(pod_dir), "aside")
    os.rename(pod_dir, aside)
    os.symlink(aside, pod_dir)
    return pod_dir, aside


@pytest.mark.asyncio
async def test_a_pod_cgroup_that_cannot_be_checked_never_costs_its_bindings(tmp_path: Path) -> None:
    """Mutation: `_pod_gone`'s `except CgroupError: return False` -> `True` drops the pod and its
    binding at the second look. With kubelet's record (where bindings may end at all)."""
    kubelet = FakeKubeletRecord()
    node = Node(tmp_path, allocations=kubelet)
    plugin = node.plugin
    holder = node.pod("1-1", "holder")
    kubelet.allocate(holder, "fwd", "dev-1")
    await plugin.synchronize([holder], [])
    container = await node.create(holder, "c1")
    await plugin.stop_container(holder, container)
    node.tree.remove_container(container)
    await plugin.remove_container(holder, container)
    assert plugin.books.pods == {}
    assert plugin.books.devices == {"dev-1": Slot(holder.uid, "fwd")}
    planted_symlink(node, holder)
    await node.clock.advance(5 * INTERVAL)
    assert plugin.books.devices == {"dev-1": Slot(holder.uid, "fwd")}
    assert node.saved().devices == {"dev-1": Slot(holder.uid, "fwd")}
    assert node.seen.heals == {}
    plugin.healer.stop()


@pytest.mark.asyncio
async def test_a_pass_that_changes_the_books_without_a_heal_saves_them(node: Node) -> None:
    """Mutation: `if healed or _changed(...)` -> `if healed` leaves a pass's change unsaved. Here the
    StopContainer could not lower the pod (its cgroup unreachable a moment), kubelet then wrote the
    pod's own quota back itself: the pass finds the pod at its target and drops its empty record."""
    plugin = node.plugin
    pod = node.pod("1-1")
    await plugin.synchronize([pod], [])
    container = await node.create(pod, "c1")
    link, aside = planted_symlink(node, pod)
    with structlog.testing.capture_logs() as logs:
        await plugin.stop_container(pod, container)
    assert [e["event"] for e in logs if e["event"] == "cannot lower the pod quota"]
    assert pod.uid in node.saved().pods  # an empty record, waiting for its lowering
    os.unlink(link)
    os.rename(aside, link)
    write_cpu_quota(node.tree.pod_dir(pod), BASELINE)  # not by the plugin
    report = await plugin.healer.reconcile()
    assert report.healed == 0
    assert plugin.books.pods == {}
    assert node.saved().pods == {}


@pytest.mark.asyncio
async def test_a_leftover_watch_of_a_displaced_instance_is_no_failed_creation(node: Node) -> None:
    """Mutation: dropping `holder.id != creation.container_id` takes the watch of an instance that a
    newer one displaced (one whose path the runtime did not send: it is not watched) for a failed
    creation: a false `container_never_created`."""
    plugin = node.plugin
    await node.runtime_is("cri-o")
    pod = node.pod("1-1")
    await plugin.synchronize([pod], [])
    await node.create(pod, "c1", run=False)  # watched; its runc create never comes
    newer = make_container(node.naming, pod, "c2", "fwd", annotations=marker(node.key, "dev-1"))
    newer.linux.cgroups_path = ""  # nothing to watch it by: c1's watch stays
    assert await plugin.create_container(pod, newer) is not None
    assert plugin.healer.watched == {"c1"}
    with structlog.testing.capture_logs() as logs:
        await node.clock.advance(CREATION_TIMEOUT)
    assert heals(logs, "container_never_created") == []
    assert node.seen.heals == {}
    assert plugin.healer.watched == frozenset()
    assert plugin.books.holder(Slot(pod.uid, "fwd")) is not None
    assert node.tree.pod_quota(pod) == RAISED  # c2's share
    plugin.healer.stop()


# -- Synchronize ---------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_synchronize_says_what_the_runtime_no_longer_runs(node: Node) -> None:
    plugin = node.plugin
    kept, stopped, gone = node.pod("1-1", "kept"), node.pod("2-2", "stopped"), node.pod("3-3", "gone")
    first = await node.create(kept, "k1")
    halted = await node.create(stopped, "s1", device="dev-2")
    await node.create(gone, "g1", device="dev-3")
    halted.state = api.CONTAINER_STOPPED  # stopped while the plugin was away: no event
    with structlog.testing.capture_logs() as logs:
        await plugin.synchronize([kept, stopped], [first, halted])
    assert sorted(e["container_id"] for e in heals(logs, "container_gone")) == ["g1", "s1"]
    [why_stopped] = [e["why"] for e in heals(logs, "container_gone") if e["container_id"] == "s1"]
    assert why_stopped.startswith("the runtime lists it stopped")
    assert [e["pod_key"] for e in heals(logs, "pod_gone")] == [gone.uid]
    assert node.seen.heals == {"container_gone": 2, "pod_gone": 1}
    # The stopped one's own quota went back before its pod quota came down.
    assert node.container_quota(halted) == OWN
    assert node.tree.pod_quota(stopped) == BASELINE
    assert set(plugin.books.pods) == {kept.uid}
    assert plugin.healer.running
    plugin.healer.stop()


# -- the timer ------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_timer_starts_once_runs_every_interval_and_stops(node: Node) -> None:
    healer = node.plugin.healer
    passes: list[float] = []
    reconcile = healer.reconcile

    async def counted() -> PassReport:
        passes.append(node.clock.monotonic())
        return await reconcile()

    healer.reconcile = counted  # type: ignore[method-assign]
    assert not healer.running
    await node.plugin.synchronize([], [])
    await node.plugin.synchronize([], [])  # a second Synchronize does not add a timer
    node.plugin.flush()  # (the books' deferred write)
    assert node.clock.pending == 1
    await node.clock.advance(INTERVAL * 3)
    assert passes == [INTERVAL, 2 * INTERVAL, 3 * INTERVAL]
    healer.stop()
    assert node.clock.pending == 0
    assert not healer.running
    with pytest.raises(ValueError, match="positive"):
        Healer(node.plugin.quotas, interval=0)
    assert Healer(node.plugin.quotas, interval=2).grace == 2  # never longer than one interval


@pytest.mark.asyncio
async def test_the_pass_drops_a_pod_missing_at_two_looks_never_in_its_events(node: Node) -> None:
    plugin = node.plugin
    await node.runtime_is("cri-o")
    pod, other = node.pod("1-1", "vanished"), node.pod("2-2", "stays")
    await plugin.synchronize([pod, other], [])
    await node.create(pod, "c1")
    await node.create(other, "c2", device="dev-2")
    node.delete_pod(pod)  # with its running container, and no event at all
    await node.clock.advance(INTERVAL)  # the first look
    assert set(plugin.books.pods) == {pod.uid, other.uid}
    with structlog.testing.capture_logs() as logs:
        await node.clock.advance(INTERVAL)  # the second, an interval later
    [gone] = heals(logs, "pod_gone")
    # The marker fallback: its books go, its binding stays until the runtime says it is removed.
    assert (gone["pod_key"], gone["containers"]) == (pod.uid, ["fwd"])
    assert list(plugin.books.pods) == [other.uid]
    assert plugin.books.devices["dev-1"] == Slot(pod.uid, "fwd")
    assert plugin.shared_containers == 1
    assert node.saved().pods.keys() == {other.uid}
    assert node.tree.pod_quota(other) == RAISED
    # A pod gone before its new container's deadline: not a failed creation, and the pod's own event
    # between two looks starts the count again.
    brief = node.pod("3-3", "brief")
    await node.create(brief, "c3", device="dev-3", run=False)  # at 60 s: its deadline at 70 s
    node.delete_pod(brief)
    await node.clock.advance(INTERVAL)  # its deadline (put off), then the first look at 90 s
    assert node.seen.heals == {"pod_gone": 1}, "neither a failed creation nor gone yet"
    await node.clock.advance(INTERVAL / 2)
    await plugin.create_container(brief, make_container(node.naming, brief, "c4", "plain"))  # an event
    await node.clock.advance(INTERVAL / 2)  # 120 s: a first look again
    assert brief.uid in plugin.books.pods
    with structlog.testing.capture_logs() as logs:
        await node.clock.advance(INTERVAL)
    assert [e["pod_key"] for e in heals(logs, "pod_gone")] == [brief.uid]
    assert node.seen.heals == {"pod_gone": 2}
    plugin.healer.stop()


@pytest.mark.asyncio
async def test_stop_of_a_container_with_a_refused_path_is_logged_not_counted(tmp_path: Path) -> None:
    node = Node(tmp_path, interval=None)
    pod = node.pod("1-1")
    container = await node.create(pod, "c1")
    container.linux.cgroups_path = "/kubepods/../etc"  # what no runtime sends: refused, never walked
    with structlog.testing.capture_logs() as logs:
        await node.plugin.stop_container(pod, container)
    [refused] = [e for e in logs if e["event"] == "cannot put the stopped container's own quota back"]
    assert "'..'" in refused["error"]
    assert node.seen.failures == {}
    assert node.tree.pod_quota(pod) == BASELINE  # the pod's share is released all the same


def test_reconcile_interval_is_configurable_and_reaches_the_plugin(tmp_path: Path) -> None:
    document: dict[str, object] = {"shared_cpuset": "0-1"}
    assert config_module.parse_config(document).reconcile_interval == 30
    for good in (1, 2.5, 3600):
        assert config_module.parse_config({**document, "reconcile_interval": good}).reconcile_interval == good
    for bad in (0, 0.5, 3601, -1, "30", True):
        with pytest.raises(config_module.ConfigError, match=r"reconcile_interval: .* seconds from 1 to 3600"):
            config_module.parse_config({**document, "reconcile_interval": bad})
    config = config_module.parse_config({**document, "reconcile_interval": 5, "state_dir": str(tmp_path)})
    plugin = build_plugin(config, FakeCgroups(tmp_path / "cgroup").layout, None)
    assert plugin.healer.interval == 5
    assert plugin.healer.grace == 5


def test_creation_timeout_is_configurable_and_reaches_the_healer(tmp_path: Path) -> None:
    document: dict[str, object] = {"shared_cpuset": "0-1", "state_dir": str(tmp_path)}
    assert config_module.parse_config(document).creation_timeout == CREATION_TIMEOUT
    for good in (1, 30.5, 600):
        assert config_module.parse_config({**document, "creation_timeout": good}).creation_timeout == good
    for bad in (0, 0.5, 86401, -1, "300", True):
        with pytest.raises(config_module.ConfigError, match=r"creation_timeout: .* plus 60"):
            config_module.parse_config({**document, "creation_timeout": bad})
    config = config_module.parse_config({**document, "creation_timeout": 600})
    plugin = build_plugin(config, FakeCgroups(tmp_path / "cgroup").layout, None)
    assert plugin.healer.creation_timeout == 600


@pytest.mark.asyncio
async def test_a_pass_that_fails_is_logged_and_the_next_one_still_comes(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    healer = node.plugin.healer
    await node.plugin.synchronize([], [])

    def broken() -> PassReport:
        raise RuntimeError("a bug")

    monkeypatch.setattr(healer, "reconcile", broken)
    with structlog.testing.capture_logs() as logs:
        await node.clock.advance(INTERVAL)
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["reconcile pass failed"]
    assert healer.running
    healer.stop()
