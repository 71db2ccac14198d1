"""In-place pod resize (issue 12 item 4): kubelet rewrites the pod cgroup's CPU quota to the pod's
new own quota, dropping the shares. The pod quota is raised again to the new own quota plus the
shares: at UpdatePodSandbox where the runtime sends it (NRI v0.10+), else at the pod's next
container event or the reconciler's pass; a resized container's own quota likewise at its update.

The runtime simulator and a fake cgroup tree (the test plays kubelet on it), and the handlers
called directly for the reconciler's part.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from mixedcpu_support import (
    GUARD,
    PERIOD,
    FakeCgroups,
    Naming,
    apply_adjustment,
    make_container,
    make_plugin,
    make_pod,
    marker,
    plugin_running,
)

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import CpuQuota, write_cpu_quota
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key
from nri_plugin.mixedcpu.baselines import adopt_resize
from nri_plugin.mixedcpu.books import PodRecord
from nri_plugin.mixedcpu.policy import plan_update
from nri_plugin.nri.events import Event
from nri_plugin.nri.simulator import RuntimeSimulator

SHARED = frozenset({0, 1})
BASELINE = 2 * PERIOD  # the pod's own quota before: its container's 2 CPUs
GROWN = 5 * PERIOD  # ... after kubelet resized the container to 5 CPUs
SHRUNK = 1 * PERIOD
SHARES = len(SHARED) * PERIOD


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rsz-", dir="/tmp"))  # unix socket paths are limited
    yield path
    shutil.rmtree(path, ignore_errors=True)


def resources(quota: int) -> api.LinuxResources:
    """What kubelet sends for a resized pod or container: the whole CPU limit."""
    wanted = api.LinuxResources()
    wanted.cpu.quota.value = quota
    wanted.cpu.period.value = PERIOD
    wanted.cpu.shares.value = quota * 1024 // PERIOD
    return wanted


class Node:
    def __init__(
        self,
        root: Path,
        naming: Naming,
        version: int = 2,
        *,
        runtime_version: str = "v2.3.4",
        nri_version: str = "v0.12.0",
    ) -> None:
        self.naming = naming
        self.tree = FakeCgroups(root / "cgroup", version)
        self.socket = root / "nri.sock"
        self.state = root / "state"
        self.sim = RuntimeSimulator(
            self.socket, runtime_name=naming.runtime, runtime_version=runtime_version, nri_version=nri_version
        )
        self.key = load_or_create_host_key(self.state)
        self.plugin, _ = make_plugin(self.state, self.tree.layout, SHARED)

    async def shared_pod(self) -> tuple[api.PodSandbox, api.Container]:
        pod = make_pod(self.naming, "12-34")
        pod.linux.pod_resources.CopyFrom(resources(BASELINE))
        self.tree.add_pod(pod, BASELINE)
        await self.sim.run_pod_sandbox(pod)
        container = make_container(self.naming, pod, "fwd", "fwd", annotations=marker(self.key))
        result = await self.sim.create_container(container)
        self.tree.run_container(result.container)
        assert self.tree.pod_quota(pod) == BASELINE + SHARES
        return pod, result.container

    def kubelet_resizes_pod(self, pod: api.PodSandbox, quota: int) -> None:
        """kubelet writes the pod cgroup's new limit (before the containers' when it grows)."""
        write_cpu_quota(self.tree.pod_dir(pod), quota)


@pytest.mark.asyncio
@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
async def test_update_pod_sandbox_raises_the_pod_to_its_new_quota_plus_the_shares(
    root: Path, version: int
) -> None:
    node = Node(root, Naming("containerd", "systemd"), version)  # NRI v0.12: UpdatePodSandbox sent
    async with node.sim, plugin_running(node.plugin, node.socket):
        await node.sim.wait_for_plugins(1, GUARD)
        pod, container = await node.shared_pod()
        node.kubelet_resizes_pod(pod, GROWN)
        await node.sim.update_pod_sandbox(pod.id, resources(GROWN))
        assert node.tree.pod_quota(pod) == GROWN + SHARES
        assert [r.event for r in node.sim.records][-1] == "UpdatePodSandbox"
        record = node.plugin.books.pods[pod.uid]
        assert (record.baseline, record.baseline_source) == (GROWN, "pod-resources")
        # The new own quota is the pod's from now on: its share released, that is what stays.
        await node.sim.stop_container(container.id)
        assert node.tree.pod_quota(pod) == GROWN


@pytest.mark.asyncio
async def test_without_update_pod_sandbox_the_containers_update_brings_both_quotas(root: Path) -> None:
    """containerd 1.7 (NRI v0.8) sends no UpdatePodSandbox: the resized container's UpdateContainer
    finds the pod's quota kubelet wrote, and raises it before the container's own."""
    node = Node(root, Naming("containerd", "systemd"), 1, runtime_version="v1.7.34", nri_version="v0.8.0")
    async with node.sim, plugin_running(node.plugin, node.socket):
        await node.sim.wait_for_plugins(1, GUARD)
        assert not any(p.subscribed(Event.UPDATE_POD_SANDBOX) for p in node.sim.plugins)
        pod, container = await node.shared_pod()
        node.kubelet_resizes_pod(pod, GROWN)  # the pod first, when it grows (v1 demands it)
        applied = await node.sim.update_container(container.id, resources(GROWN))
        assert applied.cpu.quota.value == GROWN + SHARES, "its new own limit plus its shared CPUs"
        assert applied.cpu.cpus == "0-1,4-5"
        assert node.tree.pod_quota(pod) == GROWN + SHARES
        assert node.plugin.books.pods[pod.uid].baseline_source == "resized"


@pytest.mark.asyncio
async def test_the_reconciler_notices_a_pod_shrunk_behind_it(root: Path) -> None:
    """A resize down writes the pod's quota after its containers' and no event follows: the next pass
    takes kubelet's value as the pod's own quota and gives the shares back on top of it."""
    tree = FakeCgroups(root / "cgroup", 2)
    plugin, key = make_plugin(root / "state", tree.layout, SHARED)
    naming = Naming("containerd", "cgroupfs")
    pod = make_pod(naming, "56-78")
    tree.add_pod(pod, BASELINE)
    container = make_container(naming, pod, "fwd", "fwd", annotations=marker(key))
    apply_adjustment(
        container, (await plugin.create_container(pod, container) or api.CreateContainerResponse()).adjust
    )
    tree.run_container(container)
    assert tree.pod_quota(pod) == BASELINE + SHARES
    write_cpu_quota(tree.pod_dir(pod), SHRUNK)
    report = await plugin.healer.reconcile()
    assert report.healed == 1
    assert tree.pod_quota(pod) == SHRUNK + SHARES
    assert plugin.books.pods[pod.uid].baseline == SHRUNK
    # systemd re-applying kubelet's value (the pod's own) is not a resize: brought back, same books.
    write_cpu_quota(tree.pod_dir(pod), SHRUNK)
    await plugin.healer.reconcile()
    assert tree.pod_quota(pod) == SHRUNK + SHARES
    assert plugin.books.pods[pod.uid].baseline == SHRUNK


# -- the rules, pure ---------------------------------------------------------------------------------


def test_adopt_resize_takes_only_a_value_nobody_here_wrote() -> None:
    record = PodRecord(cgroup_parent="/kubepods/pod1", baseline=BASELINE, period=PERIOD)
    target = record.target()
    assert target == BASELINE
    now = CpuQuota(GROWN, PERIOD)
    assert adopt_resize(record, now, None) is record, "nothing written since the start: no telling"
    assert adopt_resize(record, now, GROWN) is record, "what we wrote ourselves (a refused lowering)"
    assert adopt_resize(record, CpuQuota(BASELINE, PERIOD), 3 * PERIOD) is record, "the pod's own, put back"
    assert adopt_resize(record, CpuQuota(None, PERIOD), 3 * PERIOD) is record, "unlimited: rebase's"
    resized = adopt_resize(record, now, 3 * PERIOD)
    assert (resized.baseline, resized.baseline_source) == (GROWN, "resized")


@pytest.mark.parametrize(
    ("asked", "current", "expected"),
    [
        (GROWN, BASELINE + SHARES, GROWN + SHARES),  # a resize keeping the cpuset: the new limit + shares
        (SHRUNK, BASELINE + SHARES, SHRUNK + SHARES),
        (BASELINE, BASELINE + SHARES, BASELINE + SHARES),  # n(exclusive): as before
        (BASELINE + SHARES, BASELINE + SHARES, BASELINE + 2 * SHARES),  # grown to what it had raised
    ],
    ids=["grown", "shrunk", "own", "grown-to-the-raised-value"],
)
def test_a_resized_containers_quota_is_its_new_limit_plus_its_shares(
    asked: int, current: int, expected: int
) -> None:
    naming = Naming("containerd", "cgroupfs")
    pod = make_pod(naming)
    container = make_container(naming, pod, "c1", cpus="0-1,4-5", quota=current)
    requested = resources(asked)
    plan = plan_update(SHARED, pod, container, requested, frozenset({4, 5}))
    assert plan.update.linux.resources.cpu.quota.value == expected
    assert plan.update.linux.resources.cpu.cpus == "0-1,4-5"
