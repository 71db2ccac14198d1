"""The runtime simulator's modes (`RuntimeModes`): the behaviours of real runtimes that a plugin cannot
learn from its events, each reproduced on demand (and off by default)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from mixedcpu_support import GUARD, plugin_running

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.nri.simulator import CreationFailed, RuntimeModes, RuntimeSimulator


class Events:
    """A plugin that records every event it is told of, by handler and object id."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        self.seen.append(("synchronize", ",".join(sorted(p.id for p in pods))))
        return ()

    async def create_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> api.CreateContainerResponse:
        self.seen.append(("create", container.id))
        response = api.CreateContainerResponse()
        response.adjust.linux.resources.cpu.cpus = "0-3"
        return response

    async def stop_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> Sequence[api.ContainerUpdate]:
        self.seen.append(("stop", container.id))
        return ()

    async def remove_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        self.seen.append(("remove", container.id))

    async def stop_pod_sandbox(self, pod: api.PodSandbox) -> None:
        self.seen.append(("stop_pod", pod.id))

    async def remove_pod_sandbox(self, pod: api.PodSandbox) -> None:
        self.seen.append(("remove_pod", pod.id))


class Cgroups(RuntimeSimulator):
    """A runtime that notes when it releases a container's resources, and what plugins knew then."""

    def __init__(self, socket_path: Path, plugin: Events) -> None:
        super().__init__(socket_path)
        self.plugin = plugin
        self.released: list[tuple[str, list[tuple[str, str]]]] = []

    def release_resources(self, container: api.Container) -> None:
        self.released.append((container.id, list(self.plugin.seen)))


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="mcpu-m-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def pod(n: int) -> api.PodSandbox:
    return api.PodSandbox(id=f"pod{n}", uid=f"uid-{n}", name=f"pod-{n}", namespace="ns")


def container(n: int, pod_id: str) -> api.Container:
    made = api.Container(id=f"c{n}", pod_sandbox_id=pod_id, name=f"c{n}")
    made.linux.resources.cpu.cpus = "2-3"
    return made


def test_every_mode_is_off_by_default() -> None:
    assert RuntimeModes() == RuntimeModes(False, False, False, False)


@pytest.mark.asyncio
async def test_a_runtime_that_forgets_pods_across_its_restart(short_dir: Path) -> None:
    plugin = Events()
    socket = short_dir / "nri.sock"
    async with plugin_running(plugin, socket, reconnect=True):
        first = RuntimeSimulator(socket)
        first.modes.forgets_pods_on_restart = True
        async with first:
            await first.wait_for_plugins(1, GUARD)
            await first.run_pod_sandbox(pod(1))
            await first.create_container(container(1, "pod1"))
        second = RuntimeSimulator(socket)
        second.restore(first)
        assert second.modes.forgets_pods_on_restart
        async with second:
            await second.wait_for_plugins(1, GUARD)
            await second.run_pod_sandbox(pod(2))
            await second.stop_container("c1")
            await second.remove_container("c1")
            for pod_id in ("pod1", "pod2"):
                await second.stop_pod_sandbox(pod_id)
                await second.remove_pod_sandbox(pod_id)
    # The restored pod was synchronized, its container's events came, its own never did.
    assert plugin.seen == [
        ("synchronize", ""),
        ("create", "c1"),
        ("synchronize", "pod1"),
        ("stop", "c1"),
        ("remove", "c1"),
        ("stop_pod", "pod2"),
        ("remove_pod", "pod2"),
    ]
    assert second.omitted == [("StopPodSandbox", "pod1"), ("RemovePodSandbox", "pod1")]
    assert second.pods == {}


@pytest.mark.asyncio
async def test_a_creation_that_fails_after_the_adjustment(short_dir: Path) -> None:
    plugin = Events()
    socket = short_dir / "nri.sock"
    async with RuntimeSimulator(socket) as sim, plugin_running(plugin, socket):
        await sim.wait_for_plugins(1, GUARD)
        await sim.run_pod_sandbox(pod(1))
        sim.modes.create_fails_after_adjustment = True
        with pytest.raises(CreationFailed, match="runc create failed") as info:
            await sim.create_container(container(1, "pod1"))
        assert info.value.container_id == "c1"
        assert "c1" not in sim.containers  # nothing to stop or remove, ever
        sim.modes.create_fails_after_adjustment = False
        created = await sim.create_container(container(2, "pod1"))
        assert created.container.linux.resources.cpu.cpus == "0-3"
    assert plugin.seen[-2:] == [("create", "c1"), ("create", "c2")]


@pytest.mark.asyncio
@pytest.mark.parametrize("lingers", [False, True], ids=["released-at-stop", "lingers-until-removal"])
async def test_when_a_stopped_containers_resources_go(short_dir: Path, lingers: bool) -> None:
    plugin = Events()
    socket = short_dir / "nri.sock"
    sim = Cgroups(socket, plugin)
    sim.modes.stopped_cgroup_lingers = lingers
    async with sim, plugin_running(plugin, socket):
        await sim.wait_for_plugins(1, GUARD)
        await sim.run_pod_sandbox(pod(1))
        await sim.create_container(container(1, "pod1"))
        await sim.stop_container("c1")
        assert [cid for cid, _ in sim.released] == ([] if lingers else ["c1"])
        await sim.remove_container("c1")
    [(cid, known)] = sim.released  # once, and before plugins heard of that step
    assert cid == "c1"
    assert known[-1] == (("stop", "c1") if lingers else ("create", "c1"))


class Made(Cgroups):
    """A runtime that also notes when it makes a container's cgroup."""

    def make_resources(self, container: api.Container) -> None:
        self.released.append((f"made {container.id}", list(self.plugin.seen)))


class Starts(Events):
    async def start_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        self.seen.append(("start", container.id))


@pytest.mark.asyncio
@pytest.mark.parametrize("at_start", [False, True], ids=["cri-o", "containerd"])
async def test_where_the_runtime_makes_a_containers_cgroup(short_dir: Path, at_start: bool) -> None:
    """CRI-O makes it in CreateContainer, after the plugins' adjustment; containerd at StartContainer,
    before plugins hear of the start, however long kubelet waits between the two."""
    plugin = Starts()
    socket = short_dir / "nri.sock"
    async with plugin_running(plugin, socket):
        runtime = Made(socket, plugin)
        runtime.modes.cgroup_made_at_start = at_start
        async with runtime:
            await runtime.wait_for_plugins(1, GUARD)
            await runtime.run_pod_sandbox(pod(1))
            await runtime.create_container(container(1, "pod1"))
            made_at_creation = list(runtime.released)
            await runtime.start_container("c1")
    if at_start:
        assert made_at_creation == []
        assert runtime.released == [("made c1", [("synchronize", ""), ("create", "c1")])]
    else:
        assert made_at_creation == [("made c1", [("synchronize", ""), ("create", "c1")])]
    assert plugin.seen[-1] == ("start", "c1")
