"""The pod-quota reconciler's timers on virtual time: a lowering the kernel refuses is retried after
each of `LOWER_RETRY_DELAYS`, then left to the pod's next event; a removed pod's retry is cancelled;
without a running loop nothing is scheduled (and nothing fails).

A fake v1 tree cannot refuse a write the way the kernel does (tests/test_mixedcpu_kernel_v1.py has
the real thing): `refusing` makes the reconciler's quota write refuse lowerings, as v1 does while a
container cgroup still holds its raised quota.
"""

from __future__ import annotations

import errno
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import structlog
from mixedcpu_support import PERIOD, FakeCgroups, Naming, make_container, make_plugin, make_pod, marker

from nri_plugin import cgroups
from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import Cgroup, CgroupWriteRejected, CpuQuota, read_cpu_quota
from nri_plugin.common.clock import ManualClock
from nri_plugin.mixedcpu import baselines
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin
from nri_plugin.mixedcpu.quota import LOWER_RETRY_DELAYS

_T = TypeVar("_T")

CGROUPFS = Naming("containerd", "cgroupfs")
SHARED = frozenset({0, 1})
BASELINE = 300_000
RAISED = BASELINE + len(SHARED) * PERIOD


@dataclass
class Refusals:
    """How many more lowerings the 'kernel' refuses (-1: all of them), and how many it has."""

    left: int = 0
    refused: int = 0


@pytest.fixture
def refusing(monkeypatch: pytest.MonkeyPatch) -> Refusals:
    refusals = Refusals()
    write_limit = cgroups.write_cpu_limit

    def refuse_a_lowering(cgroup: Cgroup, value: int | None, now: CpuQuota) -> None:
        lowering = value is not None and (now.quota is None or value < now.quota)
        if lowering and refusals.left != 0:
            refusals.left -= 1
            refusals.refused += 1
            raise CgroupWriteRejected(
                f"writing {value} to {cgroup}/cpu.cfs_quota_us was rejected: Invalid argument (EINVAL)",
                path=str(cgroup),
                value=str(value),
                errno=errno.EINVAL,
            )

    def write_cpu_limit(cgroup: Cgroup, limit: CpuQuota) -> None:
        refuse_a_lowering(cgroup, limit.quota, read_cpu_quota(cgroup))
        write_limit(cgroup, limit)

    # Every quota write of the cgroups library (write_cpu_quota, set_cpu_limit) ends in this one.
    monkeypatch.setattr(cgroups.files, "write_cpu_limit", write_cpu_limit)
    return refusals


class Pod:
    """A pod with one shared container, created through the plugin on a fake v1 tree."""

    def __init__(self, tmp_path: Path, clock: ManualClock) -> None:
        self.tree = FakeCgroups(tmp_path / "cgroup")
        self.plugin: MixedCpuPlugin
        self.plugin, key = make_plugin(tmp_path / "state", self.tree.layout, SHARED, clock=clock)
        self.pod = make_pod(CGROUPFS)
        self.tree.add_pod(self.pod, BASELINE)
        self.container = make_container(CGROUPFS, self.pod, "c1", annotations=marker(key))

    async def create(self) -> None:
        assert await self.plugin.create_container(self.pod, self.container) is not None
        self.container.state = api.CONTAINER_RUNNING
        assert self.quota == RAISED

    @property
    def quota(self) -> int | None:
        return self.tree.pod_quota(self.pod)


@pytest.mark.asyncio
async def test_a_refused_lowering_is_retried_on_the_clock(tmp_path: Path, refusing: Refusals) -> None:
    clock = ManualClock()
    node = Pod(tmp_path, clock)
    await node.create()
    refusing.left = 2
    with structlog.testing.capture_logs() as logs:
        await node.plugin.stop_container(node.pod, node.container)
    assert [e["event"] for e in logs if "refuses to lower" in e["event"]] != []
    assert node.quota == RAISED  # the higher quota stays meanwhile
    assert node.plugin.quotas.retries_pending == {node.pod.uid}
    await clock.advance(LOWER_RETRY_DELAYS[0] - 0.001)
    assert refusing.refused == 1  # not yet due
    await clock.advance(0.001)
    assert refusing.refused == 2  # the first retry, refused too
    assert node.quota == RAISED
    await clock.advance(LOWER_RETRY_DELAYS[1])
    assert node.quota == BASELINE  # the second retry went through
    assert node.plugin.books.pods == {}  # back at its own quota with no shared container: forgotten
    assert node.plugin.store.load().pods == {}
    assert clock.pending == 0


