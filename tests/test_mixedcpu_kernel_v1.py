"""The plugin against the real kernel's cgroup v1 `cpu` and `cpuset` hierarchies, end to end.

Runs only as root on a host whose `cpu` and `cpuset` controllers are v1 hierarchies with at least two
CPUs; skipped otherwise. The pod cgroups are real kernel cgroups in a scratch tree
``<mount>/mixed-cpu-test-<pid>-<random>/kubepods/pod<uid>`` that the fixture always removes, children
first. The test plays the runtime's part on the container cgroups (create them with the adjusted
cpuset and quota, apply updates, delete them before RemoveContainer), the plugin plays its own through
the simulator over a real socket, and the kernel is the judge of the write order.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import structlog
from kernel_support import inherit_cpuset, make_cgroups, require_v1_layout, scratch_subtree
from mixedcpu_support import GUARD, Naming, make_container, make_plugin, make_pod, marker, plugin_running
from wait_support import wait_until

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import (
    CgroupDir,
    CgroupLayout,
    CgroupPath,
    CgroupWriteRejected,
    container_cgroup_path,
    pod_cgroup_path,
    read_cpu_quota,
    read_cpuset,
    write_cpu_quota,
    write_cpuset,
)
from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.nri.simulator import RuntimeSimulator

PERIOD = 100_000
NAMING = Naming("containerd", "cgroupfs")


@dataclass
class Kernel:
    """A scratch subtree holding one pod cgroup, in both hierarchies, and the runtime's part."""

    layout: CgroupLayout
    top: str
    shared: frozenset[int]
    exclusive: frozenset[int]

    def pod_parent(self, uid: str) -> str:
        return f"/{self.top}/kubepods/pod{uid}"

    def pod_cpu(self, pod: api.PodSandbox) -> CgroupDir:
        return self.layout.cpu.dir(pod_cgroup_path(pod.linux.cgroup_parent))

    def pod_quota(self, pod: api.PodSandbox) -> int | None:
        return read_cpu_quota(self.pod_cpu(pod)).quota

    def make_pod_cgroup(self, pod: api.PodSandbox, quota: int) -> None:
        """What kubelet does: the pod cgroup, its cpuset inherited, its quota the sum of its limits."""
        path = pod_cgroup_path(pod.linux.cgroup_parent)
        for hierarchy in (self.layout.cpu, self.layout.cpuset):
            make_cgroups(self.layout, hierarchy, path)
        write_cpu_quota(self.pod_cpu(pod), quota)

    def run_container(self, container: api.Container) -> None:
        """What the runtime does at creation: the container cgroups with the (adjusted) spec values."""
        path = container_cgroup_path(container.linux.cgroups_path)
        cpu, cpuset = self.layout.cpu.dir(path), self.layout.cpuset.dir(path)
        os.mkdir(cpu.fs_path)
        os.mkdir(cpuset.fs_path)
        inherit_cpuset(cpuset)
        self.apply(container, container.linux.resources)

    def apply(self, container: api.Container, resources: api.LinuxResources) -> None:
        """What the runtime does with a container's resources (at create, on update)."""
        path = container_cgroup_path(container.linux.cgroups_path)
        if resources.cpu.cpus:
            write_cpuset(self.layout.cpuset.dir(path), parse(resources.cpu.cpus))
        if resources.cpu.HasField("quota"):
            write_cpu_quota(self.layout.cpu.dir(path), resources.cpu.quota.value)

    def container_quota(self, container: api.Container) -> int | None:
        return read_cpu_quota(self.layout.cpu.dir(container_cgroup_path(container.linux.cgroups_path))).quota

    def container_cpus(self, container: api.Container) -> frozenset[int]:
        return read_cpuset(self.layout.cpuset.dir(container_cgroup_path(container.linux.cgroups_path)))

    def delete_container(self, container: api.Container) -> None:
        path = container_cgroup_path(container.linux.cgroups_path)
        for hierarchy in (self.layout.cpu, self.layout.cpuset):
            os.rmdir(hierarchy.dir(path).fs_path)


def parse(text: str) -> frozenset[int]:
    from nri_plugin.cgroups import parse_cpuset

    return parse_cpuset(text)


@pytest.fixture
def kernel() -> Iterator[Kernel]:
    layout = require_v1_layout(min_cpus=2)
    cpus = sorted(read_cpuset(layout.cpuset.dir(CgroupPath())))
    with scratch_subtree(layout, "mixed-cpu-test") as top:
        yield Kernel(layout, top, frozenset(cpus[:1]), frozenset(cpus[1:2]))


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="mcpu-k-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _pod(kernel: Kernel, uid: str) -> api.PodSandbox:
    pod = make_pod(NAMING, uid)
    pod.linux.cgroup_parent = kernel.pod_parent(uid)
    return pod


def _container(kernel: Kernel, pod: api.PodSandbox, cid: str, key: HostKey) -> api.Container:
    container = make_container(
        NAMING,
        pod,
        cid,
        "fwd",
        cpus=_fmt(kernel.exclusive),
        quota=PERIOD,
        shares=1024,
        annotations=marker(key),
    )
    container.linux.cgroups_path = f"{pod.linux.cgroup_parent}/{cid}"
    return container


def _fmt(cpus: frozenset[int]) -> str:
    from nri_plugin.cgroups import format_cpuset

    return format_cpuset(cpus)


