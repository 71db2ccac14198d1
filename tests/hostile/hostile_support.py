"""A hostile runtime for the real plugin: raw ttrpc over the real NRI mux over a real unix socket.

`HostileRuntime` listens where the plugin's `Stub` connects, serves the Runtime service the stub
needs (RegisterPlugin, UpdateContainers) on mux connection 2, and on connection 1 writes whatever
bytes a test wants, reading the plugin's answers with the sans-I/O frame decoder. `Node` puts the
runtime, a `Stub` serving the real `MixedCpuPlugin`, a fake cgroup tree and a state dir together in
one event loop of its own, so hypothesis examples (plain functions) can drive it with `node.run(...)`.

`snapshot` records every path below a directory (kind, content, mode, mtime) so that a test can
show that nothing was written, created or removed anywhere for an input the plugin refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import stat
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from mixedcpu_support import (
    PERIOD,
    FakeCgroups,
    Naming,
    apply_adjustment,
    make_container,
    make_plugin,
    make_pod,
    marker,
)

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.api.ttrpc import request_pb2
from nri_plugin.common.backoff import Backoff
from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.mixedcpu.allocations import AllocationRecord
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin
from nri_plugin.nri import mux
from nri_plugin.nri.identity import Identity
from nri_plugin.nri.stub import PLUGIN_SERVICE, RUNTIME_SERVICE, Stub
from nri_plugin.ttrpc.aio import Server, UnaryMethod
from nri_plugin.ttrpc.errors import Code
from nri_plugin.ttrpc.protocol import NEED_DATA, FrameDecoder, MessageType, encode_frame

T = TypeVar("T")

NAMING = Naming("containerd", "cgroupfs")
# Every await in these tests is bounded: a hang is a failure, not a stuck CI job. Against hangs only,
# so generous: a loaded 2-core CI machine took over 5 s for one wait, and the daemon-process tests
# (test_bounded_by_peer) await these bounded calls inside their own 20 s guard.
BOUND = 15.0
# Codes a refused or failed request may carry. UNKNOWN (2) is what the ttrpc server sends for an
# exception the handler did not expect: a crash, never acceptable.
ERROR_CODES = frozenset(
    {
        Code.INVALID_ARGUMENT,
        Code.RESOURCE_EXHAUSTED,
        Code.FAILED_PRECONDITION,
        Code.UNIMPLEMENTED,
        Code.INTERNAL,
    }
)


@dataclass(frozen=True)
class Reply:
    code: int
    message: str
    payload: bytes

    @property
    def ok(self) -> bool:
        return self.code == Code.OK


class RawPluginChannel:
    """Our end of mux connection 1: raw ttrpc requests out, responses matched by stream id."""

    def __init__(self, send: Callable[[bytes], None]) -> None:
        self._send = send
        self._decoder = FrameDecoder()
        self._ids = itertools.count(1, 2)
        self.next_id = 1
        self.responses: dict[int, Reply] = {}
        self.stray: list[int] = []
        self._arrived = asyncio.Event()
        self.lost = asyncio.Event()

    def allocate(self) -> int:
        self.next_id = next(self._ids)
        return self.next_id

    def send_raw(self, message: bytes) -> None:
        self._send(message)

    def request(
        self, method: str, payload: bytes, *, service: str = PLUGIN_SERVICE, timeout: float = BOUND
    ) -> int:
        stream_id = self.allocate()
        envelope = request_pb2.Request(
            service=service, method=method, payload=payload, timeout_nano=int(timeout * 1e9)
        )
        self._send(encode_frame(stream_id, MessageType.REQUEST, 0, envelope.SerializeToString()))
        return stream_id

    async def response(self, stream_id: int) -> Reply:
        async def wait() -> Reply:
            while stream_id not in self.responses:
                if self.lost.is_set():
                    raise ConnectionError("the plugin closed the connection")
                self._arrived.clear()
                await self._arrived.wait()
            return self.responses.pop(stream_id)

        return await asyncio.wait_for(wait(), BOUND)

    async def call(self, method: str, payload: bytes, *, service: str = PLUGIN_SERVICE) -> Reply:
        return await self.response(self.request(method, payload, service=service))

    def data_received(self, data: bytes | memoryview) -> None:
        self._decoder.receive_data(data)
        while (frame := self._decoder.next_event()) is not NEED_DATA:
            assert frame.type is MessageType.RESPONSE, frame
            assert not hasattr(frame, "length"), "the plugin sent an oversized frame"
            response = request_pb2.Response.FromString(bytes(frame.data))
            code = response.status.code if response.HasField("status") else Code.OK
            if frame.stream_id in self.responses:
                self.stray.append(frame.stream_id)  # answered twice
            self.responses[frame.stream_id] = Reply(code, response.status.message, response.payload)
        self._arrived.set()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost.set()
        self._arrived.set()


class RecordingTrunk(mux.Trunk):
    """A trunk that also lets a test write raw bytes on the socket, bypassing the mux framing."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.raw_transport = transport
        super().connection_made(transport)

    def write_raw(self, data: bytes) -> None:
        self.raw_transport.write(data)  # type: ignore[attr-defined]


