"""Both sides of the daemon together: ``mixed-cpu-nri-plugin run`` as a subprocess, a fake kubelet and
the NRI runtime simulator in the test process, a fake cgroup v1 tree, all over real unix sockets.

The device plugin registers with the fake kubelet, whose Allocate gets the signed marker; the container
the simulator then creates with that annotation gets the shared CPUs. Every request without valid proof
(forged, unsigned or replayed marker, ``OPENSHIFT_*`` env set by the pod) is created untouched, and
the daemon's stderr says why. Kubelet absent at start, and a kubelet restart, leave the NRI side serving
and end with the device plugin registered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from fake_kubelet import FakeKubelet, remove_sockets
from mixedcpu_support import (
    PERIOD,
    Daemon,
    FakeCgroups,
    Naming,
    make_container,
    make_pod,
    start_daemon,
    write_daemon_config,
)

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key
from nri_plugin.deviceplugin.marker import ANNOTATION_KEY, HostKey
from nri_plugin.nri.simulator import CreateResult, RuntimeSimulator, env_of

T = TypeVar("T")

RESOURCE = "workload.openshift.io/enable-shared-cpus"
ENDPOINT = "mixed-cpu-nri-plugin.sock"
NAMING = Naming("containerd", "cgroupfs")
# A guard against hangs only: what is awaited normally takes milliseconds (a daemon start, a second).
GUARD = 20.0
# The one bound the issue asks for: a restarted kubelet sees the daemon again within 1 s. The daemon
# checks kubelet.sock and its own socket every 0.2 s (CHECK_INTERVAL); 15 restarts on the development
# VM took 0.006-0.21 s, so 1 s leaves room for a loaded CI machine.
REREGISTER_WITHIN = 1.0


async def within(awaitable: Awaitable[T], seconds: float = GUARD) -> T:
    return await asyncio.wait_for(awaitable, seconds)


async def _logged_at_least(daemon: Daemon, count: int, *fragments: str) -> None:
    while len(daemon.logged(*fragments)) < count:  # noqa: ASYNC110 (lines come from a reader task)
        await asyncio.sleep(0.01)


@dataclass
class Node:
    """One node: the daemon's config and files, the runtime simulator, the pod cgroup tree."""

    root: Path
    plugin_dir: Path
    sim: RuntimeSimulator
    tree: FakeCgroups
    daemon: Daemon

    @property
    def key(self) -> HostKey:
        """The node's marker key, as the daemon created it at start in its state dir."""
        return load_or_create_host_key(self.root / "state")

    def pod(self, uid: str, name: str) -> api.PodSandbox:
        """A Guaranteed pod (cgroupfs naming) with 2 CPUs of quota in the fake tree."""
        pod = make_pod(NAMING, uid, name=name)
        self.tree.add_pod(pod, 2 * PERIOD)
        return pod

    async def create(
        self,
        pod: api.PodSandbox,
        cid: str,
        name: str = "app",
        *,
        annotations: dict[str, str] | None = None,
        env: tuple[str, ...] = (),
    ) -> CreateResult:
        """CreateContainer of a container with 2 exclusive CPUs (2-3) and 2 CPUs of quota."""
        if pod.id not in self.sim.pods:
            await self.sim.run_pod_sandbox(pod)
        container = make_container(
            NAMING, pod, cid, name, cpus="2-3", quota=2 * PERIOD, annotations=annotations, env=env
        )
        return await self.sim.create_container(container)


@contextlib.asynccontextmanager
async def node_with_daemon(root: Path, plugin_dir: Path) -> AsyncIterator[Node]:
    """The simulator listening, the daemon started against it and synchronized; stopped afterwards
    (exit status 0 and no traceback asserted)."""
    config = write_daemon_config(root, plugin_dir)
    socket_path = root / "nri.sock"
    async with RuntimeSimulator(socket_path) as sim:
        proc = await start_daemon(
            "--log-level", "info", "run", "--config", str(config), "--socket", str(socket_path)
        )
        daemon = Daemon(proc, GUARD)
        try:
            [plugin] = await sim.wait_for_plugins(1, GUARD)
            assert plugin.full_name == "10-mixed-cpu"
            yield Node(root, plugin_dir, sim, FakeCgroups(root / "cgroup", 1), daemon)
        finally:
            status = await daemon.stop()
            print(f"daemon stderr (exit status {status}):\n{daemon.stderr}")  # shown if the test fails
    assert status == 0, daemon.stderr
    assert "Traceback" not in daemon.stderr, daemon.stderr
    assert not (plugin_dir / ENDPOINT).exists(), "the daemon removes its device-plugin socket on exit"


@contextlib.asynccontextmanager
async def kubelet_running(plugin_dir: Path) -> AsyncIterator[FakeKubelet]:
    kubelet = await FakeKubelet(plugin_dir).start()
    try:
        yield kubelet
    finally:
        await kubelet.stop()