def test_reverse_order_is_rejected_by_the_kernel(kernel: Kernel) -> None:
    """What a plugin that let the runtime raise the container first would meet."""
    pod = _pod(kernel, "rev-1")
    kernel.make_pod_cgroup(pod, PERIOD)
    container = _container(kernel, pod, "c1", HostKey(b"k" * 32))
    kernel.run_container(container)
    with pytest.raises(CgroupWriteRejected) as info:
        write_cpu_quota(
            kernel.layout.cpu.dir(container_cgroup_path(container.linux.cgroups_path)), 2 * PERIOD
        )
    assert info.value.errno == errno.EINVAL
    # ... and lowering the pod below a child that still has a raised quota is rejected too.
    write_cpu_quota(kernel.pod_cpu(pod), 2 * PERIOD)
    write_cpu_quota(kernel.layout.cpu.dir(container_cgroup_path(container.linux.cgroups_path)), 2 * PERIOD)
    with pytest.raises(CgroupWriteRejected) as info:
        write_cpu_quota(kernel.pod_cpu(pod), PERIOD)
    assert info.value.errno == errno.EINVAL
    kernel.delete_container(container)


@pytest.mark.asyncio
async def test_plugin_write_order_is_accepted_by_the_kernel(kernel: Kernel, short_dir: Path) -> None:
    socket = short_dir / "nri.sock"
    plugin, key = make_plugin(short_dir / "state", kernel.layout, kernel.shared)
    pod = _pod(kernel, "k-1")
    kernel.make_pod_cgroup(pod, PERIOD)  # one exclusive CPU: kubelet's pod quota
    raised = PERIOD + len(kernel.shared) * PERIOD
    union = kernel.exclusive | kernel.shared
    async with RuntimeSimulator(socket) as sim, plugin_running(plugin, socket):
        await sim.wait_for_plugins(1, GUARD)
        await sim.run_pod_sandbox(pod)
        created = (await sim.create_container(_container(kernel, pod, "c1", key))).container
        # The pod was raised before the reply, so the runtime's container write is accepted.
        assert kernel.pod_quota(pod) == raised
        kernel.run_container(created)
        assert kernel.container_quota(created) == len(union) * PERIOD
        assert kernel.container_cpus(created) == union

        # kubelet re-sends the exclusive CPUs only: the answer keeps the shared ones and the quota.
        requested = api.LinuxResources()
        requested.cpu.cpus = _fmt(kernel.exclusive)
        applied = await sim.update_container("c1", requested)
        kernel.apply(created, applied)
        assert kernel.container_cpus(created) == union
        assert kernel.container_quota(created) == len(union) * PERIOD

        # A restart: the old cgroup still exists at StopContainer (it lingers until removal), with
        # its raised quota. Stop means stop: the plugin puts the container's own quota back first,
        # so the kernel accepts the lower pod quota at once; the new instance raises both again.
        with structlog.testing.capture_logs() as logs:
            await sim.stop_container("c1")
        assert not any("refuses to lower the pod quota yet" in e["event"] for e in logs)
        assert kernel.container_quota(created) == len(kernel.exclusive) * PERIOD
        assert kernel.pod_quota(pod) == PERIOD
        again = (await sim.create_container(_container(kernel, pod, "c2", key))).container
        kernel.run_container(again)
        assert kernel.pod_quota(pod) == raised  # raised once again, no growth
        kernel.delete_container(created)
        await sim.remove_container("c1")
        assert kernel.pod_quota(pod) == raised  # c2 still holds its share

        # Removal: the runtime deletes the cgroup, then tells plugins. The kernel releases a deleted
        # cgroup's quota some 20-30 ms later: the plugin retries, and the pod comes down.
        await sim.stop_container("c2")
        kernel.delete_container(again)
        await sim.remove_container("c2")
        await wait_until(lambda: kernel.pod_quota(pod) == PERIOD, what="the pod quota came down")
        assert plugin.books.pods == {}
        assert [r for r in sim.records if r.outcome != "ok"] == []


@pytest.mark.asyncio
async def test_cpuset_widening_of_a_running_container(kernel: Kernel, short_dir: Path) -> None:
    """A container started before the plugin: Synchronize widens its cpuset and raises its quota."""
    socket = short_dir / "nri.sock"
    plugin, key = make_plugin(short_dir / "state", kernel.layout, kernel.shared)
    pod = _pod(kernel, "k-2")
    kernel.make_pod_cgroup(pod, PERIOD)
    early = _container(kernel, pod, "early", key)
    early.state = api.CONTAINER_RUNNING
    kernel.run_container(early)
    assert kernel.container_cpus(early) == kernel.exclusive
    union = kernel.exclusive | kernel.shared
    async with RuntimeSimulator(socket) as sim:
        sim.add_pod(pod)
        sim.add_container(early)
        async with plugin_running(plugin, socket):
            await sim.wait_for_plugins(1, GUARD)
        [update] = [u for u in sim.applied_updates if u.container_id == "early"]
        assert kernel.pod_quota(pod) == len(union) * PERIOD  # raised before the reply
        kernel.apply(early, update.linux.resources)  # the runtime applies the update
        assert kernel.container_cpus(early) == union
        assert kernel.container_quota(early) == len(union) * PERIOD

    # The rule the kernel enforces on cpusets: a child cannot be widened past its parent's CPUs.
    narrow = _pod(kernel, "k-3")
    kernel.make_pod_cgroup(narrow, PERIOD)
    other = _container(kernel, narrow, "other", key)
    kernel.run_container(other)
    write_cpuset(kernel.layout.cpuset.dir(pod_cgroup_path(narrow.linux.cgroup_parent)), kernel.exclusive)
    with pytest.raises(CgroupWriteRejected) as info:
        write_cpuset(kernel.layout.cpuset.dir(container_cgroup_path(other.linux.cgroups_path)), union)
    assert "subset of its parent's" in str(info.value)
    kernel.delete_container(other)
    kernel.delete_container(early)
