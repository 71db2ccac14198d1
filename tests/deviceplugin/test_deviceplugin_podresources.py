"""The client of kubelet's PodResources API against the fake kubelet's record, over a real unix socket:
Get where served, List otherwise, a short memory, and None (said once, counted each time) whenever
kubelet cannot be asked."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
import structlog
from fake_kubelet import PodResourcesRecord

from api.podresources.v1 import api_pb2 as podresources
from nri_plugin.common.clock import ManualClock
from nri_plugin.deviceplugin.podresources import LOOKUP_TIMEOUT, PodResourcesClient, socket_state

RESOURCE = "workload.openshift.io/enable-shared-cpus"


class Lookups:
    def __init__(self) -> None:
        self.outcomes: list[str] = []

    def pod_resources_lookup(self, outcome: str) -> None:
        self.outcomes.append(outcome)


@pytest.fixture
def directory() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="pr-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest_asyncio.fixture
async def record(directory: Path) -> AsyncIterator[PodResourcesRecord]:
    served = PodResourcesRecord(directory / "kubelet.sock")
    served.assign("ns", "fwd", "main", RESOURCE, "shared-cpus-3")
    served.assign("ns", "fwd", "gpu-user", "example.com/gpu", "gpu-0")
    served.run("ns", "plain", "main")
    await served.start()
    yield served
    await served.stop()


def client(path: Path, **kw: object) -> tuple[PodResourcesClient, Lookups]:
    lookups = Lookups()
    return PodResourcesClient(str(path), RESOURCE, observer=lookups, **kw), lookups  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_get_gives_each_container_its_devices_of_our_resource(
    record: PodResourcesRecord, directory: Path
) -> None:
    asked, lookups = client(directory / "kubelet.sock", ttl=0.0)
    assert await asked.pod_allocations("ns", "fwd") == {"main": frozenset({"shared-cpus-3"})}
    assert await asked.pod_allocations("ns", "plain") == {}, "a pod kubelet runs, with no device of ours"
    assert await asked.pod_allocations("ns", "thief") == {}, "a pod kubelet does not run"
    assert await asked.pod_allocations("other", "fwd") == {}
    assert record.calls == ["Get"] * 4
    assert asked.get_supported is True
    assert lookups.outcomes == ["ok"] * 4
    assert asked.reachable is True


@pytest.mark.asyncio
async def test_list_when_get_is_disabled_and_for_the_whole_node(
    record: PodResourcesRecord, directory: Path
) -> None:
    record.get_enabled = False
    asked, _ = client(directory / "kubelet.sock", ttl=0.0)
    with structlog.testing.capture_logs() as logs:
        assert await asked.pod_allocations("ns", "fwd") == {"main": frozenset({"shared-cpus-3"})}
        assert await asked.pod_allocations("ns", "thief") == {}
    assert record.calls == ["Get", "List", "List"], "once refused, Get is not asked again"
    assert asked.get_supported is False
    assert [e["event"] for e in logs] == ["kubelet does not serve the pod-resources Get: asking with List"]
    node = await asked.node_allocations()
    assert node == {("ns", "fwd"): {"main": frozenset({"shared-cpus-3"})}, ("ns", "plain"): {}}


@pytest.mark.asyncio
async def test_a_pod_with_our_device_is_remembered_for_a_moment(
    record: PodResourcesRecord, directory: Path
) -> None:
    clock = ManualClock()
    asked, _ = client(directory / "kubelet.sock", clock=clock, ttl=2.0)
    for _ in range(3):
        assert await asked.pod_allocations("ns", "fwd") == {"main": frozenset({"shared-cpus-3"})}
        assert await asked.pod_allocations("ns", "thief") == {}
    assert record.calls == ["Get", "Get", "Get", "Get"], "found: once; not found: every time"
    await clock.advance(2.0)
    await asked.pod_allocations("ns", "fwd")
    assert record.calls.count("Get") == 5
    # A List refreshes what is remembered, and forgets pods that lost their devices.
    record.pods.pop(("ns", "fwd"))
    await asked.node_allocations()
    assert await asked.pod_allocations("ns", "fwd") == {}


@pytest.mark.asyncio
async def test_no_socket_no_answer_then_kubelet_comes(directory: Path) -> None:
    path = directory / "kubelet.sock"
    asked, lookups = client(path)
    assert socket_state(str(path)) == f"{path} does not exist"
    with structlog.testing.capture_logs() as logs:
        asked.log_start()
        assert await asked.pod_allocations("ns", "fwd") is None
        assert await asked.node_allocations() is None
    assert not asked.answering
    [warning] = logs
    assert warning["log_level"] == "warning"
    assert warning["event"].startswith(
        "kubelet's pod-resources API cannot be asked: the allocation marker alone"
    )
    assert warning["reason"] == f"{path} does not exist"
    assert lookups.outcomes == ["unavailable", "unavailable"]
    served = PodResourcesRecord(path)
    served.assign("ns", "fwd", "main", RESOURCE, "shared-cpus-1")
    await served.start()
    try:
        with structlog.testing.capture_logs() as logs:
            assert await asked.pod_allocations("ns", "fwd") == {"main": frozenset({"shared-cpus-1"})}
        assert [e["event"] for e in logs] == [
            "kubelet's pod-resources API answers again: kubelet's record proves requests"
        ]
        assert asked.answering
    finally:
        await served.stop()
    # kubelet gone, its socket file left behind (refused connections): unavailable again, said once.
    with structlog.testing.capture_logs() as logs:
        assert await asked.pod_allocations("ns", "other") is None
        assert await asked.pod_allocations("ns", "other2") is None
    assert [e["log_level"] for e in logs] == ["warning"]
    assert lookups.outcomes[-2:] == ["unavailable", "unavailable"]


@pytest.mark.asyncio
async def test_a_kubelet_that_never_answers_costs_the_timeout_only(directory: Path) -> None:
    path = directory / "kubelet.sock"
    silent = socket.socket(socket.AF_UNIX)
    silent.bind(str(path))
    silent.listen(16)  # connections queue, nobody ever speaks
    try:
        asked, lookups = client(path)
        started = time.monotonic()
        assert await asked.pod_allocations("ns", "fwd") is None
        took = time.monotonic() - started
        assert LOOKUP_TIMEOUT * 0.9 <= took < LOOKUP_TIMEOUT + 1.0, took
        assert lookups.outcomes == ["unavailable"]
    finally:
        silent.close()


@pytest.mark.asyncio
async def test_a_socket_path_that_is_not_a_socket(directory: Path) -> None:
    path = directory / "kubelet.sock"
    path.write_text("")
    asked, _ = client(path)
    assert socket_state(str(path)) == f"{path} is not a socket"
    assert await asked.pod_allocations("ns", "fwd") is None


def test_only_our_resource_counts() -> None:
    asked = PodResourcesClient("/nonexistent", RESOURCE)
    pod = podresources.PodResources(name="p", namespace="ns")
    both = pod.containers.add(name="both")
    both.devices.add(resource_name=RESOURCE, device_ids=["shared-cpus-1"])
    both.devices.add(resource_name="example.com/gpu", device_ids=["gpu-1"])
    pod.containers.add(name="none").devices.add(resource_name="example.com/gpu", device_ids=["gpu-2"])
    assert asked._devices(pod) == {"both": frozenset({"shared-cpus-1"})}


@pytest.mark.asyncio
async def test_concurrent_lookups_each_get_an_answer(record: PodResourcesRecord, directory: Path) -> None:
    asked, _ = client(directory / "kubelet.sock", ttl=0.0)
    answers = await asyncio.gather(*(asked.pod_allocations("ns", "fwd") for _ in range(8)))
    assert answers == [{"main": frozenset({"shared-cpus-3"})}] * 8


@pytest.mark.asyncio
async def test_what_is_remembered_stays_bounded(directory: Path) -> None:
    served = PodResourcesRecord(directory / "kubelet.sock")
    for i in range(600):
        served.assign("ns", f"pod-{i}", "main", RESOURCE, f"shared-cpus-{i}")
    await served.start()
    try:
        clock = ManualClock()
        asked, _ = client(directory / "kubelet.sock", clock=clock, ttl=2.0)
        for i in range(600):
            assert await asked.pod_allocations("ns", f"pod-{i}") == {"main": frozenset({f"shared-cpus-{i}"})}
            if i % 100 == 99:
                await clock.advance(2.0)
        assert len(asked._pods) <= 256 + 100
    finally:
        await served.stop()
