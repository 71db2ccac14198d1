"""The kubelet device plugin for the shared-CPUs resource: gRPC service, socket lifecycle, registration.

Kubelet learns of an extended resource from a device plugin: the plugin serves ``v1beta1.DevicePlugin``
on a unix socket in kubelet's device-plugin directory and calls ``v1beta1.Registration/Register`` on
``kubelet.sock`` there; kubelet then dials the plugin, asks ``GetDevicePluginOptions``, keeps a
``ListAndWatch`` stream open for the device list, and calls ``Allocate`` when it admits a container that
requests the resource.

Our devices are admission tickets, not hardware: ``device_count`` interchangeable ids
(``shared-cpus-0`` ...), all healthy, none tied to a NUMA node. A container may hold exactly one; the
``Allocate`` answer carries the signed allocation marker (see :mod:`.marker`) that the NRI side takes as
proof that the container really requested shared CPUs.

Registration
    `DevicePluginServer` walks the states of :mod:`.registration` (``server.state``): it waits for
    ``kubelet.sock``, serves our socket, registers, and then watches for signs of losing the
    registration. All its waiting (socket checks, backoff, the Register deadline) is on the `Clock`
    it is given, so tests run it on virtual time while its gRPC I/O stays real.

Kubelet restarts
    A starting kubelet deletes every socket in its directory and forgets every plugin. We notice it by
    three signals, whichever comes first, then re-create our socket and register again:

    * our socket is gone or is another file (kubelet's clean-up),
    * ``kubelet.sock`` is gone, new, or re-created (a different inode/ctime),
    * kubelet's ``ListAndWatch`` stream ended (kubelet went away or dropped us).

    The first two are two ``lstat()`` calls every ``check_interval`` (0.2 s): inotify is not in the
    standard library, and this check costs microseconds, needs no extra dependency, and keeps working
    in the cases an inotify watch misses (the directory created or re-mounted after the watch was set).
    Registration retries back off (0.1 s doubling to 5 s, jittered) while kubelet refuses, but a new
    ``kubelet.sock`` cuts the wait short, so a restarted kubelet sees us again well within a second.
    None of this touches the NRI side, which keeps working while kubelet is away.

Kubelet's stream, nobody else's
    Anyone who can open our socket can open a ListAndWatch stream and end it. Only kubelet's counts:
    kubelet dials us back for each Register and opens exactly one stream, so the *first* stream opened
    after our latest Register call is taken as kubelet's; any other (a monitoring tool's, a hostile
    client's, a second one on the same registration) ends without consequence. The one window left
    is the few milliseconds between our Register call and kubelet's dial, in which a client with root
    on the node (the socket is 0600) could open its stream first; ending it then costs one
    re-registration, and the socket checks above stay the ground truth.

    A registration that has held for ``STABLE_REGISTRATION`` is a success: the retry backoff starts
    over then (not only when it is lost), so the failures before it never slow the next recovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import structlog

from nri_plugin.api.deviceplugin.v1beta1 import api_pb2 as api
from nri_plugin.api.deviceplugin.v1beta1 import api_pb2_grpc as api_grpc
from nri_plugin.common.backoff import Backoff
from nri_plugin.common.clock import LOOP_CLOCK, Clock, sleep_unless, within
from nri_plugin.common.unixsocket import FileId, bind_socket, file_id, remove_if_ours
from nri_plugin.deviceplugin.config import DevicePluginConfig
from nri_plugin.deviceplugin.marker import ANNOTATION_KEY, HostKey
from nri_plugin.deviceplugin.registration import RegistrationState, check_transition

if TYPE_CHECKING:
    from grpc.aio import ServicerContext

log = structlog.get_logger("nri_plugin.deviceplugin")

API_VERSION = "v1beta1"  # what Register announces; the only version kubelet supports
HEALTHY = "Healthy"
DEVICE_ID_PREFIX = "shared-cpus-"

CHECK_INTERVAL = 0.2  # seconds between the socket checks (see the module docstring)
REGISTER_TIMEOUT = 5.0  # kubelet answers Register once it has dialed us back: normally milliseconds
BACKOFF_INITIAL = 0.1
BACKOFF_MAX = 5.0
# Each delay is drawn between half and all of the doubling one: many nodes whose kubelets restarted
# together do not retry in lockstep, and none waits longer than BACKOFF_MAX.
BACKOFF_JITTER = (0.5, 1.0)
# A registration that is lost sooner than this counts as a failed attempt, so that a kubelet that
# takes us and drops us at once is retried with backoff rather than in a tight loop.
STABLE_REGISTRATION = 1.0
# How long stop() lets an in-flight Allocate finish; ListAndWatch streams are ended first.
STOP_GRACE = 1.0

# The token of a ListAndWatch stream that is not kubelet's: Register calls are numbered from 1.
_NOT_KUBELETS = -1

GRPC_CORE_LOGGER = "grpc._cython.cygrpc"
# Each Register call dials kubelet afresh: grpc otherwise shares connections between channels to the
# same address, and a new channel would inherit the refused connection of the last attempt, with its
# reconnect backoff, instead of dialing the kubelet that just appeared.
_FRESH_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


def default_backoff() -> Backoff:
    """The registration retry pacing: 0.1 s doubling to 5 s, each delay jittered down to half."""
    return Backoff(BACKOFF_INITIAL, BACKOFF_MAX, jitter=BACKOFF_JITTER)


class _CancelledRpcFilter(logging.Filter):
    """Drop grpc's error report for an RPC that was cancelled.

    grpc.aio logs, with a traceback, every servicer task that ends in CancelledError. Ours end so only
    when the server stops (a ListAndWatch that kubelet opened while we were shutting down, say): a
    normal part of a clean shutdown, not an error an operator should see.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info is not None and isinstance(record.exc_info[1], asyncio.CancelledError))


