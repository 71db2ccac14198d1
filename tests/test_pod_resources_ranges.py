"""Hostile ``pod_resources`` values (issue #13, break 7): a period of 1 us or 2^63 us, a quota of -5 us
were trusted in the pod quota's arithmetic. Values outside the kernel's CFS ranges (period 1000 to
1000000 us; quota -1 or 1000 to 2^44 - 1 us) are now refused with a clear error at creation, and
ignored (logged) at Synchronize, where the pod's cgroup gives its baseline instead."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import structlog
from mixedcpu_support import PERIOD, FakeCgroups, Naming, make_container, make_plugin, make_pod, marker
from redteam_support import daemon_node, is_shared, short_directory

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.mixedcpu.policy import (
    MAX_CFS_QUOTA,
    PolicyError,
    baseline_from_pod_resources,
    check_pod_resources,
)
from nri_plugin.nri.errors import PreconditionFailed
from nri_plugin.nri.simulator import PluginFailed

CGROUPFS = Naming("containerd", "cgroupfs")

# (field, quota, period, what the message says)
HOSTILE = [
    ("pod_resources", 300_000, 1, "a CFS period of 1 us"),
    ("pod_resources", 300_000, 2**63, f"a CFS period of {2**63} us"),
    ("pod_resources", 300_000, 999, "a CFS period of 999 us"),
    ("pod_resources", 300_000, 1_000_001, "a CFS period of 1000001 us"),
    ("pod_resources", -5, 100_000, "a CFS quota of -5 us"),
    ("pod_resources", 999, 100_000, "a CFS quota of 999 us"),
    ("pod_resources", MAX_CFS_QUOTA + 1, 100_000, f"a CFS quota of {MAX_CFS_QUOTA + 1} us"),
    ("pod_resources", -(2**63), 100_000, f"a CFS quota of {-(2**63)} us"),
    ("pod_overhead", 25_000, 7, "a CFS period of 7 us"),
]


def hostile_pod(field: str, quota: int, period: int, uid: str = "1111-aaaa") -> api.PodSandbox:
    pod = make_pod(CGROUPFS, uid, name="hostile")
    pod.linux.pod_resources.cpu.quota.value = 300_000
    pod.linux.pod_resources.cpu.period.value = PERIOD
    cpu = getattr(pod.linux, field).cpu
    cpu.quota.value = quota
    cpu.period.value = period
    return pod


@pytest.mark.parametrize(("field", "quota", "period", "what"), HOSTILE)
def test_values_outside_the_kernels_ranges_are_refused(
    field: str, quota: int, period: int, what: str
) -> None:
    pod = hostile_pod(field, quota, period)
    checks: list[Callable[[], object]] = [
        lambda: check_pod_resources(pod),
        lambda: baseline_from_pod_resources(pod, PERIOD),
    ]
    for check in checks:
        with pytest.raises(PolicyError) as info:
            check()
        assert info.value.kind == "node"
        assert str(info.value).startswith(f"pod ns/hostile: the runtime sent {field} with {what}, outside")
        assert "kernel's range" in str(info.value)


@pytest.mark.parametrize(
    ("quota", "period", "baseline"),
    [
        (-1, 100_000, None),
        (0, 0, None),
        (1_000, 1_000, 100_000),
        (MAX_CFS_QUOTA, 1_000_000, -(-MAX_CFS_QUOTA // 10)),
    ],
)
def test_the_edges_of_the_ranges_are_taken(quota: int, period: int, baseline: int | None) -> None:
    pod = make_pod(CGROUPFS)
    pod.linux.pod_resources.cpu.quota.value = quota
    pod.linux.pod_resources.cpu.period.value = period
    check_pod_resources(pod)
    assert baseline_from_pod_resources(pod, PERIOD) == baseline


@pytest.mark.asyncio
async def test_creation_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    tree = FakeCgroups(tmp_path / "cgroup")
    plugin, key = make_plugin(tmp_path / "state", tree.layout)
    pod = hostile_pod("pod_resources", 300_000, 1)
    tree.add_pod(pod, 2 * PERIOD)
    container = make_container(CGROUPFS, pod, "c1", "fwd", annotations=marker(key, "shared-cpus-0"))
    with structlog.testing.capture_logs() as logs, pytest.raises(PreconditionFailed) as info:
        await plugin.create_container(pod, container)
    assert "a CFS period of 1 us, outside the kernel's range (1000 to 1000000 us)" in str(info.value)
    assert tree.pod_quota(pod) == 2 * PERIOD
    assert plugin.books.find("c1") is None
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["refused shared CPUs"]
    # A container that asks for nothing is not concerned.
    plain = make_container(CGROUPFS, pod, "c2", "plain")
    assert await plugin.create_container(pod, plain) is None


@pytest.mark.asyncio
async def test_synchronize_ignores_them_and_takes_the_cgroups_quota(tmp_path: Path) -> None:
    tree = FakeCgroups(tmp_path / "cgroup")
    plugin, key = make_plugin(tmp_path / "state", tree.layout)
    pod = hostile_pod("pod_resources", -5, 2**63)
    tree.add_pod(pod, 2 * PERIOD)
    container = make_container(
        CGROUPFS, pod, "c1", "fwd", annotations=marker(key, "shared-cpus-0"), state=api.CONTAINER_RUNNING
    )
    with structlog.testing.capture_logs() as logs:
        updates = await plugin.synchronize([pod], [container])
    assert [u.container_id for u in updates] == ["c1"]
    record = plugin.books.pods[pod.uid]
    assert (record.baseline, record.baseline_source) == (2 * PERIOD, "first-seen")
    assert tree.pod_quota(pod) == 4 * PERIOD  # its own 2 CPUs + the 2 shared ones
    [error] = [e for e in logs if e["event"] == "pod_resources ignored"]
    assert "a CFS quota of -5 us" in error["reason"] or "a CFS period" in error["reason"]
    assert pod.linux.pod_resources.cpu.quota.value == -5, "the runtime's message is left as it came"


@pytest.mark.asyncio
async def test_through_the_daemon_the_runtime_gets_the_error() -> None:
    with short_directory("pr-") as root:
        async with daemon_node(root) as node:
            pod = node.pod("1111-aaaa", "hostile")
            pod.linux.pod_resources.cpu.quota.value = 300_000
            pod.linux.pod_resources.cpu.period.value = 1
            with pytest.raises(PluginFailed) as info:
                await node.create(pod, "c1", "fwd", annotations=marker(node.key, "shared-cpus-0"))
            assert info.value.code == 9  # FailedPrecondition
            assert "pod_resources with a CFS period of 1 us, outside the kernel's range" in info.value.message
            assert node.tree.pod_text(pod) == f"{2 * PERIOD}\n"
            await node.daemon.wait_log("refused shared CPUs", "a CFS period of 1 us")
            # The daemon serves the next, sane pod.
            sane = node.pod("2222-bbbb", "sane")
            assert is_shared(
                await node.create(sane, "c2", "fwd", annotations=marker(node.key, "shared-cpus-1"))
            )
