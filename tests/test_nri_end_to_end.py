"""The plugin stub against the runtime simulator, over real unix sockets."""

from __future__ import annotations

import asyncio
import functools
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from google.protobuf.message import Message
from mixedcpu_support import plugin_running as running_stub
from structlog.testing import capture_logs
from wait_support import wait_until

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.common.backoff import Backoff
from nri_plugin.common.clock import ManualClock, Timer
from nri_plugin.nri import mux
from nri_plugin.nri.connection import ConnectionState
from nri_plugin.nri.errors import InvalidRequest, PluginFailure, PreconditionFailed
from nri_plugin.nri.events import VALID_EVENTS_V0_9, Event, mask_of
from nri_plugin.nri.identity import Identity
from nri_plugin.nri.simulator import PluginConnection, PluginFailed, RuntimeSimulator, env_of
from nri_plugin.nri.stub import PLUGIN_SERVICE, RUNTIME_SERVICE, Stub, StubError
from nri_plugin.ttrpc.aio import Server, UnaryMethod
from nri_plugin.ttrpc.errors import Code, TtrpcError
from nri_plugin.ttrpc.protocol import ClientSession, ResponseReceived

# The name and index the stubs here register with.
TEST_IDENTITY = Identity(name="test", index="10")

ROOT = Path(__file__).resolve().parent.parent
# Guards against a hung test only; nothing here measures time.
GUARD = 10.0
T = TypeVar("T")


async def guarded(awaitable: Awaitable[T]) -> T:
    """Fail instead of hanging when something that must happen does not (not a timing check)."""
    return await asyncio.wait_for(awaitable, GUARD)


class Recorder:
    """A plugin that records what it is given and answers with configurable adjustments."""

    def __init__(self) -> None:
        self.synced: list[tuple[int, int]] = []
        self.events: list[tuple[str, str]] = []
        self.shared = "0-1"

    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        self.synced.append((len(pods), len(containers)))
        return ()

    async def create_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> api.CreateContainerResponse:
        self.events.append(("create", container.id))
        response = api.CreateContainerResponse()
        response.adjust.linux.resources.cpu.cpus = f"{self.shared},{container.linux.resources.cpu.cpus}"
        response.adjust.env.add(key="OPENSHIFT_SHARED_CPUS", value=self.shared)
        return response

    async def update_container(
        self, pod: api.PodSandbox, container: api.Container, resources: api.LinuxResources
    ) -> Sequence[api.ContainerUpdate]:
        self.events.append(("update", container.id))
        update = api.ContainerUpdate(container_id=container.id)
        update.linux.resources.cpu.cpus = f"{self.shared},{resources.cpu.cpus}"
        return (update,)

    async def stop_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> Sequence[api.ContainerUpdate]:
        self.events.append(("stop", container.id))
        return ()

    async def remove_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        self.events.append(("remove", container.id))

    async def start_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        self.events.append(("start", container.id))


def make_pod(n: int, annotations: int = 0) -> api.PodSandbox:
    pod = api.PodSandbox(id=f"pod{n}", uid=f"uid-{n:04d}", name=f"pod-{n}", namespace="ns")
    pod.linux.cgroup_parent = f"/kubepods/poduid-{n:04d}"
    for i in range(annotations):
        pod.annotations[f"example.com/annotation-{i}"] = "x" * 64
    return pod


def make_container(pod: api.PodSandbox, n: int, cpus: str = "2-3") -> api.Container:
    container = api.Container(id=f"{pod.id}-c{n}", pod_sandbox_id=pod.id, name=f"c{n}", env=["PATH=/bin"])
    container.linux.cgroups_path = f"{pod.linux.cgroup_parent}/{container.id}"
    container.linux.resources.cpu.cpus = cpus
    container.linux.resources.cpu.quota.value = 200000
    container.linux.resources.cpu.period.value = 100000
    return container


class SkippingClock(ManualClock):
    """Virtual time that jumps to a timer as soon as one is set: the stub's reconnect waits take no
    real time at all (time moves only when the stub waits, and only as far as it waits)."""

    def call_later(self, seconds: float, callback: Callable[[], object]) -> Timer:
        timer = super().call_later(seconds, callback)
        asyncio.get_running_loop().call_soon(self._skip)
        return timer

    def _skip(self) -> None:
        due = self.next_due()
        if due is not None:
            task = asyncio.ensure_future(self.advance(due - self.monotonic()))
            self._advancing.add(task)
            task.add_done_callback(self._advancing.discard)

    @functools.cached_property
    def _advancing(self) -> set[asyncio.Task[None]]:
        return set()


def plugin_running(plugin: object, socket: Path, **options: Any) -> AbstractAsyncContextManager[Stub]:
    """The stub as a daemon runs it here: name "test", reconnecting after a runtime restart, its
    reconnect waits on virtual time."""
    defaults = {"identity": Identity(name="test", index="10"), "reconnect": True, "clock": SkippingClock()}
    return running_stub(plugin, socket, **{**defaults, **options})


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "nri.sock"


