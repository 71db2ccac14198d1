"""The ResourceSlice publisher and the API claim source against a fake API server over real HTTP.

The client is the real one (lightkube over httpx, built by `make_client` from a kubeconfig file that
points at the fake); the fake records every request, so the tests see what went over the wire.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import pytest_asyncio
import structlog
from fake_apiserver import APPLY, SLICES, TOKEN, FakeApiServer
from lightkube import AsyncClient
from wait_support import wait_until

from nri_plugin.common.backoff import Backoff
from nri_plugin.dra import apiserver, slices
from nri_plugin.dra.apiserver import ApiClaimSource, ClientConfigError, PublishError, ResourceSlicePublisher
from nri_plugin.dra.claims import AllocatedDevice, ClaimError, ClaimSourceUnreachable

DRIVER = "shared-cpus.mixed-cpu.openshift.io"
OTHER_DRIVER = "gpu.example.com"
NODE = "worker-1"
GUARD = 20.0  # seconds: a bound on waits for conditions, never an expectation of speed


@pytest_asyncio.fixture
async def server() -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer() as fake:
        yield fake


@pytest_asyncio.fixture
async def kubeconfig(server: FakeApiServer, tmp_path: Path) -> Path:
    return server.write_kubeconfig(tmp_path / "kubeconfig")


@pytest_asyncio.fixture
async def client(kubeconfig: Path) -> AsyncIterator[AsyncClient]:
    made = apiserver.make_client(str(kubeconfig), timeout=2.0)
    yield made
    await made.close()


def fast_backoff() -> Backoff:
    return Backoff(0.01, 0.05)


def publisher(
    client: AsyncClient, device_count: int = 256, resync_interval: float = 3600.0
) -> ResourceSlicePublisher:
    """A publisher with fast retries; the resync is an hour unless a test shortens it, so what
    restores a slice within a test is the watch."""
    return ResourceSlicePublisher(
        client=client,
        driver=DRIVER,
        node_name=NODE,
        device_count=device_count,
        backoff=fast_backoff(),
        watch_backoff=fast_backoff(),
        resync_interval=resync_interval,
    )


def validate(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def pools(server: FakeApiServer) -> list[tuple[str, int, int, int]]:
    """(name, generation, resourceSliceCount, devices) of each stored slice."""
    return [
        (
            obj["metadata"]["name"],
            obj["spec"]["pool"]["generation"],
            obj["spec"]["pool"]["resourceSliceCount"],
            len(obj["spec"]["devices"]),
        )
        for obj in server.slices()
    ]


async def run_until_published(pub: ResourceSlicePublisher) -> asyncio.Task[None]:
    task = asyncio.create_task(pub.run())
    await asyncio.wait_for(pub.wait_published(), GUARD)
    return task


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# -- publishing ------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_publish_creates_the_slices_owned_by_the_node(
    server: FakeApiServer, client: AsyncClient
) -> None:
    node_uid = server.add_node(NODE)
    pub = publisher(client)
    assert not pub.published
    await pub.publish()
    assert pub.published
    assert pub.generation == 1
    stored = server.slices()
    assert pools(server) == [(f"{NODE}-{DRIVER}-0", 1, 2, 128), (f"{NODE}-{DRIVER}-1", 1, 2, 128)]
    for obj in stored:
        validate(obj)
        assert obj["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node_uid, "controller": True}
        ]
        assert obj["spec"]["driver"] == DRIVER
        assert obj["spec"]["nodeName"] == NODE
    names = [device["name"] for obj in stored for device in obj["spec"]["devices"]]
    assert names == [f"shared-cpus-{n}" for n in range(256)]
    # What went over the wire: the node, our slices by field selector, one apply per slice.
    assert [(r.method, r.path) for r in server.requests] == [
        ("GET", f"/api/v1/nodes/{NODE}"),
        ("GET", SLICES),
        ("PATCH", f"{SLICES}/{NODE}-{DRIVER}-0"),
        ("PATCH", f"{SLICES}/{NODE}-{DRIVER}-1"),
    ]
    assert server.requests[1].query["fieldSelector"] in (
        f"spec.driver={DRIVER},spec.nodeName={NODE}",
        f"spec.nodeName={NODE},spec.driver={DRIVER}",
    )
    for request in server.requests[2:]:
        assert request.headers["content-type"] == APPLY
        assert request.query["fieldManager"] == "mixed-cpu-nri-plugin"
        assert request.query["force"] == "true"
    assert all(r.headers["authorization"] == f"Bearer {TOKEN}" for r in server.requests)


@pytest.mark.asyncio
async def test_a_restart_with_the_same_configuration_writes_nothing(
    server: FakeApiServer, client: AsyncClient, kubeconfig: Path
) -> None:
    server.add_node(NODE)
    await publisher(client).publish()
    before = server.slices()
    writes = len(server.writes())
    restarted = apiserver.make_client(str(kubeconfig), timeout=2.0)
    try:
        again = publisher(restarted)
        await again.publish()
    finally:
        await restarted.close()
    assert again.published
    assert again.generation == 1
    assert len(server.writes()) == writes
    assert server.slices() == before


@pytest.mark.asyncio
async def test_a_changed_count_bumps_the_generation_and_deletes_stale_slices(
    server: FakeApiServer, client: AsyncClient
) -> None:
    server.add_node(NODE)
    pub = publisher(client, device_count=256)
    await pub.publish()
    first = len(server.requests)

    pub.republish(device_count=100)
    assert not pub.published
    await pub.publish()
    assert pools(server) == [(f"{NODE}-{DRIVER}-0", 2, 1, 100)]
    assert pub.generation == 2
    # The new generation is applied before the stale slice goes.
    assert [(r.method, r.path) for r in server.writes()[-2:]] == [
        ("PATCH", f"{SLICES}/{NODE}-{DRIVER}-0"),
        ("DELETE", f"{SLICES}/{NODE}-{DRIVER}-1"),
    ]
    assert len(server.requests) > first

    pub.republish(device_count=300)
    await pub.publish()
    assert pools(server) == [
        (f"{NODE}-{DRIVER}-0", 3, 3, 128),
        (f"{NODE}-{DRIVER}-1", 3, 3, 128),
        (f"{NODE}-{DRIVER}-2", 3, 3, 44),
    ]
    for obj in server.slices():
        validate(obj)


@pytest.mark.asyncio
async def test_a_404_is_success_for_a_stale_delete_only(server: FakeApiServer, client: AsyncClient) -> None:
    """A stale slice someone else deleted first is gone, as wanted (a 404 to our DELETE); a 404 to
    an apply is a failure. The call says which, never the text describing it."""
    server.add_node(NODE)
    pub = publisher(client, device_count=256)
    await pub.publish()
    pub.republish(device_count=100)
    server.fail_next(1, status=404, path_contains=f"{SLICES}/{NODE}-{DRIVER}-1")
    await pub.publish()
    assert pub.published
    assert server.writes()[-1].method == "DELETE"
    pub.republish(device_count=300)
    server.fail_next(1, status=404, path_contains=f"{SLICES}/{NODE}-{DRIVER}-0")
    with pytest.raises(PublishError, match=r"rejected applying ResourceSlice .*-0 \(404: injected failure\)"):
        await pub.publish()
    assert not pub.published


@pytest.mark.asyncio
async def test_slices_of_other_drivers_and_nodes_are_left_alone(
    server: FakeApiServer, client: AsyncClient
) -> None:
    node_uid = server.add_node(NODE)
    other_uid = server.add_node("worker-2")
    foreign = [
        slices.resource_slices(
            node_name=NODE, node_uid=node_uid, driver=OTHER_DRIVER, device_count=2, generation=7
        ),
        slices.resource_slices(
            node_name="worker-2", node_uid=other_uid, driver=DRIVER, device_count=2, generation=4
        ),
    ]
    for objs in foreign:
        for obj in objs:
            server.objects.setdefault(SLICES, {})[obj["metadata"]["name"]] = dict(obj)
    await publisher(client, device_count=3).publish()
    stored = {obj["metadata"]["name"]: obj["spec"]["pool"]["generation"] for obj in server.slices()}
    assert stored == {
        f"{NODE}-{OTHER_DRIVER}-0": 7,
        f"worker-2-{DRIVER}-0": 4,
        f"{NODE}-{DRIVER}-0": 1,
    }
    assert not [r for r in server.requests if r.method == "DELETE"]


@pytest.mark.asyncio
async def test_a_recreated_node_gets_its_slices_owned_again(
    server: FakeApiServer, client: AsyncClient
) -> None:
    server.add_node(NODE)
    await publisher(client, device_count=4).publish()
    server.remove_node(NODE)
    new_uid = server.add_node(NODE)
    pub = publisher(client, device_count=4)
    await pub.publish()
    assert pub.generation == 2
    (obj,) = server.slices()
    assert obj["metadata"]["ownerReferences"][0]["uid"] == new_uid


@pytest.mark.asyncio
async def test_api_failures_are_retried_then_succeed_with_one_line_per_kind(
    server: FakeApiServer, client: AsyncClient
) -> None:
    server.add_node(NODE)
    server.fail_next(3, status=500)
    pub = publisher(client)
    with structlog.testing.capture_logs() as logs:
        task = await run_until_published(pub)
    await stop(task)
    assert len(pools(server)) == 2
    assert [r.path for r in server.requests[:3]] == [f"/api/v1/nodes/{NODE}"] * 3
    failures = [entry for entry in logs if entry["event"] == "publishing the ResourceSlices failed, retrying"]
    assert [entry["log_level"] for entry in failures] == ["warning", "debug", "debug"]
    assert "the API server failed reading Node worker-1 (500: injected failure)" in failures[0]["error"]
    assert any(entry["event"] == "ResourceSlices published after failed attempts" for entry in logs)
    assert pub.failures == 0
    assert pub.last_error is None


@pytest.mark.asyncio
async def test_a_hanging_api_server_times_out_and_is_retried(server: FakeApiServer, kubeconfig: Path) -> None:
    server.add_node(NODE)
    server.hang_next(1, path_contains="resourceslices")
    impatient = apiserver.make_client(str(kubeconfig), timeout=0.3)
    try:
        pub = publisher(impatient)
        with structlog.testing.capture_logs() as logs:
            task = await run_until_published(pub)
        await stop(task)
    finally:
        await impatient.close()
    failures = [entry for entry in logs if entry["event"] == "publishing the ResourceSlices failed, retrying"]
    assert [entry["error"] for entry in failures] == [
        "the API server did not answer listing our ResourceSlices in time"
    ]
    assert len(pools(server)) == 2


@pytest.mark.asyncio
async def test_a_change_of_failure_kind_is_logged_again(server: FakeApiServer, client: AsyncClient) -> None:
    server.fail_next(1, status=500)
    server.fail_next(1, status=403)
    server.fail_next(1, status=403)
    pub = publisher(client)
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(pub.run())
        await wait_until(lambda: pub.failures >= 4, what="four failed attempts")  # the last: no such node
        server.add_node(NODE)
        await asyncio.wait_for(pub.wait_published(), GUARD)
    await stop(task)
    warnings = [entry["error"] for entry in logs if entry.get("log_level") == "warning"]
    assert warnings[0].startswith("the API server failed reading Node worker-1 (500")
    assert warnings[1].startswith("the API server refused reading Node worker-1 (403")
    assert "the chart's ClusterRole with dra.enabled" in warnings[1]
    assert warnings[2].startswith("Node worker-1 does not exist")
    assert "NODE_NAME" in warnings[2]
    assert len(warnings) == 3


@pytest.mark.asyncio
async def test_republish_during_run_publishes_the_new_count(
    server: FakeApiServer, client: AsyncClient
) -> None:
    server.add_node(NODE)
    pub = publisher(client)
    task = await run_until_published(pub)
    pub.republish(device_count=10)
    await asyncio.wait_for(pub.wait_published(), GUARD)
    await stop(task)
    assert pools(server) == [(f"{NODE}-{DRIVER}-0", 2, 1, 10)]


# -- keeping them published -------------------------------------------------------------------------

OURS = f"spec.nodeName={NODE},spec.driver={DRIVER}"


def names_and_devices(server: FakeApiServer) -> list[tuple[str, int]]:
    return [(name, devices) for name, _, _, devices in pools(server)]


FULL = [(f"{NODE}-{DRIVER}-0", 128), (f"{NODE}-{DRIVER}-1", 128)]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "selector", [f"spec.nodeName={NODE}", OURS], ids=["kubelet-start", "driver-unusable"]
)
async def test_slices_kubelet_wipes_come_back(
    server: FakeApiServer, client: AsyncClient, selector: str
) -> None:
    """kubelet deletes every slice of its node when it starts, and a driver's slices once the driver
    was unusable for 30 s (DeleteCollection by field selector); the watch sees it and they return."""
    server.add_node(NODE)
    pub = publisher(client)
    with structlog.testing.capture_logs() as logs:
        task = await run_until_published(pub)
        await wait_until(lambda: server.watches >= 1, what="the publisher watching its slices")
        gone = server.delete_collection(SLICES, selector)
        assert [name for name, _ in FULL] == gone
        await wait_until(lambda: names_and_devices(server) == FULL, what="the slices published again")
        await asyncio.wait_for(pub.wait_published(), GUARD)
        await stop(task)
    assert pub.published
    assert pub.restores >= 1
    seen = [entry for entry in logs if entry["event"].startswith("our ResourceSlices were deleted")]
    assert [(entry["log_level"], entry["watch_event"]) for entry in seen][:1] == [("warning", "DELETED")]
    assert server.watches == 1  # the same watch saw it through: it never failed
    assert not [entry for entry in logs if entry["log_level"] not in ("info", "debug", "warning")]
    assert not [entry for entry in logs if "failed" in entry["event"]]


@pytest.mark.asyncio
async def test_a_slice_changed_by_another_writer_is_put_back(
    server: FakeApiServer, client: AsyncClient
) -> None:
    server.add_node(NODE)
    pub = publisher(client)
    task = await run_until_published(pub)
    await wait_until(lambda: server.watches >= 1, what="the publisher watching its slices")
    [first, _] = server.slices()
    first["spec"]["devices"] = first["spec"]["devices"][:3]
    server.replace_object(SLICES, first)
    await wait_until(lambda: names_and_devices(server) == FULL, what="the slice put back")
    await asyncio.wait_for(pub.wait_published(), GUARD)
    assert {obj["spec"]["pool"]["generation"] for obj in server.slices()} == {2}  # a new generation
    await stop(task)


@pytest.mark.asyncio
async def test_our_own_writes_start_no_new_round(server: FakeApiServer, client: AsyncClient) -> None:
    server.add_node(NODE)
    pub = publisher(client)
    task = await run_until_published(pub)
    await wait_until(lambda: server.watches >= 1, what="the publisher watching its slices")
    pub.republish(device_count=300)  # three slices now: the watch sees our own applies
    await asyncio.wait_for(pub.wait_published(), GUARD)
    await wait_until(lambda: len(server.slices()) == 3, what="the new pool")
    lists = len(
        [r for r in server.requests if r.method == "GET" and r.path == SLICES and "watch" not in r.query]
    )
    await stop(task)
    assert pub.restores == 0
    assert lists == 2  # the first round and the republish, nothing the watch asked for


@pytest.mark.asyncio
async def test_an_expired_watch_starts_again_from_a_fresh_list(
    server: FakeApiServer, client: AsyncClient
) -> None:
    """The API server ends a watch; resumed from its resourceVersion, it is too old (410 Expired):
    the publisher checks the slices and watches again from the new list, and still sees deletions."""
    server.add_node(NODE)
    pub = publisher(client)
    with structlog.testing.capture_logs() as logs:
        task = await run_until_published(pub)
        await wait_until(lambda: server.watches >= 1, what="the publisher watching its slices")
        server.add_node("worker-2")  # history moves on, and what the watch started from is compacted
        server.expired_below = server._last_version
        server.end_watches()
        await wait_until(lambda: server.watches >= 3, what="the watch resumed, expired, started again")
        server.delete_collection(SLICES, OURS)
        await wait_until(lambda: names_and_devices(server) == FULL, what="the slices published again")
        await stop(task)
    [expired] = [entry for entry in logs if entry["event"].startswith("watching the ResourceSlices failed")]
    assert expired["log_level"] == "warning"
    assert expired["error"] == "the watch's starting point expired on the API server (410 Gone)"
    assert pub.restores >= 1


@pytest.mark.asyncio
async def test_a_missed_deletion_is_caught_at_the_resync(server: FakeApiServer, client: AsyncClient) -> None:
    server.add_node(NODE)
    pub = publisher(client, resync_interval=0.2)
    task = await run_until_published(pub)
    server.deliver_watch_events = False  # the watch misses what follows
    server.delete_collection(SLICES, OURS)
    await wait_until(lambda: names_and_devices(server) == FULL, what="the slices back after a resync")
    assert pub.restores == 0  # not the watch: the resync's check
    await stop(task)


@pytest.mark.asyncio
async def test_the_api_server_down_for_a_while_and_back(server: FakeApiServer, client: AsyncClient) -> None:
    server.add_node(NODE)
    pub = publisher(client)
    task = await run_until_published(pub)
    await wait_until(lambda: server.watches >= 1, what="the publisher watching its slices")
    await server.stop_listening()
    await wait_until(lambda: pub.watch_failures >= 1, what="the watch failing")
    await wait_until(lambda: pub.failures >= 2, what="the checks failing")
    server.objects[SLICES].clear()  # gone meanwhile, unseen
    await server.listen_again()
    await wait_until(lambda: names_and_devices(server) == FULL, what="the slices back")
    await asyncio.wait_for(pub.wait_published(), GUARD)
    await wait_until(lambda: pub.failures == 0, what="the failures cleared")
    await stop(task)


@pytest.mark.asyncio
async def test_an_unexpected_error_is_retried_not_the_end(server: FakeApiServer, client: AsyncClient) -> None:
    server.add_node(NODE)
    pub = publisher(client)
    real = pub._slices
    calls = 0

    def broken_once(node_uid: str, count: int, generation: int) -> tuple[dict[str, Any], ...]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug")
        return real(node_uid, count, generation)

    pub._slices = broken_once  # type: ignore[method-assign]
    with structlog.testing.capture_logs() as logs:
        task = await run_until_published(pub)
    await stop(task)
    assert names_and_devices(server) == FULL
    [failure] = [
        entry for entry in logs if entry["event"] == "publishing the ResourceSlices failed, retrying"
    ]
    assert failure["log_level"] == "warning"
    assert failure["error"] == "unexpected failure publishing: RuntimeError: a bug"
    assert isinstance(failure["exc_info"], RuntimeError)


@pytest.mark.asyncio
async def test_an_unreachable_api_server_is_a_publish_error(tmp_path: Path) -> None:
    async with FakeApiServer() as gone:
        path = gone.write_kubeconfig(tmp_path / "kubeconfig")
    client = apiserver.make_client(str(path), timeout=2.0)
    try:
        with pytest.raises(
            PublishError, match=r"could not be reached for reading Node worker-1: ConnectError"
        ) as caught:
            await publisher(client).publish()
    finally:
        await client.close()
    assert caught.value.kind == "unreachable"


@pytest.mark.asyncio
async def test_a_client_that_cannot_be_made_is_retried_not_fatal(tmp_path: Path) -> None:
    missing = tmp_path / "no-kubeconfig"
    pub = ResourceSlicePublisher(
        client=lambda: apiserver.make_client(str(missing)),
        driver=DRIVER,
        node_name=NODE,
        device_count=1,
        backoff=fast_backoff(),
    )
    with pytest.raises(
        PublishError, match="point \\[dra\\] kubeconfig at a readable kubeconfig file"
    ) as caught:
        await pub.publish()
    assert caught.value.kind == "credentials"


def test_bad_publisher_arguments_are_refused(client: AsyncClient) -> None:
    with pytest.raises(ValueError, match="node name 'Worker_1'"):
        ResourceSlicePublisher(client=client, driver=DRIVER, node_name="Worker_1", device_count=1)
    with pytest.raises(ValueError, match="device count 0"):
        ResourceSlicePublisher(client=client, driver=DRIVER, node_name=NODE, device_count=0)


# -- client construction ---------------------------------------------------------------------------


def test_make_client_without_a_service_account_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ClientConfigError, match=r"in-cluster service account .* or set \[dra\] kubeconfig"):
        apiserver.make_client("", service_account_dir="/nonexistent/serviceaccount")


@pytest.fixture
def service_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A service account directory as kubelet mounts it (a real self-signed CA), and the env vars."""
    (tmp_path / "token").write_text("in-cluster-token")
    (tmp_path / "namespace").write_text("mixed-cpu")
    openssl = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
    files = ["-keyout", str(tmp_path / "ca.key"), "-out", str(tmp_path / "ca.crt")]
    subprocess.run(
        [*openssl, "-nodes", "-days", "1", "-subj", "/CN=test-ca", *files],
        check=True,
        capture_output=True,
    )
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    return tmp_path