@pytest.mark.asyncio
async def test_retries_end_after_the_last_delay_and_the_next_event_lowers(
    tmp_path: Path, refusing: Refusals
) -> None:
    clock = ManualClock()
    node = Pod(tmp_path, clock)
    await node.create()
    refusing.left = -1
    with structlog.testing.capture_logs() as logs:
        await node.plugin.stop_container(node.pod, node.container)
        await clock.advance(sum(LOWER_RETRY_DELAYS) + 1)
    assert refusing.refused == 1 + len(LOWER_RETRY_DELAYS)
    [gave_up] = [
        e for e in logs if e["event"] == "the pod quota stays above its target until the pod's next event"
    ]
    assert gave_up["attempts"] == len(LOWER_RETRY_DELAYS)
    assert clock.pending == 0
    assert node.plugin.quotas.retries_pending == frozenset()
    assert node.quota == RAISED
    refusing.left = 0
    await node.plugin.remove_container(node.pod, node.container)  # the pod's next event
    assert node.quota == BASELINE


@pytest.mark.asyncio
async def test_removing_the_pod_cancels_its_retry(tmp_path: Path, refusing: Refusals) -> None:
    clock = ManualClock()
    node = Pod(tmp_path, clock)
    await node.create()
    refusing.left = -1
    await node.plugin.stop_container(node.pod, node.container)
    node.plugin.flush()  # the slot change's deferred write: only the retry waits now
    assert clock.pending == 1
    await node.plugin.remove_pod_sandbox(node.pod)
    assert clock.pending == 0
    await clock.advance(sum(LOWER_RETRY_DELAYS))
    assert refusing.refused == 1


@pytest.mark.asyncio
async def test_cancel_retries_stops_every_pending_one(tmp_path: Path, refusing: Refusals) -> None:
    clock = ManualClock()
    node = Pod(tmp_path, clock)
    await node.create()
    refusing.left = -1
    await node.plugin.stop_container(node.pod, node.container)
    node.plugin.flush()
    assert clock.pending == 1
    node.plugin.quotas.cancel_retries()
    assert clock.pending == 0
    assert node.plugin.quotas.retries_pending == frozenset()


def run_without_a_loop(step: Coroutine[Any, Any, _T]) -> _T:
    """Run a coroutine that never suspends (the file writer never does) with no event loop at all."""
    try:
        step.send(None)
    except StopIteration as done:
        result: _T = done.value
        return result
    step.close()
    raise AssertionError("the coroutine suspended: it needs a loop")


def test_without_a_running_loop_nothing_is_scheduled(tmp_path: Path, refusing: Refusals) -> None:
    """The real clock needs a running loop: outside one, a refused lowering waits for the pod's next
    event, and a slot change is written at once (nothing would fire a deferred write)."""
    tree = FakeCgroups(tmp_path / "cgroup")
    plugin, _ = make_plugin(tmp_path / "state", tree.layout, SHARED)  # the loop's clock
    pod = make_pod(CGROUPFS)
    tree.add_pod(pod, RAISED)
    plugin.books.pods[pod.uid] = baselines.new_pod_record(pod, CpuQuota(BASELINE, PERIOD))
    refusing.left = -1
    run_without_a_loop(plugin.quotas.settle(pod.uid, pod.linux.cgroup_parent, {"pod_key": pod.uid}))
    assert refusing.refused == 1
    assert plugin.quotas.retries_pending == frozenset()
    assert tree.pod_quota(pod) == RAISED
    assert plugin.store.load().pods[pod.uid].baseline == BASELINE  # saved at once
