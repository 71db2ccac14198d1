"""The runtime side of NRI, for tests, benchmarks and the demo.

``RuntimeSimulator`` does what containerd and CRI-O do through containerd/nri's adaptation library:
it listens on a unix socket, accepts plugins, waits for RegisterPlugin within the registration timeout,
configures them (refusing event masks the simulated NRI version does not know), synchronizes its pods
and containers (in chunks when one message would exceed the ttrpc limit), and then drives lifecycle
events through the plugins in index order, merging their adjustments and applying their updates to a
small container model. Plugins that miss the request timeout or close their connection are dropped,
and the operation goes on without them, as on a real node; an error status fails the operation.

Real runtimes do not keep every promise of that model; `RuntimeModes` (``sim.modes``, all off by
default) switches on the behaviours seen on them that leave a plugin's view of the node behind:
pods forgotten across a restart, creations that fail after the plugins adjusted them, a slow
``runc create`` between NRI CreateContainer and PostCreateContainer, stopped containers whose
resources linger until removal. The simulator holds no resources itself: it calls
`RuntimeSimulator.release_resources` when the runtime would delete a container's cgroup, for a
subclass that plays the cgroups (the tests' fake tree) to do it.

A container may be created with CDI devices (``create_container(..., cdi_devices=...)``): their env
edits, read from the spec files in the directories of ``sim.cdi`` (a `CdiSpecs`), are applied before
plugins see the container, as containerd and CRI-O do (`nri_plugin.nri.cdispecs`; device nodes,
mounts and hooks are not simulated); a device no spec defines fails the creation
(`CdiInjectionFailed`) without a plugin hearing of it.

It uses the same ttrpc and multiplexer modules as the plugin side.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import time
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, TypeVar, cast

import structlog
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.common.clock import LOOP_CLOCK, Clock
from nri_plugin.nri import mux
from nri_plugin.nri.cdispecs import CdiError, CdiSpecs, apply_env
from nri_plugin.nri.events import Event, events_in, parse_version, valid_events
from nri_plugin.nri.routes import EVENT_ROUTES, STATE_CHANGE, STATE_CHANGE_EVENTS
from nri_plugin.nri.stub import PLUGIN_SERVICE, RUNTIME_SERVICE
from nri_plugin.ttrpc.aio import Client, Server, UnaryMethod
from nri_plugin.ttrpc.errors import Code, ConnectionClosed, OversizedMessage, TtrpcError
from nri_plugin.ttrpc.protocol import MAX_DATA

log = structlog.get_logger("nri_plugin.nri.simulator")

# Go's adaptation library never shrinks a Synchronize chunk below this many objects.
MIN_SYNC_CHUNK = 8


class PluginFailed(Exception):
    """A plugin answered an event with an error status: the runtime fails the operation."""

    def __init__(self, plugin: str, event: str, code: int, message: str) -> None:
        super().__init__(f"NRI plugin {plugin} failed {event}: {message} (code {code})")
        self.plugin = plugin
        self.event = event
        self.code = code
        self.message = message


class CreationFailed(Exception):
    """The runtime could not create the container after the plugins adjusted it (`RuntimeModes.
    create_fails_after_adjustment`): the CRI call fails, and no plugin hears of the container again."""

    def __init__(self, container_id: str) -> None:
        super().__init__(
            f"failed to create container {container_id}: runc create failed after the NRI adjustment "
            '(exec: "no-such-command": executable file not found in $PATH)'
        )
        self.container_id = container_id


class CdiInjectionFailed(Exception):
    """The container names a CDI device no spec file defines: the runtime fails the CRI call before
    any NRI plugin hears of the container, with its CDI library's message."""

    def __init__(self, container_id: str, reason: str, spec_errors: tuple[str, ...] = ()) -> None:
        super().__init__(f"failed to create container {container_id}: CDI device injection failed: {reason}")
        self.container_id = container_id
        self.reason = reason
        self.spec_errors = spec_errors  # the spec files that could not be used, and why


@dataclass
class RuntimeModes:
    """Behaviours of real runtimes that a plugin cannot learn from its events (docs/runtime-behaviour.md,
    "Ends the runtimes do not report"); each off by default, switched on to reproduce it."""

    # containerd (its issue 8426, still so in v2.4): after its own restart it never reports the pods it
    # ran before as stopped or removed (no StopPodSandbox, no RemovePodSandbox); their containers'
    # events still come. Takes effect in `RuntimeSimulator.restore`.
    forgets_pods_on_restart: bool = False
    # CRI-O runs ``runc create`` after NRI CreateContainer: when that fails (a command that does not
    # exist, an image problem), the creation fails after the plugins adjusted it, and no StopContainer
    # or RemoveContainer ever follows (`CreationFailed`).
    create_fails_after_adjustment: bool = False
    # CRI-O always, containerd for exited containers: a stopped container's cgroup (with its quota)
    # is deleted only at its removal; off, it goes at the stop, before plugins hear of it.
    stopped_cgroup_lingers: bool = False
    # containerd: a container's cgroup is made at StartContainer (its task's creation, just before
    # plugins hear of the start), however long after CreateContainer kubelet starts it; off, as CRI-O,
    # in CreateContainer right after the plugins' adjustment (its runc create). See `make_resources`.
    cgroup_made_at_start: bool = False
    # CRI-O: its ``runc create`` (which makes the cgroup) runs after NRI CreateContainer, outside the
    # runtime's NRI lock, and PostCreateContainer follows it: the seconds it takes, on `RuntimeSimulator.
    # clock` (a loaded node or a slow disk make seconds ordinary). With `create_fails_after_adjustment`
    # it fails at their end. 0: at once, in the same hold of the lock as NRI CreateContainer.
    runc_create_seconds: float = 0.0