@pytest.mark.asyncio
async def test_make_client_in_cluster_uses_the_service_account(service_account: Path) -> None:
    made = apiserver.make_client("", service_account_dir=str(service_account))
    try:
        assert made.config.cluster.server == "https://10.96.0.1:443"
        assert made.config.user is not None
        assert made.config.user.token_file == str(service_account / "token")
    finally:
        await made.close()


def test_make_client_with_a_bad_ca_says_so(service_account: Path) -> None:
    (service_account / "ca.crt").write_text("")
    with pytest.raises(
        ClientConfigError, match=r"cannot configure the API client from the in-cluster service"
    ):
        apiserver.make_client("", service_account_dir=str(service_account))


# -- claims ----------------------------------------------------------------------------------------


def result(device: str, driver: str = DRIVER, request: str = "shared") -> dict[str, str]:
    return {"request": request, "driver": driver, "pool": NODE, "device": device}


def claims(client: AsyncClient, timeout: float = 5.0) -> ApiClaimSource:
    return ApiClaimSource(client=client, driver=DRIVER, timeout=timeout)


@pytest.mark.asyncio
async def test_claim_devices_of_our_driver_in_allocation_order(
    server: FakeApiServer, client: AsyncClient
) -> None:
    uid = server.add_claim(
        "team-a",
        "pod-1-shared",
        results=[
            result("shared-cpus-7"),
            result("gpu-0", driver=OTHER_DRIVER),
            result("shared-cpus-2", request="b"),
        ],
    )
    devices = await claims(client).allocated_devices("team-a", "pod-1-shared", uid)
    assert devices == (
        AllocatedDevice(request="shared", pool=NODE, device="shared-cpus-7"),
        AllocatedDevice(request="b", pool=NODE, device="shared-cpus-2"),
    )
    assert [(r.method, r.path) for r in server.requests] == [
        ("GET", "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/pod-1-shared")
    ]


