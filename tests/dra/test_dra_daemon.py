"""The DRA front door through the real daemon process: ``run`` with ``[dra] enabled``.

Around the daemon: the NRI runtime simulator (with CDI injection from the daemon's CDI dir), the
independent fake kubelet for DRA (plugin watcher and DRA manager, wire format by hand), and the fake
API server (its kubeconfig given to the daemon), which holds the Node and the ResourceClaim and
records the ResourceSlices the daemon publishes. What a cluster would do in between (the scheduler
allocating a device to the claim) is the test's part.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
from fake_apiserver import SLICES, TOKEN, FakeApiServer
from fake_kubelet_dra import Claim, FakeKubeletDra, cdi_devices_for
from mixedcpu_support import make_container
from probe_support import Samples, scrape, value
from redteam_support import NAMING, DaemonNode, daemon_node, is_shared, short_directory, within
from wait_support import wait_until

from nri_plugin.daemon.status import status_socket_path
from nri_plugin.daemon.status_client import fetch_status, render_table
from nri_plugin.dra import cdi
from nri_plugin.nri.cdispecs import CdiSpecs
from nri_plugin.nri.simulator import env_of

pytestmark = pytest.mark.asyncio

DRIVER = "shared-cpus.mixed-cpu.openshift.io"
STATUS_SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "status.schema.json").read_text())
NODE = "node-1"


@dataclass
class DraNode:
    node: DaemonNode
    api: FakeApiServer
    kubelet: FakeKubeletDra
    cdi_dir: Path


@asynccontextmanager
async def dra_node(
    *, device_plugin: str = "", publish: bool = True, node_known: bool = True
) -> AsyncIterator[DraNode]:
    with short_directory("dra-") as root:
        async with FakeApiServer() as api:
            if node_known:
                api.add_node(NODE)
            kubeconfig = api.write_kubeconfig(root / "kubeconfig")
            for name in ("reg", "plugins"):
                (root / name).mkdir()
            extra = (
                f'[dra]\nenabled = true\nregistry_dir = "{root}/reg"\nplugins_dir = "{root}/plugins"\n'
                f'cdi_dir = "{root}/cdi"\nnode_name = "{NODE}"\nkubeconfig = "{kubeconfig}"\n'
                f"publish_resource_slices = {str(publish).lower()}\n"
            )
            async with daemon_node(root, extra=extra, device_plugin_extra=device_plugin) as node:
                node.sim.cdi = CdiSpecs([root / "cdi"])
                kubelet = FakeKubeletDra(root / "reg")
                try:
                    yield DraNode(node, api, kubelet, root / "cdi")
                finally:
                    await kubelet.close()


async def test_the_daemon_registers_publishes_prepares_and_the_container_gets_shared_cpus() -> None:
    async with dra_node() as dra:
        await wait_until(lambda: dra.kubelet.registration_sockets(), what="the registration socket")
        [socket] = dra.kubelet.registration_sockets()
        registered = await within(dra.kubelet.register(socket))
        assert registered.info.name == DRIVER
        assert "v1.DRAPlugin" in registered.info.supported_versions

        # The node's pool: 256 devices ([device_plugin] device_count) in slices of at most 128.
        await wait_until(lambda: len(dra.api.slices()) == 2, what="the node's ResourceSlices")
        published = dra.api.slices()
        names = [d["name"] for s in published for d in s["spec"]["devices"]]
        assert names == [f"shared-cpus-{i}" for i in range(256)]
        for obj in published:
            assert obj["spec"]["nodeName"] == NODE
            assert obj["spec"]["pool"]["resourceSliceCount"] == 2
            kubernetes_validate.validate(obj, "1.34", strict=True)

        # The scheduler allocates shared-cpus-7 to the claim; kubelet prepares it.
        results = [{"driver": DRIVER, "pool": NODE, "device": "shared-cpus-7", "request": "shared"}]
        uid = dra.api.add_claim("telco", "fwd-shared", results=results)
        answer = await within(dra.kubelet.prepare(DRIVER, [Claim("telco", "fwd-shared", uid)]))
        assert answer[uid].error == ""
        [device] = answer[uid].devices
        assert device.device_name == "shared-cpus-7"
        [cdi_id] = device.cdi_device_ids
        assert cdi_id == cdi.cdi_device_id(uid, "shared-cpus-7")
        assert cdi.spec_path(dra.cdi_dir, uid).exists()

        # The runtime injects the CDI device; the daemon proves the marker and grants the shared CPUs.
        node = dra.node
        pod = node.pod("aaaa-1111", "fwd", namespace="telco")
        await node.sim.run_pod_sandbox(pod)
        container = make_container(NAMING, pod, "fwd-1", "fwd", cpus="2-3", quota=200000)
        result = await within(node.sim.create_container(container, cdi_devices=[cdi_id]))
        signed = node.key.read(env_of(result.container)[cdi.marker_env("shared-cpus-7")])
        assert signed is not None
        assert signed.device == "dra.shared-cpus-7"
        assert is_shared(result)

        # A second prepare (kubelet retries) answers the same; unprepare removes the spec, twice is fine.
        again = await within(dra.kubelet.prepare(DRIVER, [Claim("telco", "fwd-shared", uid)]))
        assert again == answer
        for _ in range(2):
            assert await within(dra.kubelet.unprepare(DRIVER, [Claim("telco", "fwd-shared", uid)])) == {
                uid: ""
            }
        assert not cdi.spec_path(dra.cdi_dir, uid).exists()


async def test_a_copied_dra_marker_is_refused_in_any_pod_the_claim_is_not_reserved_for() -> None:
    """Issue 30, item 5: no PodResources record here (the marker decides). The claim is reserved for
    one pod; its marker copied into another pod's env (no claim, no request) gets nothing, while the
    holder runs and once its pod has ended."""
    async with dra_node() as dra:
        await wait_until(lambda: dra.kubelet.registration_sockets(), what="the registration socket")
        [socket] = dra.kubelet.registration_sockets()
        await within(dra.kubelet.register(socket))
        holder_uid = "aaaa-5555"
        results = [{"driver": DRIVER, "pool": NODE, "device": "shared-cpus-5", "request": "shared"}]
        uid = dra.api.add_claim("telco", "fwd-shared", results=results, reserved_for=[holder_uid])
        answer = await within(dra.kubelet.prepare(DRIVER, [Claim("telco", "fwd-shared", uid)]))
        [cdi_id] = answer[uid].devices[0].cdi_device_ids
        node = dra.node
        holder = node.pod(holder_uid, "fwd", namespace="telco")
        await node.sim.run_pod_sandbox(holder)
        container = make_container(NAMING, holder, "fwd-5", "fwd", cpus="2-3", quota=200000)
        result = await within(node.sim.create_container(container, cdi_devices=[cdi_id]))
        assert is_shared(result)
        copied = env_of(result.container)[cdi.marker_env("shared-cpus-5")]
        signed = node.key.read(copied)
        assert signed is not None
        assert signed.pods == {holder_uid}

        async def copy_in(pod_uid: str, cid: str) -> bool:
            pod = node.pod(pod_uid, f"copier-{cid}", namespace="telco")
            await node.sim.run_pod_sandbox(pod)
            env = (f"{cdi.marker_env('shared-cpus-5')}={copied}",)
            copy = make_container(NAMING, pod, cid, "fwd", cpus="4-5", quota=200000, env=env)
            return is_shared(await within(node.sim.create_container(copy)))

        assert not await copy_in("bbbb-5555", "copy-1")
        # The holder's pod ends; no kubelet record to ask: the copy is still refused.
        await node.sim.stop_pod_sandbox(holder.id)
        await node.sim.remove_pod_sandbox(holder.id)
        assert not await copy_in("cccc-5555", "copy-2")
        await within(node.daemon.wait_log("copier-copy-2", "a claim reserved for other pods (aaaa-5555)"))


async def test_a_claim_reserved_for_two_pods_goes_to_the_second_when_the_first_ends() -> None:
    """One claim reserved for two pods, no PodResources record: the second pod's container waits and
    is given the shared CPUs, by the daemon's own UpdateContainers, when the first pod ends."""
    async with dra_node() as dra:
        await wait_until(lambda: dra.kubelet.registration_sockets(), what="the registration socket")
        [socket] = dra.kubelet.registration_sockets()
        await within(dra.kubelet.register(socket))
        results = [{"driver": DRIVER, "pool": NODE, "device": "shared-cpus-6", "request": "shared"}]
        pods = ["aaaa-6666", "bbbb-6666"]
        uid = dra.api.add_claim("telco", "both", results=results, reserved_for=pods)
        answer = await within(dra.kubelet.prepare(DRIVER, [Claim("telco", "both", uid)]))
        [cdi_id] = answer[uid].devices[0].cdi_device_ids
        node = dra.node
        first, second = (node.pod(pod_uid, f"fwd-{i}", namespace="telco") for i, pod_uid in enumerate(pods))
        results_by_pod = []
        for i, pod in enumerate((first, second)):
            await node.sim.run_pod_sandbox(pod)
            container = make_container(
                NAMING, pod, f"both-{i}", "fwd", cpus=f"{2 + 2 * i}-{3 + 2 * i}", quota=200000
            )
            results_by_pod.append(await within(node.sim.create_container(container, cdi_devices=[cdi_id])))
        assert is_shared(results_by_pod[0])
        assert not is_shared(results_by_pod[1])
        await within(
            node.daemon.wait_log("for now: device dra.shared-cpus-6 is held by container aaaa-6666/fwd")
        )
        await node.sim.stop_container("both-0")
        await node.sim.stop_pod_sandbox(first.id)
        await within(node.daemon.wait_log("shared CPUs given once the device's binding ended", "both-1"))
        await wait_until(
            lambda: node.sim.containers["both-1"].linux.resources.cpu.cpus == "0-1,4-5",
            what="the daemon's update of the waiting container",
        )
        [sent] = node.sim.unsolicited
        assert sent.containers == ("both-1",)