@pytest.mark.asyncio
async def test_register_configure_synchronize(socket_path: Path) -> None:
    plugin = Recorder()
    async with RuntimeSimulator(socket_path) as sim:
        pod = make_pod(1)
        sim.add_pod(pod)
        sim.add_container(make_container(pod, 1))
        async with plugin_running(plugin, socket_path) as stub:
            [connected] = await sim.wait_for_plugins(1, GUARD)
            assert (connected.name, connected.index) == ("test", "10")
            expected = mask_of(
                [
                    Event.CREATE_CONTAINER,
                    Event.UPDATE_CONTAINER,
                    Event.STOP_CONTAINER,
                    Event.REMOVE_CONTAINER,
                    Event.START_CONTAINER,
                ]
            )
            assert connected.events == expected
            assert plugin.synced == [(1, 1)]
            await asyncio.wait_for(stub.ready.wait(), GUARD)
            assert stub.runtime.name == "containerd"
            assert stub.runtime.request_timeout == 2.0


@pytest.mark.parametrize(
    ("runtime", "version", "nri_version", "accepted"),
    [
        pytest.param("containerd", "v2.0.5", "", VALID_EVENTS_V0_9, id="containerd-2.0"),
        pytest.param("containerd", "v1.7.20", "", VALID_EVENTS_V0_9, id="containerd-1.7"),
        pytest.param("cri-o", "1.36.3", "", (1 << 14) - 1, id="crio-1.36"),
        pytest.param("containerd", "v2.3.4", "v0.12.0", (1 << 14) - 1, id="containerd-2.3"),
    ],
)
@pytest.mark.asyncio
async def test_event_mask_limited_to_runtime(
    socket_path: Path, runtime: str, version: str, nri_version: str, accepted: int
) -> None:
    class PodUpdates(Recorder):
        async def update_pod_sandbox(
            self, pod: api.PodSandbox, overhead: api.LinuxResources, resources: api.LinuxResources
        ) -> None:
            return None

    async with (
        RuntimeSimulator(
            socket_path, runtime_name=runtime, runtime_version=version, nri_version=nri_version
        ) as sim,
        plugin_running(PodUpdates(), socket_path),
    ):
        [connected] = await sim.wait_for_plugins(1, GUARD)
        assert connected.events & ~accepted == 0
        assert bool(connected.events & Event.UPDATE_POD_SANDBOX.bit) == bool(
            accepted & Event.UPDATE_POD_SANDBOX.bit
        )
        assert connected.events & Event.CREATE_CONTAINER.bit


@pytest.mark.asyncio
async def test_chunked_synchronize_is_reassembled(socket_path: Path) -> None:
    plugin = Recorder()
    async with RuntimeSimulator(socket_path, max_message_size=64 * 1024) as sim:
        for n in range(200):
            pod = make_pod(n, annotations=4)
            sim.add_pod(pod)
            for c in range(2):
                sim.add_container(make_container(pod, c))
        async with plugin_running(plugin, socket_path):
            await sim.wait_for_plugins(1, GUARD)
    assert len(sim.sync_chunks) > 1
    assert sum(sim.sync_chunks) == 600
    assert plugin.synced == [(200, 400)]


@pytest.mark.asyncio
async def test_container_lifecycle(socket_path: Path) -> None:
    plugin = Recorder()
    async with RuntimeSimulator(socket_path) as sim, plugin_running(plugin, socket_path):
        await sim.wait_for_plugins(1, GUARD)
        pod = make_pod(1)
        await sim.run_pod_sandbox(pod)
        result = await sim.create_container(make_container(pod, 1))
        assert result.container.linux.resources.cpu.cpus == "0-1,2-3"
        assert env_of(result.container)["OPENSHIFT_SHARED_CPUS"] == "0-1"
        await sim.start_container("pod1-c1")
        resources = api.LinuxResources()
        resources.cpu.cpus = "3"
        applied = await sim.update_container("pod1-c1", resources)
        assert applied.cpu.cpus == "0-1,3"
        assert sim.containers["pod1-c1"].linux.resources.cpu.cpus == "0-1,3"
        await sim.stop_container("pod1-c1")
        await sim.remove_container("pod1-c1")
    assert plugin.events == [
        ("create", "pod1-c1"),
        ("start", "pod1-c1"),
        ("update", "pod1-c1"),
        ("stop", "pod1-c1"),
        ("remove", "pod1-c1"),
    ]


