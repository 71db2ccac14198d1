"""A request served through DRA, proven end to end (issue #23, part 3): the mixed-CPU plugin behind a
real NRI stub, the runtime simulator injecting CDI specs from real files, and kubelet's PodResources
record (the fake kubelet's, over a real unix socket) read by the real `PodResourcesClient` with our DRA
driver's name.

What our DRA driver's NodePrepareResources leaves on the node is written here by hand, to the
contract's layout (one CDI spec file per claim, its device's env carrying the signed marker), so this
test needs nothing of the driver itself: the container the runtime creates with the CDI device gets
the marker in its env before the plugin sees it, kubelet's record lists the claim's device under our
driver, and the container gets the shared CPUs. A forged or replayed env marker gets nothing, with
kubelet's record and without it (the marker binding then decides).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog
from fake_kubelet import PodResourcesRecord
from mixedcpu_support import (
    GUARD,
    NAMINGS,
    PERIOD,
    FakeCgroups,
    make_container,
    make_plugin,
    make_pod,
    plugin_running,
)
from wait_support import wait_until

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.deviceplugin.marker import MARKER_ENV, HostKey, dra_device_id
from nri_plugin.deviceplugin.podresources import DraDevices, PodResourcesClient
from nri_plugin.nri.cdispecs import CdiSpecs
from nri_plugin.nri.simulator import RuntimeSimulator, env_of

RESOURCE = "workload.openshift.io/enable-shared-cpus"
DRIVER = "shared-cpus.mixed-cpu.openshift.io"
CDI_KIND = "mixed-cpu.openshift.io/shared-cpus"
NAMING = NAMINGS[0]
FORGED = "v1:dra.shared-cpus-4:" + "A" * 43
PUBLISHED = frozenset(f"shared-cpus-{n}" for n in range(8))  # what node-1's ResourceSlices list


@pytest.fixture
def root() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path for long test ids is longer.
    path = Path(tempfile.mkdtemp(prefix="drap-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def prepare(cdi_dir: Path, claim_uid: str, device: str, marker: str) -> str:
    """What our DRA driver's prepare of one claim leaves: the claim's CDI spec, whose device sets
    `marker` in the container's env; gives the CDI device id kubelet passes to the runtime."""
    name = f"{claim_uid}-{device}"
    spec = {
        "cdiVersion": "0.6.0",
        "kind": CDI_KIND,
        "devices": [{"name": name, "containerEdits": {"env": [f"{MARKER_ENV}={marker}"]}}],
    }
    cdi_dir.mkdir(parents=True, exist_ok=True)
    (cdi_dir / f"mixed-cpu.openshift.io-shared-cpus_{claim_uid}.json").write_text(json.dumps(spec))
    return f"{CDI_KIND}={name}"


@dataclass
class Node:
    sim: RuntimeSimulator
    tree: FakeCgroups
    key: HostKey
    record: PodResourcesRecord
    cdi_dir: Path

    def pod(self, uid: str, name: str) -> api.PodSandbox:
        pod = make_pod(NAMING, uid, name=name)
        self.tree.add_pod(pod, 2 * PERIOD)
        return pod

    async def create(self, pod: api.PodSandbox, cid: str, name: str, **kw: Any) -> api.Container:
        """A container of 2 exclusive CPUs (4-5), created with `kw` (cdi_devices) and its `env`."""
        container = make_container(NAMING, pod, cid, name, env=kw.pop("env", ()))
        result = await self.sim.create_container(container, **kw)
        self.tree.run_container(result.container)
        return result.container

    def claim(self, pod: api.PodSandbox, container: str, claim_uid: str, device: str) -> str:
        """kubelet allocated `device` of our driver to the container through a claim, and our driver
        prepared it: its CDI spec written, the device in kubelet's record."""
        cdi = prepare(self.cdi_dir, claim_uid, device, self.key.sign(dra_device_id(device)))
        self.record.claim(
            pod.namespace, pod.name, container, f"claim-{claim_uid}", DRIVER, device, cdi_devices=(cdi,)
        )
        return cdi