async def test_a_claim_the_api_server_does_not_know_fails_alone_and_the_daemon_runs_on() -> None:
    async with dra_node() as dra:
        await wait_until(lambda: dra.kubelet.registration_sockets(), what="the registration socket")
        [socket] = dra.kubelet.registration_sockets()
        await within(dra.kubelet.register(socket))
        results = [{"driver": DRIVER, "pool": NODE, "device": "shared-cpus-1", "request": "shared"}]
        good = dra.api.add_claim("telco", "good", results=results)
        missing = "00000000-0000-4000-8000-000000000001"
        answer = await within(
            dra.kubelet.prepare(DRIVER, [Claim("telco", "gone", missing), Claim("telco", "good", good)])
        )
        assert "does not exist" in answer[missing].error
        assert answer[good].error == ""
        assert not cdi.spec_path(dra.cdi_dir, missing).exists()
        assert dra.node.daemon.proc.returncode is None


@pytest.mark.parametrize("table", ["enabled = false\n"])
async def test_dra_alone_serves_with_the_device_plugin_off(table: str) -> None:
    async with dra_node(device_plugin=table) as dra:
        await wait_until(lambda: dra.kubelet.registration_sockets(), what="the registration socket")
        await wait_until(lambda: len(dra.api.slices()) == 2, what="the node's ResourceSlices")
        assert not list(dra.node.plugin_dir.iterdir())  # no device-plugin socket


