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
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import random
import stat
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import structlog

from api.deviceplugin.v1beta1 import api_pb2 as api
from api.deviceplugin.v1beta1 import api_pb2_grpc as api_grpc
from nri_plugin.deviceplugin.config import DevicePluginConfig
from nri_plugin.deviceplugin.marker import ANNOTATION_KEY, HostKey

if TYPE_CHECKING:
    from grpc.aio import ServicerContext

log = structlog.get_logger("nri_plugin.deviceplugin")


class _CancelledRpcFilter(logging.Filter):
    """Drop grpc's error report for an RPC that was cancelled.

    grpc.aio logs, with a traceback, every servicer task that ends in CancelledError. Ours end so only
    when the server stops (a ListAndWatch that kubelet opened while we were shutting down, say): a
    normal part of a clean shutdown, not an error an operator should see.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info is not None and isinstance(record.exc_info[1], asyncio.CancelledError))


logging.getLogger("grpc._cython.cygrpc").addFilter(_CancelledRpcFilter())

API_VERSION = "v1beta1"  # what Register announces; the only version kubelet supports
HEALTHY = "Healthy"
DEVICE_ID_PREFIX = "shared-cpus-"

CHECK_INTERVAL = 0.2  # seconds between the socket checks (see the module docstring)
REGISTER_TIMEOUT = 5.0  # kubelet answers Register once it has dialed us back: normally milliseconds
BACKOFF_INITIAL = 0.1
BACKOFF_MAX = 5.0
# A registration that is lost sooner than this counts as a failed attempt, so that a kubelet that
# takes us and drops us at once is retried with backoff rather than in a tight loop.
STABLE_REGISTRATION = 1.0
# How long stop() lets an in-flight Allocate finish; ListAndWatch streams are ended first.
STOP_GRACE = 1.0


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


class _Why(enum.Enum):
    """Why the supervisor stopped waiting."""

    TIMEOUT = "backoff elapsed"
    RECONFIGURED = "configuration changed"
    STREAM_ENDED = "kubelet ended ListAndWatch"
    SOCKET_REMOVED = "our socket was removed"
    KUBELET_CHANGED = "kubelet.sock changed"


_FileId = tuple[int, int, int]


def _file_id(path: str) -> _FileId | None:
    """(device, inode, ctime) of ``path`` itself, None if it is not there (or cannot be looked at)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_ctime_ns)


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