# The claims and allocations as the scheduler writes them (resource.k8s.io/v1), one per shape.
CLASS = DRIVER  # the chart's DeviceClass is named after the driver
PLAIN = ([{"name": "shared", "exactly": {"deviceClassName": CLASS}}], [result("shared-cpus-4")])
FIRST_AVAILABLE = (
    [
        {
            "name": "cpus",
            "firstAvailable": [
                {"name": "gpu-side", "deviceClassName": "gpu.example.com"},
                {"name": "shared", "deviceClassName": CLASS},
            ],
        }
    ],
    [result("shared-cpus-5", request="cpus/shared")],
)
ADMIN = (
    [{"name": "watch", "exactly": {"deviceClassName": CLASS, "adminAccess": True}}],
    [{**result("shared-cpus-6", request="watch"), "adminAccess": True}],
)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        (PLAIN, (AllocatedDevice("shared", NODE, "shared-cpus-4"),)),
        (FIRST_AVAILABLE, (AllocatedDevice("cpus/shared", NODE, "shared-cpus-5"),)),
        (ADMIN, (AllocatedDevice("watch", NODE, "shared-cpus-6", admin_access=True),)),
    ],
    ids=["plain", "firstAvailable", "adminAccess"],
)
async def test_claim_shapes_the_scheduler_writes(
    server: FakeApiServer,
    client: AsyncClient,
    shape: tuple[list[dict[str, Any]], list[dict[str, Any]]],
    expected: tuple[AllocatedDevice, ...],
) -> None:
    requests, results = shape
    uid = server.add_claim("team-a", "c", requests=requests, results=results)
    stored = server.objects["/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims"]["c"]
    validate(stored)  # the shape is one the API server takes
    assert await claims(client).allocated_devices("team-a", "c", uid) == expected