async def test_the_status_shows_the_dra_front_door_and_its_claim() -> None:
    async with dra_node() as dra:
        await wait_until(lambda: dra.kubelet.registration_sockets(), what="the registration socket")
        [socket] = dra.kubelet.registration_sockets()
        await within(dra.kubelet.register(socket))
        await wait_until(lambda: len(dra.api.slices()) == 2, what="the node's ResourceSlices")
        results = [{"driver": DRIVER, "pool": NODE, "device": "shared-cpus-3", "request": "shared"}]
        uid = dra.api.add_claim("telco", "fwd-shared", results=results)
        answer = await within(dra.kubelet.prepare(DRIVER, [Claim("telco", "fwd-shared", uid)]))
        [cdi_id] = answer[uid].devices[0].cdi_device_ids
        node = dra.node
        pod = node.pod("aaaa-3333", "fwd", namespace="telco")
        await node.sim.run_pod_sandbox(pod)
        container = make_container(NAMING, pod, "fwd-3", "fwd", cpus="2-3", quota=200000)
        assert is_shared(await within(node.sim.create_container(container, cdi_devices=[cdi_id])))

        path = status_socket_path(str(node.state_dir))

        def published() -> bool:
            return bool(fetch_status(path)["dra"]["resource_slices"]["published"])

        # The daemon marks them published once the API server has answered: ask until it says so.
        await wait_until(published, what="the status saying the slices are published")
        document = await asyncio.to_thread(fetch_status, path)
        jsonschema.Draft202012Validator(STATUS_SCHEMA).validate(document)
        section = document["dra"]
        assert (section["enabled"], section["driver"], section["node"]) == (True, DRIVER, NODE)
        kubelet = section["kubelet"]
        assert (kubelet["registered"], kubelet["registrations"], kubelet["last_error"]) == (True, 1, None)
        assert kubelet["registration_socket"] == str(socket)
        assert section["resource_slices"] == {
            "published_here": True,
            "published": True,
            "generation": 1,
            "devices": 256,
            "failures": 0,
            "last_error": None,
            "restores": 0,
        }
        assert section["prepared_claims"] == {"count": 1, "capped": False, "read_error": None}
        [row] = document["containers"]
        assert (row["namespace"], row["container"], row["device"]) == ("telco", "fwd", "dra.shared-cpus-3")
        assert row["proof"] == "marker-binding"  # no PodResources socket here: the marker binding proves

        table = render_table(document).splitlines()
        start = table.index(f"DRA            {DRIVER} on node {NODE}")
        assert table[start + 1 : start + 4] == [
            "  kubelet      registered (1 registration)",
            "  slices       published: generation 1, 256 devices",
            "  claims       1 prepared",
        ]

        await within(dra.kubelet.unprepare(DRIVER, [Claim("telco", "fwd-shared", uid)]))
        after = await asyncio.to_thread(fetch_status, path)
        assert after["dra"]["prepared_claims"]["count"] == 0