def install_grpc_log_filter() -> None:
    """Have grpc's core logger drop its reports of cancelled RPCs (see `_CancelledRpcFilter`).

    Idempotent. `DevicePluginServer.start()` calls it: importing this module changes no logger, so
    that merely loading it (a test, a tool) leaves grpc's logging as its owner set it.
    """
    grpc_log = logging.getLogger(GRPC_CORE_LOGGER)
    if not any(isinstance(existing, _CancelledRpcFilter) for existing in grpc_log.filters):
        grpc_log.addFilter(_CancelledRpcFilter())


def device_ids(count: int) -> tuple[str, ...]:
    """The ids we advertise for ``count`` devices: ``shared-cpus-0`` ... ``shared-cpus-<count-1>``."""
    return tuple(f"{DEVICE_ID_PREFIX}{i}" for i in range(count))


class AllocationError(Exception):
    """``Allocate`` refuses; ``code`` is the gRPC status kubelet gets, the message is shown on the pod."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def allocate(
    request: api.AllocateRequest, *, known: frozenset[str], key: HostKey, resource_name: str
) -> api.AllocateResponse:
    """Answer one ``Allocate`` call: one device per container, each answered with its signed marker."""
    response = api.AllocateResponse()
    for container in request.container_requests:
        ids = list(container.devices_ids)
        if len(ids) != 1:
            raise AllocationError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{resource_name}: a container asked for {len(ids)}, but this resource is an on/off switch"
                f" per container: request exactly 1 (resources.requests and resources.limits"
                f' "{resource_name}": 1)',
            )
        (device_id,) = ids
        if device_id not in known:
            raise AllocationError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{resource_name}: unknown device id {device_id!r}; kubelet may have an outdated device"
                " list, retry once it has the current one",
            )
        response.container_responses.add().annotations[ANNOTATION_KEY] = key.sign(device_id)
    return response


class _DeviceBoard:
    """The advertised device list, shared by every ListAndWatch stream; ``changed`` fires on updates."""

    def __init__(self, count: int) -> None:
        self.ids = device_ids(count)
        self.known = frozenset(self.ids)
        self.changed = asyncio.Event()

    def set_count(self, count: int) -> None:
        if count == len(self.ids):
            return
        self.ids = device_ids(count)
        self.known = frozenset(self.ids)
        fired, self.changed = self.changed, asyncio.Event()
        fired.set()

    def response(self) -> api.ListAndWatchResponse:
        return api.ListAndWatchResponse(devices=[api.Device(ID=i, health=HEALTHY) for i in self.ids])


class SharedCpusServicer(api_grpc.DevicePluginServicer):
    """``v1beta1.DevicePlugin`` for the shared-CPUs resource. One instance per socket generation.

    ``stream_token()`` is called when kubelet opens ListAndWatch, and ``on_stream_end(token)`` with its
    result when that stream ends, however it ends: the owner uses them to tell which registration a
    stream belonged to.
    """

    def __init__(
        self,
        *,
        resource_name: str,
        key: HostKey,
        board: _DeviceBoard,
        stream_token: Callable[[], int] = lambda: 0,
        on_stream_end: Callable[[int], None] = lambda token: None,
    ) -> None:
        self.resource_name = resource_name
        self.key = key
        self.open_streams = 0
        self._board = board
        self._stream_token = stream_token
        self._on_stream_end = on_stream_end
        self._closing = asyncio.Event()

    def close_streams(self) -> None:
        """End every ListAndWatch stream (before the gRPC server stops, so that it stops at once)."""
        self._closing.set()

    async def GetDevicePluginOptions(
        self, request: api.Empty, context: ServicerContext[Any, Any]
    ) -> api.DevicePluginOptions:
        # Neither GetPreferredAllocation (all our devices are alike) nor PreStartContainer is wanted.
        return api.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=False)

    async def ListAndWatch(
        self, request: api.Empty, context: ServicerContext[Any, Any]
    ) -> AsyncIterator[api.ListAndWatchResponse]:
        token = self._stream_token()
        self.open_streams += 1
        log.debug("ListAndWatch opened", event_name="ListAndWatch", devices=len(self._board.ids))
        try:
            while not self._closing.is_set():
                changed = self._board.changed
                yield self._board.response()
                await _first_of(changed, self._closing)
        finally:
            self.open_streams -= 1
            log.debug("ListAndWatch ended", event_name="ListAndWatch")
            self._on_stream_end(token)

    async def Allocate(
        self, request: api.AllocateRequest, context: ServicerContext[Any, Any]
    ) -> api.AllocateResponse:
        try:
            response = allocate(
                request, known=self._board.known, key=self.key, resource_name=self.resource_name
            )
        except AllocationError as exc:
            log.warning("Allocate refused", event_name="Allocate", reason=str(exc))
            await context.abort(exc.code, str(exc))
            raise  # abort() raises; this only tells type checkers so
        log.info(
            "Allocate",
            event_name="Allocate",
            devices=[list(c.devices_ids) for c in request.container_requests],
        )
        return response

    async def GetPreferredAllocation(
        self, request: api.PreferredAllocationRequest, context: ServicerContext[Any, Any]
    ) -> api.PreferredAllocationResponse:
        # Not announced, so kubelet does not call it; answer sensibly anyway: any devices will do.
        response = api.PreferredAllocationResponse()
        for container in request.container_requests:
            chosen = list(dict.fromkeys([*container.must_include_deviceIDs, *container.available_deviceIDs]))
            response.container_responses.add(deviceIDs=chosen[: max(container.allocation_size, 0)])
        return response

    async def PreStartContainer(
        self, request: api.PreStartContainerRequest, context: ServicerContext[Any, Any]
    ) -> api.PreStartContainerResponse:
        return api.PreStartContainerResponse()  # not announced; nothing to prepare


class _WatchEnd(enum.Enum):
    """Why the supervisor stopped watching (the value is what the logs say)."""

    TIMEOUT = "backoff elapsed"
    RECONFIGURED = "configuration changed"
    STREAM_ENDED = "kubelet ended ListAndWatch"
    SOCKET_REMOVED = "our socket was removed"
    KUBELET_CHANGED = "kubelet.sock changed"


class _Signal(enum.Enum):
    """What happens outside the supervisor and that it must act on."""

    RECONFIGURED = "configuration changed"  # reconfigure() changed what we register
    STREAM_ENDED = "kubelet ended ListAndWatch"  # the stream of our latest Register ended


class _Inbox:
    """Signals posted by callbacks (reconfigure, a stream's end) until the supervisor takes them.

    Posting wakes the supervisor from its pause, whatever it waits for.
    """

    def __init__(self) -> None:
        self._signals: set[_Signal] = set()
        # asyncio.Event binds to a loop on first use, so this may be made outside one.
        self._wake = asyncio.Event()

    def post(self, signal: _Signal) -> None:
        self._signals.add(signal)
        self._wake.set()

    def discard(self, signal: _Signal) -> None:
        self._signals.discard(signal)

    def __contains__(self, signal: _Signal) -> bool:
        return signal in self._signals

    async def pause(self, clock: Clock, seconds: float) -> None:
        """Sleep `seconds` on `clock`, less if a signal is posted meanwhile.

        Not ``asyncio.wait_for``: before Python 3.12 it can return normally, swallowing a
        cancellation, when the wake-up and ``close()`` coincide (a kubelet leaving as we shut down).
        """
        self._wake.clear()
        if _Signal.RECONFIGURED not in self._signals:
            await sleep_unless(clock, self._wake, seconds)


async def _first_of(*events: asyncio.Event) -> None:
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


class RegistrationObserver(Protocol):
    """Told of every registration attempt's outcome (`nri_plugin.daemon.metrics`)."""

    def registration_done(self, outcome: str) -> None:
        """`outcome`: ``ok``, or ``failed`` (kubelet refused, or our socket could not be served)."""


@dataclass
class _Socket:
    """Our socket while it is served: the gRPC server, its servicer, and the file it listens on."""

    server: grpc.aio.Server
    servicer: SharedCpusServicer
    path: str
    file_id: FileId | None = None  # set once the socket is bound


@dataclass
class _Round:
    """What the supervisor works with from one restart (new configuration or new try) to the next."""

    config: DevicePluginConfig
    kubelet: FileId | None = None  # kubelet.sock as we found it; None while disabled or waiting
    error: str = ""  # why the attempt failed, for BACKING_OFF's log line
    registered_at: float = 0.0  # clock time kubelet accepted us
    lost: _WatchEnd | None = None  # why REGISTERED ended
    lasted: float = 0.0  # how long the registration held, on the clock


_State = RegistrationState


class DevicePluginServer:
    """Serves and registers the device plugin, and keeps it registered across kubelet restarts.

    ``start()`` returns at once; the work runs in a background task that waits for ``kubelet.sock``,
    creates our socket (mode 0600), registers, and watches for kubelet restarts (the states of
    :mod:`.registration`; ``state`` says where it stands). ``close()`` stops it and removes the socket.
    Use as ``async with DevicePluginServer(config, key) as plugin: ...``.

    Every wait is on `clock` (the loop's unless a test passes a `ManualClock`), and retries are paced
    by `backoff` (default: `default_backoff()`).
    """

    def __init__(
        self,
        config: DevicePluginConfig,
        key: HostKey,
        *,
        clock: Clock = LOOP_CLOCK,
        backoff: Backoff | None = None,
        check_interval: float = CHECK_INTERVAL,
        register_timeout: float = REGISTER_TIMEOUT,
        observer: RegistrationObserver | None = None,
    ) -> None:
        self._config = config
        self.key = key
        self.clock = clock
        self.backoff = backoff if backoff is not None else default_backoff()
        self.check_interval = check_interval
        self.register_timeout = register_timeout
        self.observer = observer
        self.registrations = 0  # successful Register calls so far
        self.failures = 0  # failed attempts since the backoff last started over
        self._state = _State.STOPPED
        self._registered = asyncio.Event()  # set exactly while the state is REGISTERED
        self._inbox = _Inbox()
        self._round = _Round(config)
        self._attempts = 0  # Register calls made; kubelet's ListAndWatch stream is tagged with it
        self._kubelet_stream_seen = False  # the first stream since the latest Register was opened
        self._board: _DeviceBoard | None = None
        self._task: asyncio.Task[None] | None = None
        self._socket: _Socket | None = None

    @property
    def config(self) -> DevicePluginConfig:
        return self._config

    @property
    def state(self) -> RegistrationState:
        return self._state

    @property
    def registered(self) -> bool:
        """True while kubelet has accepted our registration and we have seen no sign of losing it."""
        return self._state is _State.REGISTERED

    @property
    def open_streams(self) -> int:
        """ListAndWatch streams open on the current socket (kubelet keeps one; for readiness probes)."""
        return self._socket.servicer.open_streams if self._socket is not None else 0

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("DevicePluginServer already started")
        install_grpc_log_filter()
        self._board = _DeviceBoard(self._config.device_count)
        self._start_backoff_over()
        self._enter(self._restart())
        self._task = asyncio.create_task(self._supervise(), name="device-plugin")

    async def close(self) -> None:
        """Stop registering and serving, and remove our socket. Idempotent."""
        task, self._task = self._task, None
        try:
            if task is not None:
                self._enter(_State.CLOSING)  # in case something below us swallows the cancellation
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        finally:
            await self._stop_serving()
            if self._closing:
                self._enter(_State.STOPPED)

    async def __aenter__(self) -> DevicePluginServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def wait_registered(self) -> None:
        """Return once kubelet has accepted our registration (at once if it already has)."""
        await self._registered.wait()

    def reconfigure(self, config: DevicePluginConfig) -> None:
        """Apply a new ``[device_plugin]`` table.

        A new ``device_count`` is pushed to kubelet on the open ListAndWatch stream. A change of
        ``enabled``, ``resource_name``, ``plugin_dir`` or ``endpoint`` re-creates the socket and
        registers again (or just stops, for ``enabled = false``).
        """
        old, self._config = self._config, config
        if self._board is not None:
            self._board.set_count(config.device_count)
        identity = ("enabled", "resource_name", "plugin_dir", "endpoint")
        if any(getattr(old, name) != getattr(config, name) for name in identity):
            self._inbox.post(_Signal.RECONFIGURED)

    # -- the state machine --------------------------------------------------------------------------

    def _enter(self, target: RegistrationState) -> None:
        check_transition(self._state, target)
        previous, self._state = self._state, target
        if target is _State.REGISTERED:
            self.registrations += 1
            self._registered.set()
        elif previous is _State.REGISTERED:
            self._registered.clear()
        log.debug("device plugin state", state=target.value, previous=previous.value)

    def _restart(self) -> RegistrationState:
        """Start a new round with the configuration of this moment; where it begins."""
        self._inbox.discard(_Signal.RECONFIGURED)
        self._round = _Round(self._config)
        return _State.WAITING_FOR_KUBELET if self._round.config.enabled else _State.DISABLED

    async def _supervise(self) -> None:
        """Run each state's step, which says the next state, until close()."""
        steps: dict[RegistrationState, Callable[[], Awaitable[RegistrationState]]] = {
            _State.DISABLED: self._disabled,
            _State.WAITING_FOR_KUBELET: self._wait_for_kubelet,
            _State.SERVING: self._serve_socket,
            _State.REGISTERING: self._register_with_kubelet,
            _State.REGISTERED: self._stay_registered,
            _State.LOST: self._take_socket_down,
            _State.BACKING_OFF: self._back_off,
        }
        while not self._closing:
            target = await steps[self._state]()
            if not self._closing:  # else close() took over while the step ran
                self._enter(target)

    @property
    def _closing(self) -> bool:
        return self._state is _State.CLOSING

    async def _disabled(self) -> RegistrationState:
        await self._stop_serving()
        log.info("device plugin disabled by configuration")
        await self._watch()  # only a reconfiguration ends it: no kubelet to watch
        return self._restart()

    async def _wait_for_kubelet(self) -> RegistrationState:
        path = str(self._round.config.kubelet_socket)
        kubelet = file_id(path)
        if kubelet is None:
            log.info("waiting for kubelet", socket=path)
        while kubelet is None:
            await self._pause(self.check_interval)
            if _Signal.RECONFIGURED in self._inbox:
                return self._restart()
            kubelet = file_id(path)
        self._round.kubelet = kubelet
        return _State.SERVING

    async def _serve_socket(self) -> RegistrationState:
        error = await self._serve(self._round.config)
        return _State.REGISTERING if error is None else self._failed(error)

    async def _register_with_kubelet(self) -> RegistrationState:
        error = await self._register(self._round.config)
        if error is not None:
            return self._failed(error)
        self._report("ok")
        self._round.registered_at = self.clock.monotonic()
        return _State.REGISTERED

    async def _stay_registered(self) -> RegistrationState:
        why = await self._watch(timeout=STABLE_REGISTRATION)
        if why is _WatchEnd.TIMEOUT:
            # Held long enough to count as a success: earlier failures no longer pace the next try.
            self._start_backoff_over()
            why = await self._watch()
        self._round.lost = why
        self._round.lasted = self.clock.monotonic() - self._round.registered_at
        return _State.LOST

    async def _take_socket_down(self) -> RegistrationState:
        why, lasted = self._round.lost, self._round.lasted
        assert why is not None
        log.warning("device plugin registration lost, registering again", reason=why.value)
        await self._stop_serving()
        if lasted >= STABLE_REGISTRATION or why is _WatchEnd.RECONFIGURED:
            self._start_backoff_over()
            return self._restart()
        self._round.error = f"registration lost after {lasted:.2f} s: {why.value}"
        return _State.BACKING_OFF

    async def _back_off(self) -> RegistrationState:
        delay = self.backoff.next()
        self.failures += 1
        log.warning(
            "device plugin registration failed",
            error=self._round.error,
            attempt=self.failures,
            retry_in=round(delay, 2),
        )
        why = await self._watch(timeout=delay)
        if why in (_WatchEnd.KUBELET_CHANGED, _WatchEnd.SOCKET_REMOVED):
            self._start_backoff_over()  # kubelet (re)started: try at once
        if why is not _WatchEnd.TIMEOUT:
            await self._stop_serving()
        return self._restart()

    def _failed(self, error: str) -> RegistrationState:
        self._report("failed")
        self._round.error = error
        return _State.BACKING_OFF

    def _report(self, outcome: str) -> None:
        if self.observer is not None:
            self.observer.registration_done(outcome)

    def _start_backoff_over(self) -> None:
        self.backoff.reset()
        self.failures = 0

    # -- waiting --------------------------------------------------------------------------------------

    async def _pause(self, seconds: float) -> None:
        if self._closing:
            raise asyncio.CancelledError("device plugin closing")
        await self._inbox.pause(self.clock, seconds)

    async def _watch(self, timeout: float | None = None) -> _WatchEnd:
        """Wait for a reason to stop waiting (see `_WatchEnd`), checking every `check_interval`."""
        deadline = None if timeout is None else self.clock.monotonic() + timeout
        while (why := self._check()) is None:
            pause = self.check_interval
            if deadline is not None:
                pause = min(pause, deadline - self.clock.monotonic())
                if pause <= 0:
                    return _WatchEnd.TIMEOUT
            await self._pause(pause)
        return why

    def _check(self) -> _WatchEnd | None:
        config, kubelet = self._round.config, self._round.kubelet
        if _Signal.RECONFIGURED in self._inbox:
            return _WatchEnd.RECONFIGURED
        if kubelet is None:  # disabled: only a reconfiguration wakes us
            return None
        if self._state is _State.REGISTERED and _Signal.STREAM_ENDED in self._inbox:
            return _WatchEnd.STREAM_ENDED
        if self._socket is not None and file_id(str(config.socket_path)) != self._socket.file_id:
            return _WatchEnd.SOCKET_REMOVED
        if file_id(str(config.kubelet_socket)) != kubelet:
            return _WatchEnd.KUBELET_CHANGED
        return None

    def _stream_token(self) -> int:
        """Kubelet's stream (the first one opened since our latest Register) gets that Register's
        number; every other stream a number no Register has (see the module docstring)."""
        if self._kubelet_stream_seen:
            log.debug("ListAndWatch opened by a client other than kubelet; its end changes nothing")
            return _NOT_KUBELETS
        self._kubelet_stream_seen = True
        return self._attempts

    def _stream_ended(self, token: int) -> None:
        # Only the stream kubelet opened for our latest Register counts: older ones end when kubelet
        # replaces a connection or when we replace the socket, and other clients' are no news. It may
        # end even before Register has returned to us; then the registration is lost as soon as made.
        if token == self._attempts:
            self._inbox.post(_Signal.STREAM_ENDED)

    # -- socket and registration --------------------------------------------------------------------

    async def _serve(self, config: DevicePluginConfig) -> str | None:
        """Make sure our socket is up (re-created if it is gone); an error text if it cannot be."""
        path = str(config.socket_path)
        if self._socket is not None and file_id(path) == self._socket.file_id:
            return None
        await self._stop_serving()
        assert self._board is not None
        servicer = SharedCpusServicer(
            resource_name=config.resource_name,
            key=self.key,
            board=self._board,
            stream_token=self._stream_token,
            on_stream_end=self._stream_ended,
        )
        server = grpc.aio.server()
        api_grpc.add_DevicePluginServicer_to_server(servicer, server)
        self._socket = _Socket(server, servicer, path)  # from here on, _stop_serving() cleans up
        try:
            self._socket.file_id = bind_socket(
                path, lambda temporary: server.add_insecure_port(f"unix:{temporary}")
            )
            await server.start()
        except (OSError, RuntimeError) as exc:
            await self._stop_serving()
            return f"cannot serve on {path}: {exc}"
        log.info("device plugin serving", socket=path)
        return None

    async def _stop_serving(self) -> None:
        served, self._socket = self._socket, None
        if served is not None:
            # The name first, before anything that awaits (and may be cancelled): the listening
            # socket serves on without it. A file someone put there since is left alone.
            remove_if_ours(served.path, served.file_id)
            served.servicer.close_streams()
            await served.server.stop(STOP_GRACE)

    async def _register(self, config: DevicePluginConfig) -> str | None:
        """Call Registration/Register on kubelet.sock; an error text if kubelet did not take us."""
        request = api.RegisterRequest(
            version=API_VERSION,
            endpoint=config.endpoint,
            resource_name=config.resource_name,
            options=api.DevicePluginOptions(
                pre_start_required=False, get_preferred_allocation_available=False
            ),
        )
        self._attempts += 1
        self._kubelet_stream_seen = False
        self._inbox.discard(_Signal.STREAM_ENDED)
        where = f"Register on {config.kubelet_socket}"
        target = f"unix:{config.kubelet_socket}"
        async with grpc.aio.insecure_channel(target, options=_FRESH_CONNECTION) as channel:
            stub = api_grpc.RegistrationStub(channel)
            try:
                await within(self.clock, self.register_timeout, stub.Register(request))
            except grpc.aio.AioRpcError as exc:
                return f"{where}: {exc.code().name}: {exc.details()}"
            except TimeoutError:
                return f"{where}: no answer within {self.register_timeout} s"
        log.info(
            "registered with kubelet",
            resource=config.resource_name,
            endpoint=config.endpoint,
            devices=config.device_count,
        )
        return None
