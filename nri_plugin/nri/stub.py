"""The plugin side of NRI: connect, register, configure, synchronize, serve events, reconnect.

The stub knows the protocol and nothing of any policy. A plugin is any object implementing some of
the handler protocols of `nri_plugin.nri.handlers` (``create_container``, ``update_container``, ...;
best by subclassing them, so mypy checks the signatures). The stub finds them with ``isinstance``
through the table of `nri_plugin.nri.routes`, subscribes to exactly those events (limited to what the
runtime accepts), and answers each request through the row's typed call. Methods the plugin lacks are
answered with status 12 (Unimplemented), which NRI v0.12 runtimes take as "use StateChange instead".

A handler refuses a request by raising one of `nri_plugin.nri.errors`: the runtime gets that status
code and the message. Any other exception is answered as the ttrpc server answers it (Unknown).

The connection goes through the states of `nri_plugin.nri.connection` (``stub.state``); its waits
run on an injected `Clock`, its reconnects are paced by one `Backoff`, reset by every registration.

The runtime is a peer, not a master of our memory: the chunks of one Synchronize are gathered only up
to `max_sync_bytes` (`DEFAULT_MAX_SYNC_BYTES`, the config's ``max_synchronize_mib``), counted at what
they cost in memory, not only their bytes (`SYNC_CHUNK_COST`, `SYNC_OBJECT_COST`: a 7-byte chunk
holding one pod costs some 550 bytes), and in at most `SYNC_CHUNKS_PER_MIB` chunks per MiB of it. A
runtime that sends more (say, ``more=true`` without end, in chunks large or tiny) gets
ResourceExhausted, the connection is dropped, what it sent is let go and the heap's free memory given
back to the system; the stub then reconnects as after any lost connection.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import structlog
from google.protobuf.message import DecodeError

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.common import heap
from nri_plugin.common.backoff import Backoff
from nri_plugin.common.clock import LOOP_CLOCK, Clock, sleep_unless
from nri_plugin.nri import handlers, mux
from nri_plugin.nri.connection import ConnectionMachine, ConnectionState
from nri_plugin.nri.errors import PluginRefusal
from nri_plugin.nri.events import Event, events_in, mask_of, valid_events
from nri_plugin.nri.identity import DEFAULT_SOCKET_PATH, Identity
from nri_plugin.nri.routes import (
    CONFIGURE,
    EVENT_LABELS,
    EVENT_ROUTES,
    METHOD_LABELS,
    SHUTDOWN,
    STATE_CHANGE,
    SYNCHRONIZE,
    Call,
    Deliver,
)
from nri_plugin.nri.unreachable import ConnectWarnings, why_unreachable
from nri_plugin.ttrpc import wire
from nri_plugin.ttrpc.aio import CallContext, Client, Server, UnaryMethod, decode_payload
from nri_plugin.ttrpc.errors import Code, ConnectionClosed, TtrpcError

__all__ = [
    "DEFAULT_MAX_SYNC_BYTES",
    "DEFAULT_SOCKET_PATH",
    "PLUGIN_SERVICE",
    "RUNTIME_SERVICE",
    "SYNC_CHUNKS_PER_MIB",
    "SYNC_CHUNK_COST",
    "SYNC_OBJECT_COST",
    "AfterReply",
    "ConnectionState",
    "LostConnection",
    "RuntimeInfo",
    "Stub",
    "StubError",
    "StubObserver",
    "SyncFilter",
    "SyncSelector",
]

log = structlog.get_logger("nri_plugin.nri.stub")

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
# NRI_version we announce in RegisterPlugin: the API level our .proto files describe.
NRI_VERSION = "v0.12.2"
DEFAULT_REGISTRATION_TIMEOUT = 5.0
DEFAULT_REQUEST_TIMEOUT = 2.0
# The reconnect pacing when none is given: 0.1 s after a lost connection, doubling up to 5 s.
DEFAULT_BACKOFF_INITIAL = 0.1
DEFAULT_BACKOFF_MAX = 5.0
# The most one Synchronize may bring, all chunks together (serialized size). 5,000 containers with
# realistic env, mounts and annotations take 7.3 MB (docs/performance.md); the plugin's memory at
# this cap stays well under the DaemonSet's 256 Mi limit.
DEFAULT_MAX_SYNC_BYTES = 32 << 20
# What a Synchronize chunk holds in memory beyond its bytes until the last chunk comes, counted with
# the bytes against max_sync_bytes. Measured (RSS over 100,000 chunks): a chunk of one 7-byte pod,
# 550 B (the pod's own arena); 100,000 pods in one chunk, 414 B each; a chunk of kept containers, some
# 75 B beyond their bytes (they are kept as bytes). So: 128 B a chunk, and 448 B a pod (or a container
# kept parsed, when a chunk is decoded whole).
SYNC_CHUNK_COST = 128
SYNC_OBJECT_COST = 448
# The most chunks one Synchronize may come in, per MiB of max_sync_bytes (4,096 at the default 32
# MiB), whatever they weigh: endless tiny chunks are dropped within that many (a few MiB), not at
# the byte cap. NRI splits a Synchronize only when it exceeds the 4 MiB message limit, fills each
# chunk up to that limit, and never puts fewer than 8 objects in a chunk but the last: 4,096 chunks
# carry at least 32,000 pods and containers.
SYNC_CHUNKS_PER_MIB = 128
# How long after a dropped oversized Synchronize the heap's free memory is given back (the chunks
# are let go once the handler has returned).
_RELEASE_DELAY = 0.1

S = ConnectionState
T = TypeVar("T")
Handler = Callable[[Any, CallContext], Awaitable[Any]]


class StubError(Exception):
    """The stub cannot run as configured (a plugin without handlers, ...)."""


class StubObserver(Protocol):
    """Told of every request the stub answers and of every lost connection (`nri_plugin.daemon.metrics`)."""

    def request_done(self, event: str, outcome: str, seconds: float) -> None:
        """`event`: ``configure``, ``synchronize``, ``shutdown``, a handler name (``create_container``)
        or ``unknown``; `outcome`: ``ok``, ``error`` or ``cancelled``."""

    def reconnecting(self) -> None:
        """The connection to the runtime was lost; the stub connects again."""

    def synchronized(self, pods: int, containers: int, size: int, seconds: float) -> None:
        """A Synchronize ended well: the pods and containers the runtime listed, its `size` in bytes
        (all of its chunks), and the `seconds` it took, from its first chunk to the answer."""


# Whether the plugin's `synchronize` must see a container, given its pod (None: not come yet).
SyncFilter = Callable[[api.PodSandbox | None, api.Container], bool]


@runtime_checkable
class SyncSelector(Protocol):
    """What a plugin may add to its `handlers.Synchronize`: which containers it needs to see.

    A Synchronize then keeps, from one chunk to the next, every pod and only the containers the
    plugin needs, each parsed on its own from the chunk's bytes, so that no chunk is ever parsed
    whole (a 4 MiB chunk parses into some 9 MiB). A plugin without it gets every container."""

    def sync_filter(self) -> Callable[[api.PodSandbox | None, api.Container], bool]:
        """For one chunk: whether `synchronize` must see a container (given its pod, None when no
        chunk has brought it yet). Asked once per chunk, so the plugin reads its settings once."""


@runtime_checkable
class AfterReply(Protocol):
    """What a plugin may add to its handlers: work done once each reply has gone to the runtime.

    The stub calls `after_reply` right after it has written each reply, in the same turn of the
    event loop (no turn of its own, and the runtime is not kept waiting): for what nothing waits
    for, such as a log line about what the handler did."""

    def after_reply(self) -> None:
        """Do what waits for the reply (it must not raise: what it raises is only logged)."""


@dataclass
class RuntimeInfo:
    """What the runtime told us in Configure."""

    name: str = ""
    version: str = ""
    nri_version: str = ""
    registration_timeout: float = DEFAULT_REGISTRATION_TIMEOUT
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    events: int = 0


@dataclass(frozen=True)
class LostConnection:
    """Why the last connection to the runtime ended, and when (wall time, `time.time()`)."""

    cause: str
    at: float


@dataclass(frozen=True)
class _PluginHandlers:
    """A plugin's handlers, found once through the handler protocols and bound to the plugin."""

    configure: handlers.Configure | None
    synchronize: handlers.Synchronize | None
    select: SyncSelector | None
    shutdown: handlers.Shutdown | None
    after_reply: AfterReply | None
    # Every event the plugin handles: its request as its own method...
    calls: Mapping[Event, Call[Any, Any]]
    # ... and, for the StateChange-class ones, as a StateChange carries it.
    notifiers: Mapping[Event, Deliver]

    @classmethod
    def of(cls, plugin: object) -> _PluginHandlers:
        calls: dict[Event, Call[Any, Any]] = {}
        notifiers: dict[Event, Deliver] = {}
        for event, route in EVENT_ROUTES.items():
            call = route.bind(plugin)
            if call is not None:
                calls[event] = call
            notify = route.bind_notify(plugin)
            if notify is not None:
                notifiers[event] = notify
        return cls(
            configure=plugin if isinstance(plugin, handlers.Configure) else None,
            synchronize=plugin if isinstance(plugin, handlers.Synchronize) else None,
            select=plugin if isinstance(plugin, SyncSelector) else None,
            shutdown=plugin if isinstance(plugin, handlers.Shutdown) else None,
            after_reply=plugin if isinstance(plugin, AfterReply) else None,
            calls=calls,
            notifiers=notifiers,
        )

    @property
    def subscribed(self) -> int:
        return mask_of(self.calls)