class AfterEachReply(Recorder):
    """Notes, at each `after_reply`, the events it has seen and the requests the observer was told
    of by then."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list[str] = []
        self.after: list[tuple[list[tuple[str, str]], list[str]]] = []

    def after_reply(self) -> None:
        self.after.append((list(self.events), list(self.told)))

    # The stub's observer: told of each request once its reply has gone out.
    def request_done(self, event: str, outcome: str, seconds: float) -> None:
        self.told.append(f"{event} {outcome}")

    def reconnecting(self) -> None:
        pass

    def synchronized(self, pods: int, containers: int, size: int, seconds: float) -> None:
        pass


@pytest.mark.asyncio
async def test_after_reply_follows_each_reply_before_the_next_event(socket_path: Path) -> None:
    """The plugin's `AfterReply` runs once per reply, after its handler and before the next event
    reaches it; the observer has heard of each request by then."""
    plugin = AfterEachReply()
    async with RuntimeSimulator(socket_path) as sim, plugin_running(plugin, socket_path, observer=plugin):
        await sim.wait_for_plugins(1, GUARD)
        pod = make_pod(1)
        await sim.run_pod_sandbox(pod)
        await sim.create_container(make_container(pod, 1))
        await sim.start_container("pod1-c1")
    create, start = ("create", "pod1-c1"), ("start", "pod1-c1")
    # Configure, Synchronize, CreateContainer, StartContainer (and nothing later: the stub stopped).
    assert [events for events, _ in plugin.after] == [[], [], [create], [create, start]]
    assert [told for _, told in plugin.after] == [
        ["configure ok"],
        ["configure ok", "synchronize ok"],
        ["configure ok", "synchronize ok", "create_container ok"],
        ["configure ok", "synchronize ok", "create_container ok", "start_container ok"],
    ]


class EnvAdjuster(Recorder):
    """Sets one variable the container has, removes another, adds a third, and sets the quota."""

    async def create_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> api.CreateContainerResponse:
        response = api.CreateContainerResponse()
        response.adjust.env.add(key="PATH", value="/opt/bin")
        response.adjust.env.add(key="-HOME")
        response.adjust.env.add(key="NEW", value="1")
        response.adjust.linux.resources.cpu.quota.value = 400000
        return response


@pytest.mark.asyncio
async def test_env_and_cpu_adjustments_applied_as_the_spec_generator_does(socket_path: Path) -> None:
    async with RuntimeSimulator(socket_path) as sim, plugin_running(EnvAdjuster(), socket_path):
        await sim.wait_for_plugins(1, GUARD)
        pod = make_pod(1)
        await sim.run_pod_sandbox(pod)
        container = make_container(pod, 1)
        container.env.extend(["HOME=/root", "PATH=/usr/bin", "LANG=C"])
        result = await sim.create_container(container)
    # Every entry of a name set or removed goes; the ones set come last, in the adjustment's order.
    assert list(result.container.env) == ["LANG=C", "PATH=/opt/bin", "NEW=1"]
    cpu = result.container.linux.resources.cpu
    assert (cpu.quota.value, cpu.period.value, cpu.cpus) == (400000, 100000, "2-3")
    assert list(container.env) == ["PATH=/bin", "HOME=/root", "PATH=/usr/bin", "LANG=C"]  # the CRI's copy


@pytest.mark.asyncio
async def test_state_change_events_on_older_runtime(socket_path: Path) -> None:
    """CRI-O 1.36 (NRI v0.11) sends start/remove through StateChange; the stub delivers them the same."""
    plugin = Recorder()
    async with (
        RuntimeSimulator(socket_path, runtime_name="cri-o", runtime_version="1.36.3", nri_version="") as sim,
        plugin_running(plugin, socket_path),
    ):
        await sim.wait_for_plugins(1, GUARD)
        pod = make_pod(1)
        await sim.run_pod_sandbox(pod)
        await sim.create_container(make_container(pod, 1))
        await sim.start_container("pod1-c1")
        await sim.remove_container("pod1-c1")
        assert {r.event for r in sim.records} >= {"StateChange", "CreateContainer"}
        assert "StartContainer" not in {r.event for r in sim.records}
    assert [e for e, _ in plugin.events] == ["create", "start", "remove"]


@pytest.mark.asyncio
async def test_unsolicited_updates_after_handler(socket_path: Path) -> None:
    class Updater(Recorder):
        stub: Stub

        async def create_container(
            self, pod: api.PodSandbox, container: api.Container
        ) -> api.CreateContainerResponse:
            # Queued now, sent after this handler's reply (the runtime holds its lock until then).
            update = api.ContainerUpdate(container_id="pod1-c0")
            update.linux.resources.cpu.cpus = "0-3"
            self.pending = self.stub.update_containers([update])
            return api.CreateContainerResponse()

    plugin = Updater()
    async with RuntimeSimulator(socket_path) as sim:
        pod = make_pod(1)
        sim.add_pod(pod)
        sim.add_container(make_container(pod, 0))
        async with plugin_running(plugin, socket_path) as stub:
            plugin.stub = stub
            await sim.wait_for_plugins(1, GUARD)
            await sim.create_container(make_container(pod, 1))
            failed = await asyncio.wait_for(plugin.pending, GUARD)
            assert failed == []
            assert sim.containers["pod1-c0"].linux.resources.cpu.cpus == "0-3"
            # An update for a container the runtime does not know comes back as failed.
            ghost = api.ContainerUpdate(container_id="nope")
            [returned] = await asyncio.wait_for(stub.update_containers([ghost]), GUARD)
            assert returned.container_id == "nope"


@pytest.mark.asyncio
async def test_handler_exception_fails_the_operation(socket_path: Path) -> None:
    class Failing(Recorder):
        async def create_container(
            self, pod: api.PodSandbox, container: api.Container
        ) -> api.CreateContainerResponse:
            raise RuntimeError("pod spec is wrong: ask for 1 shared-cpu device")

    async with RuntimeSimulator(socket_path) as sim, plugin_running(Failing(), socket_path):
        await sim.wait_for_plugins(1, GUARD)
        pod = make_pod(1)
        await sim.run_pod_sandbox(pod)
        with pytest.raises(PluginFailed) as failure:
            await sim.create_container(make_container(pod, 1))
        assert failure.value.code == Code.UNKNOWN
        assert failure.value.message == "pod spec is wrong: ask for 1 shared-cpu device"
        assert "pod1-c1" not in sim.containers
        # The plugin stays connected and serves the next request.
        assert len(sim.plugins) == 1


class RawRuntime:
    """A hand-driven runtime: answers RegisterPlugin, then lets the test write any bytes on conn 1."""

    def __init__(self) -> None:
        self.session = ClientSession()
        self.responses: asyncio.Queue[ResponseReceived] = asyncio.Queue()
        self.connected: asyncio.Future[mux.Trunk] = asyncio.get_running_loop().create_future()

    def factory(self) -> mux.Trunk:
        trunk = mux.Trunk()
        trunk.channel(mux.PLUGIN_SERVICE_CONN, self)

        async def register(_request: api.RegisterPluginRequest, _ctx: object) -> api.Empty:
            if not self.connected.done():
                self.connected.set_result(trunk)
            return api.Empty()

        services = {RUNTIME_SERVICE: {"RegisterPlugin": UnaryMethod(api.RegisterPluginRequest, register)}}
        trunk.channel(mux.RUNTIME_SERVICE_CONN, Server(services, functools.partial(trunk.send, 2)))
        return trunk

    def data_received(self, data: bytes | memoryview) -> None:
        for event in self.session.receive_data(data):
            assert isinstance(event, ResponseReceived)
            self.responses.put_nowait(event)

    def connection_lost(self, exc: Exception | None) -> None:
        pass


@pytest.mark.asyncio
async def test_unknown_method_and_oversize_request_keep_connection(socket_path: Path) -> None:
    runtime = RawRuntime()
    server = await asyncio.get_running_loop().create_unix_server(runtime.factory, str(socket_path))
    try:
        async with plugin_running(Recorder(), socket_path, reconnect=False):
            trunk = await asyncio.wait_for(runtime.connected, GUARD)
            _, unknown = runtime.session.send_request(PLUGIN_SERVICE, "NoSuchMethod", b"")
            trunk.send(mux.PLUGIN_SERVICE_CONN, unknown)
            # A request whose header announces 5 MiB: the plugin discards it and answers on its stream.
            big_id, _ = runtime.session.send_request(PLUGIN_SERVICE, "Configure", b"")
            trunk.send(mux.PLUGIN_SERVICE_CONN, encode_frame_header(5 << 20, big_id) + bytes(5 << 20))
            configure = api.ConfigureRequest(runtime_name="containerd", runtime_version="v2.3.4")
            _, ok = runtime.session.send_request(PLUGIN_SERVICE, "Configure", configure.SerializeToString())
            trunk.send(mux.PLUGIN_SERVICE_CONN, ok)
            # Requests run concurrently, so replies may come in any order: match them by stream id.
            replies = sorted(
                [await asyncio.wait_for(runtime.responses.get(), GUARD) for _ in range(3)],
                key=lambda r: r.stream_id,
            )
            assert [(r.stream_id, r.code) for r in replies] == [
                (1, Code.UNIMPLEMENTED),
                (3, Code.RESOURCE_EXHAUSTED),
                (5, Code.OK),
            ]
            assert replies[0].message == "method NoSuchMethod"
            assert api.ConfigureResponse.FromString(replies[2].payload).events & Event.CREATE_CONTAINER.bit
            assert not trunk.closed.is_set()
    finally:
        server.close()
        await server.wait_closed()


def encode_frame_header(length: int, stream_id: int) -> bytes:
    return length.to_bytes(4, "big") + stream_id.to_bytes(4, "big") + bytes([1, 0])


@pytest.mark.asyncio
async def test_oversized_reply_becomes_an_error_and_connection_survives(socket_path: Path) -> None:
    class Huge(Recorder):
        first = True

        async def create_container(
            self, pod: api.PodSandbox, container: api.Container
        ) -> api.CreateContainerResponse:
            if self.first:
                self.first = False
                response = api.CreateContainerResponse()
                response.adjust.env.add(key="BIG", value="x" * (5 << 20))
                return response
            return await super().create_container(pod, container)

    async with RuntimeSimulator(socket_path) as sim, plugin_running(Huge(), socket_path):
        await sim.wait_for_plugins(1, GUARD)
        pod = make_pod(1)
        await sim.run_pod_sandbox(pod)
        with pytest.raises(PluginFailed) as failure:
            await sim.create_container(make_container(pod, 1))
        assert failure.value.code == Code.RESOURCE_EXHAUSTED
        result = await sim.create_container(make_container(pod, 2))
        assert result.container.linux.resources.cpu.cpus == "0-1,2-3"
        assert len(sim.plugins) == 1


@pytest.mark.asyncio
async def test_runtime_restart_reconnects_and_resyncs(socket_path: Path) -> None:
    plugin = Recorder()
    async with plugin_running(plugin, socket_path) as stub:
        async with RuntimeSimulator(socket_path) as first:
            await first.wait_for_plugins(1, GUARD)
        # The runtime is gone; the stub retries until a new one listens on the same path.
        async with RuntimeSimulator(socket_path) as second:
            pod = make_pod(7)
            second.add_pod(pod)
            second.add_container(make_container(pod, 1))
            await second.wait_for_plugins(1, GUARD)
            result = await second.create_container(make_container(pod, 2))
            assert result.container.linux.resources.cpu.cpus == "0-1,2-3"
        assert stub.synchronizations == 2
        assert stub.connections >= 2
    assert plugin.synced == [(0, 0), (1, 1)]


@pytest.mark.asyncio
async def test_runtime_closing_mid_request(socket_path: Path) -> None:
    """The runtime goes away while a handler runs: the stub reconnects to the next runtime."""
    started = asyncio.Event()

    class Slow(Recorder):
        async def create_container(
            self, pod: api.PodSandbox, container: api.Container
        ) -> api.CreateContainerResponse:
            started.set()
            await asyncio.sleep(GUARD)
            return api.CreateContainerResponse()

    plugin = Slow()
    async with plugin_running(plugin, socket_path) as stub:
        sim = RuntimeSimulator(socket_path)
        await sim.start()
        await sim.wait_for_plugins(1, GUARD)
        pod = make_pod(1)
        await sim.run_pod_sandbox(pod)
        creating = asyncio.ensure_future(sim.create_container(make_container(pod, 1)))
        await asyncio.wait_for(started.wait(), GUARD)
        await sim.close()
        creating.cancel()
        async with RuntimeSimulator(socket_path) as again:
            await again.wait_for_plugins(1, GUARD)
        assert stub.synchronizations == 2


@pytest.mark.asyncio
async def test_plugin_missing_the_request_timeout_is_dropped_then_recovers(socket_path: Path) -> None:
    class Stalls(Recorder):
        stall = True

        async def create_container(
            self, pod: api.PodSandbox, container: api.Container
        ) -> api.CreateContainerResponse:
            if self.stall:
                self.stall = False
                await asyncio.sleep(GUARD)
            return await super().create_container(pod, container)

    plugin = Stalls()
    async with (
        RuntimeSimulator(socket_path, request_timeout=0.2) as sim,
        plugin_running(plugin, socket_path) as stub,
    ):
        await sim.wait_for_plugins(1, GUARD)
        pod = make_pod(1)
        await sim.run_pod_sandbox(pod)
        result = await sim.create_container(make_container(pod, 1))
        # The runtime gave up on the plugin and created the container unadjusted.
        assert result.container.linux.resources.cpu.cpus == "2-3"
        assert any(r.outcome == "dropped" and "timed out" in r.detail for r in sim.records)
        # The stub sees its connection closed, reconnects, registers and synchronizes again.
        await sim.wait_for_plugins(1, GUARD)
        assert stub.synchronizations == 2
        result = await sim.create_container(make_container(pod, 2))
        assert result.container.linux.resources.cpu.cpus == "0-1,2-3"


@pytest.mark.asyncio
async def test_registration_timeout_drops_silent_peer(socket_path: Path) -> None:
    async with RuntimeSimulator(socket_path, registration_timeout=0.1) as sim:
        reader, writer = await asyncio.open_unix_connection(str(socket_path))
        assert await asyncio.wait_for(reader.read(), GUARD) == b""  # closed by the runtime
        writer.close()
    assert [(r.event, r.outcome, r.detail) for r in sim.records] == [
        ("RegisterPlugin", "dropped", "registration timed out")
    ]


@pytest.mark.asyncio
async def test_invalid_event_mask_is_refused(socket_path: Path) -> None:
    """A plugin answering with bits the runtime does not know is closed, as NRI runtimes do."""

    class Greedy(Recorder):
        async def update_pod_sandbox(
            self, pod: api.PodSandbox, overhead: api.LinuxResources, resources: api.LinuxResources
        ) -> None:
            return None

    async with RuntimeSimulator(
        socket_path, runtime_name="containerd", runtime_version="v2.0.0", nri_version=""
    ) as sim:
        stub = Stub(Greedy(), identity=TEST_IDENTITY, socket_path=str(socket_path), reconnect=False)
        # Pretend the stub did not limit its mask: subscribe to everything the plugin handles.
        stub_configure = stub._configure

        async def unlimited(request: api.ConfigureRequest, ctx: object) -> api.ConfigureResponse:
            reply = await stub_configure(request, ctx)
            reply.events = stub.subscribed
            return reply

        stub._configure = unlimited  # type: ignore[method-assign, assignment]
        await asyncio.wait_for(stub.run(), GUARD)
    assert any(r.event == "Configure" and "invalid plugin events" in r.detail for r in sim.records)
    assert sim.plugins == []


def test_plugin_without_handlers_is_refused() -> None:
    with pytest.raises(StubError, match="no NRI handler"):
        Stub(object(), identity=Identity(name="x", index="10"))


LAUNCHED_PLUGIN = """
import asyncio, os, sys
sys.path.insert(0, {root!r})
from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.nri.identity import resolve_identity
from nri_plugin.nri.stub import Stub

