"""What the runtime simulator does with plugins' CreateContainer replies: the request each plugin is
sent, the adjustments merged under NRI's ownership rule, the container as the runtime then runs it,
the updates a creation carries, and what it records. Two scripted plugins (real stubs over the unix
socket) answer with fixed adjustments."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from mixedcpu_support import GUARD, plugin_running

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.nri.identity import Identity
from nri_plugin.nri.simulator import (
    AdjustmentConflict,
    CreateResult,
    PluginFailed,
    Record,
    RuntimeSimulator,
    env_of,
)

Outcome = CreateResult | AdjustmentConflict | PluginFailed


class Scripted:
    """A plugin that answers every CreateContainer with `reply` and keeps what it was sent."""

    def __init__(self, reply: api.CreateContainerResponse | None = None) -> None:
        self.reply = reply or api.CreateContainerResponse()
        self.seen: list[tuple[api.PodSandbox, api.Container]] = []

    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        return ()

    async def create_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> api.CreateContainerResponse:
        self.seen.append((pod, container))
        return self.reply


def make_pod() -> api.PodSandbox:
    pod = api.PodSandbox(id="pod1", uid="uid-1", name="pod-1", namespace="ns")
    pod.labels["app"] = "web"
    pod.annotations["cpu-shared.crio.io/c1"] = "enable"
    pod.linux.cgroup_parent = "/kubepods/poduid-1"
    return pod


def make_container() -> api.Container:
    container = api.Container(id="c1", pod_sandbox_id="pod1", name="c1", state=api.CONTAINER_UNKNOWN, pid=42)
    # Entries whose names only look like SHARED's (a longer name, a value holding "\nSHARED=") stay.
    container.env.extend(["PATH=/bin", "KEEP=1", "SHARED=old", "MY_SHARED=1", "DROP=x", "SHARED=older"])
    container.env.append("NOTE=a\nSHARED=b")
    container.annotations.update({"io.kubernetes.container.hash": "1", "stale": "yes"})
    container.labels["io.kubernetes.container.name"] = "c1"
    container.linux.cgroups_path = "/kubepods/poduid-1/c1"
    cpu = container.linux.resources.cpu
    cpu.cpus = "2-3"
    cpu.mems = "0"
    cpu.quota.value = 200000
    cpu.period.value = 100000
    cpu.shares.value = 2048
    return container


def reply(
    env: Sequence[tuple[str, str]] = (), annotations: dict[str, str] | None = None, **cpu: str | int
) -> api.CreateContainerResponse:
    """A CreateContainer reply: env entries, annotations and CPU fields (strings as they are,
    wrapper fields by their value)."""
    response = api.CreateContainerResponse()
    for key, value in env:
        response.adjust.env.add(key=key, value=value)
    response.adjust.annotations.update(annotations or {})
    target = response.adjust.linux.resources.cpu
    for name, setting in cpu.items():
        if isinstance(setting, str):
            setattr(target, name, setting)
        else:
            getattr(target, name).value = setting
    return response


async def create_with(
    socket_path: Path, first: Scripted, second: Scripted, container: api.Container | None = None
) -> tuple[RuntimeSimulator, Outcome]:
    """Plugins "10-a" and "20-b" running; `container` created. Gives the simulator and the result,
    or the exception the creation raised."""
    async with (
        RuntimeSimulator(socket_path) as sim,
        plugin_running(first, socket_path, identity=Identity(name="a", index="10")),
        plugin_running(second, socket_path, identity=Identity(name="b", index="20")),
    ):
        await sim.wait_for_plugins(2, GUARD)
        await sim.run_pod_sandbox(make_pod())
        try:
            return sim, await sim.create_container(container or make_container())
        except (AdjustmentConflict, PluginFailed) as exc:
            return sim, exc


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "nri.sock"


@pytest.mark.asyncio
async def test_each_plugin_is_sent_the_pod_and_the_container_as_adjusted_before_it(socket_path: Path) -> None:
    first = Scripted(reply(env=[("SHARED", "0-1")], cpus="0-3"))
    second = Scripted(reply(quota=400000))
    pristine = make_container()
    sim, result = await create_with(socket_path, first, second, pristine)
    assert isinstance(result, CreateResult)
    assert pristine == make_container(), "the caller's container is left as it was"
    [(pod, sent)] = first.seen
    assert pod == make_pod()
    expected = make_container()
    expected.state = api.CONTAINER_CREATED
    assert sent == expected
    [(pod, sent)] = second.seen
    assert pod == make_pod()
    expected.env[:] = ["PATH=/bin", "KEEP=1", "MY_SHARED=1", "DROP=x", "NOTE=a\nSHARED=b", "SHARED=0-1"]
    expected.linux.resources.cpu.cpus = "0-3"
    assert sent == expected
    assert [r for r in sim.records if r.event == "CreateContainer"] == [
        Record(event="CreateContainer", plugin="10-a", container="c1"),
        Record(event="CreateContainer", plugin="20-b", container="c1"),
    ]


@pytest.mark.asyncio
async def test_adjustments_of_two_plugins_are_merged_and_applied(socket_path: Path) -> None:
    first = Scripted(
        reply(env=[("SHARED", "0-1"), ("-DROP", "")], annotations={"-stale": "", "given": "a"}, cpus="0-3")
    )
    second = Scripted(reply(env=[("NEW", "1")], quota=0, mems="0-1"))
    sim, result = await create_with(socket_path, first, second)
    assert isinstance(result, CreateResult)
    adjust = result.adjustment
    assert [(e.key, e.value) for e in adjust.env] == [("SHARED", "0-1"), ("-DROP", ""), ("NEW", "1")]
    assert dict(adjust.annotations) == {"-stale": "", "given": "a"}
    cpu = adjust.linux.resources.cpu
    assert (cpu.cpus, cpu.mems, cpu.HasField("quota"), cpu.quota.value) == ("0-3", "0-1", True, 0)
    assert not cpu.HasField("period")
    container = sim.containers["c1"]
    assert container is result.container
    assert container.state == api.CONTAINER_CREATED
    # Names set or removed lose every old entry; those set go at the end, in the adjustment's order.
    assert list(container.env) == [
        "PATH=/bin",
        "KEEP=1",
        "MY_SHARED=1",
        "NOTE=a\nSHARED=b",
        "SHARED=0-1",
        "NEW=1",
    ]
    assert env_of(container)["SHARED"] == "0-1"
    assert dict(container.annotations) == {"io.kubernetes.container.hash": "1", "given": "a"}
    cpu = container.linux.resources.cpu
    # A wrapper set to 0 is set (quota 0), not skipped; the fields nobody set are kept.
    assert (cpu.cpus, cpu.mems, cpu.quota.value, cpu.period.value, cpu.shares.value) == (
        "0-3",
        "0-1",
        0,
        100000,
        2048,
    )


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("first", "second", "field"),
    [
        (reply(cpus="0-1"), reply(cpus="2-3"), "cpu.cpus"),
        (reply(quota=1), reply(quota=2), "cpu.quota"),
        (reply(env=[("SHARED", "1")]), reply(env=[("-SHARED", "")]), "env SHARED"),
        (reply(annotations={"a": "1"}), reply(annotations={"-a": ""}), "annotation a"),
    ],
)
async def test_two_plugins_setting_one_field_conflict(
    socket_path: Path, first: api.CreateContainerResponse, second: api.CreateContainerResponse, field: str
) -> None:
    sim, result = await create_with(socket_path, Scripted(first), Scripted(second))
    assert isinstance(result, AdjustmentConflict)
    assert str(result) == f'plugins "10-a" and "20-b" both tried to set {field}'
    assert "c1" not in sim.containers


@pytest.mark.asyncio
async def test_one_plugin_setting_an_env_name_twice_conflicts(socket_path: Path) -> None:
    twice = Scripted(reply(env=[("X", "1"), ("X", "2")]))
    _, result = await create_with(socket_path, twice, Scripted())
    assert isinstance(result, AdjustmentConflict)
    assert str(result) == 'plugins "10-a" and "10-a" both tried to set env X'


@pytest.mark.asyncio
async def test_updates_in_a_creation_reply(socket_path: Path) -> None:
    """Updates of other containers are applied once the container is created; one of the container
    being created fails the creation."""
    other = reply(cpus="0-3")
    update = other.update.add(container_id="c0")
    update.linux.resources.cpu.cpus = "0-1,4"
    update.linux.resources.cpu.quota.value = 300000
    async with (
        RuntimeSimulator(socket_path) as sim,
        plugin_running(Scripted(other), socket_path, identity=Identity(name="a", index="10")),
    ):
        await sim.wait_for_plugins(1, GUARD)
        await sim.run_pod_sandbox(make_pod())
        earlier = make_container()
        earlier.id = "c0"
        sim.add_container(earlier)
        result = await sim.create_container(make_container())
        assert [u.container_id for u in result.updates] == ["c0"]
        assert sim.applied_updates == [update]
        cpu = sim.containers["c0"].linux.resources.cpu
        assert (cpu.cpus, cpu.quota.value, cpu.period.value) == ("0-1,4", 300000, 100000)
    own = reply()
    own.update.add(container_id="c1").linux.resources.cpu.cpus = "1"
    refused, failure = await create_with(socket_path, Scripted(own), Scripted())
    assert isinstance(failure, PluginFailed)
    assert str(failure) == (
        "NRI plugin 10-a failed CreateContainer: asked update of c1 during creation (code 2)"
    )
    assert "c1" not in refused.containers
    assert refused.applied_updates == []


@pytest.mark.asyncio
async def test_names_the_container_lacks_are_added_after_its_entries(socket_path: Path) -> None:
    container = make_container()
    container.env[:] = ["PATH=/bin", "NOTE=a\nSHARED=b"]
    _, result = await create_with(
        socket_path, Scripted(reply(env=[("SHARED", "0-1"), ("-GONE", "")])), Scripted(), container
    )
    assert isinstance(result, CreateResult)
    assert list(result.container.env) == ["PATH=/bin", "NOTE=a\nSHARED=b", "SHARED=0-1"]


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [0, 100, 20_000, 3_000_000])
async def test_the_request_carries_the_pod_and_container_whole_at_any_size(
    socket_path: Path, size: int
) -> None:
    """The request is encoded from its parts: lengths of one, two, three and four varint bytes."""
    first, second = Scripted(), Scripted()
    container = make_container()
    if size:
        container.annotations["big"] = "x" * size
    pristine = api.Container()
    pristine.CopyFrom(container)
    await create_with(socket_path, first, second, container)
    expected = pristine
    expected.state = api.CONTAINER_CREATED
    for plugin in (first, second):
        [(pod, sent)] = plugin.seen
        assert (pod, sent) == (make_pod(), expected)
