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

import grpc
import pytest
import pytest_asyncio
import structlog
from fake_kubelet import PodResourcesRecord
from mixedcpu_support import write_daemon_config

from nri_plugin.api.podresources.v1 import api_pb2 as podresources
from nri_plugin.common.clock import ManualClock
from nri_plugin.daemon.check import Status, check_pod_resources
from nri_plugin.daemon.config import load_config
from nri_plugin.deviceplugin.podresources import (
    DEGRADED_WARNING_PERIOD,
    GET_RETRY_FIRST,
    LOOKUP_TIMEOUT,
    MAX_ANSWER,
    DraDevices,
    PodResourcesClient,
    socket_state,
)

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
    clock = ManualClock()
    asked, lookups = client(directory / "kubelet.sock", ttl=0.0, clock=clock)
    with structlog.testing.capture_logs() as logs:
        assert await asked.pod_allocations("ns", "fwd") == {"main": frozenset({"shared-cpus-3"})}
        assert await asked.pod_allocations("ns", "thief") == {}
    assert record.calls == ["Get", "List", "List"], "refused, Get is not asked again at once"
    assert asked.get_supported is False
    assert (asked.proof, asked.degraded, lookups.outcomes) == ("list", True, ["list", "list"])
    [warning] = logs
    assert warning["log_level"] == "warning"
    assert warning["event"].startswith("kubelet does not serve the pod-resources Get: requests for shared")
    assert "KubeletPodResourcesGet feature gate" in warning["event"]
    node = await asked.node_allocations()
    assert node == {("ns", "fwd"): {"main": frozenset({"shared-cpus-3"})}, ("ns", "plain"): {}}


@pytest.mark.parametrize(
    ("code", "details", "answer"),
    [
        # kubelet's own answer for a pod it does not run (a plain Go error: Unknown): no devices.
        (grpc.StatusCode.UNKNOWN, "pod thief in namespace ns not found", {}),
        (grpc.StatusCode.NOT_FOUND, "no such pod", {}),
        # Anything else is kubelet failing, not kubelet saying it allocated nothing.
        (grpc.StatusCode.UNKNOWN, "pod other in namespace ns not found", None),
        (grpc.StatusCode.UNKNOWN, "checkpoint not found", None),
        (grpc.StatusCode.INTERNAL, "pod thief in namespace ns not found", None),
        (grpc.StatusCode.INTERNAL, "PodResources API Get method disabled", None),
    ],
)
@pytest.mark.asyncio
async def test_only_kubelets_answer_for_an_unknown_pod_means_no_devices(
    record: PodResourcesRecord,
    directory: Path,
    code: grpc.StatusCode,
    details: str,
    answer: dict[str, frozenset[str]] | None,
) -> None:
    """An error text ending in " not found" was taken for "kubelet runs no such pod", whatever its code
    and whichever pod it named: an answer that refuses the request, where an unavailable kubelet
    falls back to the marker. The status code and kubelet's exact text for the pod asked decide."""
    record.get_error = (code, details)
    asked, lookups = client(directory / "kubelet.sock", ttl=0.0)
    assert await asked.pod_allocations("ns", "thief") == answer
    assert lookups.outcomes == (["ok"] if answer is not None else ["unavailable"])
    assert asked.get_supported is (True if answer is not None else None)


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled"),
        (grpc.StatusCode.UNIMPLEMENTED, "unknown method Get for service v1.PodResourcesLister"),
    ],
)
@pytest.mark.asyncio
async def test_a_get_refused_by_code_and_kubelets_text_goes_to_list(
    record: PodResourcesRecord, directory: Path, code: grpc.StatusCode, details: str
) -> None:
    record.get_error = (code, details)
    asked, lookups = client(directory / "kubelet.sock", ttl=0.0)
    assert await asked.pod_allocations("ns", "fwd") == {"main": frozenset({"shared-cpus-3"})}
    assert record.calls == ["Get", "List"]
    assert (asked.get_supported, lookups.outcomes) == (False, ["list"])