class Plugin:
    async def create_container(self, pod, container):
        response = api.CreateContainerResponse()
        response.adjust.env.add(key="LAUNCHED", value="yes")
        return response

# The plugin reads its environment once, and hands the stub what it says.
asyncio.run(Stub(Plugin(), identity=resolve_identity(environ=os.environ, executable=sys.argv[0])).run())
"""


@pytest.mark.asyncio
async def test_plugin_launched_by_the_runtime_uses_the_inherited_socket(tmp_path: Path) -> None:
    """Pre-launched plugins get one end of a socketpair and only the three NRI_* variables."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    script = LAUNCHED_PLUGIN.format(root=str(ROOT))
    # Runtimes use fd 3; any inherited fd number named by NRI_PLUGIN_SOCKET works the same.
    fd = str(theirs.fileno())
    env = {"NRI_PLUGIN_NAME": "05-launched", "NRI_PLUGIN_IDX": "05", "NRI_PLUGIN_SOCKET": fd}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, env=env, pass_fds=[theirs.fileno()], stderr=asyncio.subprocess.PIPE
    )
    theirs.close()
    sim = RuntimeSimulator(tmp_path / "unused.sock")
    try:
        await sim.adopt(ours)
        [plugin] = await sim.wait_for_plugins(1, GUARD)
        assert plugin.full_name == "05-launched"  # the old "NN-name" form of the name is stripped
        pod = make_pod(1)
        await sim.run_pod_sandbox(pod)
        result = await sim.create_container(make_container(pod, 1))
        assert env_of(result.container)["LAUNCHED"] == "yes"
    finally:
        await sim.close()
        # A launched plugin cannot reconnect: the runtime closing fd 3 ends it.
        try:
            _, stderr = await asyncio.wait_for(proc.communicate(), GUARD)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        print(f"launched plugin's stderr:\n{stderr.decode(errors='replace')}")  # shown if the test fails
    assert proc.returncode == 0, stderr.decode()