async def test_claims_as_the_scheduler_writes_them_plain_first_available_and_admin_access() -> None:
    """A firstAvailable result names ``<request>/<subrequest>``; kubelet gives the container that names
    the request the devices whose request_names hold it, so the answer names the request alone. A
    result with adminAccess is refused with the reason, alone."""
    async with dra_node() as dra:
        await wait_until(lambda: dra.kubelet.registration_sockets(), what="the registration socket")
        [socket] = dra.kubelet.registration_sockets()
        await within(dra.kubelet.register(socket))

        def ours(device: str, request: str, **extra: object) -> dict[str, object]:
            return {"driver": DRIVER, "pool": NODE, "device": device, "request": request, **extra}

        plain = dra.api.add_claim("telco", "plain", results=[ours("shared-cpus-1", "shared")])
        alternatives = [
            {"name": "gpu-side", "deviceClassName": "gpu.example.com"},
            {"name": "shared", "deviceClassName": DRIVER},
        ]
        first = dra.api.add_claim(
            "telco",
            "first",
            requests=[{"name": "cpus", "firstAvailable": alternatives}],
            results=[ours("shared-cpus-2", "cpus/shared")],
        )
        admin = dra.api.add_claim(
            "telco",
            "admin",
            requests=[{"name": "watch", "exactly": {"deviceClassName": DRIVER, "adminAccess": True}}],
            results=[ours("shared-cpus-3", "watch", adminAccess=True)],
        )
        claims = [
            Claim("telco", "plain", plain),
            Claim("telco", "first", first),
            Claim("telco", "admin", admin),
        ]
        answer = await within(dra.kubelet.prepare(DRIVER, claims))

        assert answer[plain].error == ""
        assert [d.request_names for d in answer[plain].devices] == [("shared",)]
        assert answer[first].error == ""
        [device] = answer[first].devices
        assert (device.request_names, device.device_name) == (("cpus",), "shared-cpus-2")
        assert "allocated to request 'watch' with adminAccess" in answer[admin].error
        assert "remove adminAccess from the request" in answer[admin].error
        assert not answer[admin].devices
        assert not cdi.spec_path(dra.cdi_dir, admin).exists()

        # The container names the claim's request "cpus": kubelet hands it the device, the runtime
        # injects it, and the container gets the shared CPUs.
        cdi_ids = cdi_devices_for(answer[first], "cpus")
        assert cdi_ids == [cdi.cdi_device_id(first, "shared-cpus-2")]
        assert cdi_devices_for(answer[first], "cpus/shared") == []  # what kubelet would not match
        node = dra.node
        pod = node.pod("aaaa-4444", "fwd", namespace="telco")
        await node.sim.run_pod_sandbox(pod)
        container = make_container(NAMING, pod, "fwd-4", "fwd", cpus="2-3", quota=200000)
        result = await within(node.sim.create_container(container, cdi_devices=cdi_ids))
        signed = node.key.read(env_of(result.container)[cdi.marker_env("shared-cpus-2")])
        assert signed is not None
        assert signed.device == "dra.shared-cpus-2"
        assert is_shared(result)