@contextlib.asynccontextmanager
async def dra_node(root: Path, *, kubelet_answers: bool = True) -> AsyncIterator[Node]:
    """The plugin, asking kubelet's record through a `PodResourcesClient` for our DRA driver (served
    only when `kubelet_answers`), and the runtime reading CDI specs from ``root/cdi``."""
    record = PodResourcesRecord(root / "pr" / "kubelet.sock" if kubelet_answers else None)
    await record.start()
    tree = FakeCgroups(root / "cgroup", 2)
    allocations = PodResourcesClient(
        str(root / "pr" / "kubelet.sock"),
        RESOURCE,
        dra=DraDevices(DRIVER, "node-1", PUBLISHED),
        ttl=0.0,
    )
    plugin, key = make_plugin(root / "state", tree.layout, allocations=allocations)
    socket = root / "nri.sock"
    try:
        async with RuntimeSimulator(socket) as sim, plugin_running(plugin, socket) as stub:
            plugin.send_updates = stub.update_containers  # as the daemon's wiring does
            sim.cdi = CdiSpecs([root / "cdi"])
            await sim.wait_for_plugins(1, GUARD)
            yield Node(sim, tree, key, record, root / "cdi")
    finally:
        await record.stop()


def shared(container: api.Container) -> bool:
    return container.linux.resources.cpu.cpus == "0-1,4-5"


def refusals(logs: Sequence[Mapping[str, Any]]) -> list[str]:
    return [entry["reason"] for entry in logs if entry["event"] == "request refused"]


@pytest.mark.asyncio
async def test_a_dra_prepared_container_gets_the_shared_cpus_by_kubelets_record(root: Path) -> None:
    async with dra_node(root) as node:
        pod = node.pod("1111-aaaa", "fwd")
        await node.sim.run_pod_sandbox(pod)
        cdi = node.claim(pod, "main", "uid-1", "shared-cpus-3")
        with structlog.testing.capture_logs() as logs:
            container = await node.create(pod, "c1", "main", cdi_devices=[cdi])
        assert shared(container)
        env = env_of(container)
        signed = node.key.read(env[MARKER_ENV])
        assert signed is not None, "the runtime injected the CDI edit"
        assert signed.device == "dra.shared-cpus-3"
        assert (env["OPENSHIFT_SHARED_CPUS"], env["OPENSHIFT_ISOLATED_CPUS"]) == ("0-1", "4-5")
        [given] = [entry for entry in logs if entry["event"] == "shared CPUs given"]
        assert "kubelet's allocation (dra.shared-cpus-3)" in str(given)
        assert refusals(logs) == []
        assert node.record.calls == ["Get"]


@pytest.mark.asyncio
async def test_forged_and_replayed_env_markers_get_nothing_where_kubelet_answers(root: Path) -> None:
    async with dra_node(root) as node:
        holder = node.pod("1111-aaaa", "holder")
        await node.sim.run_pod_sandbox(holder)
        cdi = node.claim(holder, "main", "uid-1", "shared-cpus-3")
        assert shared(await node.create(holder, "h1", "main", cdi_devices=[cdi]))
        thief = node.pod("2222-bbbb", "thief")
        await node.sim.run_pod_sandbox(thief)
        stolen = env_of(node.sim.containers["h1"])[MARKER_ENV]
        forged = prepare(node.cdi_dir, "uid-9", "shared-cpus-4", FORGED)
        with structlog.testing.capture_logs() as logs:
            # The holder's CDI device named for another pod's container (kubelet allocated it nothing),
            # the holder's marker copied into a pod spec's env, a claim spec with a forged marker.
            assert not shared(await node.create(thief, "t1", "copy", cdi_devices=[cdi]))
            assert not shared(await node.create(thief, "t2", "env", env=(f"{MARKER_ENV}={stolen}",)))
            assert not shared(await node.create(thief, "t3", "forged", cdi_devices=[forged]))
        where = f"the {MARKER_ENV} env entry (set by the DRA driver's CDI spec)"
        assert refusals(logs) == [
            f"refused {where}: kubelet's record shows no shared-CPUs device allocated to container "
            f"ns/thief/{name} (a replayed, harvested or planted marker)"
            for name in ("copy", "env", "forged")
        ]
        # Another driver's device under our device's name proves nothing either; nor does our
        # driver's device in another node's pool, or one our pool never published.
        node.record.claim("ns", "thief", "gpu", "gpus", "gpu.example.com", "shared-cpus-3")
        assert not shared(await node.create(thief, "t4", "gpu", cdi_devices=[cdi]))
        node.record.claim("ns", "thief", "other-pool", "c2", DRIVER, "shared-cpus-3", pool="node-2")
        assert not shared(await node.create(thief, "t5", "other-pool", cdi_devices=[cdi]))
        unpublished = prepare(
            node.cdi_dir, "uid-8", "shared-cpus-99999", node.key.sign("dra.shared-cpus-99999")
        )
        node.record.claim("ns", "thief", "unpublished", "c3", DRIVER, "shared-cpus-99999")
        assert not shared(await node.create(thief, "t6", "unpublished", cdi_devices=[unpublished]))