@pytest.mark.asyncio
async def test_claim_devices_carry_the_pods_it_is_reserved_for(
    server: FakeApiServer, client: AsyncClient
) -> None:
    pods = ["bbbb-2", "aaaa-1"]
    uid = server.add_claim("team-a", "shared", results=[result("shared-cpus-7")], reserved_for=pods)
    # A consumer that is not a core pod (a custom controller's reservation) names no pod.
    claim = server.objects["/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims"]["shared"]
    claim["status"]["reservedFor"].append(
        {"apiGroup": "example.com", "resource": "pods", "name": "not-a-pod", "uid": "cccc-3"}
    )
    [device] = await claims(client).allocated_devices("team-a", "shared", uid)
    assert device.reserved_for == ("aaaa-1", "bbbb-2")


@pytest.mark.asyncio
async def test_claim_not_found(server: FakeApiServer, client: AsyncClient) -> None:
    with pytest.raises(ClaimError, match=r"^ResourceClaim team-a/gone does not exist") as info:
        await claims(client).allocated_devices("team-a", "gone", "uid-1")
    assert not isinstance(info.value, ClaimSourceUnreachable)  # an answer: no spec file may overrule it


@pytest.mark.asyncio
async def test_claim_recreated_with_another_uid(server: FakeApiServer, client: AsyncClient) -> None:
    server.add_claim("team-a", "c", results=[result("shared-cpus-0")], uid="new-uid")
    with pytest.raises(ClaimError, match="has uid new-uid, not old-uid: the claim was re-created"):
        await claims(client).allocated_devices("team-a", "c", "old-uid")