class AdjustmentConflict(Exception):
    """Two plugins (or one plugin twice) claimed the same field of one container."""


class Record(NamedTuple):
    """One exchange with one plugin, as the runtime saw it. (A named tuple: one is made per call,
    and a tuple is the cheapest immutable record to make.)"""

    event: str
    plugin: str
    container: str = ""
    outcome: str = "ok"  # ok | error | dropped | unimplemented
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class UnsolicitedUpdate:
    """An UpdateContainers request a plugin sent of its own accord, as it arrived."""

    plugin: str
    containers: tuple[str, ...]
    # The runtime's requests to that plugin still unanswered when it arrived. NRI plugins must not
    # send one while they handle a request (the runtime holds its lock for the whole event), so a
    # well-behaved plugin's are all 0.
    calls_in_flight: int


@dataclass
class PluginConnection:
    """One connected plugin, from the runtime's side."""

    name: str
    index: str
    trunk: mux.Trunk
    client: Client
    events: int = 0
    uses_state_change: bool = False
    synchronized: bool = False
    # "index-name", as runtimes name a plugin in their logs and errors; made once, named per call.
    full_name: str = field(init=False)

    def __post_init__(self) -> None:
        self.full_name = f"{self.index}-{self.name}"

    def subscribed(self, event: Event) -> bool:
        return bool(self.events & event.bit)


class CreateResult(NamedTuple):
    """What a creation gave: the adjustment merged over all plugins, the container as created, and
    the updates of other containers the plugins' replies carried (applied after the creation)."""

    adjustment: api.ContainerAdjustment
    container: api.Container
    updates: list[api.ContainerUpdate]