@pytest.mark.asyncio
async def test_get_refused_is_asked_again_after_a_backoff_not_given_up_for_good(
    record: PodResourcesRecord, directory: Path
) -> None:
    """Issue 25, break 8: one "Get method disabled" answer switched the daemon to List for good."""
    record.get_enabled = False
    clock = ManualClock()
    asked, lookups = client(directory / "kubelet.sock", ttl=0.0, clock=clock)
    await asked.pod_allocations("ns", "fwd")
    await clock.advance(GET_RETRY_FIRST * 0.7)  # within the first backoff (jitter 0.8 to 1.2)
    await asked.pod_allocations("ns", "fwd")
    assert record.calls == ["Get", "List", "List"]
    await clock.advance(GET_RETRY_FIRST * 0.6)  # past it: Get again, refused again
    await asked.pod_allocations("ns", "fwd")
    assert record.calls[3:] == ["Get", "List"]
    await clock.advance(GET_RETRY_FIRST * 1.5)  # the second backoff is twice the first
    await asked.pod_allocations("ns", "fwd")
    assert record.calls[5:] == ["List"]
    record.get_enabled = True  # kubelet restarted with the feature gate on
    await clock.advance(GET_RETRY_FIRST * 1.0)
    with structlog.testing.capture_logs() as logs:
        assert await asked.pod_allocations("ns", "fwd") == {"main": frozenset({"shared-cpus-3"})}
        assert await asked.pod_allocations("ns", "plain") == {}
    assert record.calls[6:] == ["Get", "Get"]
    assert [entry["event"] for entry in logs] == [
        "kubelet serves the pod-resources Get again: requests are proven by Get"
    ]
    assert (asked.get_supported, asked.proof, asked.degraded) == (True, "get", False)
    assert lookups.outcomes[-2:] == ["ok", "ok"]


@pytest.mark.asyncio
async def test_a_list_answer_for_a_full_node_over_the_grpc_default_is_taken(directory: Path) -> None:
    """Issue 25, break 8: a List answer over gRPC's 4 MB default made kubelet "unavailable", and the
    marker alone the proof. 110 pods of 10 containers with long device ids: taken."""
    served = PodResourcesRecord(directory / "kubelet.sock", get_enabled=False)
    served.crowd()
    served.assign("ns", "fwd", "main", RESOURCE, "shared-cpus-3")
    answer = await served.List(podresources.ListPodResourcesRequest(), None)
    assert 4 * 1024 * 1024 < answer.ByteSize() < MAX_ANSWER, answer.ByteSize()
    await served.start()
    try:
        asked, lookups = client(directory / "kubelet.sock", ttl=0.0, timeout=5.0)
        assert await asked.pod_allocations("ns", "fwd") == {"main": frozenset({"shared-cpus-3"})}
        assert await asked.pod_allocations("ns", "ghost") == {}
        node = await asked.node_allocations()
        assert node is not None
        assert len(node) == 111
        assert lookups.outcomes == ["list", "list"]
        assert asked.reachable is True
    finally:
        await served.stop()


@pytest.mark.asyncio
async def test_degraded_proof_is_said_at_warning_once_a_minute(
    record: PodResourcesRecord, directory: Path
) -> None:
    record.get_enabled = False
    clock = ManualClock()
    asked, _ = client(directory / "kubelet.sock", ttl=0.0, clock=clock)
    with structlog.testing.capture_logs() as logs:
        for _ in range(5):
            await asked.pod_allocations("ns", "fwd")
            await clock.advance(DEGRADED_WARNING_PERIOD / 4)
        await asked.pod_allocations("ns", "fwd")
    warnings = [entry for entry in logs if entry["log_level"] == "warning"]
    assert [entry["event"] for entry in warnings] == [
        "kubelet does not serve the pod-resources Get: requests for shared CPUs are proven by List, a "
        "whole-node answer per lookup, until it does; turn on kubelet's KubeletPodResourcesGet feature gate",
        "kubelet's pod-resources proof is still degraded",
    ]
    assert (warnings[1]["proof"], warnings[1]["lookups"]) == ("List", 5)  # the first one's included
    # Then kubelet goes: the marker alone, said at once, then again once a minute.
    await record.stop()
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert await asked.pod_allocations("ns", "fwd") is None
            await clock.advance(DEGRADED_WARNING_PERIOD / 2)
    warnings = [entry for entry in logs if entry["log_level"] == "warning"]
    assert len(warnings) == 2, warnings
    assert warnings[0]["event"].startswith("kubelet's pod-resources API cannot be asked")
    assert (warnings[1]["proof"], warnings[1]["lookups"]) == ("the allocation marker alone", 3)
    assert (asked.proof, asked.degraded) == ("marker", True)


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


@pytest.mark.asyncio
async def test_check_says_when_kubelet_does_not_serve_get(
    record: PodResourcesRecord, directory: Path
) -> None:
    """``check`` asks Get itself: a warning line naming the feature gate when kubelet refuses it,
    nothing when it serves it."""
    config_path = write_daemon_config(
        directory, directory / "dp", device_plugin_extra=f'pod_resources_socket = "{record.socket_path}"\n'
    )
    config = load_config(config_path, check=False)
    assert await asyncio.to_thread(check_pod_resources, config) is None
    record.get_enabled = False
    finding = await asyncio.to_thread(check_pod_resources, config)
    assert finding is not None
    assert (finding.status, finding.topic) == (Status.WARN, "pod-resources API")
    assert finding.detail == (
        "kubelet does not serve Get (PodResources API Get method disabled): requests for shared CPUs "
        "are proven by List, a whole-node answer per lookup"
    )
    assert "KubeletPodResourcesGet" in finding.fix