@dataclass
class _Session:
    """What one connection to the runtime gathers: the chunks of a Synchronize under way.

    A new one for every connection, bound into that connection's handlers: a chunk can only ever
    join the other chunks of its own connection, whatever order the old connection's handlers and
    the new connection run in.
    """

    pods: list[api.PodSandbox] = field(default_factory=list)
    # Containers as parsed (`gather`), or, from each chunk `gather_bytes` took apart, the fields of
    # those kept, as received, one after the other (parsed by `take`).
    containers: list[api.Container | bytearray] = field(default_factory=list)
    # Bytes of the chunks gathered so far, as received (their ttrpc envelopes included).
    size: int = 0
    # The chunks gathered so far, and what they hold in memory (their bytes and the objects kept
    # parsed, as `SYNC_CHUNK_COST` and `SYNC_OBJECT_COST` count them).
    chunks: int = 0
    cost: int = 0
    # Containers the chunks brought, those not kept included.
    seen: int = 0
    # When the Synchronize under way began (`time.perf_counter`, at its first chunk).
    started: float = 0.0
    # Where the connection was when the synchronization began: where a failed one goes back to.
    before_sync: ConnectionState = ConnectionState.CONFIGURED
    # The pods gathered so far by sandbox id (by `gather_bytes`, for its `select`).
    _by_sandbox: dict[str, api.PodSandbox] = field(default_factory=dict)

    def gather(self, request: api.SynchronizeRequest) -> None:
        """Add one chunk, its objects as they are (and so the whole chunk, kept with them)."""
        self.seen += len(request.containers)
        self.pods.extend(request.pods)
        self.containers.extend(request.containers)
        self.cost += (len(request.pods) + len(request.containers)) * SYNC_OBJECT_COST

    def gather_bytes(self, data: bytes | memoryview, select: SyncFilter) -> bool | None:
        """Add one chunk from its bytes (`_Apart`), so that it is never parsed whole (a 4 MiB chunk
        parses into some 9 MiB): its pods, and the containers `select` needs; the others are
        dropped as soon as they are looked at. Whether more chunks are to come; None, with nothing
        added, when the bytes are not plainly well formed (`wire.each_field`)."""
        apart = _Apart(memoryview(data), select, dict(self._by_sandbox))
        try:
            if not apart.take_apart():
                return None
        except (DecodeError, wire.Malformed):
            return None
        self.seen += apart.seen
        self.pods.extend(apart.pods)
        self.cost += len(apart.pods) * SYNC_OBJECT_COST
        if apart.kept:
            self.containers.append(apart.kept)
        self._by_sandbox = apart.by_sandbox
        return apart.more

    def take(self) -> tuple[list[api.PodSandbox], list[api.Container]]:
        """All the chunks so far, joined, the containers kept as bytes parsed (those of one chunk
        together); the next Synchronize starts afresh."""
        pods, gathered = self.pods, self.containers
        self.pods, self.containers, self.size, self.seen = [], [], 0, 0
        self.chunks = self.cost = 0
        self._by_sandbox = {}
        containers: list[api.Container] = []
        gathered.reverse()
        while gathered:
            item = gathered.pop()  # each chunk's bytes let go once parsed
            if isinstance(item, bytearray):
                containers.extend(api.SynchronizeRequest.FromString(cast(bytes, item)).containers)
            else:
                containers.append(item)
        return pods, containers