# -- refusals: the plugin's domain errors reach the runtime as ttrpc status codes -----------------------


@pytest.mark.parametrize(
    ("refusal", "code"),
    [
        (InvalidRequest("pod spec is wrong: ask for 1 shared-cpu device"), Code.INVALID_ARGUMENT),
        (PreconditionFailed("the pod cgroup cannot take the quota"), Code.FAILED_PRECONDITION),
        (PluginFailure("the state file cannot be written"), Code.INTERNAL),
        # Still accepted until every plugin raises the NRI-level errors.
        (
            TtrpcError(Code.FAILED_PRECONDITION, "the pod cgroup cannot take the quota"),
            Code.FAILED_PRECONDITION,
        ),
    ],
    ids=["invalid", "precondition", "failure", "ttrpc-error"],
)
@pytest.mark.asyncio
async def test_a_refusal_reaches_the_runtime_as_its_status_code(
    socket_path: Path, refusal: Exception, code: Code
) -> None:
    class Refusing(Recorder):
        async def create_container(
            self, pod: api.PodSandbox, container: api.Container
        ) -> api.CreateContainerResponse:
            raise refusal

    async with RuntimeSimulator(socket_path) as sim, plugin_running(Refusing(), socket_path):
        await sim.wait_for_plugins(1, GUARD)
        pod = make_pod(1)
        await sim.run_pod_sandbox(pod)
        with pytest.raises(PluginFailed) as failure:
            await sim.create_container(make_container(pod, 1))
        assert failure.value.code == code
        message = refusal.message if isinstance(refusal, TtrpcError) else str(refusal)
        assert failure.value.message == message
        assert "pod1-c1" not in sim.containers
        assert len(sim.plugins) == 1