# -- kubelet's life: its wipes of the node's ResourceSlices ---------------------------------------------


async def _registered_and_published(dra: DraNode) -> None:
    await wait_until(lambda: dra.kubelet.registration_sockets(), what="the registration socket")
    [socket] = dra.kubelet.registration_sockets()
    await within(dra.kubelet.register(socket))
    await wait_until(lambda: len(dra.api.slices()) == 2, what="the node's ResourceSlices")


def _pool(dra: DraNode) -> list[tuple[str, int]]:
    return [(obj["metadata"]["name"], len(obj["spec"]["devices"])) for obj in dra.api.slices()]


FULL_POOL = [(f"{NODE}-{DRIVER}-0", 128), (f"{NODE}-{DRIVER}-1", 128)]
DELETED_SEEN = "our ResourceSlices were deleted or changed on the API server; publishing them again"


async def test_a_restarted_kubelet_wipes_the_node_s_slices_and_they_come_back() -> None:
    """kubelet deletes every ResourceSlice of its node when it starts, then registers the plugins it
    finds in its registry directory; the daemon, running all along, publishes the pool again."""
    async with dra_node() as dra:
        await _registered_and_published(dra)
        await dra.kubelet.close()  # kubelet stops
        kubelet = FakeKubeletDra(dra.kubelet.registry_dir)  # and starts again
        dra.kubelet = kubelet
        await within(kubelet.wipe_resource_slices(dra.api.url, TOKEN, NODE))
        assert dra.api.slices() == []
        await dra.node.daemon.wait_log(DELETED_SEEN, '"watch_event": "DELETED"')  # the watch saw it
        [socket] = kubelet.registration_sockets()
        await within(kubelet.register(socket))
        await wait_until(lambda: _pool(dra) == FULL_POOL, what="the pool published again")
        for obj in dra.api.slices():
            kubernetes_validate.validate(obj, "1.34", strict=True)
        path = status_socket_path(str(dra.node.state_dir))
        await wait_until(
            lambda: fetch_status(path)["dra"]["resource_slices"]["published"], what="status: published"
        )
        document = await asyncio.to_thread(fetch_status, path)
        jsonschema.Draft202012Validator(STATUS_SCHEMA).validate(document)
        assert document["dra"]["resource_slices"]["restores"] >= 1
        [line] = [row for row in render_table(document).splitlines() if row.startswith("  slices")]
        assert re.fullmatch(
            r"  slices       published: generation \d+, 256 devices, restored \d+ times?", line
        )