@pytest.mark.asyncio
async def test_claim_not_allocated(server: FakeApiServer, client: AsyncClient) -> None:
    uid = server.add_claim("team-a", "c", results=None)
    with pytest.raises(ClaimError, match="ResourceClaim team-a/c is not allocated yet"):
        await claims(client).allocated_devices("team-a", "c", uid)


@pytest.mark.asyncio
async def test_claim_with_no_device_of_ours(server: FakeApiServer, client: AsyncClient) -> None:
    uid = server.add_claim("team-a", "c", results=[result("gpu-0", driver=OTHER_DRIVER)])
    with pytest.raises(ClaimError, match=f"is allocated no device of driver {DRIVER}"):
        await claims(client).allocated_devices("team-a", "c", uid)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("status", "message"),
    [
        (
            403,
            r"refused reading ResourceClaim team-a/c \(403: injected failure\): grant .*"
            r" get on resourceclaims",
        ),
        (500, r"the API server failed reading ResourceClaim team-a/c \(500: injected failure\)"),
    ],
)
async def test_claim_read_refused_or_failed(
    server: FakeApiServer, client: AsyncClient, status: int, message: str
) -> None:
    uid = server.add_claim("team-a", "c", results=[result("shared-cpus-0")])
    server.fail_next(1, status=status)
    with pytest.raises(ClaimError, match=message) as info:
        await claims(client).allocated_devices("team-a", "c", uid)
    assert not isinstance(info.value, ClaimSourceUnreachable)  # the server answered
    # The next read goes through.
    assert len(await claims(client).allocated_devices("team-a", "c", uid)) == 1


@pytest.mark.asyncio
async def test_claim_read_from_a_hanging_api_server_is_bounded(
    server: FakeApiServer, client: AsyncClient
) -> None:
    uid = server.add_claim("team-a", "c", results=[result("shared-cpus-0")])
    server.hang_next(1)
    with pytest.raises(
        ClaimSourceUnreachable,
        match=r"did not answer reading ResourceClaim team-a/c within 0.2 s; kubelet retries",
    ):
        await asyncio.wait_for(claims(client, timeout=0.2).allocated_devices("team-a", "c", uid), GUARD)


@pytest.mark.asyncio
async def test_claim_read_from_an_unreachable_api_server(tmp_path: Path) -> None:
    async with FakeApiServer() as gone:
        path = gone.write_kubeconfig(tmp_path / "kubeconfig")
    client = apiserver.make_client(str(path), timeout=2.0)
    try:
        with pytest.raises(
            ClaimSourceUnreachable,
            match=r"could not be reached to read ResourceClaim team-a/c \(ConnectError",
        ):
            await claims(client).allocated_devices("team-a", "c", "uid")
    finally:
        await client.close()