async def registered(kubelet: FakeKubelet) -> None:
    """Wait until the daemon has registered with ``kubelet`` and sent its device list."""
    await within(kubelet.registered.wait())
    await within(kubelet.wait_lists(RESOURCE, 1))
    [request] = [r for r in kubelet.registrations if r.resource_name == RESOURCE][-1:]
    assert (request.version, request.endpoint) == ("v1beta1", ENDPOINT)


async def allocate_marker(kubelet: FakeKubelet, device: str) -> dict[str, str]:
    """Kubelet admits a container asking for 1 device: the annotations it passes to the runtime."""
    response = await kubelet.allocate(RESOURCE, [device])
    [container] = response.container_responses
    return dict(container.annotations)


def assert_shared(result: CreateResult) -> None:
    """Exclusive 2-3 plus the shared pool 0-1; quota and env to match."""
    cpu = result.container.linux.resources.cpu
    assert (cpu.cpus, cpu.quota.value) == ("0-3", 4 * PERIOD)
    env = env_of(result.container)
    assert (env["OPENSHIFT_SHARED_CPUS"], env["OPENSHIFT_ISOLATED_CPUS"]) == ("0-1", "2-3")


def assert_untouched(result: CreateResult) -> None:
    """Created exactly as asked: no adjustment at all from the plugin."""
    assert result.adjustment == api.ContainerAdjustment()
    cpu = result.container.linux.resources.cpu
    assert (cpu.cpus, cpu.quota.value) == ("2-3", 2 * PERIOD)
    assert "OPENSHIFT_ISOLATED_CPUS" not in env_of(result.container)


# ---------------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_allocated_marker_gives_shared_cpus(tmp_path: Path, plugin_dir: Path) -> None:
    async with kubelet_running(plugin_dir) as kubelet, node_with_daemon(tmp_path, plugin_dir) as node:
        await registered(kubelet)
        annotations = await allocate_marker(kubelet, "shared-cpus-0")
        assert list(annotations) == [ANNOTATION_KEY]
        assert node.key.verify(annotations[ANNOTATION_KEY]) == "shared-cpus-0"
        pod = node.pod("1111-aaaa", "fwd")
        result = await node.create(pod, "c1", "fwd", annotations=annotations)
        assert_shared(result)
        assert node.tree.pod_text(pod) == f"{4 * PERIOD}\n", "pod quota raised by n(shared) x period"
        line = await node.daemon.wait_log("shared CPUs given", "device-plugin marker (shared-cpus-0)")
        assert json.loads(line)["container"] == "fwd", line  # the daemon logs JSON lines off a terminal


@pytest.mark.asyncio
async def test_allocate_for_two_tells_the_user_to_request_one(tmp_path: Path, plugin_dir: Path) -> None:
    async with kubelet_running(plugin_dir) as kubelet, node_with_daemon(tmp_path, plugin_dir) as node:
        await registered(kubelet)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await kubelet.allocate(RESOURCE, ["shared-cpus-0", "shared-cpus-1"])
        # What kubelet puts in the pod's status (UnexpectedAdmissionError) after "Allocate failed due to".
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == (
            f"{RESOURCE}: a container asked for 2, but this resource is an on/off switch per container: "
            f'request exactly 1 (resources.requests and resources.limits "{RESOURCE}": 1)'
        )
        await node.daemon.wait_log("Allocate refused", "asked for 2")
        # The device plugin is still registered and serves the next, correct request.
        annotations = await allocate_marker(kubelet, "shared-cpus-1")
        assert node.key.verify(annotations[ANNOTATION_KEY]) == "shared-cpus-1"


# case id: (the container's annotations, given the node's key; its env; fragments of the daemon's log line)
REFUSED: dict[str, tuple[Callable[[HostKey], dict[str, str]], tuple[str, ...], tuple[str, ...]]] = {
    "forged-marker": (
        lambda key: {ANNOTATION_KEY: HostKey(os.urandom(32)).sign("shared-cpus-0")},
        (),
        ('"level": "warning"', "request refused", "not signed with this node's key"),
    ),
    "unsigned-annotation": (
        lambda key: {ANNOTATION_KEY: "shared-cpus-0"},
        (),
        ('"level": "warning"', "request refused", "not signed with this node's key"),
    ),
    "marker-of-another-device": (
        lambda key: {ANNOTATION_KEY: key.sign("shared-cpus-0").replace("shared-cpus-0", "shared-cpus-1")},
        (),
        ('"level": "warning"', "request refused", "not signed with this node's key"),
    ),
    "env-OPENSHIFT_SHARED_CPUS": (
        lambda key: {},
        ("OPENSHIFT_SHARED_CPUS=0-1",),
        ("request evidence ignored", "OPENSHIFT_SHARED_CPUS in the container's env is not a request"),
    ),
    "env-OPENSHIFT_MUTUAL_CPUS": (
        lambda key: {},
        ("OPENSHIFT_MUTUAL_CPUS=0-1",),
        ("request evidence ignored", "OPENSHIFT_MUTUAL_CPUS in the container's env is not a request"),
    ),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(REFUSED))