class _Apart:
    """One Synchronize chunk taken apart, field by field (`take_apart`), from its bytes `view`.

    Pods are parsed a run at a time: consecutive pod fields are consecutive bytes, a
    ``SynchronizeRequest`` of those pods alone, parsed in one go into one arena, which takes some
    40% less memory than each pod parsed on its own; a run ends at the first other field, so a
    container finds every pod that came before it (`by_sandbox`). Each container is parsed on its
    own for `select`; one kept is kept as its field's bytes, appended to `kept` (a
    ``SynchronizeRequest`` of the containers kept): parsed, a container is four times its bytes,
    and the containers of the first chunks would be held parsed while the next chunk arrives.
    """

    def __init__(self, view: memoryview, select: SyncFilter, by_sandbox: dict[str, api.PodSandbox]) -> None:
        self.view = view
        self.select = select
        self.by_sandbox = by_sandbox
        self.pods: list[api.PodSandbox] = []
        self.kept = bytearray()
        self.seen = 0
        self.more = False
        # The run of pod fields not parsed yet: where it starts (None: no run) and ends.
        self._run_start: int | None = None
        self._run_end = 0

    def take_apart(self) -> bool:
        """Every field of the chunk, one at a time (no list of a chunk's thousands); False for a
        field of the request's with another wire type than its own (the chunk is then not plainly
        well formed); raises `DecodeError` for an object the decoder refuses and `wire.Malformed`.
        A field the request does not know is skipped, as protobuf does."""
        for number, wire_type, start, begin, end in wire.each_field(self.view):
            if number == _SYNC_PODS:
                if wire_type != wire.LEN:
                    return False
                self._add_pod(start, end)
                continue
            self.end_of_pods()
            if number == _SYNC_CONTAINERS:
                if wire_type != wire.LEN:
                    return False
                self._add_container(start, begin, end)
            elif number == _SYNC_MORE:
                if wire_type != wire.VARINT:
                    return False
                self.more = bool(wire.varint(self.view, begin)[0])
        self.end_of_pods()
        return True

    def _add_pod(self, start: int, end: int) -> None:
        """A pod field, the bytes ``view[start:end]``: it starts a run of pods or extends the run
        (the field before it was a pod too, so the run ends where this one starts)."""
        if self._run_start is None:
            self._run_start = start
        self._run_end = end

    def _add_container(self, start: int, begin: int, end: int) -> None:
        """A container field (its value at ``view[begin:end]``): parsed, counted, and kept as its
        field's bytes if `select` wants it."""
        self.seen += 1
        container = _parse_container(self.view[begin:end])
        if self.select(self.by_sandbox.get(container.pod_sandbox_id), container):
            self.kept += self.view[start:end]

    def end_of_pods(self) -> None:
        """Parse the run of pods the last fields were, if any."""
        if self._run_start is None:
            return
        run = self.view[self._run_start : self._run_end]
        self._run_start = None
        for pod in api.SynchronizeRequest.FromString(cast(bytes, run)).pods:
            self.pods.append(pod)
            self.by_sandbox[pod.id] = pod


