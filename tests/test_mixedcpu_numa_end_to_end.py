"""NUMA-local shared CPUs end to end: the plugin behind a real unix socket, the runtime simulator and a
fake cgroup tree, on fake topologies (one node, two nodes, CPUs offline, containers spanning nodes).

The two-node machine: node 0 holds CPUs 0-7, node 1 CPUs 8-15; the shared pool is 0-1 (node 0) and 8-9
(node 1). A container gets only the shared CPUs of the nodes its exclusive CPUs are on, in its cpuset,
its quota, its OPENSHIFT_SHARED_CPUS and its pod's quota share, at every event and across restarts.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from mixedcpu_support import (
    GUARD,
    PERIOD,
    FakeCgroups,
    Naming,
    forget_books,
    make_container,
    make_plugin,
    make_pod,
    marker,
    plugin_running,
    saved_books,
)

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import format_cpuset
from nri_plugin.daemon.config import Config
from nri_plugin.daemon.wiring import shared_pool
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin
from nri_plugin.mixedcpu.policy import NumaNodes, SharedPool
from nri_plugin.nri.simulator import PluginFailed, RuntimeSimulator, env_of
from nri_plugin.ttrpc.errors import Code

NAMING = Naming("containerd", "cgroupfs")
TWO_NODES: NumaNodes = {0: frozenset(range(8)), 1: frozenset(range(8, 16))}
SHARED = frozenset({0, 1, 8, 9})
NUMA = SharedPool(SHARED, TWO_NODES)
WHOLE = SharedPool(SHARED)
BASELINE = 2 * PERIOD  # the pod's own quota: its one container's 2 exclusive CPUs
NO_LOCAL = "no NUMA-local shared CPU: the container gets the whole shared pool"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path for long test ids is longer.
    path = Path(tempfile.mkdtemp(prefix="numa-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Node:
    """The simulator plus a fake cgroup tree, doing what the runtime does to container cgroups."""

    def __init__(self, root: Path, version: int = 1) -> None:
        self.root = root
        self.tree = FakeCgroups(root / "cgroup", version)
        self.state = root / "state"
        self.socket = root / "nri.sock"
        self.sim = RuntimeSimulator(self.socket, runtime_name="containerd", runtime_version="v2.3.4")
        self.key = load_or_create_host_key(self.state)

    def plugin(self, pool: SharedPool = NUMA) -> MixedCpuPlugin:
        """A plugin (re)started on the node (`make_plugin` closes the previous one's books)."""
        return make_plugin(self.state, self.tree.layout, pool)[0]

    def pod(self, uid: str, name: str = "app") -> api.PodSandbox:
        pod = make_pod(NAMING, uid, name=name)
        self.tree.add_pod(pod, BASELINE)
        return pod

    def asking(self, pod: api.PodSandbox, cid: str, cpus: str, **options: Any) -> api.Container:
        """A container of `pod` that asks for shared CPUs, with `cpus` exclusive."""
        return make_container(
            NAMING, pod, cid, cid, cpus=cpus, quota=2 * PERIOD, annotations=marker(self.key, cid), **options
        )

    async def create(self, container: api.Container) -> api.Container:
        result = await self.sim.create_container(container)
        self.tree.run_container(result.container)
        return result.container

    def running(self, cid: str) -> tuple[str, int, str]:
        """A container's cpuset, quota and OPENSHIFT_SHARED_CPUS as the runtime holds them now."""
        container = self.sim.containers[cid]
        cpu = container.linux.resources.cpu
        return cpu.cpus, cpu.quota.value, env_of(container).get("OPENSHIFT_SHARED_CPUS", "")

    def saved_shares(self, plugin: MixedCpuPlugin) -> dict[str, int]:
        """Container name -> its share (n(shared CPUs)) in the state file, once `plugin` wrote it."""
        books = saved_books(self.state)
        return {slot.name: record.shared_cpus for slot, record in books.slots()}


def _kubelet(cpus: str) -> api.LinuxResources:
    resources = api.LinuxResources()
    resources.cpu.cpus = cpus
    return resources


@pytest.mark.asyncio
@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
async def test_each_container_gets_its_nodes_shared_cpus(short_dir: Path, version: int) -> None:
    node = Node(short_dir, version)
    sim, tree = node.sim, node.tree
    local, spanning = node.pod("node1-pod"), node.pod("span-pod", "span")
    async with sim, plugin_running(node.plugin(), node.socket):
        await sim.wait_for_plugins(1, GUARD)
        await sim.run_pod_sandbox(local)
        await sim.run_pod_sandbox(spanning)
        created = await node.create(node.asking(local, "fwd", "12-13"))
        assert node.running("fwd") == ("8-9,12-13", 4 * PERIOD, "8-9")
        assert env_of(created)["OPENSHIFT_ISOLATED_CPUS"] == "12-13"
        assert tree.pod_quota(local) == BASELINE + 2 * PERIOD  # its share: the two CPUs of node 1
        # Exclusive CPUs on both nodes: the shared CPUs of both.
        await node.create(node.asking(spanning, "span", "7,10"))
        assert node.running("span") == ("0-1,7-10", 6 * PERIOD, "0-1,8-9")
        assert tree.pod_quota(spanning) == BASELINE + 4 * PERIOD

        # kubelet re-sends the exclusive CPUs: the same subset.
        applied = await sim.update_container("fwd", _kubelet("12-13"))
        assert (applied.cpu.cpus, applied.cpu.quota.value) == ("8-9,12-13", 4 * PERIOD)
        # kubelet moves them to node 0: node 0's shared CPUs, as many, the pod quota as it was.
        applied = await sim.update_container("fwd", _kubelet("4-5"))
        assert (applied.cpu.cpus, applied.cpu.quota.value) == ("0-1,4-5", 4 * PERIOD)
        assert tree.pod_quota(local) == BASELINE + 2 * PERIOD
        # ... then across both nodes: four shared CPUs, and the pod quota raised with them.
        applied = await sim.update_container("fwd", _kubelet("5,12"))
        assert (applied.cpu.cpus, applied.cpu.quota.value) == ("0-1,5,8-9,12", 6 * PERIOD)
        assert tree.pod_quota(local) == BASELINE + 4 * PERIOD
        # ... and back to node 1 alone: the pod quota comes down again.
        applied = await sim.update_container("fwd", _kubelet("12-13"))
        assert (applied.cpu.cpus, applied.cpu.quota.value) == ("8-9,12-13", 4 * PERIOD)
        assert tree.pod_quota(local) == BASELINE + 2 * PERIOD

        await sim.stop_container("fwd")
        assert tree.pod_quota(local) == BASELINE
        await sim.stop_container("span")
        assert tree.pod_quota(spanning) == BASELINE
        assert [r for r in sim.records if r.outcome != "ok"] == []


@pytest.mark.asyncio
async def test_the_books_follow_an_update_across_a_restart(short_dir: Path) -> None:
    node = Node(short_dir)
    sim, tree = node.sim, node.tree
    pod = node.pod("moved")
    async with sim:
        plugin = node.plugin()
        async with plugin_running(plugin, node.socket):
            await sim.wait_for_plugins(1, GUARD)
            await sim.run_pod_sandbox(pod)
            await node.create(node.asking(pod, "fwd", "12-13"))
            await sim.update_container("fwd", _kubelet("5,12"))
            assert tree.pod_quota(pod) == BASELINE + 4 * PERIOD
        assert node.saved_shares(plugin) == {"fwd": 4}
        # Restarted: the books (exclusive 5,12) and the container agree; nothing to update.
        updates = len(sim.applied_updates)
        async with plugin_running(node.plugin(), node.socket):
            await sim.wait_for_plugins(1, GUARD)
        assert len(sim.applied_updates) == updates
        assert node.running("fwd")[:2] == ("0-1,5,8-9,12", 6 * PERIOD)
        assert tree.pod_quota(pod) == BASELINE + 4 * PERIOD


@pytest.mark.asyncio
async def test_no_local_shared_cpu_gives_the_whole_pool_and_a_log_line(short_dir: Path) -> None:
    node = Node(short_dir)
    sim, tree = node.sim, node.tree
    pod = node.pod("remote")
    node0_only = SharedPool(frozenset({0, 1}), TWO_NODES)
    async with sim, plugin_running(node.plugin(node0_only), node.socket):
        await sim.wait_for_plugins(1, GUARD)
        await sim.run_pod_sandbox(pod)
        with structlog.testing.capture_logs() as logs:
            await node.create(node.asking(pod, "fwd", "12-13"))
        assert node.running("fwd") == ("0-1,12-13", 4 * PERIOD, "0-1")
        assert tree.pod_quota(pod) == BASELINE + 2 * PERIOD
    [line] = [e for e in logs if e["event"] == NO_LOCAL]
    assert line["log_level"] == "warning"
    assert line["container"] == "fwd"
    assert line["reason"].startswith("none of the shared CPUs (0-1) is on NUMA node 1, where its exclusive")


@pytest.mark.asyncio
@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
async def test_synchronize_brings_containers_to_their_subset_as_the_key_changes(
    short_dir: Path, version: int
) -> None:
    node = Node(short_dir, version)
    sim, tree = node.sim, node.tree
    pod = node.pod("before")
    sim.add_pod(pod)
    # Created while the plugin was away: its exclusive CPUs on node 1 only.
    sim.add_container(node.asking(pod, "fwd", "12-13", state=api.CONTAINER_RUNNING))
    async with sim:
        plugin = node.plugin()
        with structlog.testing.capture_logs() as logs:
            async with plugin_running(plugin, node.socket):
                await sim.wait_for_synchronizations(1, GUARD)
        assert node.running("fwd")[:2] == ("8-9,12-13", 4 * PERIOD)
        assert tree.pod_quota(pod) == BASELINE + 2 * PERIOD
        assert node.saved_shares(plugin) == {"fwd": 2}
        [stale] = [e for e in logs if e["event"].startswith("container must restart")]
        assert (stale["OPENSHIFT_SHARED_CPUS"], stale["OPENSHIFT_ISOLATED_CPUS"]) == ("8-9", "12-13")

        # The admin turns the key off: the whole pool, and the pod quota for all of it.
        plugin = node.plugin(WHOLE)
        async with plugin_running(plugin, node.socket):
            await sim.wait_for_synchronizations(2, GUARD)
        assert node.running("fwd")[:2] == ("0-1,8-9,12-13", 6 * PERIOD)
        assert tree.pod_quota(pod) == BASELINE + 4 * PERIOD
        assert node.saved_shares(plugin) == {"fwd": 4}

        # ... and on again: back to node 1's, the pod quota down with it.
        async with plugin_running(node.plugin(), node.socket):
            await sim.wait_for_synchronizations(3, GUARD)
        assert node.running("fwd")[:2] == ("8-9,12-13", 4 * PERIOD)
        assert tree.pod_quota(pod) == BASELINE + 2 * PERIOD

        # ... then narrows node 1's part of the pool.
        async with plugin_running(node.plugin(SharedPool(frozenset({0, 1, 8}), TWO_NODES)), node.socket):
            await sim.wait_for_synchronizations(4, GUARD)
        assert node.running("fwd")[:2] == ("8,12-13", 3 * PERIOD)
        assert tree.pod_quota(pod) == BASELINE + PERIOD

        # With the state file lost, the baseline is rebuilt from what the container holds.
        forget_books(node.state)
        updates = len(sim.applied_updates)
        async with plugin_running(node.plugin(SharedPool(frozenset({0, 1, 8}), TWO_NODES)), node.socket):
            await sim.wait_for_synchronizations(5, GUARD)
            assert len(sim.applied_updates) == updates
            assert tree.pod_quota(pod) == BASELINE + PERIOD
            await sim.stop_container("fwd")
            assert tree.pod_quota(pod) == BASELINE
        assert [r for r in sim.records if r.outcome != "ok" and r.event != "drop"] == []


@pytest.mark.asyncio
async def test_pod_quota_counts_each_containers_own_subset(short_dir: Path) -> None:
    """Two shared containers of one pod on different nodes, one spanning: each adds its own share."""
    node = Node(short_dir)
    sim, tree = node.sim, node.tree
    pod = node.pod("mixed")
    tree.add_pod(pod, 3 * BASELINE)
    async with sim, plugin_running(node.plugin(), node.socket):
        await sim.wait_for_plugins(1, GUARD)
        await sim.run_pod_sandbox(pod)
        await node.create(node.asking(pod, "a", "2-3"))
        await node.create(node.asking(pod, "b", "12-13"))
        await node.create(node.asking(pod, "c", "7,10"))
        assert [node.running(c)[2] for c in "abc"] == ["0-1", "8-9", "0-1,8-9"]
        assert tree.pod_quota(pod) == 3 * BASELINE + (2 + 2 + 4) * PERIOD
        await sim.stop_container("c")
        assert tree.pod_quota(pod) == 3 * BASELINE + 4 * PERIOD


def _sysfs(root: Path, online: str, nodes: dict[int, str]) -> Path:
    sysfs = root / "sys"
    cpu = sysfs / "devices" / "system" / "cpu"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text(online + "\n")
    for number, cpus in nodes.items():
        directory = sysfs / "devices" / "system" / "node" / f"node{number}"
        directory.mkdir(parents=True)
        (directory / "cpulist").write_text(cpus + "\n")
    return sysfs


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("online", "nodes", "read", "expected"),
    [
        # One node: every shared CPU is local to every container.
        ("0-15", {0: "0-15"}, {0: "0-15"}, ("0-1,8-9,12-13", 6 * PERIOD, "0-1,8-9")),
        # Two nodes.
        ("0-15", {0: "0-7", 1: "8-15"}, {0: "0-7", 1: "8-15"}, ("8-9,12-13", 4 * PERIOD, "8-9")),
        # CPUs 9 and 14-15 offline (whatever a node's list says, only online CPUs count): node 1's
        # shared CPUs are 8 alone.
        ("0-8,10-13", {0: "0-7", 1: "8-15"}, {0: "0-7", 1: "8,10-13"}, ("8,12-13", 3 * PERIOD, "8")),
        # A kernel without NUMA (no node directories): one node of every online CPU.
        ("0-15", {}, {0: "0-15"}, ("0-1,8-9,12-13", 6 * PERIOD, "0-1,8-9")),
    ],
    ids=["one-node", "two-nodes", "cpus-offline", "no-numa"],
)
async def test_the_daemon_reads_the_topology_from_sysfs(
    short_dir: Path,
    online: str,
    nodes: dict[int, str],
    read: dict[int, str],
    expected: tuple[str, int, str],
) -> None:
    sysfs = _sysfs(short_dir, online, nodes)
    # The daemon checks at start that every shared CPU is online: this pool leaves out CPU 9.
    shared = frozenset({0, 1, 8}) if "cpus-offline" in online or online == "0-8,10-13" else SHARED
    config = Config(shared_cpuset=shared, sysfs_root=str(sysfs), numa_local_shared_cpus=True)
    pool = shared_pool(config)
    assert pool.numa_nodes is not None
    assert {n: format_cpuset(cpus) for n, cpus in pool.numa_nodes.items()} == read
    node = Node(short_dir)
    sim = node.sim
    pod = node.pod("sysfs")
    async with sim, plugin_running(node.plugin(pool), node.socket):
        await sim.wait_for_plugins(1, GUARD)
        await sim.run_pod_sandbox(pod)
        await node.create(node.asking(pod, "fwd", "12-13"))
        assert node.running("fwd") == expected