async def test_request_without_valid_proof_gets_no_shared_cpus(
    tmp_path: Path, plugin_dir: Path, case: str
) -> None:
    make_annotations, env, fragments = REFUSED[case]
    async with kubelet_running(plugin_dir) as kubelet, node_with_daemon(tmp_path, plugin_dir) as node:
        await registered(kubelet)
        pod = node.pod("2222-bbbb", "app")
        result = await node.create(pod, "c1", "app", annotations=make_annotations(node.key), env=env)
        assert_untouched(result)
        for entry in env:  # what the pod set stays as it set it
            name, _, value = entry.partition("=")
            assert env_of(result.container)[name] == value
        assert node.tree.pod_text(pod) == f"{2 * PERIOD}\n", "pod quota untouched"
        line = await node.daemon.wait_log(*fragments)
        fields = json.loads(line)
        assert (fields["event"], fields["pod"], fields["container"]) == ("CreateContainer", "app", "app")
        assert not node.daemon.logged("shared CPUs given")


@pytest.mark.asyncio
async def test_replayed_marker_is_refused_while_its_holder_lives(tmp_path: Path, plugin_dir: Path) -> None:
    async with kubelet_running(plugin_dir) as kubelet, node_with_daemon(tmp_path, plugin_dir) as node:
        await registered(kubelet)
        annotations = await allocate_marker(kubelet, "shared-cpus-7")
        holder_pod = node.pod("3333-cccc", "holder")
        assert_shared(await node.create(holder_pod, "h1", "fwd", annotations=annotations))
        # The same value copied onto a container of another pod.
        thief_pod = node.pod("4444-dddd", "thief")
        assert_untouched(await node.create(thief_pod, "t1", "copy", annotations=annotations))
        assert node.tree.pod_text(thief_pod) == f"{2 * PERIOD}\n"
        line = await node.daemon.wait_log("request refused", "a replayed marker")
        assert "device shared-cpus-7 is already held by container 3333-cccc/fwd" in line, line
        assert json.loads(line)["pod"] == "thief", line
        # The holder keeps its share.
        assert node.tree.pod_text(holder_pod) == f"{4 * PERIOD}\n"
        # The device id stays bound to the holder's pod and container name while the holder is
        # stopped: the copy is still refused, and the holder's own restart is accepted.
        await node.sim.stop_container("h1")
        assert_untouched(await node.create(thief_pod, "t2", "copy", annotations=annotations))
        assert_shared(await node.create(holder_pod, "h2", "fwd", annotations=annotations))


@pytest.mark.asyncio
async def test_kubelet_absent_at_start(tmp_path: Path, plugin_dir: Path) -> None:
    """No kubelet.sock yet: the NRI side serves creates meanwhile; the device plugin registers as soon
    as kubelet starts."""
    async with node_with_daemon(tmp_path, plugin_dir) as node:
        await node.daemon.wait_log("waiting for kubelet")
        pod = node.pod("5555-eeee", "early")
        plain = await node.create(pod, "c1", "plain")
        assert_untouched(plain)
        # A container kubelet admitted before (its marker from an earlier registration on this node).
        earlier = {ANNOTATION_KEY: node.key.sign("shared-cpus-3")}
        proven = await node.create(pod, "c2", "fwd", annotations=earlier)
        assert_shared(proven)
        assert not (plugin_dir / ENDPOINT).exists(), "no device-plugin socket before kubelet is there"
        async with kubelet_running(plugin_dir) as kubelet:
            await registered(kubelet)
            await node.daemon.wait_log("registered with kubelet")
            annotations = await allocate_marker(kubelet, "shared-cpus-0")
            assert_shared(await node.create(pod, "c3", "late", annotations=annotations))


@pytest.mark.asyncio
async def test_kubelet_restart_registers_again(tmp_path: Path, plugin_dir: Path) -> None:
    async with node_with_daemon(tmp_path, plugin_dir) as node:
        async with kubelet_running(plugin_dir) as kubelet:
            await registered(kubelet)
            first = await allocate_marker(kubelet, "shared-cpus-0")
        # The old kubelet is gone; the new one deletes every socket in the directory before it listens.
        remove_sockets(plugin_dir)
        async with kubelet_running(plugin_dir) as restarted:
            await asyncio.wait_for(restarted.registered.wait(), REREGISTER_WITHIN)
            await registered(restarted)
            await node.daemon.wait_log("device plugin registration lost, registering again")
            annotations = await allocate_marker(restarted, "shared-cpus-1")
            pod = node.pod("6666-ffff", "after")
            assert_shared(await node.create(pod, "c1", "a", annotations=first))
            assert_shared(await node.create(pod, "c2", "b", annotations=annotations))
        # The daemon logs it once kubelet's Register reply is back, and the pipe is read by a task of
        # ours: the line may reach us after the answers that followed it.
        await within(_logged_at_least(node.daemon, 2, "registered with kubelet"))