@pytest.mark.asyncio
async def test_a_refusal_in_a_state_change_reaches_the_runtime_as_its_status_code(socket_path: Path) -> None:
    class Refusing(Recorder):
        async def start_container(self, pod: api.PodSandbox, container: api.Container) -> None:
            raise PreconditionFailed("not now")

    async with (
        RuntimeSimulator(socket_path, runtime_name="cri-o", runtime_version="1.36.3", nri_version="") as sim,
        plugin_running(Refusing(), socket_path),
    ):
        await sim.wait_for_plugins(1, GUARD)
        pod = make_pod(1)
        await sim.run_pod_sandbox(pod)
        await sim.create_container(make_container(pod, 1))
        with pytest.raises(PluginFailed) as failure:
            await sim.start_container("pod1-c1")
        assert (failure.value.event, failure.value.code, failure.value.message) == (
            "StateChange",
            Code.FAILED_PRECONDITION,
            "not now",
        )


# -- the connection's states ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_connection_goes_through_its_states(socket_path: Path) -> None:
    seen: list[tuple[str, ConnectionState]] = []

    class Watching(Recorder):
        stub: Stub

        async def synchronize(
            self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
        ) -> Sequence[api.ContainerUpdate]:
            seen.append(("synchronize", self.stub.state))
            return await super().synchronize(pods, containers)

        async def create_container(
            self, pod: api.PodSandbox, container: api.Container
        ) -> api.CreateContainerResponse:
            seen.append(("create", self.stub.state))
            return await super().create_container(pod, container)

    plugin = Watching()
    clock = ManualClock()  # the reconnect waits until the test moves time on
    stub = Stub(plugin, identity=TEST_IDENTITY, socket_path=str(socket_path), clock=clock)
    plugin.stub = stub
    before = stub.state
    running = asyncio.ensure_future(stub.run())
    try:
        assert await guarded(stub.wait_for_state(ConnectionState.BACKING_OFF)) is ConnectionState.BACKING_OFF
        async with RuntimeSimulator(socket_path) as sim:
            await clock.advance(1.0)
            await guarded(stub.wait_for_state(ConnectionState.READY))
            assert stub.ready.is_set()
            pod = make_pod(1)
            await sim.run_pod_sandbox(pod)
            await sim.create_container(make_container(pod, 1))
        await guarded(stub.wait_for_state(ConnectionState.BACKING_OFF))
        assert not stub.ready.is_set()
    finally:
        stub.stop()
        await guarded(running)
    assert (before, stub.state) == (ConnectionState.DISCONNECTED, ConnectionState.STOPPED)
    assert seen == [("synchronize", ConnectionState.SYNCHRONIZING), ("create", ConnectionState.READY)]


