"""The plugin side of NRI: connect, register, configure, synchronize, serve events, reconnect.

The stub knows the protocol and nothing of any policy. A plugin is any object; the stub looks for
coroutine methods by name (``create_container``, ``update_container``, ...; see ``EVENT_HANDLERS``),
subscribes to exactly the events the plugin handles (limited to what the runtime accepts), and turns
each request into a call of that method. Methods the plugin lacks are answered with status 12
(Unimplemented), which NRI v0.12 runtimes take as "use StateChange instead".

Handler signatures (all ``async``; ``api`` is ``api.nri.api_pb2``)::

    configure(request: api.ConfigureRequest) -> None
    synchronize(pods, containers) -> Sequence[api.ContainerUpdate]
    create_container(pod, container) -> api.CreateContainerResponse | None
    update_container(pod, container, resources: api.LinuxResources) -> Sequence[api.ContainerUpdate]
    stop_container(pod, container) -> Sequence[api.ContainerUpdate]
    update_pod_sandbox(pod, overhead: api.LinuxResources, resources: api.LinuxResources) -> None
    validate_container_adjustment(request) -> str | None     # a reason rejects the adjustment
    run_pod_sandbox(pod), stop_pod_sandbox(pod), remove_pod_sandbox(pod),
    post_update_pod_sandbox(pod) -> None
    post_create_container(pod, container), start_container(pod, container),
    post_start_container(pod, container), post_update_container(pod, container),
    remove_container(pod, container) -> None
    shutdown() -> None
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import re
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from api.nri import api_pb2 as api
from nri_plugin.nri import mux
from nri_plugin.nri.events import (
    DEDICATED_METHODS,
    POD_EVENTS,
    STATE_CHANGE_EVENTS,
    Event,
    events_in,
    mask_of,
    valid_events,
)
from nri_plugin.nri.identity import DEFAULT_SOCKET_PATH, valid_index, valid_name
from nri_plugin.ttrpc.aio import CallContext, Client, Server, UnaryMethod
from nri_plugin.ttrpc.errors import ConnectionClosed, TtrpcError

log = structlog.get_logger("nri_plugin.nri.stub")

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
# NRI_version we announce in RegisterPlugin: the API level our .proto files describe.
NRI_VERSION = "v0.12.2"
DEFAULT_REGISTRATION_TIMEOUT = 5.0
DEFAULT_REQUEST_TIMEOUT = 2.0

# Handler method name → the event it subscribes to.
EVENT_HANDLERS: dict[str, Event] = {
    "run_pod_sandbox": Event.RUN_POD_SANDBOX,
    "stop_pod_sandbox": Event.STOP_POD_SANDBOX,
    "remove_pod_sandbox": Event.REMOVE_POD_SANDBOX,
    "create_container": Event.CREATE_CONTAINER,
    "post_create_container": Event.POST_CREATE_CONTAINER,
    "start_container": Event.START_CONTAINER,
    "post_start_container": Event.POST_START_CONTAINER,
    "update_container": Event.UPDATE_CONTAINER,
    "post_update_container": Event.POST_UPDATE_CONTAINER,
    "stop_container": Event.STOP_CONTAINER,
    "remove_container": Event.REMOVE_CONTAINER,
    "update_pod_sandbox": Event.UPDATE_POD_SANDBOX,
    "post_update_pod_sandbox": Event.POST_UPDATE_POD_SANDBOX,
    "validate_container_adjustment": Event.VALIDATE_CONTAINER_ADJUSTMENT,
}
HANDLER_OF_EVENT = {event: name for name, event in EVENT_HANDLERS.items()}


class StubError(Exception):
    """The stub cannot run as configured (bad identity, no plugin handlers, ...)."""


class StubObserver(Protocol):
    """Told of every request the stub answers and of every lost connection (`nri_plugin.daemon.metrics`)."""

    def request_done(self, event: str, outcome: str, seconds: float) -> None:
        """`event`: ``configure``, ``synchronize``, ``shutdown``, a handler name (``create_container``)
        or ``unknown``; `outcome`: ``ok``, ``error`` or ``cancelled``."""

    def reconnecting(self) -> None:
        """The connection to the runtime was lost; the stub connects again."""


@dataclass(frozen=True, kw_only=True)
class Identity:
    name: str
    index: str

    @property
    def full_name(self) -> str:
        return f"{self.index}-{self.name}"


def resolve_identity(
    name: str | None = None, index: str | None = None, *, environ: dict[str, str] | None = None
) -> Identity:
    """The plugin's name and index: options first, then NRI_PLUGIN_NAME/IDX, then ``argv[0]`` as NN-name."""
    env = os.environ if environ is None else environ
    name = name or env.get("NRI_PLUGIN_NAME") or None
    index = index or env.get("NRI_PLUGIN_IDX") or None
    if name and re.match(r"^[0-9]{2}-", name):
        # Runtimes on NRI <= v0.3 pass the whole file name ("10-name") as the name.
        index = index or name[:2]
        name = name[3:]
    if not name or not index:
        base = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
        head, sep, tail = base.partition("-")
        if sep and valid_index(head):
            index = index or head
            name = name or tail
    if not index or not valid_index(index):
        raise StubError(
            f"plugin index {index!r} is invalid: use exactly two digits, e.g. --nri-plugin-index 10 "
            "or NRI_PLUGIN_IDX=10"
        )
    if not name or not valid_name(name):
        raise StubError(
            f"plugin name {name!r} is invalid: use letters, digits and _ . + - only, "
            "e.g. --nri-plugin-name mixed-cpu"
        )
    return Identity(name=name, index=index)