class DevicePluginServer:
    """Serves and registers the device plugin, and keeps it registered across kubelet restarts.

    ``start()`` returns at once; the work runs in a background task that waits for ``kubelet.sock``,
    creates our socket (mode 0600), registers, and watches for kubelet restarts. ``close()`` stops it
    and removes the socket. Use as ``async with DevicePluginServer(config, key) as plugin: ...``.
    """

    def __init__(
        self,
        config: DevicePluginConfig,
        key: HostKey,
        *,
        check_interval: float = CHECK_INTERVAL,
        register_timeout: float = REGISTER_TIMEOUT,
        backoff_initial: float = BACKOFF_INITIAL,
        backoff_max: float = BACKOFF_MAX,
        observer: RegistrationObserver | None = None,
    ) -> None:
        self._config = config
        self.observer = observer
        self.key = key
        self.check_interval = check_interval
        self.register_timeout = register_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.registrations = 0  # successful Register calls so far
        self._board: _DeviceBoard | None = None
        self._task: asyncio.Task[None] | None = None
        self._grpc: grpc.aio.Server | None = None
        self._servicer: SharedCpusServicer | None = None
        self._socket_id: _FileId | None = None
        # asyncio.Event binds to a loop on first use, so these may be made outside one.
        self._wake = asyncio.Event()
        self._registered = asyncio.Event()
        self._restart_pending = False
        self._attempt = 0  # Register calls made; ListAndWatch streams are tagged with it
        self._stream_lost = False  # the stream of the current attempt has ended
        self._closing = False

    @property
    def config(self) -> DevicePluginConfig:
        return self._config

    @property
    def registered(self) -> bool:
        """True while kubelet has accepted our registration and we have seen no sign of losing it."""
        return self._registered.is_set()

    @property
    def open_streams(self) -> int:
        """ListAndWatch streams open on the current socket (kubelet keeps one; for readiness probes)."""
        return self._servicer.open_streams if self._servicer is not None else 0

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("DevicePluginServer already started")
        self._board = _DeviceBoard(self._config.device_count)
        self._task = asyncio.create_task(self._supervise(), name="device-plugin")

    async def close(self) -> None:
        """Stop registering and serving, and remove our socket. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            self._closing = True  # in case something below us swallows the cancellation
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._set_registered(False)
        await self._stop_serving()

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
            self._restart_pending = True
            self._wake.set()

    # -- supervisor ---------------------------------------------------------------------------------

    async def _supervise(self) -> None:
        failures = 0
        while not self._closing:
            self._restart_pending = False
            config = self._config
            if not config.enabled:
                await self._stop_serving()
                log.info("device plugin disabled by configuration")
                await self._watch(config, None, timeout=None)
                continue
            kubelet = await self._wait_for_kubelet(config)
            if kubelet is None:
                continue  # reconfigured meanwhile
            error = await self._serve(config)
            if error is None:
                error = await self._register(config)
            if self.observer is not None:
                self.observer.registration_done("ok" if error is None else "failed")
            if error is None:
                loop = asyncio.get_running_loop()
                since = loop.time()
                self._set_registered(True)
                why = await self._watch(config, kubelet, timeout=None)
                self._set_registered(False)
                lasted = loop.time() - since
                log.warning("device plugin registration lost, registering again", reason=why.value)
                await self._stop_serving()
                if lasted >= STABLE_REGISTRATION or why is _Why.RECONFIGURED:
                    failures = 0
                    continue
                error = f"registration lost after {lasted:.2f} s: {why.value}"
            delay = min(self.backoff_initial * 2**failures, self.backoff_max) * random.uniform(0.5, 1.0)
            failures += 1
            log.warning(
                "device plugin registration failed", error=error, attempt=failures, retry_in=round(delay, 2)
            )
            why = await self._watch(config, kubelet, timeout=delay)
            if why in (_Why.KUBELET_CHANGED, _Why.SOCKET_REMOVED):
                failures = 0  # kubelet (re)started: try at once
            if why is not _Why.TIMEOUT:
                await self._stop_serving()

    def _set_registered(self, registered: bool) -> None:
        if registered:
            self.registrations += 1
            self._registered.set()
        else:
            self._registered.clear()

    async def _wait_for_kubelet(self, config: DevicePluginConfig) -> _FileId | None:
        """Wait until kubelet.sock exists; its identity, or None if reconfigured meanwhile."""
        path = str(config.kubelet_socket)
        kubelet = _file_id(path)
        if kubelet is None:
            log.info("waiting for kubelet", socket=path)
        while kubelet is None:
            if await self._sleep(self.check_interval):
                return None
            kubelet = _file_id(path)
        return kubelet

    async def _sleep(self, seconds: float) -> bool:
        """Sleep, or less if woken; True if a restart is pending.

        Not ``asyncio.wait_for``: before Python 3.12 it can return normally, swallowing a cancellation,
        when the wake-up and ``close()`` coincide (a kubelet leaving as we shut down), and the
        supervisor would then run on.
        """
        if self._closing:
            raise asyncio.CancelledError("device plugin closing")
        self._wake.clear()
        if not self._restart_pending:
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait([waiter], timeout=seconds)
            finally:
                waiter.cancel()
        return self._restart_pending

    async def _watch(
        self, config: DevicePluginConfig, kubelet: _FileId | None, timeout: float | None
    ) -> _Why:
        """Wait for a reason to stop waiting: see ``_Why``."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            why = self._check(config, kubelet)
            if why is not None:
                return why
            pause = self.check_interval
            if deadline is not None:
                pause = min(pause, deadline - loop.time())
                if pause <= 0:
                    return _Why.TIMEOUT
            await self._sleep(pause)

    def _check(self, config: DevicePluginConfig, kubelet: _FileId | None) -> _Why | None:
        if self._restart_pending:
            return _Why.RECONFIGURED
        if kubelet is None:  # disabled: only a reconfiguration wakes us
            return None
        if self._stream_lost and self.registered:
            return _Why.STREAM_ENDED
        if self._grpc is not None and _file_id(str(config.socket_path)) != self._socket_id:
            return _Why.SOCKET_REMOVED
        if _file_id(str(config.kubelet_socket)) != kubelet:
            return _Why.KUBELET_CHANGED
        return None

    def _stream_token(self) -> int:
        return self._attempt

    def _stream_ended(self, token: int) -> None:
        # Only the stream kubelet opened for our latest Register counts: older ones end when kubelet
        # replaces a connection or when we replace the socket, and are no news. It may end even before
        # Register has returned to us; then the registration is lost as soon as it is made.
        if token == self._attempt:
            self._stream_lost = True
            self._wake.set()

    # -- socket and registration --------------------------------------------------------------------

    async def _serve(self, config: DevicePluginConfig) -> str | None:
        """Make sure our socket is up (re-created if it is gone); an error text if it cannot be."""
        path = str(config.socket_path)
        if self._grpc is not None and _file_id(path) == self._socket_id:
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
        self._grpc, self._servicer = server, servicer  # from here on, _stop_serving() cleans up
        try:
            _remove_stale_socket(path)
            # Bind with a umask that leaves the socket 0600 from its first instant, then say so again.
            umask = os.umask(0o177)
            try:
                server.add_insecure_port(f"unix:{path}")
            finally:
                os.umask(umask)
            os.chmod(path, 0o600)
            await server.start()
        except (OSError, RuntimeError) as exc:
            await self._stop_serving()
            return f"cannot serve on {path}: {exc}"
        self._socket_id = _file_id(path)
        log.info("device plugin serving", socket=path)
        return None

    async def _stop_serving(self) -> None:
        server, servicer = self._grpc, self._servicer
        self._grpc, self._servicer, self._socket_id = None, None, None
        if servicer is not None:
            servicer.close_streams()
        if server is not None:
            await server.stop(STOP_GRACE)

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
        self._attempt += 1
        self._stream_lost = False
        async with grpc.aio.insecure_channel(f"unix:{config.kubelet_socket}") as channel:
            stub = api_grpc.RegistrationStub(channel)
            try:
                await stub.Register(request, timeout=self.register_timeout)
            except grpc.aio.AioRpcError as exc:
                return f"Register on {config.kubelet_socket}: {exc.code().name}: {exc.details()}"
        log.info(
            "registered with kubelet",
            resource=config.resource_name,
            endpoint=config.endpoint,
            devices=config.device_count,
        )
        return None


def _remove_stale_socket(path: str) -> None:
    """Remove a socket left at ``path`` by an earlier run; refuse to remove anything else."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise OSError(f"{path} exists and is not a socket; remove it or set another [device_plugin] endpoint")
    os.unlink(path)