# -- requests served through DRA (kubelet's dynamic_resources, KEP-3695) --------------------------------

DRIVER = "shared-cpus.mixed-cpu.openshift.io"
# What our driver published: node-1's pool, shared-cpus-0 .. shared-cpus-9.
OURS = {"dra": DraDevices(DRIVER, "node-1", frozenset(f"shared-cpus-{n}" for n in range(10)))}


def record_dra(served: PodResourcesRecord) -> None:
    """A pod whose "main" holds a DRA device of ours beside a device-plugin one, its "sidecar" one of
    ours only, its "gpu-user" a device of another driver under a name like ours, its "far" one of our
    driver in another node's pool, and its "ghost" one our pool never published."""
    served.assign("ns", "dra", "main", RESOURCE, "shared-cpus-1")
    cdi = ("mixed-cpu.openshift.io/shared-cpus=uid-1-shared-cpus-7",)
    served.claim("ns", "dra", "main", "cpus", DRIVER, "shared-cpus-7", cdi_devices=cdi)
    served.claim("ns", "dra", "sidecar", "cpus-2", DRIVER, "shared-cpus-8")
    served.claim("ns", "dra", "sidecar", "cpus-2", DRIVER, "shared-cpus-9")
    served.claim("ns", "dra", "gpu-user", "gpus", "gpu.example.com", "shared-cpus-5")
    served.claim("ns", "dra", "far", "cpus-3", DRIVER, "shared-cpus-4", pool="node-2")
    served.claim("ns", "dra", "ghost", "cpus-4", DRIVER, "shared-cpus-19999")


DRA_PROOF = {
    "main": frozenset({"shared-cpus-1", "dra.shared-cpus-7"}),
    "sidecar": frozenset({"dra.shared-cpus-8", "dra.shared-cpus-9"}),
}


@pytest.mark.asyncio
async def test_get_gives_a_container_its_dra_devices_of_our_driver_as_marker_ids(
    record: PodResourcesRecord, directory: Path
) -> None:
    record_dra(record)
    asked, lookups = client(directory / "kubelet.sock", ttl=0.0, **OURS)
    assert await asked.pod_allocations("ns", "dra") == DRA_PROOF
    assert await asked.pod_allocations("ns", "fwd") == {"main": frozenset({"shared-cpus-3"})}
    assert record.calls == ["Get", "Get"]
    assert lookups.outcomes == ["ok", "ok"]
    # Without a DRA driver, DRA devices are nobody's proof: the device plugin's ids alone.
    plain, _ = client(directory / "kubelet.sock", ttl=0.0)
    assert await plain.pod_allocations("ns", "dra") == {"main": frozenset({"shared-cpus-1"})}


@pytest.mark.asyncio
async def test_list_gives_the_dra_devices_of_our_driver_too(
    record: PodResourcesRecord, directory: Path
) -> None:
    record_dra(record)
    record.get_enabled = False
    asked, lookups = client(directory / "kubelet.sock", ttl=0.0, **OURS)
    assert await asked.pod_allocations("ns", "dra") == DRA_PROOF
    assert record.calls == ["Get", "List"]
    node = await asked.node_allocations()
    assert node == {
        ("ns", "fwd"): {"main": frozenset({"shared-cpus-3"})},
        ("ns", "plain"): {},
        ("ns", "dra"): DRA_PROOF,
    }
    assert lookups.outcomes == ["list"]


@pytest.mark.asyncio
async def test_a_pod_with_only_a_dra_device_of_ours_is_remembered(
    record: PodResourcesRecord, directory: Path
) -> None:
    record.claim("ns", "drapod", "main", "cpus", DRIVER, "shared-cpus-0")
    record.claim("ns", "gpupod", "main", "gpus", "gpu.example.com", "gpu-0")
    clock = ManualClock()
    asked, _ = client(directory / "kubelet.sock", clock=clock, ttl=2.0, **OURS)
    for _ in range(3):
        assert await asked.pod_allocations("ns", "drapod") == {"main": frozenset({"dra.shared-cpus-0"})}
        assert await asked.pod_allocations("ns", "gpupod") == {}
    assert record.calls == ["Get"] * 4, "ours: asked once; another driver's: every time"
    # The claim's pod deleted: a List forgets it, and Get then finds nothing.
    record.forget("ns", "drapod")
    await asked.node_allocations()
    assert await asked.pod_allocations("ns", "drapod") == {}