@pytest.mark.asyncio
async def test_without_kubelets_record_the_binding_refuses_a_replay_and_the_key_a_forgery(root: Path) -> None:
    async with dra_node(root, kubelet_answers=False) as node:
        holder = node.pod("1111-aaaa", "holder")
        await node.sim.run_pod_sandbox(holder)
        cdi = node.claim(holder, "main", "uid-1", "shared-cpus-3")
        with structlog.testing.capture_logs() as logs:
            assert shared(await node.create(holder, "h1", "main", cdi_devices=[cdi]))
        [given] = [entry for entry in logs if entry["event"] == "shared CPUs given"]
        assert "DRA marker (dra.shared-cpus-3)" in str(given)
        thief = node.pod("2222-bbbb", "thief")
        await node.sim.run_pod_sandbox(thief)
        forged = prepare(node.cdi_dir, "uid-9", "shared-cpus-4", FORGED)
        with structlog.testing.capture_logs() as logs:
            assert not shared(await node.create(thief, "t1", "copy", cdi_devices=[cdi]))
            assert not shared(await node.create(thief, "t2", "forged", cdi_devices=[forged]))
        where = f"the {MARKER_ENV} env entry (set by the DRA driver's CDI spec)"
        assert refusals(logs) == [
            f"refused {where}: device dra.shared-cpus-3 is already held by container 1111-aaaa/main "
            "(a replayed marker)",
            f"refused {where}: it was not signed with this node's key (forged, or copied from another node)",
        ]


@pytest.mark.asyncio
async def test_a_claim_reserved_for_two_pods_goes_to_the_second_once_the_first_ends(root: Path) -> None:
    """Without kubelet's record, one claim reserved for two pods (one allocation of one device): the
    first container to present it holds the device, the other pod's waits, refused for now, and is
    given the shared CPUs when the first pod's sandbox stops: its pod quota raised, its cpuset and
    quota by an UpdateContainers right after that event (its env cannot change). A pod the claim is
    not reserved for gets nothing, before or after."""
    async with dra_node(root, kubelet_answers=False) as node:
        first, second, other = (
            node.pod("1111-aaaa", "first"),
            node.pod("2222-bbbb", "second"),
            node.pod("3333-cccc", "other"),
        )
        for pod in (first, second, other):
            await node.sim.run_pod_sandbox(pod)
        marker = node.key.sign(dra_device_id("shared-cpus-3"), pods=[first.uid, second.uid])
        cdi = prepare(node.cdi_dir, "uid-1", "shared-cpus-3", marker)
        assert shared(await node.create(first, "f1", "main", cdi_devices=[cdi]))
        with structlog.testing.capture_logs() as logs:
            assert not shared(await node.create(second, "s1", "main", cdi_devices=[cdi]))
            assert not shared(await node.create(other, "o1", "main", cdi_devices=[cdi]))
        waits, stranger = refusals(logs)
        assert "for now: device dra.shared-cpus-3 is held by container 1111-aaaa/main" in waits
        assert "reserved for other pods (1111-aaaa, 2222-bbbb), not pod 3333-cccc" in stranger
        assert node.tree.pod_quota(second) == 2 * PERIOD
        assert node.sim.unsolicited == []
        # kubelet ends the first pod: its container stops (the binding holds), then its sandbox.
        await node.sim.stop_container("f1")
        assert node.sim.unsolicited == []
        with structlog.testing.capture_logs() as logs:
            await node.sim.stop_pod_sandbox(first.id)
            # (the simulator notes an update as it arrives, and applies it once it holds its lock)
            await wait_until(lambda: shared(node.sim.containers["s1"]), what="the late grant's update")
        [given] = [entry for entry in logs if entry["event"].startswith("shared CPUs given once")]
        assert given["container_id"] == "s1"
        [sent] = node.sim.unsolicited
        assert sent.containers == ("s1",)
        assert sent.calls_in_flight == 0  # sent once the StopPodSandbox was answered
        assert shared(node.sim.containers["s1"])
        assert node.sim.containers["s1"].linux.resources.cpu.quota.value == 4 * PERIOD
        assert node.tree.pod_quota(second) == 4 * PERIOD  # raised before the update was sent
        assert not shared(node.sim.containers["o1"])
        # The stranger's retry is still refused; the second pod's restart keeps the device.
        assert not shared(await node.create(other, "o2", "main", cdi_devices=[cdi]))
        assert shared(await node.create(second, "s2", "main", cdi_devices=[cdi]))