class RuntimeSimulator:
    """A fake container runtime speaking real NRI over a unix socket."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        runtime_name: str = "containerd",
        runtime_version: str = "v2.3.4",
        nri_version: str = "v0.12.0",
        registration_timeout: float = 5.0,
        request_timeout: float = 2.0,
        max_message_size: int = MAX_DATA,
        plugin_config: str = "",
    ) -> None:
        self.socket_path = os.fspath(socket_path)
        self.runtime_name = runtime_name
        self.runtime_version = runtime_version
        self.nri_version = nri_version
        self.registration_timeout = registration_timeout
        self.request_timeout = request_timeout
        # ttrpc refuses anything larger whatever the runtime wants: chunking is the only way past it.
        self.max_message_size = min(max_message_size, MAX_DATA)
        self.plugin_config = plugin_config
        # The CDI spec directories, lowest precedence first: none (no CDI device resolves) until set,
        # as ``sim.cdi = CdiSpecs([...])`` (set like `modes`: the constructor is at its argument limit).
        self.cdi = CdiSpecs()
        self.valid_events = valid_events(
            nri_version=nri_version, runtime_name=runtime_name, runtime_version=runtime_version
        )
        version = parse_version(nri_version) if nri_version else None
        self.dedicated_rpcs = version is not None and version[:2] >= (0, 12)
        self.pods: dict[str, api.PodSandbox] = {}
        self.containers: dict[str, api.Container] = {}
        self.records: list[Record] = []
        self.applied_updates: list[api.ContainerUpdate] = []
        self.unsolicited: list[UnsolicitedUpdate] = []
        self.sync_chunks: list[int] = []  # objects in each Synchronize message sent
        # Each whole synchronization, all chunks: from the first request sent to the last reply, and
        # the building of its messages before that (see `_synchronize`).
        self.sync_seconds: list[float] = []
        self.sync_build_seconds: list[float] = []
        # Called once a Synchronize's messages are built, just before the first is sent.
        self.on_sync_start: Callable[[], None] | None = None
        self.modes = RuntimeModes()
        self.clock: Clock = LOOP_CLOCK  # what `RuntimeModes.runc_create_seconds` are counted on
        # Pods this runtime ran before its restart and forgot (`RuntimeModes.forgets_pods_on_restart`),
        # and the events it did not send for them: (event, pod id).
        self.forgotten_pods: set[str] = set()
        self.omitted: list[tuple[str, str]] = []
        self._released: set[str] = set()  # containers whose resources are gone
        self._plugins: list[PluginConnection] = []
        # `plugins`, and each event's subscribers among them, kept until a plugin joins or leaves
        # (`_plugins_changed`): an event reads them instead of sorting and filtering every time.
        self._ready: tuple[PluginConnection, ...] = ()
        self._subscribed: dict[Event, tuple[PluginConnection, ...]] = dict.fromkeys(Event, ())
        self._changed = asyncio.Condition()
        # Runtimes hold one lock for a whole event across all plugins, and take it again to apply a
        # plugin's unsolicited updates (so a plugin that waits for those inside a handler stalls).
        self._lock = asyncio.Lock()
        self._server: asyncio.AbstractServer | None = None
        self._trunks: set[mux.Trunk] = set()  # every connection accepted, registered or not
        self._tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._new_trunk, self.socket_path)
        os.chmod(self.socket_path, 0o600)

    async def adopt(self, sock: socket.socket) -> None:
        """Serve a plugin on an already connected socket, as runtimes do for plugins they launch
        themselves (one end of a socketpair, handed to the plugin as fd 3)."""
        await asyncio.get_running_loop().create_unix_connection(self._new_trunk, sock=sock)

    async def close(self) -> None:
        """Stop listening and close every plugin connection (a runtime shutdown)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        # Every connection is closed before the server is waited for: from Python 3.12 on,
        # `wait_closed` returns only once each connection it accepted has gone.
        for trunk in list(self._trunks):
            trunk.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()
        self._plugins.clear()
        self._plugins_changed()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    async def __aenter__(self) -> RuntimeSimulator:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    @property
    def plugins(self) -> list[PluginConnection]:
        """Plugins that registered, configured and synchronized, in index order."""
        return list(self._ready)

    def _plugins_changed(self) -> None:
        """A plugin was synchronized or left: which plugins events go to, and in what order."""
        self._ready = tuple(sorted((p for p in self._plugins if p.synchronized), key=lambda p: p.index))
        self._subscribed = {event: tuple(p for p in self._ready if p.subscribed(event)) for event in Event}

    async def wait_for_plugins(self, count: int = 1, timeout: float | None = 5.0) -> list[PluginConnection]:
        """The ready plugins, once there are at least `count` of them; `timeout` None: no limit of its
        own, for a caller whose own guard bounds the whole wait."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: len(self.plugins) >= count), timeout)
        return self.plugins

    async def wait_for_synchronizations(self, count: int, timeout: float | None = 5.0) -> None:
        """Wait until plugins have synchronized `count` times in all since this runtime was made.
        Unlike `wait_for_plugins`, a plugin that left but whose leaving the runtime has not read yet
        does not count: this is the wait for a plugin restarted under a running runtime."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: len(self.sync_seconds) >= count), timeout)

    # -- accepting plugins -------------------------------------------------------------------------

    def _new_trunk(self) -> mux.Trunk:
        # Channels are wired before the trunk sees any byte: the plugin speaks first (RegisterPlugin),
        # and frames for a connection id nobody listens on are dropped.
        trunk = mux.Trunk()
        link = _Link(trunk)
        client = Client(functools.partial(trunk.send, mux.PLUGIN_SERVICE_CONN), close_channel=trunk.close)
        trunk.channel(mux.PLUGIN_SERVICE_CONN, client)

        async def register(request: api.RegisterPluginRequest, _ctx: object) -> api.Empty:
            if not link.registered.done():
                link.registered.set_result(request)
            return api.Empty()

        async def update_containers(
            request: api.UpdateContainersRequest, _ctx: object
        ) -> api.UpdateContainersResponse:
            source = link.plugin.full_name if link.plugin else "unregistered"
            self.unsolicited.append(
                UnsolicitedUpdate(
                    plugin=source,
                    containers=tuple(u.container_id for u in request.update),
                    calls_in_flight=client.pending_calls,
                )
            )
            async with self._lock:
                failed = [u for u in request.update if not self._apply_update(u, source=source)]
            return api.UpdateContainersResponse(failed=failed)

        server = Server(
            {
                RUNTIME_SERVICE: {
                    "RegisterPlugin": UnaryMethod(api.RegisterPluginRequest, register),
                    "UpdateContainers": UnaryMethod(api.UpdateContainersRequest, update_containers),
                }
            },
            functools.partial(trunk.send, mux.RUNTIME_SERVICE_CONN),
            close_channel=trunk.close,
        )
        trunk.channel(mux.RUNTIME_SERVICE_CONN, server)
        task = asyncio.ensure_future(self._accept(link, client, server))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._trunks.add(trunk)
        task.add_done_callback(lambda _task: self._trunks.discard(trunk))
        return trunk

    async def _accept(self, link: _Link, client: Client, server: Server) -> None:
        trunk = link.trunk
        closed: asyncio.Future[None] = asyncio.ensure_future(trunk.wait_closed())
        try:
            waiters: set[asyncio.Future[Any]] = {link.registered, closed}
            await asyncio.wait(
                waiters,
                timeout=self.registration_timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            closed.cancel()
        if not link.registered.done():
            self._record(
                "RegisterPlugin",
                "unregistered",
                outcome="dropped",
                detail="connection closed" if trunk.closed.is_set() else "registration timed out",
            )
            trunk.close()
            server.close()
            await server.wait_closed()
            return
        request = link.registered.result()
        plugin = PluginConnection(
            name=request.plugin_name, index=request.plugin_idx, trunk=trunk, client=client
        )
        link.plugin = plugin
        self._plugins.append(plugin)

        try:
            if await self._configure(plugin):
                async with self._lock:
                    await self._synchronize(plugin)
                async with self._changed:
                    self._changed.notify_all()
            await trunk.wait_closed()
        finally:
            self._drop(plugin, "connection closed")
            server.close()
            await server.wait_closed()

    async def _configure(self, plugin: PluginConnection) -> bool:
        request = api.ConfigureRequest(
            config=self.plugin_config,
            runtime_name=self.runtime_name,
            runtime_version=self.runtime_version,
            registration_timeout=int(self.registration_timeout * 1000),
            request_timeout=int(self.request_timeout * 1000),
            NRI_version=self.nri_version if self.dedicated_rpcs else "",
        )
        try:
            reply = await self._call(plugin, "Configure", request, api.ConfigureResponse)
        except PluginFailed as exc:
            self._drop(plugin, f"configure failed: {exc.message}")
            return False
        if reply is None:
            return False
        events = reply.events or self.valid_events  # 0 subscribes to everything
        if events & ~self.valid_events:
            self._record(
                "Configure", plugin.full_name, outcome="dropped", detail=f"invalid plugin events: {events:#x}"
            )
            plugin.trunk.close()
            return False
        plugin.events = events
        log.info("plugin configured", plugin=plugin.full_name, events=[e.name for e in events_in(events)])
        return True

    async def _synchronize(self, plugin: PluginConnection) -> None:
        """Send every pod and container; in chunks marked ``more`` when one message is too large.

        The messages are built first, then sent: `sync_build_seconds` is the building (copying the
        objects into requests and sizing them, which a Go runtime does in a few milliseconds and this
        Python one in tens), `sync_seconds` the rest, from the first request's serialization and
        write to the plugin's last reply. `on_sync_start`, when set, runs in between."""
        pods, containers = list(self.pods.values()), list(self.containers.values())
        built = time.perf_counter()
        try:
            requests = self._sync_requests(pods, containers)
            started = time.perf_counter()
            if self.on_sync_start is not None:
                self.on_sync_start()
            replies = await asyncio.wait_for(self._sync_messages(plugin, requests), self.request_timeout)
        except (asyncio.TimeoutError, _Dropped, PluginFailed) as exc:
            self._drop(plugin, f"synchronize failed: {str(exc) or 'timed out'}")
            return
        self.sync_seconds.append(time.perf_counter() - started)
        self.sync_build_seconds.append(started - built)
        for update in replies:
            self._apply_update(update, source=plugin.full_name)
        plugin.synchronized = True
        self._plugins_changed()

    def _sync_requests(
        self, pods: list[api.PodSandbox], containers: list[api.Container]
    ) -> list[api.SynchronizeRequest]:
        """The Synchronize messages: one if it fits the message size, else chunks of a share of the
        objects each, that share cut by a tenth while a chunk is still too large, as Go's library
        does (never below `MIN_SYNC_CHUNK` objects)."""
        whole = api.SynchronizeRequest(pods=pods, containers=containers)
        size = whole.ByteSize()
        if size <= self.max_message_size - 512:
            return [whole]
        items: list[api.PodSandbox | api.Container] = [*pods, *containers]
        per_chunk = max(MIN_SYNC_CHUNK, int(len(items) * min(0.9, self.max_message_size / size)))
        requests: list[api.SynchronizeRequest] = []
        start = 0
        while start < len(items):
            chunk = items[start : start + per_chunk]
            request = api.SynchronizeRequest(
                pods=[m for m in chunk if isinstance(m, api.PodSandbox)],
                containers=[m for m in chunk if isinstance(m, api.Container)],
                more=start + len(chunk) < len(items),
            )
            if request.ByteSize() > self.max_message_size - 512:
                if per_chunk == MIN_SYNC_CHUNK:
                    raise _Dropped("objects too large to synchronize even in the smallest chunks")
                per_chunk = max(MIN_SYNC_CHUNK, int(per_chunk * 0.9))
                continue
            requests.append(request)
            start += len(chunk)
        return requests

    async def _sync_messages(
        self, plugin: PluginConnection, requests: list[api.SynchronizeRequest]
    ) -> Sequence[api.ContainerUpdate]:
        """Send the messages one after the other; the updates the plugin answered the last with."""
        for request in requests:
            self.sync_chunks.append(len(request.pods) + len(request.containers))
            reply = await self._call(plugin, "Synchronize", request, api.SynchronizeResponse, strict=True)
            if request.more and (not reply.more or reply.update):
                raise _Dropped("plugin does not handle split sync requests")
            if not request.more:
                return list(reply.update)
        return ()

    # -- talking to plugins ------------------------------------------------------------------------

    async def _call(
        self,
        plugin: PluginConnection,
        method: str,
        request: Message,
        response_type: type[Any],
        *,
        container: str = "",
        strict: bool = False,
    ) -> Any:
        """One call to one plugin. Fatal failures drop the plugin and give ``None``.

        An error status raises ``PluginFailed`` (the caller decides whether it fails the operation);
        with ``strict``, fatal failures raise ``_Dropped`` instead of giving ``None``.
        """
        try:
            reply = await plugin.client.call(
                PLUGIN_SERVICE, method, request, response_type, timeout=self.request_timeout
            )
        except (ConnectionClosed, OversizedMessage) as exc:
            self._drop(plugin, f"{method}: {exc}")
            if strict:
                raise _Dropped(str(exc)) from exc
            return None
        except TtrpcError as exc:
            if exc.code == Code.DEADLINE_EXCEEDED:
                self._drop(plugin, f"{method} timed out")
                if strict:
                    raise _Dropped(f"{method} timed out") from exc
                return None
            outcome = "unimplemented" if exc.code == Code.UNIMPLEMENTED else "error"
            self._record(method, plugin.full_name, container=container, outcome=outcome, detail=exc.message)
            raise PluginFailed(plugin.full_name, method, exc.code, exc.message) from exc
        self.records.append(Record(method, plugin.full_name, container))
        return reply

    def _drop(self, plugin: PluginConnection, reason: str) -> None:
        if plugin in self._plugins:
            self._plugins.remove(plugin)
            self._plugins_changed()
            self._record("drop", plugin.full_name, outcome="dropped", detail=reason)
            if reason == "connection closed":
                log.info("plugin disconnected", plugin=plugin.full_name)
            else:
                log.warning("plugin dropped", plugin=plugin.full_name, reason=reason)
        plugin.trunk.close()

    def _record(self, event: str, plugin: str, **fields: str) -> None:
        self.records.append(Record(event=event, plugin=plugin, **fields))

    def _subscribers(self, event: Event) -> tuple[PluginConnection, ...]:
        """The plugins `event` goes to, in index order (a tuple: a plugin dropped during the event
        makes a new one, and the event goes on over the one it started with)."""
        return self._subscribed[event]

    async def _state_event(self, event: Event, pod: api.PodSandbox, container: api.Container | None) -> None:
        """Deliver a StateChange-class event, on the dedicated v0.12 method where the plugin has it."""
        assert event in STATE_CHANGE_EVENTS
        route = EVENT_ROUTES[event]
        for plugin in self._subscribers(event):
            ident = container.id if container is not None else pod.id
            if self.dedicated_rpcs and not plugin.uses_state_change:
                if route.pod_only:
                    request = route.request_type(pod=pod)
                else:
                    request = route.request_type(pod=pod, container=container)
                try:
                    await self._call(plugin, route.method, request, route.response_type, container=ident)
                    continue
                except PluginFailed as exc:
                    if exc.code != Code.UNIMPLEMENTED:
                        raise
                    plugin.uses_state_change = True
            state = api.StateChangeEvent(event=api.Event.ValueType(event), pod=pod, container=container)
            await self._call(plugin, STATE_CHANGE, state, api.Empty, container=ident)

    # -- the runtime's operations ------------------------------------------------------------------

    def add_pod(self, pod: api.PodSandbox) -> None:
        """Make a pod exist without events (state the next Synchronize will carry)."""
        self.pods[pod.id] = pod

    def add_container(self, container: api.Container) -> None:
        self.containers[container.id] = container

    def restore(self, before: RuntimeSimulator) -> None:
        """Become `before` started again: its modes, and its pods and containers restored from its
        own state, as containerd and CRI-O do after a restart (no events: the next Synchronize carries
        them). With `RuntimeModes.forgets_pods_on_restart` the pods restored are forgotten: their
        stop and removal are never reported."""
        self.modes = replace(before.modes)
        for pod in before.pods.values():
            self.add_pod(_copy(pod))
        for container in before.containers.values():
            self.add_container(_copy(container))
        self._released |= before._released & set(self.containers)
        if self.modes.forgets_pods_on_restart:
            self.forgotten_pods |= set(self.pods)

    def make_resources(self, container: api.Container) -> None:
        """Where the runtime makes a container's cgroup from its adjusted resources: in CreateContainer
        after the plugins, or with `RuntimeModes.cgroup_made_at_start` in StartContainer before them.
        Nothing here: a subclass that plays the cgroups makes it, and may raise (as runc fails when the
        kernel refuses a value): the creation, or the start, then fails with no event sent."""

    def release_resources(self, container: api.Container) -> None:
        """Where the runtime deletes a container's cgroup: at its stop, or with
        `RuntimeModes.stopped_cgroup_lingers` only at its removal; before plugins hear of either.
        Nothing here (the simulator holds no cgroups): a subclass that plays them deletes them."""

    def _release(self, container: api.Container) -> None:
        if container.id not in self._released:
            self._released.add(container.id)
            self.release_resources(container)

    def _forgets(self, event: str, pod_id: str) -> bool:
        """True (and noted) when the runtime does not report `event` of a pod it forgot."""
        if pod_id not in self.forgotten_pods:
            return False
        self.omitted.append((event, pod_id))
        log.info(
            "pod event not sent: the runtime forgot the pod across its restart", nri_event=event, pod=pod_id
        )
        return True

    async def run_pod_sandbox(self, pod: api.PodSandbox) -> None:
        async with self._lock:
            self.pods[pod.id] = pod
            await self._state_event(Event.RUN_POD_SANDBOX, pod, None)

    async def stop_pod_sandbox(self, pod_id: str) -> None:
        async with self._lock:
            pod = self.pods[pod_id]
            if not self._forgets("StopPodSandbox", pod_id):
                await self._state_event(Event.STOP_POD_SANDBOX, pod, None)

    async def remove_pod_sandbox(self, pod_id: str) -> None:
        async with self._lock:
            pod = self.pods.pop(pod_id)
            if not self._forgets("RemovePodSandbox", pod_id):
                await self._state_event(Event.REMOVE_POD_SANDBOX, pod, None)
            self.forgotten_pods.discard(pod_id)

    async def lose_pod(self, pod_id: str) -> list[str]:
        """containerd's forgotten pod (its issue 8426) at its end: a pod it forgot across its restart
        (`RuntimeModes.forgets_pods_on_restart`) goes with its containers and no event at all, not
        even their stop or removal; their cgroups go too (`release_resources`). The ids of the
        containers that went with it."""
        async with self._lock:
            if pod_id not in self.forgotten_pods:
                raise ValueError(f"pod {pod_id} was not forgotten across a restart: its end is reported")
            self.pods.pop(pod_id)
            self.forgotten_pods.discard(pod_id)
            gone = [cid for cid, c in self.containers.items() if c.pod_sandbox_id == pod_id]
            for cid in gone:
                self._release(self.containers.pop(cid))
            self.omitted.append(("(every event of the pod and its containers)", pod_id))
            log.info("pod gone with no event: the runtime forgot it across its restart", pod=pod_id)
            return gone

    async def create_container(
        self, container: api.Container, *, cdi_devices: Sequence[str] = ()
    ) -> CreateResult:
        """CreateContainer through every subscribed plugin; the adjusted container is created (its
        resources made: `make_resources`), stored, and PostCreateContainer sent.

        `cdi_devices`: fully qualified CDI device names (``<vendor>/<class>=<name>``, as kubelet passes
        them in the CRI request); their env edits are applied first, and one no spec defines raises
        `CdiInjectionFailed` before any plugin is called (see `cdi`).

        With `RuntimeModes.runc_create_seconds`, the creation proper (CRI-O's ``runc create``) takes
        that long after NRI CreateContainer, the lock let go meanwhile (other events go on); with
        `RuntimeModes.create_fails_after_adjustment` it then fails (`CreationFailed`), no event sent."""
        async with self._lock:
            pod, current, merged, updates = await self._adjusted(container, cdi_devices)
            if self.modes.runc_create_seconds <= 0:
                return await self._created(pod, current, merged, updates)
        await self.clock.sleep(self.modes.runc_create_seconds)
        async with self._lock:
            return await self._created(pod, current, merged, updates)

    async def _adjusted(
        self, container: api.Container, cdi_devices: Sequence[str]
    ) -> tuple[api.PodSandbox, api.Container, api.ContainerAdjustment, list[api.ContainerUpdate]]:
        """NRI CreateContainer: the pod, the container as the plugins adjusted it, the adjustment
        merged over them and the updates of other containers they asked.

        Each plugin is sent the pod and the container as the plugins before it adjusted it; its
        adjustment is claimed, merged and applied at once (`_take_adjustment`). The request goes
        out encoded from its two parts (`_create_request`), the pod's encoded once per creation."""
        pod = self.pods[container.pod_sandbox_id]
        current = _copy(container)
        current.state = api.CONTAINER_CREATED
        ident = current.id  # (each read of a message's field makes a new str)
        if cdi_devices:
            self._inject_cdi(current, cdi_devices)
        merged = api.ContainerAdjustment()
        claims: dict[str, str] = {}
        updates: list[api.ContainerUpdate] = []
        plugins = self._subscribers(Event.CREATE_CONTAINER)
        pod_field = _length_delimited(_POD_TAG, pod.SerializeToString()) if plugins else b""
        for plugin in plugins:
            request = _create_request(pod_field, current)
            reply = await self._call(plugin, _CREATE.method, request, _CREATE.response_type, container=ident)
            if reply is None:
                continue
            if reply.update:
                asked = reply.update[:]
                _refuse_own_update(asked, ident, plugin.full_name)
                updates += asked
            _take_adjustment(merged, current, reply.adjust, claims, plugin.full_name)
        if self._subscribers(Event.VALIDATE_CONTAINER_ADJUSTMENT):
            await self._validate(pod, container, merged, updates)
        return pod, current, merged, updates

    async def _created(
        self,
        pod: api.PodSandbox,
        current: api.Container,
        merged: api.ContainerAdjustment,
        updates: list[api.ContainerUpdate],
    ) -> CreateResult:
        """The creation proper (CRI-O's ``runc create``, which makes the cgroup; containerd makes it
        at the start), then PostCreateContainer."""
        if self.modes.create_fails_after_adjustment:
            raise CreationFailed(current.id)
        if not self.modes.cgroup_made_at_start:
            self.make_resources(current)
        self.containers[current.id] = current
        for update in updates:
            self._apply_update(update, source=_CREATE.method)
        if self._subscribers(Event.POST_CREATE_CONTAINER):
            await self._state_event(Event.POST_CREATE_CONTAINER, pod, current)
        return CreateResult(merged, current, updates)

    def _inject_cdi(self, container: api.Container, names: Sequence[str]) -> None:
        """The CDI devices' env edits, applied to `container`; `CdiInjectionFailed` as the runtime."""
        try:
            edits = self.cdi.env_edits(names)
        except CdiError as exc:
            log.warning(
                "CDI device injection failed",
                container=container.id,
                reason=str(exc),
                spec_errors=self.cdi.errors,
            )
            raise CdiInjectionFailed(container.id, str(exc), self.cdi.errors) from None
        apply_env(container.env, edits)

    async def _validate(
        self,
        pod: api.PodSandbox,
        pristine: api.Container,
        adjust: api.ContainerAdjustment,
        updates: list[api.ContainerUpdate],
    ) -> None:
        validators = self._subscribers(Event.VALIDATE_CONTAINER_ADJUSTMENT)
        route = EVENT_ROUTES[Event.VALIDATE_CONTAINER_ADJUSTMENT]
        consulted = [api.PluginInstance(name=p.name, index=p.index) for p in self._ready]
        for plugin in validators:
            request = api.ValidateContainerAdjustmentRequest(
                pod=pod, container=pristine, adjust=adjust, update=updates, plugins=consulted
            )
            reply = await self._call(
                plugin, route.method, request, route.response_type, container=pristine.id
            )
            if reply is not None and reply.reject:
                raise PluginFailed(
                    plugin.full_name,
                    route.method,
                    0,
                    f'validator "{plugin.full_name}" rejected container adjustment, reason: {reply.reason}',
                )

    async def start_container(self, container_id: str) -> None:
        async with self._lock:
            container = self.containers[container_id]
            if self.modes.cgroup_made_at_start:
                self.make_resources(container)
            container.state = api.CONTAINER_RUNNING
            await self._state_event(Event.START_CONTAINER, self.pods[container.pod_sandbox_id], container)

    async def create_and_start(
        self,
        container: api.Container,
        *,
        gap: float = 0.0,
        clock: Clock = LOOP_CLOCK,
        cdi_devices: Sequence[str] = (),
    ) -> CreateResult:
        """kubelet's CreateContainer (with its CDI devices), then its StartContainer `gap` seconds later
        on `clock` (a loaded node, an image pull or a volume between the two make long gaps ordinary)."""
        result = await self.create_container(container, cdi_devices=cdi_devices)
        if gap > 0:
            await clock.sleep(gap)
        await self.start_container(container.id)
        return result

    async def update_container(self, container_id: str, resources: api.LinuxResources) -> api.LinuxResources:
        """UpdateContainerResources as kubelet's CPU manager issues it; gives what gets applied."""
        async with self._lock:
            container = self.containers[container_id]
            pod = self.pods[container.pod_sandbox_id]
            applied = _copy(resources)
            claims: dict[str, str] = {}
            others: list[api.ContainerUpdate] = []
            route = EVENT_ROUTES[Event.UPDATE_CONTAINER]
            for plugin in self._subscribers(Event.UPDATE_CONTAINER):
                request = api.UpdateContainerRequest(pod=pod, container=container, linux_resources=resources)
                reply = await self._call(
                    plugin, route.method, request, route.response_type, container=container_id
                )
                for update in reply.update if reply is not None else ():
                    if update.container_id == container_id:
                        _merge_cpu(update.linux.resources.cpu, claims, plugin.full_name, applied.cpu)
                    else:
                        others.append(update)
            # Runtimes change only what the update carries: kubelet's CPU manager sends a cpuset
            # alone, and the container keeps its quota and period.
            _merge_cpu(applied.cpu, None, "", container.linux.resources.cpu)
            for update in others:
                self._apply_update(update, source=route.method)
            return applied

    async def update_pod_sandbox(
        self, pod_id: str, resources: api.LinuxResources, overhead: api.LinuxResources | None = None
    ) -> None:
        """UpdatePodSandbox (NRI v0.10+), as a runtime sends it when kubelet has resized a pod in
        place (CRI UpdatePodSandboxResources, after kubelet rewrote the pod cgroup): the pod's new
        resources, which the pod keeps (`pod_resources`). A plugin's error fails it (`PluginFailed`)."""
        async with self._lock:
            pod = self.pods[pod_id]
            pod.linux.pod_resources.CopyFrom(resources)
            if overhead is not None:
                pod.linux.pod_overhead.CopyFrom(overhead)
            route = EVENT_ROUTES[Event.UPDATE_POD_SANDBOX]
            for plugin in self._subscribers(Event.UPDATE_POD_SANDBOX):
                request = api.UpdatePodSandboxRequest(
                    pod=pod, overhead_linux_resources=pod.linux.pod_overhead, linux_resources=resources
                )
                await self._call(plugin, route.method, request, route.response_type, container=pod_id)

    async def stop_container(self, container_id: str) -> None:
        async with self._lock:
            container = self.containers[container_id]
            container.state = api.CONTAINER_STOPPED
            if not self.modes.stopped_cgroup_lingers:
                self._release(container)
            route = EVENT_ROUTES[Event.STOP_CONTAINER]
            for plugin in self._subscribers(Event.STOP_CONTAINER):
                request = api.StopContainerRequest(
                    pod=self.pods[container.pod_sandbox_id], container=container
                )
                reply = await self._call(
                    plugin, route.method, request, route.response_type, container=container_id
                )
                for update in reply.update if reply is not None else ():
                    self._apply_update(update, source=route.method)

    async def remove_container(self, container_id: str) -> None:
        async with self._lock:
            container = self.containers.pop(container_id)
            self._release(container)
            self._released.discard(container_id)
            await self._state_event(Event.REMOVE_CONTAINER, self.pods[container.pod_sandbox_id], container)

    def _apply_update(self, update: api.ContainerUpdate, *, source: str) -> bool:
        container = self.containers.get(update.container_id)
        if container is None:
            self._record(
                "UpdateContainers",
                source,
                container=update.container_id,
                outcome="error",
                detail="no such container",
            )
            return False
        _merge_cpu(update.linux.resources.cpu, None, source, container.linux.resources.cpu)
        self.applied_updates.append(update)
        return True


class _Link:
    """A plugin connection being accepted: its trunk, its registration, then the plugin."""

    def __init__(self, trunk: mux.Trunk) -> None:
        self.trunk = trunk
        self.registered: asyncio.Future[api.RegisterPluginRequest] = (
            asyncio.get_running_loop().create_future()
        )
        self.plugin: PluginConnection | None = None


class _Dropped(Exception):
    """The plugin failed fatally during a multi-step exchange."""


_CPU_STRINGS = frozenset({"cpus", "mems"})  # LinuxCPU's string fields; the others are wrapper messages


_M = TypeVar("_M", bound=Message)


def _copy(message: _M) -> _M:
    clone = type(message)()
    clone.CopyFrom(message)
    return clone


def _claim(claims: dict[str, str], key: str, owner: str) -> None:
    """NRI's ownership rule: a field may be set once per container, by one plugin, once."""
    previous = claims.get(key)
    if previous is not None:
        raise AdjustmentConflict(f'plugins "{previous}" and "{owner}" both tried to set {key}')
    claims[key] = owner


def _merge_cpu(
    source: api.LinuxCPU, claims: dict[str, str] | None, owner: str, *targets: api.LinuxCPU
) -> None:
    """Copy the CPU fields ``source`` sets into each of ``targets`` (the only resources our plugins
    touch), each claimed for `owner` first unless `claims` is None."""
    _set_cpu(source.ListFields(), claims, owner, targets)


def _set_cpu(
    fields: Sequence[tuple[FieldDescriptor, Any]],
    claims: dict[str, str] | None,
    owner: str,
    targets: Sequence[api.LinuxCPU],
) -> None:
    """`_merge_cpu` from the source's `ListFields`: just the fields set (a wrapper present, even at
    0; a string not empty), two or three of the seven in an adjustment. A wrapper is copied whole
    (0 is a value), not merged."""
    for descriptor, value in fields:
        name = descriptor.name
        if claims is not None:
            _claim(claims, "cpu." + name, owner)
        if name in _CPU_STRINGS:
            for target in targets:
                setattr(target, name, value)
        else:
            for target in targets:
                getattr(target, name).CopyFrom(value)


def _take_adjustment(
    merged: api.ContainerAdjustment,
    container: api.Container,
    adjust: api.ContainerAdjustment,
    claims: dict[str, str],
    owner: str,
) -> None:
    """One plugin's adjustment of a container being created: each field it sets claimed for it
    (`_claim`), added to the adjustment merged over all plugins, and applied to the container as the
    runtime's OCI spec generator does, so that the next plugin is sent the container adjusted.

    Repeated fields are read through a slice (``env[:]``, a list): upb's containers have no
    ``__iter__``, and iterating one ends in an IndexError raised and caught."""
    env = adjust.env[:]
    if env:
        _take_env(merged.env, container.env, env, claims, owner)
    annotations = adjust.annotations
    if annotations:
        for key, value in annotations.items():
            _claim(claims, "annotation " + key.lstrip("-"), owner)
            merged.annotations[key] = value
            if key.startswith("-"):
                container.annotations.pop(key[1:], None)
            else:
                container.annotations[key] = value
    cpu = adjust.linux.resources.cpu.ListFields()
    if cpu:
        _set_cpu(cpu, claims, owner, (merged.linux.resources.cpu, container.linux.resources.cpu))


def _take_env(
    merged: MutableSequence[api.KeyValue],
    env: MutableSequence[str],
    items: list[api.KeyValue],
    claims: dict[str, str],
    owner: str,
) -> None:
    """The env part of `_take_adjustment`. Each name comes once in an adjustment (the claim refuses
    it otherwise): a name set or removed ("-NAME") loses its old entries, and one set goes at the
    end, in the adjustment's order."""
    touched: set[str] = set()
    added: list[str] = []
    for item in items:
        key = item.key
        name = key.lstrip("-")
        _claim(claims, "env " + name, owner)
        touched.add(name)
        if not key.startswith("-"):
            added.append(f"{key}={item.value}")
    merged.extend(items)
    entries = env[:]
    if _may_set(entries, touched):
        kept = [entry for entry in entries if entry.partition("=")[0] not in touched]
        del env[:]
        env.extend(kept)
    env.extend(added)


def _may_set(entries: Sequence[str], names: set[str]) -> bool:
    """Whether one of `entries` may set one of `names`: never False when one does (such an entry
    starts the joined text or follows a newline), True also for a value holding a newline and
    ``NAME=``. One search in one string: most adjustments add names the container does not have,
    and the exact filter then need not run."""
    text = "\n" + "\n".join(entries)
    return any(f"\n{name}=" in text for name in names)


def _refuse_own_update(updates: Sequence[api.ContainerUpdate], container_id: str, plugin: str) -> None:
    """A CreateContainer reply may update other containers, never the one being created."""
    for update in updates:
        if update.container_id == container_id:
            raise PluginFailed(plugin, _CREATE.method, 2, f"asked update of {container_id} during creation")


class _Encoded:
    """A request already encoded: `Client.call` asks a request for nothing but its bytes
    (``SerializeToString``), so one put together from parts encoded apart goes out as it is. (Every
    creation in the tests goes out so: a client that asked for more would fail them at once.)"""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def SerializeToString(self) -> bytes:  # protobuf's name: what the client calls
        return self._data


def _field_tag(message: type[Message], name: str) -> bytes:
    """The encoded tag of a length-delimited (message) field of `message`."""
    number = message.DESCRIPTOR.fields_by_name[name].number
    return _varint(number << 3 | 2)


def _varint(value: int) -> bytes:
    """`value` (not negative) as a protobuf varint: 7 bits a byte, low first, the high bit set on
    every byte but the last."""
    if value < 0x80:
        return bytes((value,))
    if value < 0x4000:  # most messages here: one call instead of two
        return bytes((value & 0x7F | 0x80, value >> 7))
    return bytes((value & 0x7F | 0x80,)) + _varint(value >> 7)


def _length_delimited(tag: bytes, data: bytes) -> bytes:
    """One length-delimited field: its tag, the data's length as a varint, the data."""
    return tag + _varint(len(data)) + data


_CREATE = EVENT_ROUTES[Event.CREATE_CONTAINER]
_POD_TAG = _field_tag(api.CreateContainerRequest, "pod")
_CONTAINER_TAG = _field_tag(api.CreateContainerRequest, "container")


def _create_request(pod_field: bytes, container: api.Container) -> Message:
    """CreateContainerRequest{pod, container}, its pod field already encoded: a message's encoding
    is its fields' encodings one after the other, so this is what the message built from both
    would give, without copying the pod and the container into it first. (Typed as the message it
    stands for: the client takes it for one.)"""
    encoded = _Encoded(pod_field + _length_delimited(_CONTAINER_TAG, container.SerializeToString()))
    return cast(Message, encoded)


def env_of(container: api.Container) -> dict[str, str]:
    """A container's environment as a dict (later entries win, as in a process environment)."""
    pairs = (e.partition("=") for e in container.env)
    return {name: value for name, _, value in pairs}


__all__ = [
    "AdjustmentConflict",
    "CdiInjectionFailed",
    "CreateResult",
    "CreationFailed",
    "PluginConnection",
    "PluginFailed",
    "Record",
    "RuntimeModes",
    "RuntimeSimulator",
    "UnsolicitedUpdate",
    "env_of",
]