def _move(path: Path, to: Path) -> Path:
    """Take a cgroup file away (or put it back): the pod cgroup then fails us."""
    return path.rename(to)


@pytest.mark.asyncio
async def test_an_update_whose_pod_quota_cannot_follow_is_refused(short_dir: Path) -> None:
    node = Node(short_dir)
    sim, tree = node.sim, node.tree
    pod = node.pod("stuck")
    plugin = node.plugin()
    async with sim, plugin_running(plugin, node.socket):
        await sim.wait_for_plugins(1, GUARD)
        await sim.run_pod_sandbox(pod)
        await node.create(node.asking(pod, "fwd", "12-13"))
        quota_file = Path(tree.pod_dir(pod).fs_path, "cpu.cfs_quota_us")
        hidden = _move(quota_file, quota_file.with_suffix(".hidden"))
        with structlog.testing.capture_logs() as logs, pytest.raises(PluginFailed) as info:
            await sim.update_container("fwd", _kubelet("5,12"))
        assert info.value.code == Code.FAILED_PRECONDITION
        assert "cannot raise the CPU quota of pod ns/app" in info.value.message
        assert [e["event_name"] for e in logs if e["event"] == "update refused"] == ["UpdateContainer"]
        # Nothing changed: the container, its share in the books, the pod quota.
        assert node.running("fwd")[:2] == ("8-9,12-13", 4 * PERIOD)
        found = plugin.books.find("fwd")
        assert found is not None
        assert (found[1].shared_cpus, found[1].exclusive) == (2, "12-13")
        _move(hidden, quota_file)
        assert tree.pod_quota(pod) == BASELINE + 2 * PERIOD
        applied = await sim.update_container("fwd", _kubelet("5,12"))
        assert applied.cpu.cpus == "0-1,5,8-9,12"
        assert tree.pod_quota(pod) == BASELINE + 4 * PERIOD