@dataclass
class RuntimeInfo:
    """What the runtime told us in Configure."""

    name: str = ""
    version: str = ""
    nri_version: str = ""
    registration_timeout: float = DEFAULT_REGISTRATION_TIMEOUT
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    events: int = 0


@dataclass
class _SyncChunks:
    pods: list[api.PodSandbox] = field(default_factory=list)
    containers: list[api.Container] = field(default_factory=list)


class Stub:
    """Runs one plugin against one runtime, reconnecting when the runtime restarts."""

    def __init__(
        self,
        plugin: object,
        *,
        name: str | None = None,
        index: str | None = None,
        socket_path: str = DEFAULT_SOCKET_PATH,
        reconnect: bool = True,
        registration_timeout: float = DEFAULT_REGISTRATION_TIMEOUT,
        backoff_initial: float = 0.1,
        backoff_max: float = 5.0,
        environ: dict[str, str] | None = None,
        observer: StubObserver | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self.plugin = plugin
        # Read when a connection starts: set it before `run()`.
        self.observer = observer
        self.identity = resolve_identity(name, index, environ=dict(env))
        self.socket_path = socket_path
        self.inherited_fd = _inherited_fd(env)
        self.reconnect = reconnect and self.inherited_fd is None
        self.registration_timeout = registration_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.handlers = {name: getattr(plugin, name) for name in EVENT_HANDLERS if _has(plugin, name)}
        if not self.handlers and not _has(plugin, "synchronize"):
            raise StubError(f"{type(plugin).__name__} defines no NRI handler (e.g. create_container)")
        self.runtime = RuntimeInfo()
        self.ready = asyncio.Event()
        self.connections = 0
        self.synchronizations = 0
        self._stopping = asyncio.Event()
        self._trunk: mux.Trunk | None = None
        self._client: Client | None = None
        self._sync = _SyncChunks()
        self._busy = 0
        self._sync_busy = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def subscribed(self) -> int:
        """The events the plugin handles, before the runtime's limits."""
        return mask_of(EVENT_HANDLERS[name] for name in self.handlers)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until ``stop()``; reconnect with backoff when the runtime goes away (if enabled)."""
        delay = self.backoff_initial
        while not self._stopping.is_set():
            try:
                trunk = await self._connect()
            except OSError as exc:
                if not self.reconnect:
                    raise StubError(f"cannot connect to the NRI socket {self.socket_path}: {exc}") from exc
                log.warning(
                    "nri connect failed, retrying", socket=self.socket_path, error=str(exc), retry_in=delay
                )
                await self._sleep(delay)
                delay = min(delay * 2, self.backoff_max)
                continue
            registered = await self._serve(trunk)
            if registered:
                delay = self.backoff_initial
            if self._stopping.is_set() or not self.reconnect:
                return
            log.warning("nri connection lost, reconnecting", socket=self.socket_path, retry_in=delay)
            if self.observer is not None:
                self.observer.reconnecting()
            await self._sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, self.backoff_max)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        self._stopping.set()
        if self._trunk is not None:
            self._trunk.close()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _connect(self) -> mux.Trunk:
        if self.inherited_fd is not None:
            sock = socket.socket(fileno=self.inherited_fd)
            self.inherited_fd = None  # one use only: the fd belongs to the trunk now
            return await mux.adopt_socket(sock)
        return await mux.open_unix(self.socket_path)

    async def _serve(self, trunk: mux.Trunk) -> bool:
        """One connection: register, then serve until it closes. True if registration succeeded."""
        self.connections += 1
        self._trunk = trunk
        self._sync = _SyncChunks()
        self._busy_sync(False)
        server = Server(
            {PLUGIN_SERVICE: self._methods()},
            functools.partial(trunk.send, mux.PLUGIN_SERVICE_CONN),
            close_channel=trunk.close,
        )
        trunk.channel(mux.PLUGIN_SERVICE_CONN, server)
        client = Client(functools.partial(trunk.send, mux.RUNTIME_SERVICE_CONN), close_channel=trunk.close)
        trunk.channel(mux.RUNTIME_SERVICE_CONN, client)
        self._client = client
        registered = False
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
            registered = True
            log.info("registered with the runtime", plugin=self.identity.full_name, socket=self.socket_path)
            await trunk.wait_closed()
        except (TtrpcError, ConnectionClosed) as exc:
            log.error("nri registration failed", plugin=self.identity.full_name, error=str(exc))
        finally:
            self.ready.clear()
            self._client = None
            self._trunk = None
            trunk.close()
            server.close()
            await server.wait_closed()
        return registered

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
        while self._busy:
            await self._idle.wait()
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

    # -- the Plugin service ------------------------------------------------------------------------

    def _methods(self) -> dict[str, UnaryMethod[Any, Any]]:
        methods: dict[str, UnaryMethod[Any, Any]] = {
            "Configure": UnaryMethod(api.ConfigureRequest, self._configure),
            "Synchronize": UnaryMethod(api.SynchronizeRequest, self._synchronize),
            "Shutdown": UnaryMethod(api.Empty, self._shutdown),
            "StateChange": UnaryMethod(api.StateChangeEvent, self._state_change),
        }
        wanted: dict[str, tuple[str, type[Any], Callable[[Any, CallContext], Awaitable[Any]]]] = {
            "CreateContainer": ("create_container", api.CreateContainerRequest, self._create_container),
            "UpdateContainer": ("update_container", api.UpdateContainerRequest, self._update_container),
            "StopContainer": ("stop_container", api.StopContainerRequest, self._stop_container),
            "UpdatePodSandbox": ("update_pod_sandbox", api.UpdatePodSandboxRequest, self._update_pod_sandbox),
            "ValidateContainerAdjustment": (
                "validate_container_adjustment",
                api.ValidateContainerAdjustmentRequest,
                self._validate,
            ),
        }
        for method, (handler, request_type, impl) in wanted.items():
            if handler in self.handlers:
                methods[method] = UnaryMethod(request_type, impl)
        for event, (method, request_type, response_type) in DEDICATED_METHODS.items():
            if HANDLER_OF_EVENT[event] in self.handlers:
                methods[method] = UnaryMethod(request_type, self._dedicated(event, response_type))
        if self.observer is not None:
            for method, unary in list(methods.items()):
                label = _state_change_label if method == "StateChange" else _METHOD_LABELS[method]
                methods[method] = UnaryMethod(
                    unary.request_type, _observed(self.observer, label, unary.handler)
                )
        return methods

    async def _call(self, name: str, *args: Any) -> Any:
        """Run one plugin handler, marking the stub busy so unsolicited updates wait for the reply."""
        self._add_busy(1)
        try:
            handler: Callable[..., Awaitable[Any]] = getattr(self.plugin, name)
            return await handler(*args)
        finally:
            self._add_busy(-1)

    def _add_busy(self, delta: int) -> None:
        self._busy += delta
        if self._busy:
            self._idle.clear()
        else:
            self._idle.set()

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
        if _has(self.plugin, "configure"):
            await self._call("configure", request)
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

    async def _synchronize(self, request: api.SynchronizeRequest, _ctx: object) -> api.SynchronizeResponse:
        self._sync.pods.extend(request.pods)
        self._sync.containers.extend(request.containers)
        if request.more:
            self._busy_sync(True)
            return api.SynchronizeResponse(more=True)
        pods, containers = self._sync.pods, self._sync.containers
        self._sync = _SyncChunks()
        self._busy_sync(False)
        updates: Sequence[api.ContainerUpdate] = ()
        if _has(self.plugin, "synchronize"):
            updates = await self._call("synchronize", pods, containers) or ()
        self.synchronizations += 1
        self.ready.set()
        log.info(
            "synchronized",
            event_name="Synchronize",
            pods=len(pods),
            containers=len(containers),
            updates=len(updates),
        )
        return api.SynchronizeResponse(update=updates)

    def _busy_sync(self, in_progress: bool) -> None:
        """A chunked Synchronize counts as one long request for the update queue."""
        if in_progress == self._sync_busy:
            return
        self._sync_busy = in_progress
        self._add_busy(1 if in_progress else -1)

    async def _shutdown(self, _request: api.Empty, _ctx: object) -> api.Empty:
        if _has(self.plugin, "shutdown"):
            await self._call("shutdown")
        return api.Empty()

    async def _create_container(
        self, request: api.CreateContainerRequest, _ctx: object
    ) -> api.CreateContainerResponse:
        reply = await self._call("create_container", request.pod, request.container)
        return reply if reply is not None else api.CreateContainerResponse()

    async def _update_container(
        self, request: api.UpdateContainerRequest, _ctx: object
    ) -> api.UpdateContainerResponse:
        updates = await self._call(
            "update_container", request.pod, request.container, request.linux_resources
        )
        return api.UpdateContainerResponse(update=updates or ())

    async def _stop_container(
        self, request: api.StopContainerRequest, _ctx: object
    ) -> api.StopContainerResponse:
        updates = await self._call("stop_container", request.pod, request.container)
        return api.StopContainerResponse(update=updates or ())

    async def _update_pod_sandbox(
        self, request: api.UpdatePodSandboxRequest, _ctx: object
    ) -> api.UpdatePodSandboxResponse:
        await self._call(
            "update_pod_sandbox", request.pod, request.overhead_linux_resources, request.linux_resources
        )
        return api.UpdatePodSandboxResponse()

    async def _validate(
        self, request: api.ValidateContainerAdjustmentRequest, _ctx: object
    ) -> api.ValidateContainerAdjustmentResponse:
        reason = await self._call("validate_container_adjustment", request)
        if reason:
            return api.ValidateContainerAdjustmentResponse(reject=True, reason=str(reason))
        return api.ValidateContainerAdjustmentResponse()

    def _dedicated(
        self, event: Event, response_type: type[Any]
    ) -> Callable[[Any, CallContext], Awaitable[Any]]:
        async def handle(request: Any, _ctx: CallContext) -> Any:
            await self._deliver(event, request.pod, request.container if event not in POD_EVENTS else None)
            return response_type()

        return handle

    async def _state_change(self, request: api.StateChangeEvent, _ctx: object) -> api.Empty:
        try:
            event = Event(request.event)
        except ValueError:
            raise TtrpcError(3, f"unknown NRI event {request.event}") from None
        if HANDLER_OF_EVENT[event] in self.handlers and event in STATE_CHANGE_EVENTS:
            await self._deliver(event, request.pod, request.container)
        return api.Empty()

    async def _deliver(self, event: Event, pod: api.PodSandbox, container: api.Container | None) -> None:
        if event in POD_EVENTS:
            await self._call(HANDLER_OF_EVENT[event], pod)
        else:
            await self._call(HANDLER_OF_EVENT[event], pod, container)


async def run_until_signalled(stub: Stub) -> None:
    """Run the stub until SIGTERM or SIGINT; a second signal ends the process at once.

    The first signal stops the stub (the connection closes, handlers in flight are cancelled) and
    ``run`` returns normally, so the caller's clean-up runs.
    """
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)

    def on_signal(signum: int) -> None:
        if stub.stopping:
            os._exit(128 + signum)
        log.info("signal received, shutting down", signal=signal.Signals(signum).name)
        stub.stop()

    for signum in signals:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await stub.run()
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


# What `StubObserver.request_done` is told for each Plugin method (StateChange: its event's handler).
_METHOD_LABELS: dict[str, str] = {
    "Configure": "configure",
    "Synchronize": "synchronize",
    "Shutdown": "shutdown",
    "CreateContainer": "create_container",
    "UpdateContainer": "update_container",
    "StopContainer": "stop_container",
    "UpdatePodSandbox": "update_pod_sandbox",
    "ValidateContainerAdjustment": "validate_container_adjustment",
    **{method: HANDLER_OF_EVENT[event] for event, (method, _, _) in DEDICATED_METHODS.items()},
}
_EVENT_LABELS: dict[int, str] = {int(event): name for event, name in HANDLER_OF_EVENT.items()}


def _state_change_label(request: api.StateChangeEvent) -> str:
    return _EVENT_LABELS.get(request.event, "unknown")


def _observed(
    observer: StubObserver,
    label: str | Callable[[Any], str],
    handler: Callable[[Any, CallContext], Awaitable[Any]],
) -> Callable[[Any, CallContext], Awaitable[Any]]:
    """`handler`, timed and reported to `observer`. A coroutine awaiting another: the handler still
    starts at once, without a task of its own (see `nri_plugin.ttrpc.aio.Server`)."""

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
            observer.request_done(event, outcome, time.perf_counter() - started)

    return handle


def _has(plugin: object, name: str) -> bool:
    return callable(getattr(plugin, name, None))


def _inherited_fd(env: os._Environ[str] | dict[str, str]) -> int | None:
    value = env.get("NRI_PLUGIN_SOCKET")
    if not value:
        return None
    if not value.isdigit():
        raise StubError(f"NRI_PLUGIN_SOCKET={value!r} is not a file descriptor number")
    return int(value)