@pytest.mark.asyncio
async def test_stop_ends_the_backoff_wait_at_once(socket_path: Path) -> None:
    clock = ManualClock()  # never advanced: only stop() can end the wait
    stub = Stub(Recorder(), identity=TEST_IDENTITY, socket_path=str(socket_path), clock=clock)
    running = asyncio.ensure_future(stub.run())
    await guarded(stub.wait_for_state(ConnectionState.BACKING_OFF))
    stub.stop()
    await guarded(running)
    assert stub.state is ConnectionState.STOPPED


class RegistersOnly:
    """A runtime that takes the plugin's registration and then says nothing (no Configure, no
    Synchronize), until `close()`: a runtime stuck between registration and configuration."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.trunks: list[mux.Trunk] = []
        self.registered = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.get_running_loop().create_unix_server(self._accept, str(self.path))

    def _accept(self) -> mux.Trunk:
        trunk = mux.Trunk()

        async def register(_request: api.RegisterPluginRequest, _ctx: object) -> api.Empty:
            self.registered.set()
            return api.Empty()

        service = {RUNTIME_SERVICE: {"RegisterPlugin": UnaryMethod(api.RegisterPluginRequest, register)}}
        server = Server(service, functools.partial(trunk.send, mux.RUNTIME_SERVICE_CONN))
        trunk.channel(mux.RUNTIME_SERVICE_CONN, server)
        self.trunks.append(trunk)
        return trunk

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for trunk in self.trunks:  # first: from Python 3.12 on, wait_closed waits for every connection
            trunk.close()
        await self._server.wait_closed()


@pytest.mark.asyncio
async def test_the_stub_says_how_long_it_is_stuck_and_why_it_lost_its_connection(socket_path: Path) -> None:
    """`stalled_for` counts, on the stub's clock, from the start of an attempt until it is READY or
    waits by design (BACKING_OFF); `lost` says why and when the last connection ended (what
    ``/healthz`` and ``/readyz`` tell, issue 29)."""
    clock = ManualClock()
    backoff = Backoff(initial=1.0, maximum=1.0, jitter=(1.0, 1.0))
    stub = Stub(
        Recorder(), identity=TEST_IDENTITY, socket_path=str(socket_path), backoff=backoff, clock=clock
    )
    assert (stub.stalled_for, stub.lost) == (0.0, None)
    running = asyncio.ensure_future(stub.run())
    try:
        await guarded(stub.wait_for_state(ConnectionState.BACKING_OFF))
        assert stub.stalled_for == 0.0, "no runtime to connect to: waiting by design"
        assert stub.lost is None, "never connected: nothing lost"
        runtime = RegistersOnly(socket_path)
        await runtime.start()
        await clock.advance(1.0)  # the reconnect wait: the attempt begins
        await guarded(runtime.registered.wait())
        await guarded(stub.wait_for_state(ConnectionState.REGISTERED))
        await clock.advance(30.0)
        assert stub.stalled_for == 30.0, "registered, never configured: stuck since the attempt began"
        await runtime.close()
        await guarded(stub.wait_for_state(ConnectionState.BACKING_OFF))
        assert stub.stalled_for == 0.0
        assert stub.lost is not None
        assert stub.lost.cause == "the runtime closed the connection"
        assert stub.lost.at > 0
    finally:
        stub.stop()
        await guarded(running)
    assert stub.stalled_for == 0.0


async def next_backoff(stub: Stub, clock: ManualClock) -> float:
    """The wait the stub is backing off for, once it waits (the clock has no other timer)."""
    await guarded(stub.wait_for_state(ConnectionState.BACKING_OFF))
    while (due := clock.next_due()) is None:
        await guarded(asyncio.sleep(0))
    assert stub.state is ConnectionState.BACKING_OFF
    return due - clock.monotonic()


@pytest.mark.asyncio
async def test_every_registration_resets_the_reconnect_backoff(socket_path: Path) -> None:
    """Mutation testing found the reset after a successful registration untested: without it, after
    a few runtime restarts every reconnect waits the longest delay."""
    clock = ManualClock()
    backoff = Backoff(initial=1.0, maximum=8.0, jitter=(1.0, 1.0))
    stub = Stub(
        Recorder(), identity=TEST_IDENTITY, socket_path=str(socket_path), backoff=backoff, clock=clock
    )
    running = asyncio.ensure_future(stub.run())
    try:
        for restart in range(3):
            # The runtime is away: each failed attempt waits twice as long as the one before.
            assert await next_backoff(stub, clock) == 1.0, f"restart {restart}"
            await clock.advance(1.0)
            assert await next_backoff(stub, clock) == 2.0
            await clock.advance(2.0)
            assert await next_backoff(stub, clock) == 4.0
            async with RuntimeSimulator(socket_path) as sim:
                await clock.advance(4.0)
                await sim.wait_for_plugins(1, GUARD)
                await guarded(stub.wait_for_state(ConnectionState.READY))
            # Registered, then lost: back at the initial delay.
        assert stub.connections == 3
        assert await next_backoff(stub, clock) == 1.0
    finally:
        stub.stop()
        await guarded(running)


# -- Synchronize chunks belong to their connection -------------------------------------------------------


class Selecting(Recorder):
    """A plugin that needs only the containers named c0 (a `SyncSelector`), and records what it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[str | None, str]] = []
        self.given: list[api.Container] = []

    def sync_filter(self) -> Callable[[api.PodSandbox | None, api.Container], bool]:
        return self._needed

    def _needed(self, pod: api.PodSandbox | None, container: api.Container) -> bool:
        self.asked.append((pod.id if pod is not None else None, container.id))
        return container.name == "c0"

    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        self.given = list(containers)
        return await super().synchronize(pods, containers)