class Stub:
    """Runs one plugin against one runtime, reconnecting when the runtime restarts.

    `backoff` paces the reconnects (default: 0.1 s doubling up to 5 s, with jitter); `clock` runs the
    waits (virtual time in tests); `observer` is told of every request and lost connection. Set
    `registration_timeout` before `run()` to wait longer than 5 s for RegisterPlugin's reply, and
    `max_sync_bytes` to take a Synchronize larger than 32 MiB (see the module docstring).
    """

    def __init__(
        self,
        plugin: object,
        *,
        identity: Identity,
        socket_path: str = DEFAULT_SOCKET_PATH,
        reconnect: bool = True,
        backoff: Backoff | None = None,
        observer: StubObserver | None = None,
        clock: Clock = LOOP_CLOCK,
    ) -> None:
        self.plugin = plugin
        # The most one Synchronize may bring (see the module docstring); set it before `run()`.
        self.max_sync_bytes = DEFAULT_MAX_SYNC_BYTES
        # Read when a connection starts: set it before `run()`.
        self.observer = observer
        self.identity = identity
        self.socket_path = socket_path
        # The connection a launching runtime handed over (`Identity.inherited_fd`), until it is used.
        self.inherited_fd = identity.inherited_fd
        self.reconnect = reconnect and self.inherited_fd is None
        self.registration_timeout = DEFAULT_REGISTRATION_TIMEOUT
        self.backoff = backoff or Backoff(DEFAULT_BACKOFF_INITIAL, DEFAULT_BACKOFF_MAX)
        self.clock = clock
        self._connect_warnings = ConnectWarnings(clock)
        self._handlers = _PluginHandlers.of(plugin)
        if not self._handlers.calls and self._handlers.synchronize is None:
            raise StubError(f"{type(plugin).__name__} defines no NRI handler (e.g. create_container)")
        self.runtime = RuntimeInfo()
        self.connections = 0
        self.synchronizations = 0
        self.connected_since: float | None = None  # wall time the live connection was opened
        # The last connection that ended (not by stop()): why and when; None before any.
        self.lost: LostConnection | None = None
        self._drop_cause: str | None = None  # why the stub itself is closing the live connection
        # `clock.monotonic()` since which the stub has been neither serving (READY) nor waiting by
        # design (BACKING_OFF, STOPPED): see `stalled_for`.
        self._stalled_since: float | None = None
        self._machine = ConnectionMachine()
        # Set while synchronized with a live runtime (from READY until the connection ends).
        self.ready = asyncio.Event()
        self._stopped = asyncio.Event()
        # Set while no runtime request is being handled: unsolicited updates wait for it.
        # Runtime requests being handled; unsolicited updates wait in `_idle_waiters` until there
        # are none (`_idle`). Futures, not an asyncio.Event: a request then costs two additions and
        # one test, not an Event's clear() and set() (see `_handling`).
        self._busy = 0
        self._idle_waiters: list[asyncio.Future[None]] = []
        self._state_waiters: list[tuple[frozenset[ConnectionState], asyncio.Future[ConnectionState]]] = []
        self._session: _Session | None = None
        self._trunk: mux.Trunk | None = None
        self._client: Client | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        # Requests answered whose observation waits for the reply to go out: (event, outcome, seconds).
        self._observed: list[tuple[str, str, float]] = []

    @property
    def subscribed(self) -> int:
        """The events the plugin handles, before the runtime's limits."""
        return self._handlers.subscribed

    # -- the connection's state --------------------------------------------------------------------

    @property
    def state(self) -> ConnectionState:
        return self._machine.state

    @property
    def stopping(self) -> bool:
        return self.state is S.STOPPED

    @property
    def stalled_for(self) -> float:
        """Seconds the stub has been neither serving the runtime (READY) nor waiting by design
        between attempts (BACKING_OFF) nor stopped; 0 when it is one of those.

        It counts from the start of a connection attempt (or from leaving READY) and is reset when
        the attempt reaches READY or ends (the wait before the next one). An attempt takes
        milliseconds, at most the registration timeout when the runtime is slow; the hang-up of a
        lost connection at most the trunk's `mux.CLOSE_FLUSH_TIMEOUT`. A large value means the
        connection is stuck: a runtime that registered the plugin but does not configure or
        synchronize it, or a hang-up that never ends (``/healthz`` fails on it).
        """
        if self._stalled_since is None:
            return 0.0
        return max(0.0, self.clock.monotonic() - self._stalled_since)

    async def wait_for_state(self, *states: ConnectionState) -> ConnectionState:
        """Wait until the connection enters one of `states` (at once if it is in one); that state."""
        if self.state in states:
            return self.state
        waiter: asyncio.Future[ConnectionState] = asyncio.get_running_loop().create_future()
        self._state_waiters.append((frozenset(states), waiter))
        return await waiter

    def _enter(self, target: ConnectionState) -> None:
        """Move to `target` (`IllegalTransition` if the table forbids it) and keep the events in step."""
        self._machine.move(target)
        if target in (S.READY, S.BACKING_OFF, S.STOPPED):
            self._stalled_since = None
        elif self._stalled_since is None:
            self._stalled_since = self.clock.monotonic()
        if target is S.READY:
            self.ready.set()
        elif target in (S.DISCONNECTED, S.STOPPED):
            self.ready.clear()
        self._wake_if_idle()
        waiting, self._state_waiters = self._state_waiters, []
        for states, waiter in waiting:
            if waiter.done():
                continue
            if target in states:
                waiter.set_result(target)
            else:
                self._state_waiters.append((states, waiter))

    def _current(self, session: _Session) -> bool:
        """`session` is the live connection's (not an old one's, nor one served by hand)."""
        return session is self._session and self._machine.connected

    # -- lifecycle ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until ``stop()``; reconnect with backoff when the runtime goes away (if enabled)."""
        while not self.stopping:
            delay = await self._attempt()
            if delay is None:
                return
            await self._back_off(delay)

    async def _attempt(self) -> float | None:
        """Connect and, if that works, serve the connection until it ends; the wait before the next
        attempt, or None when there is to be none (stopped, or no reconnects)."""
        opened = await self._open()
        if self.stopping:
            if not isinstance(opened, OSError):
                opened.close()
            return None
        if isinstance(opened, OSError):
            delay = self.backoff.next()
            self._connect_warnings.failed(self.socket_path, opened, delay)
            return delay
        self._connect_warnings.connected()
        if await self._serve(opened):
            self.backoff.reset()
        if self.stopping or not self.reconnect:
            return None
        delay = self.backoff.next()
        log.warning(
            "nri connection lost, reconnecting",
            socket=self.socket_path,
            cause=self.lost.cause if self.lost is not None else None,
            retry_in=round(delay, 2),
        )
        if self.observer is not None:
            self.observer.reconnecting()
        return delay

    def stop(self) -> None:
        if self.stopping:
            return
        self._enter(S.STOPPED)
        self._stopped.set()
        if self._trunk is not None:
            self._trunk.close()

    async def _back_off(self, delay: float) -> None:
        if self.stopping:  # an observer may have stopped us
            return
        self._enter(S.BACKING_OFF)
        await sleep_unless(self.clock, self._stopped, delay)

    async def _open(self) -> mux.Trunk | OSError:
        """A connected trunk, or why there is none (then DISCONNECTED; StubError without reconnects)."""
        self._enter(S.CONNECTING)
        try:
            trunk = await self._connect()
        except OSError as exc:
            self._disconnected()
            if not self.reconnect:
                why = why_unreachable(self.socket_path, exc)
                raise StubError(
                    f"cannot connect to the NRI socket {self.socket_path}: {why.cause}; check {why.check}"
                ) from exc
            return exc
        return trunk

    async def _connect(self) -> mux.Trunk:
        if self.inherited_fd is not None:
            sock = socket.socket(fileno=self.inherited_fd)
            self.inherited_fd = None  # one use only: the fd belongs to the trunk now
            return await mux.adopt_socket(sock)
        return await mux.open_unix(self.socket_path)

    def _disconnected(self) -> None:
        if not self.stopping:
            self._enter(S.DISCONNECTED)

    async def _serve(self, trunk: mux.Trunk) -> bool:
        """One connection: register, then serve until it closes. True if registration succeeded."""
        self.connections += 1
        self.connected_since = time.time()
        session = self._session = _Session()
        self._enter(S.REGISTERING)
        self._drop_cause = None
        broken = functools.partial(self._drop, trunk, "the runtime broke the ttrpc protocol (see the log)")
        server = self.server(functools.partial(trunk.send, mux.PLUGIN_SERVICE_CONN), session, broken)
        trunk.channel(mux.PLUGIN_SERVICE_CONN, server)
        client = Client(functools.partial(trunk.send, mux.RUNTIME_SERVICE_CONN), close_channel=broken)
        trunk.channel(mux.RUNTIME_SERVICE_CONN, client)
        self._trunk, self._client = trunk, client
        registered = False
        try:
            registered = await self._register(client)
            if registered:
                # Until the connection is lost: the trunk tells its receivers at once, while the
                # socket itself may take up to its close_timeout to close (`_hang_up` waits for it).
                await client.wait_closed()
                self._lost(trunk)
        finally:
            await self._hang_up(trunk, server)
        return registered

    def _drop(self, trunk: mux.Trunk, cause: str) -> None:
        """Close the live connection ourselves, for `cause` (what `lost` will say)."""
        if not trunk.closing:
            self._drop_cause = cause
        trunk.close()

    def _lost(self, trunk: mux.Trunk, cause: str | None = None) -> None:
        """Record why and when the connection ended (not when stop() ended it)."""
        if self.stopping:
            return
        if cause is None:
            if self._drop_cause is not None:
                cause = self._drop_cause
            elif trunk.exception is not None:
                cause = f"{type(trunk.exception).__name__}: {trunk.exception}"
            else:
                cause = "the runtime closed the connection"
        self.lost = LostConnection(cause, time.time())

    async def _register(self, client: Client) -> bool:
        try:
            await client.call(
                RUNTIME_SERVICE,
                "RegisterPlugin",
                api.RegisterPluginRequest(
                    plugin_name=self.identity.name, plugin_idx=self.identity.index, NRI_version=NRI_VERSION
                ),
                api.Empty,
                timeout=self.registration_timeout,
            )
        except (TtrpcError, ConnectionClosed) as exc:
            log.error("nri registration failed", plugin=self.identity.full_name, error=str(exc))
            if self._trunk is not None:
                self._lost(self._trunk, f"registration failed: {exc}")
            return False
        log.info("registered with the runtime", plugin=self.identity.full_name, socket=self.socket_path)
        if self.state is S.REGISTERING:  # else Configure came first
            self._enter(S.REGISTERED)
        return True

    async def _hang_up(self, trunk: mux.Trunk, server: Server) -> None:
        """End the connection: from here on its handlers change nothing of the stub's state."""
        self._session = None
        self._client = None
        self._trunk = None
        self.connected_since = None
        self._disconnected()
        trunk.close()
        server.close()
        await server.wait_closed()
        await trunk.wait_closed()  # within the trunk's close_timeout, however the peer behaves

    # -- unsolicited updates -----------------------------------------------------------------------

    def update_containers(
        self, updates: Iterable[api.ContainerUpdate]
    ) -> asyncio.Task[list[api.ContainerUpdate]]:
        """Send updates to the runtime once no runtime request is being handled.

        Returns a task giving the updates the runtime failed to apply. The runtime holds its lock for
        the whole event, so a handler must never await this task: it would wait on itself.
        """
        task = asyncio.ensure_future(self._send_updates(list(updates)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _send_updates(self, updates: list[api.ContainerUpdate]) -> list[api.ContainerUpdate]:
        while not self._idle():
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._idle_waiters.append(waiter)
            await waiter
        if self._trunk is not None:
            await self._trunk.drain()  # not one more message onto a backlog the runtime does not read
        client = self._client
        if client is None:
            raise ConnectionClosed("not connected to the runtime")
        reply = await client.call(
            RUNTIME_SERVICE,
            "UpdateContainers",
            api.UpdateContainersRequest(update=updates),
            api.UpdateContainersResponse,
            timeout=self.runtime.request_timeout,
        )
        return list(reply.failed)

    def _idle(self) -> bool:
        """No runtime request is being handled. A chunked Synchronize counts as one long request,
        from its first chunk to the plugin's answer."""
        return self._busy == 0 and self.state is not S.SYNCHRONIZING

    def _wake_if_idle(self) -> None:
        """Let the unsolicited updates waiting for idleness go, if it has come."""
        if self._idle_waiters and self._idle():
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    # -- the Plugin service ------------------------------------------------------------------------

    def server(
        self,
        send: Callable[[bytes], None],
        session: _Session | None = None,
        broken: Callable[[], None] | None = None,
    ) -> Server:
        """The ttrpc server of the Plugin service for one connection, replies going to `send` (a
        detached session when served by hand); after each reply, the requests' observations go to
        the observer and the plugin's `AfterReply` runs."""
        methods = {PLUGIN_SERVICE: self._methods(session)}
        return Server(methods, send, close_channel=broken, after_reply=self._after_reply)

    def _after_reply(self) -> None:
        observed = self._observed  # (the handlers' wrappers hold this list: emptied, not replaced)
        if observed:
            taken = observed.copy()
            observed.clear()
            if self.observer is not None:
                for event, outcome, seconds in taken:
                    self.observer.request_done(event, outcome, seconds)
        if self._handlers.after_reply is not None:
            self._handlers.after_reply.after_reply()

    def _methods(self, session: _Session | None = None) -> dict[str, UnaryMethod[Any, Any]]:
        """The Plugin service for one connection (`session`; a detached one when served by hand)."""
        session = session if session is not None else _Session()
        methods: dict[str, UnaryMethod[Any, Any]] = {
            CONFIGURE.method: UnaryMethod(CONFIGURE.request_type, self._configure_for(session)),
            SYNCHRONIZE.method: UnaryMethod(
                SYNCHRONIZE.request_type, functools.partial(self._synchronize, session), raw=True
            ),
            SHUTDOWN.method: UnaryMethod(SHUTDOWN.request_type, self._shutdown),
            STATE_CHANGE: UnaryMethod(api.StateChangeEvent, self._state_change),
        }
        for event, call in self._handlers.calls.items():
            route = EVENT_ROUTES[event]
            methods[route.method] = UnaryMethod(route.request_type, self._serving(call))
        observer = self.observer
        if observer is not None:
            for method, unary in list(methods.items()):
                label = _state_change_label if method == STATE_CHANGE else METHOD_LABELS[method]
                methods[method] = UnaryMethod(
                    unary.request_type, _observed(self._observed, label, unary.handler), raw=unary.raw
                )
        return methods

    async def _handling(self, work: Awaitable[T]) -> T:
        """Await one plugin handler: the stub is busy meanwhile (unsolicited updates wait for the
        reply), and a refusal becomes the ttrpc status it names."""
        self._busy += 1
        try:
            return await work
        except PluginRefusal as exc:
            raise TtrpcError(exc.code, str(exc)) from exc
        finally:
            self._busy -= 1
            if self._idle_waiters:
                self._wake_if_idle()

    def _serving(self, call: Call[Any, Any]) -> Handler:
        async def handle(request: Any, _ctx: CallContext) -> Any:
            return await self._handling(call(request))

        return handle

    def _configure_for(self, session: _Session) -> Handler:
        async def configure(request: api.ConfigureRequest, ctx: CallContext) -> api.ConfigureResponse:
            reply = await self._configure(request, ctx)
            if self._current(session) and self.state in (S.REGISTERING, S.REGISTERED):
                self._enter(S.CONFIGURED)
            return reply

        return configure

    async def _configure(self, request: api.ConfigureRequest, _ctx: object) -> api.ConfigureResponse:
        accepted = valid_events(
            nri_version=request.NRI_version,
            runtime_name=request.runtime_name,
            runtime_version=request.runtime_version,
        )
        events = self.subscribed & accepted
        dropped = events_in(self.subscribed & ~accepted)
        if dropped:
            log.warning(
                "runtime does not support some events; not subscribing to them",
                runtime=request.runtime_name,
                runtime_version=request.runtime_version,
                events=[event.name for event in dropped],
            )
        self.runtime = RuntimeInfo(
            name=request.runtime_name,
            version=request.runtime_version,
            nri_version=request.NRI_version,
            registration_timeout=(request.registration_timeout or 5000) / 1000,
            request_timeout=(request.request_timeout or 2000) / 1000,
            events=events,
        )
        if self._handlers.configure is not None:
            await self._handling(self._handlers.configure.configure(request))
        log.info(
            "configured",
            event_name="Configure",
            runtime=request.runtime_name,
            runtime_version=request.runtime_version,
            nri_version=request.NRI_version or "unknown",
            events=[event.name for event in events_in(events)],
        )
        # 0 would mean "every event" to the runtime: never send it for a real subscription.
        return api.ConfigureResponse(events=events)

    async def _synchronize(
        self, session: _Session, request: api.SynchronizeRequest | bytes | memoryview, ctx: CallContext
    ) -> api.SynchronizeResponse:
        """One chunk: `request` as received (undecoded: `_gather` decodes it and keeps only what the
        plugin needs), or a message when called by hand."""
        self._sync_began(session)
        if not session.chunks:
            session.started = time.perf_counter()
        # The bytes received, as the ttrpc server counted them: a chunk's ByteSize() would walk
        # all of its objects again (10 ms for a 4 MiB chunk).
        session.size += ctx.request_size
        session.chunks += 1
        session.cost += ctx.request_size + SYNC_CHUNK_COST
        if session.cost > self.max_sync_bytes or session.chunks > self.max_sync_chunks:
            raise self._sync_too_large(session)
        more = self._gather(session, request)
        del request  # what was not kept goes now, before the plugin works on what was
        if session.cost > self.max_sync_bytes:  # (the objects it held, parsed)
            raise self._sync_too_large(session)
        if self._handlers.select is not None:
            # The chunk's memory back to the system at once: the next chunk, or the plugin's work on
            # the whole, would otherwise come on top of it (glibc keeps what large frees leave).
            heap.release_free_memory()
        if more:
            return api.SynchronizeResponse(more=True)
        seen, size = session.seen, session.size
        pods, containers = session.take()
        try:
            updates = await self._synchronize_plugin(pods, containers)
        except BaseException:
            self._sync_ended(session, session.before_sync)
            raise
        self.synchronizations += 1
        self._sync_ended(session, S.READY)
        log.info(
            "synchronized",
            event_name="Synchronize",
            pods=len(pods),
            containers=seen,
            updates=len(updates),
        )
        if self.observer is not None:
            self.observer.synchronized(len(pods), seen, size, time.perf_counter() - session.started)
        return api.SynchronizeResponse(update=updates)

    def _gather(self, session: _Session, data: api.SynchronizeRequest | bytes | memoryview) -> bool:
        """Add one chunk to the session; whether more are to come. With the plugin's `SyncSelector`
        the chunk is taken apart from its bytes (`_Session.gather_bytes`); without, or when its bytes
        are not plainly well formed, it is decoded (or refused, as always) and kept whole. The bytes
        received are let go (a view of them released) as soon as that is done."""
        request = None
        if isinstance(data, api.SynchronizeRequest):  # served by hand
            request, data = data, data.SerializeToString()
        if self._handlers.select is not None:
            more = session.gather_bytes(data, self._handlers.select.sync_filter())
            if more is not None:
                _release(data)
                return more
        if request is None:
            request = decode_payload(api.SynchronizeRequest, data)
        _release(data)
        session.gather(request)
        return request.more

    @property
    def max_sync_chunks(self) -> int:
        """The most chunks one Synchronize may come in (`SYNC_CHUNKS_PER_MIB` of `max_sync_bytes`)."""
        return max(SYNC_CHUNKS_PER_MIB, self.max_sync_bytes * SYNC_CHUNKS_PER_MIB >> 20)

    def _sync_too_large(self, session: _Session) -> TtrpcError:
        """A Synchronize over `max_sync_bytes` or `max_sync_chunks`: its chunks let go, the connection
        dropped, the memory given back soon; the error to answer (if the answer still goes out)."""
        size, chunks, cost = session.size, session.chunks, session.cost
        session.take()
        self._sync_ended(session, session.before_sync)
        if chunks > self.max_sync_chunks:
            log.error(
                "Synchronize in more chunks than the plugin accepts: dropping the connection (a "
                "runtime fills its chunks up to 4 MiB; raise max_synchronize_mib, which allows "
                f"{SYNC_CHUNKS_PER_MIB} chunks per MiB, if the runtime really splits it that finely)",
                event_name="Synchronize",
                chunks=chunks,
                limit_chunks=self.max_sync_chunks,
                received_bytes=size,
            )
        else:
            log.error(
                "Synchronize larger than the plugin accepts: dropping the connection (raise "
                "max_synchronize_mib if the node really runs that much)",
                event_name="Synchronize",
                received_bytes=size,
                counted_bytes=cost,
                chunks=chunks,
                limit_bytes=self.max_sync_bytes,
            )
        if self._current(session) and self._trunk is not None:
            what = (
                f"in more than {self.max_sync_chunks} chunks"
                if chunks > self.max_sync_chunks
                else f"of more than {self.max_sync_bytes} bytes"
            )
            self._drop(self._trunk, f"the plugin dropped it: a Synchronize {what} (max_synchronize_mib)")
        asyncio.get_running_loop().call_later(_RELEASE_DELAY, heap.release_free_memory)
        if chunks > self.max_sync_chunks:
            return TtrpcError(
                Code.RESOURCE_EXHAUSTED,
                f"Synchronize in more than {self.max_sync_chunks} chunks refused: over the plugin's "
                "max_synchronize_mib",
            )
        return TtrpcError(
            Code.RESOURCE_EXHAUSTED,
            f"Synchronize of more than {self.max_sync_bytes} bytes refused: over the plugin's "
            "max_synchronize_mib",
        )

    def _sync_began(self, session: _Session) -> None:
        if self._current(session) and self.state is not S.SYNCHRONIZING:
            session.before_sync = self.state
            self._enter(S.SYNCHRONIZING)

    def _sync_ended(self, session: _Session, target: ConnectionState) -> None:
        """READY after a synchronization, back where it began after a failed one."""
        if self._current(session) and self.state is S.SYNCHRONIZING:
            self._enter(target)

    async def _synchronize_plugin(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        plugin = self._handlers.synchronize
        if plugin is None:
            return ()
        return await self._handling(plugin.synchronize(pods, containers)) or ()

    async def _shutdown(self, _request: api.Empty, _ctx: object) -> api.Empty:
        if self._handlers.shutdown is not None:
            await self._handling(self._handlers.shutdown.shutdown())
        return api.Empty()

    async def _state_change(self, request: api.StateChangeEvent, _ctx: object) -> api.Empty:
        try:
            event = Event(request.event)
        except ValueError:
            raise TtrpcError(Code.INVALID_ARGUMENT, f"unknown NRI event {request.event}") from None
        notify = self._handlers.notifiers.get(event)
        if notify is not None:
            await self._handling(notify(request.pod, request.container))
        return api.Empty()


# SynchronizeRequest's fields (pods and containers are LEN fields, more a VARINT).
_SYNC_PODS, _SYNC_CONTAINERS, _SYNC_MORE = 1, 2, 3

# upb parses any buffer, a view in place (the stubs say bytes): the parser, typed once as it is.
_parse_container = cast(Callable[[bytes | memoryview], api.Container], api.Container.FromString)


def _release(data: bytes | memoryview) -> None:
    """Let go of a view of the bytes received (the bytes go with it, if nothing else holds them)."""
    if isinstance(data, memoryview):
        data.release()


def _state_change_label(request: api.StateChangeEvent) -> str:
    return EVENT_LABELS.get(request.event, "unknown")


def _observed(
    observed: list[tuple[str, str, float]], label: str | Callable[[Any], str], handler: Handler
) -> Handler:
    """`handler`, timed, its (event, outcome, seconds) added to `observed`, which the stub hands to
    its observer once the reply has gone out (`Stub._after_reply`). A coroutine awaiting another:
    the handler still starts at once, without a task of its own (see `nri_plugin.ttrpc.aio.Server`)."""

    async def handle(request: Any, ctx: CallContext) -> Any:
        started = time.perf_counter()
        outcome = "error"
        try:
            reply = await handler(request, ctx)
            outcome = "ok"
            return reply
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            event = label if isinstance(label, str) else label(request)
            observed.append((event, outcome, time.perf_counter() - started))

    return handle