@dataclass
class Connection:
    trunk: RecordingTrunk
    plugin: RawPluginChannel
    registered: asyncio.Future[api.RegisterPluginRequest]
    updates: list[api.ContainerUpdate] = field(default_factory=list)
    synchronized: api.SynchronizeResponse | None = None


class HostileRuntime:
    """The runtime side of NRI, minus all manners: see the module docstring."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.connections: list[Connection] = []
        # What every new connection is synchronized with.
        self.pods: list[api.PodSandbox] = []
        self.containers: list[api.Container] = []
        self._server: asyncio.AbstractServer | None = None
        self._new = asyncio.Event()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # left by an earlier runtime on this path
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._accept, str(self.path))

    async def close(self) -> None:
        # The connections first: from Python 3.12 on, `wait_closed` waits until each has gone.
        if self._server is not None:
            self._server.close()
        for connection in self.connections:
            connection.trunk.close()
        if self._server is not None:
            await self._server.wait_closed()

    def _accept(self) -> RecordingTrunk:
        trunk = RecordingTrunk()
        plugin = RawPluginChannel(functools.partial(trunk.send, mux.PLUGIN_SERVICE_CONN))
        trunk.channel(mux.PLUGIN_SERVICE_CONN, plugin)
        registered: asyncio.Future[api.RegisterPluginRequest] = asyncio.get_running_loop().create_future()
        connection = Connection(trunk, plugin, registered)

        async def register(request: api.RegisterPluginRequest, _ctx: object) -> api.Empty:
            if not registered.done():
                registered.set_result(request)
            return api.Empty()

        async def update(request: api.UpdateContainersRequest, _ctx: object) -> api.UpdateContainersResponse:
            connection.updates.extend(request.update)
            return api.UpdateContainersResponse()

        server = Server(
            {
                RUNTIME_SERVICE: {
                    "RegisterPlugin": UnaryMethod(api.RegisterPluginRequest, register),
                    "UpdateContainers": UnaryMethod(api.UpdateContainersRequest, update),
                }
            },
            functools.partial(trunk.send, mux.RUNTIME_SERVICE_CONN),
            close_channel=trunk.close,
        )
        trunk.channel(mux.RUNTIME_SERVICE_CONN, server)
        self.connections.append(connection)
        self._new.set()
        return trunk

    async def connected(self, count: int = 1) -> Connection:
        """The `count`-th connection, once its plugin has registered and been configured and synced."""

        async def wait() -> Connection:
            while len(self.connections) < count:
                self._new.clear()
                await self._new.wait()
            connection = self.connections[count - 1]
            await connection.registered
            reply = await connection.plugin.call(
                "Configure",
                api.ConfigureRequest(
                    runtime_name="containerd", runtime_version="v2.3.4", NRI_version="v0.12.0"
                ).SerializeToString(),
            )
            assert reply.ok, reply
            sync = api.SynchronizeRequest(pods=self.pods, containers=self.containers)
            reply = await connection.plugin.call("Synchronize", sync.SerializeToString())
            assert reply.ok, reply
            connection.synchronized = api.SynchronizeResponse.FromString(reply.payload)
            return connection

        return await asyncio.wait_for(wait(), BOUND)


def run_in(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], bound: float = BOUND) -> T:
    return loop.run_until_complete(asyncio.wait_for(coro, bound))


class Node:
    """The real plugin behind a real stub, a hostile runtime, a fake cgroup v1 tree, in `root`:

    ``root/node/cgroup`` the tree, ``root/node/state`` the state dir, ``root/node/nri.sock`` the
    socket, and ``root/outside`` a decoy beside it (a pod cgroup's files, out of the tree) that an
    escaping path would reach.
    """

    def __init__(
        self,
        root: Path,
        *,
        trust_pod_annotation: bool = False,
        trust_marker: bool = True,
        reconnect: bool = False,
        allocations: AllocationRecord | None = None,
    ) -> None:
        self.root = root
        base = root / "node"
        self.tree = FakeCgroups(base / "cgroup")
        self.state_dir = base / "state"
        self.socket = base / "nri.sock"
        decoy = root / "outside" / "kubepods" / "podvictim"
        decoy.mkdir(parents=True, exist_ok=True)
        (decoy / "cpu.cfs_quota_us").write_text("100000\n")
        (decoy / "cpu.cfs_period_us").write_text("100000\n")
        (decoy / "cpu.max").write_text("100000 100000\n")
        self.plugin, self.key = make_plugin(
            self.state_dir,
            self.tree.layout,
            trust_pod_annotation=trust_pod_annotation,
            trust_marker=trust_marker,
            allocations=allocations,
        )
        self.loop = asyncio.new_event_loop()
        # Exceptions nobody retrieved (a task that died, a callback that raised) end up here.
        self.loop_errors: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _loop, context: self.loop_errors.append(context))
        self.runtime = HostileRuntime(self.socket)
        self.stub: Stub | None = None
        self._task: asyncio.Task[None] | None = None
        self._reconnect = reconnect
        self.connection: Connection | None = None

    def run(self, coro: Coroutine[Any, Any, T], bound: float = BOUND) -> T:
        return run_in(self.loop, coro, bound)

    def __enter__(self) -> Node:
        self.run(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(self._stop(), 2 * BOUND)
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
        if exc[0] is None:
            assert self.loop_errors == [], self.loop_errors

    async def _start(self) -> None:
        await self.runtime.start()
        self.stub = Stub(
            self.plugin,
            identity=Identity(name="mixed-cpu", index="10"),
            socket_path=str(self.socket),
            reconnect=self._reconnect,
            backoff=Backoff(initial=0.01, maximum=0.05),
        )
        self._task = asyncio.ensure_future(self.stub.run())
        self.connection = await self.runtime.connected()

    async def _stop(self) -> None:
        assert self.stub is not None
        assert self._task is not None
        self.stub.stop()
        await asyncio.wait_for(self._task, BOUND)
        await self.runtime.close()
        # Let the closed transports finish (no ResourceWarning for an unclosed socket).
        await asyncio.sleep(0)
        self.plugin.flush()
        self.plugin.quotas.cancel_retries()

    async def next_connection(self) -> Connection:
        """The connection the stub makes after the current one closed (it reconnects)."""
        assert self.connection is not None
        self.connection = await self.runtime.connected(self.runtime.connections.index(self.connection) + 2)
        return self.connection

    @property
    def channel(self) -> RawPluginChannel:
        assert self.connection is not None
        return self.connection.plugin

    async def call(self, method: str, message: Any) -> Reply:
        payload = message if isinstance(message, bytes) else message.SerializeToString()
        return await self.channel.call(method, payload)

    # -- the pods a test starts from ------------------------------------------------------------------

    def pod(self, uid: str, name: str = "app", quota: int | None = 2 * PERIOD) -> api.PodSandbox:
        pod = make_pod(NAMING, uid, name=name)
        self.tree.add_pod(pod, quota)
        return pod

    def container(self, pod: api.PodSandbox, cid: str, name: str = "main", **kw: Any) -> api.Container:
        return make_container(NAMING, pod, cid, name, **kw)

    def marker(self, device: str) -> dict[str, str]:
        return marker(self.key, device)

    async def create(self, pod: api.PodSandbox, container: api.Container) -> Reply:
        return await self.call("CreateContainer", api.CreateContainerRequest(pod=pod, container=container))

    def running(self, pod: api.PodSandbox, container: api.Container, reply: Reply) -> None:
        """The runtime ran the container as the plugin adjusted it: later Synchronizes list it."""
        adjust = api.CreateContainerResponse.FromString(reply.payload).adjust if reply.ok else None
        apply_adjustment(container, adjust).state = api.CONTAINER_RUNNING
        self.runtime.pods.append(pod)
        self.runtime.containers.append(container)

    async def healthy(self) -> None:
        """A valid request right after: the connection still serves (a plain container, left alone)."""
        probe_pod = make_pod(NAMING, "probe-0000", name="probe")
        probe = make_container(NAMING, probe_pod, "probe-c", "probe")
        reply = await self.create(probe_pod, probe)
        assert reply.ok, reply
        assert api.CreateContainerResponse.FromString(reply.payload) == api.CreateContainerResponse()


def granted(method: str, reply: Reply) -> bool:
    """Did this reply give some container the shared CPUs (cpus, quota or env changed)?"""
    if not reply.ok or not reply.payload:
        return False
    if method == "CreateContainer":
        adjust = api.CreateContainerResponse.FromString(reply.payload).adjust
        return bool(
            adjust.linux.resources.cpu.cpus or adjust.env or adjust.linux.resources.cpu.HasField("quota")
        )
    response_types: dict[str, Any] = {
        "Synchronize": api.SynchronizeResponse,
        "UpdateContainer": api.UpdateContainerResponse,
        "StopContainer": api.StopContainerResponse,
    }
    if method in response_types:
        return bool(response_types[method].FromString(reply.payload).update)
    return False


# -- file-system snapshots ------------------------------------------------------------------------------

Entry = tuple[str, bytes | str | None, int, int]


def snapshot(root: Path, *, skip: Callable[[Path], bool] = lambda _p: False) -> dict[str, Entry]:
    """Every path below `root` (and `root`): kind, content (files, symlink targets), mode, mtime."""
    seen: dict[str, Entry] = {}
    for directory, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(directory)
        for name in [*dirnames, *filenames, ""]:
            path = base / name if name else base
            if skip(path) or str(path) in seen:
                continue
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                entry: Entry = ("link", os.readlink(path), info.st_mode, info.st_mtime_ns)
            elif stat.S_ISREG(info.st_mode):
                entry = ("file", path.read_bytes(), info.st_mode, info.st_mtime_ns)
            elif stat.S_ISDIR(info.st_mode):
                entry = ("dir", None, info.st_mode, info.st_mtime_ns)
            else:
                entry = ("other", None, info.st_mode, info.st_mtime_ns)
            seen[str(path)] = entry
    return seen


def top_level(directory: Path) -> dict[str, int]:
    """The names directly in `directory` with their mtimes (for the parent of a test's directory)."""
    return {entry.name: entry.stat(follow_symlinks=False).st_mtime_ns for entry in os.scandir(directory)}


def diff(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    changes = [f"removed {p}" for p in before.keys() - after.keys()]
    changes += [f"created {p}" for p in after.keys() - before.keys()]
    changes += [f"changed {p}" for p in before.keys() & after.keys() if before[p] != after[p]]
    return sorted(changes)


def state_file_skip(node: Node) -> Callable[[Path], bool]:
    """The plugin rewrites its own state file on a timer (it keeps the books, not the pods'
    cgroups); every other path must stay as it was."""
    state = node.state_dir

    def skip(path: Path) -> bool:
        return path == state or (path.parent == state and "books.sqlite" in path.name)

    return skip


def other_node_key() -> HostKey:
    return HostKey(bytes(range(32)))


__all__ = [
    "BOUND",
    "ERROR_CODES",
    "NAMING",
    "PERIOD",
    "Connection",
    "HostileRuntime",
    "MixedCpuPlugin",
    "Node",
    "RawPluginChannel",
    "Reply",
    "diff",
    "granted",
    "other_node_key",
    "run_in",
    "snapshot",
    "state_file_skip",
    "top_level",
]