async def test_the_driver_s_slices_wiped_after_it_was_unusable_come_back() -> None:
    """kubelet deletes a driver's slices once the driver has been unusable for its wiping delay (30 s):
    here the wipe lands after the daemon had come back and published (a restart that took about as
    long as the delay), and kubelet registers it again."""
    async with dra_node() as dra:
        await _registered_and_published(dra)
        writes = len(dra.api.writes())
        await within(dra.kubelet.wipe_resource_slices(dra.api.url, TOKEN, NODE, DRIVER))
        assert dra.api.slices() == []
        await dra.node.daemon.wait_log(DELETED_SEEN, '"watch_event": "DELETED"')  # the watch saw it
        await wait_until(lambda: _pool(dra) == FULL_POOL, what="the pool published again")
        # The wipe (one DELETE) and the daemon's applies, nothing else: no stale deletes, no loop.
        after = [(r.method, r.path.rsplit("/", 1)[-1]) for r in dra.api.writes()[writes:]]
        assert after[0] == ("DELETE", "resourceslices")
        assert sorted(after[1:]) == [("PATCH", name) for name, _ in FULL_POOL]
        [socket] = dra.kubelet.registration_sockets()
        await within(dra.kubelet.register(socket))  # kubelet takes it again: the pool is as it was
        assert _pool(dra) == FULL_POOL


async def test_the_api_server_down_for_a_while_and_back() -> None:
    async with dra_node() as dra:
        await _registered_and_published(dra)
        path = status_socket_path(str(dra.node.state_dir))
        await dra.api.stop_listening()
        dra.api.objects[SLICES].clear()  # and the slices went meanwhile (unseen by any watch)
        await dra.node.daemon.wait_log("watching the ResourceSlices failed; checking them and watching again")
        await wait_until(
            lambda: fetch_status(path)["dra"]["resource_slices"]["failures"] >= 1,
            what="status: the checks failing while the API server is away",
        )
        await dra.api.listen_again()
        await wait_until(lambda: _pool(dra) == FULL_POOL, what="the pool published again")
        await wait_until(
            lambda: fetch_status(path)["dra"]["resource_slices"]["failures"] == 0, what="status: recovered"
        )
        assert dra.node.daemon.proc.returncode is None


async def _scrape(node: DaemonNode) -> Samples:
    line = await node.daemon.wait_log("serving metrics and probes")
    match = re.search(r"(127\.0\.0\.1):(\d+)", line)
    assert match, line
    return await scrape(match.group(1), int(match.group(2)))


def _slice_gauges(found: Samples) -> tuple[float, float, float]:
    """What the MixedCpuDraResourceSlicesNotPublished alert reads (and the DRA gauge beside them)."""
    return (
        value(found, "mixed_cpu_dra_enabled"),
        value(found, "mixed_cpu_dra_publishing_enabled"),
        value(found, "mixed_cpu_dra_resource_slices_published"),
    )


async def test_the_slice_gauges_read_unpublished_until_the_api_server_holds_the_pool() -> None:
    """Publishing on and the pool not on the API server (which knows no such Node yet: every round
    fails) is what the alert fires on; once the Node is there, the next round publishes."""
    async with dra_node(node_known=False) as dra:
        path = status_socket_path(str(dra.node.state_dir))
        await wait_until(
            lambda: fetch_status(path)["dra"]["resource_slices"]["failures"] >= 1, what="a failed round"
        )
        assert _slice_gauges(await _scrape(dra.node)) == (1.0, 1.0, 0.0)
        dra.api.add_node(NODE)
        await wait_until(lambda: fetch_status(path)["dra"]["resource_slices"]["published"], what="published")
        assert _slice_gauges(await _scrape(dra.node)) == (1.0, 1.0, 1.0)
        assert _pool(dra) == FULL_POOL


async def test_with_publishing_off_the_publishing_gauge_reads_0() -> None:
    """Another component publishes the slices: the alert's gate is 0, so it stays silent."""
    async with dra_node(publish=False) as dra:
        path = status_socket_path(str(dra.node.state_dir))
        document = await asyncio.to_thread(fetch_status, path)
        assert document["dra"]["resource_slices"]["published_here"] is False
        assert _slice_gauges(await _scrape(dra.node)) == (1.0, 0.0, 0.0)
        assert dra.api.slices() == []