@pytest.mark.asyncio
@pytest.mark.parametrize("limit", [64 * 1024, 4 << 20], ids=["chunked", "one-message"])
async def test_synchronize_keeps_only_the_containers_the_plugin_needs(socket_path: Path, limit: int) -> None:
    """Every pod reaches the plugin, and only the containers it says it needs (each asked with its
    pod, once that came); the log counts every container the runtime sent."""
    plugin = Selecting()
    async with RuntimeSimulator(socket_path, max_message_size=limit) as sim:
        for n in range(200):
            pod = make_pod(n, annotations=4)
            sim.add_pod(pod)
            for c in range(2):
                sim.add_container(make_container(pod, c))
        with capture_logs() as logs:
            async with plugin_running(plugin, socket_path):
                await sim.wait_for_plugins(1, GUARD)
    assert (len(sim.sync_chunks) > 2) == (limit < 1 << 20)
    assert plugin.synced == [(200, 200)]
    assert sorted(c.id for c in plugin.given) == sorted(f"pod{n}-c0" for n in range(200))
    assert len(plugin.asked) == 400
    assert all(pod_id == container_id.partition("-")[0] for pod_id, container_id in plugin.asked)
    [synced] = [entry for entry in logs if entry["event"] == "synchronized"]
    assert (synced["pods"], synced["containers"]) == (200, 400)


class DropsAfterFirstChunk(RuntimeSimulator):
    """A runtime that goes away (stops listening, drops the plugin) once the plugin has answered the
    first chunk of a split Synchronize."""

    dropped = False

    async def _call(
        self, plugin: PluginConnection, method: str, request: Message, response_type: type[Any], **kwargs: Any
    ) -> Any:
        reply = await super()._call(plugin, method, request, response_type, **kwargs)
        chunk = isinstance(request, api.SynchronizeRequest) and request.more
        if method == "Synchronize" and chunk and not self.dropped:
            self.dropped = True
            assert self._server is not None
            self._server.close()
            plugin.trunk.close()
        return reply


@pytest.mark.asyncio
async def test_chunks_of_a_lost_connection_never_reach_the_next_synchronize(socket_path: Path) -> None:
    """A connection dropped after Synchronize chunk 1, then a runtime with 3 pods: the plugin gets those
    3 pods alone, not the lost chunk's too (which would bring containers removed meanwhile back)."""
    plugin = Recorder()
    first = DropsAfterFirstChunk(socket_path, max_message_size=8 * 1024)
    for n in range(60):
        pod = make_pod(n, annotations=4)
        first.add_pod(pod)
        first.add_container(make_container(pod, 1))
    async with plugin_running(plugin, socket_path) as stub:
        async with first:
            await wait_until(lambda: first.dropped, what="the runtime dropped the plugin after chunk 1")
        assert first.sync_chunks[0] < 120  # the first chunk was part of the whole, and went astray
        async with RuntimeSimulator(socket_path) as second:
            for n in range(100, 103):
                second.add_pod(make_pod(n))
            await second.wait_for_plugins(1, GUARD)
        assert stub.synchronizations == 1
    assert plugin.synced == [(3, 0)]


# -- unsolicited updates wait for the reply ------------------------------------------------------------


@pytest.mark.asyncio
async def test_unsolicited_updates_leave_only_after_the_reply(socket_path: Path) -> None:
    """Mutation testing found the wait untested: an update queued by a handler that goes on working
    must reach the runtime after the handler's reply, never while the runtime waits for it."""

    class Updater(Recorder):
        stub: Stub

        async def create_container(
            self, pod: api.PodSandbox, container: api.Container
        ) -> api.CreateContainerResponse:
            update = api.ContainerUpdate(container_id="pod1-c0")
            update.linux.resources.cpu.cpus = "0-3"
            self.pending = self.stub.update_containers([update])
            # Still handling: long enough for an update sent at once to reach the runtime.
            for _ in range(50):
                await asyncio.sleep(0)
            return api.CreateContainerResponse()

    plugin = Updater()
    async with RuntimeSimulator(socket_path) as sim:
        pod = make_pod(1)
        sim.add_pod(pod)
        sim.add_container(make_container(pod, 0))
        async with plugin_running(plugin, socket_path) as stub:
            plugin.stub = stub
            await sim.wait_for_plugins(1, GUARD)
            await sim.create_container(make_container(pod, 1))
            assert await guarded(plugin.pending) == []
    assert [(u.plugin, u.containers, u.calls_in_flight) for u in sim.unsolicited] == [
        ("10-test", ("pod1-c0",), 0)
    ]
