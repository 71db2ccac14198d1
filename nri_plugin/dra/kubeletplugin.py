"""The DRA kubelet plugin: registration through kubelet's plugin watcher, ``dra.v1`` and device health.

kubelet learns of a DRA driver from a unix socket in its plugin registry directory
(``/var/lib/kubelet/plugins_registry/<driver>-reg.sock``): its plugin watcher sees the socket appear,
calls ``pluginregistration.Registration/GetInfo`` on it, checks the answer (type ``DRAPlugin``, a
version it speaks), dials the announced endpoint and says how that went with
``NotifyRegistrationStatus``. From then on kubelet calls the endpoint
(``/var/lib/kubelet/plugins/<driver>/dra.sock``):

* ``NodePrepareResources`` before a pod's containers start, naming the pod's claims of our driver.
  For each claim we ask the `ClaimSource` (the API server) which of our devices it was allocated,
  write its CDI spec (`nri_plugin.dra.cdi`: the edits set the signed marker variable) and answer
  the devices with their CDI device ids. A claim that cannot be prepared gets its own ``error``
  entry; the call itself never fails for one bad claim, so the others proceed.
* ``NodeUnprepareResources`` once the pod is gone: the spec is removed (already gone is success).
* ``NodeWatchResources`` (``v1.DRAResourceHealth``, and ``v1alpha1.DRAResourceHealth`` for kubelets
  1.34-1.36, which have only that client): every device healthy, sent when the stream opens and
  again every `HEALTH_REFRESH` seconds, so kubelet never sees a device go stale.

Both calls are idempotent: kubelet repeats them until every claim succeeds, also across our
restarts. A prepare repeated while the API server cannot be reached (the daemon restarted during an
outage: no connection, or no answer in time) is answered from the spec file written the first time,
whose annotations record the claim's devices; the spec is then rewritten from that record with the
current key. Only then, and only from a spec that proves to be ours: every device it names is one
this node published, in our pool, and carries the marker the node's key signs for it (a planted spec
cannot). An answer of the API server (the claim is gone, re-created, refused, a server error) is
final: it is the claim's error, whatever file is there.

One kubelet call may name thousands of claims, and the loop that prepares them also serves the
runtime's NRI requests, which must never wait long. So at most `PREPARE_CONCURRENCY` claims are
prepared at a time (across all calls), each claim's step yields to the loop before the next, the
file writes run in worker threads, and each claim prepared is logged at debug level with one line
per call at info (failures at warning, at most `FAILURE_LINES` a call, the rest counted).

A starting kubelet's plugin watcher only notices sockets created after it watches, and an operator or
a clean-up may delete ours: the registration socket is checked every `CHECK_INTERVAL` (an ``lstat``)
and served anew when it is gone or another file, so kubelet calls GetInfo again. The service socket is
checked likewise. Both sockets are mode 0600 (kubelet runs as root), made by
`nri_plugin.common.unixsocket`. A socket that cannot be served again (a file planted at its path)
is said at warning once, then every `REPEAT_WARNING` seconds while it lasts.

Strings from kubelet (a registration error) and from the API server (in a claim's error) are capped
and escaped (`nri_plugin.common.text.clip`) before they are kept, logged or answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import grpc
import structlog

from nri_plugin.api.dra.v1 import api_pb2 as dra
from nri_plugin.api.dra.v1 import api_pb2_grpc as dra_grpc
from nri_plugin.api.drahealth.v1 import api_pb2 as health
from nri_plugin.api.drahealth.v1 import api_pb2_grpc as health_grpc
from nri_plugin.api.drahealth.v1alpha1 import api_pb2 as health_alpha
from nri_plugin.api.drahealth.v1alpha1 import api_pb2_grpc as health_alpha_grpc
from nri_plugin.api.pluginregistration.v1 import api_pb2 as reg
from nri_plugin.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from nri_plugin.common.clock import LOOP_CLOCK, Clock, sleep_unless, within
from nri_plugin.common.k8snames import is_dns_subdomain
from nri_plugin.common.text import clip
from nri_plugin.common.unixsocket import FileId, bind_socket, file_id, remove_if_ours, socket_path_problem
from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.dra import cdi
from nri_plugin.dra.claims import AllocatedDevice, ClaimError, ClaimSource, ClaimSourceUnreachable
from nri_plugin.dra.config import DRIVER_NAME_MAX

if TYPE_CHECKING:
    from grpc.aio import ServicerContext

__all__ = [
    "CHECK_INTERVAL",
    "PLUGIN_TYPE",
    "SUPPORTED_VERSIONS",
    "DraKubeletPlugin",
    "DraPluginError",
    "DraPluginSettings",
]

log = structlog.get_logger("nri_plugin.dra")
T = TypeVar("T")

PLUGIN_TYPE: Final = "DRAPlugin"  # kubelet's plugin handler for DRA drivers
# The gRPC services we serve on the endpoint, as kubelet names them in supported_versions. kubelets
# 1.34-1.36 open the health stream as v1alpha1 (whatever we announce); later ones pick v1 when announced.
SUPPORTED_VERSIONS: Final = ("v1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
CHECK_INTERVAL: Final = 0.5  # seconds between the socket checks
HEALTH_REFRESH: Final = 10.0  # seconds between repeats of the (unchanging) health list
CLAIM_TIMEOUT: Final = 10.0  # how long a prepare waits for the ClaimSource before it uses the file
STOP_GRACE: Final = 1.0  # how long close() lets an in-flight call finish
# Claims prepared at once, over all calls: enough to overlap the API server's round trips, few enough
# that the loop's queue never holds more than a few claims' steps ahead of an NRI request.
PREPARE_CONCURRENCY: Final = 8
FAILURE_LINES: Final = 5  # claim failures logged one by one per call; the rest are counted
REPEAT_WARNING: Final = 60.0  # seconds between warnings while a socket still cannot be served
_ERROR_LIMIT: Final = 1024  # characters of a claim's error kept (it quotes the API server)


class DraPluginError(Exception):
    """The plugin cannot serve (a bad driver name, a socket that cannot be created); the message
    says which path or value and what to do."""


class _ClaimLocks:
    """One lock per claim uid while someone holds or waits for it: a prepare and an unprepare of the
    same claim never interleave (a prepare waiting on the API server then writing a spec that an
    unprepare had just removed), while different claims proceed side by side."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, uid: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(uid, (asyncio.Lock(), 0))
        self._locks[uid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[uid]
            if users == 1:
                del self._locks[uid]
            else:
                self._locks[uid] = (lock, users - 1)


class _RegistrationServicer(reg_grpc.RegistrationServicer):
    def __init__(self, plugin: DraKubeletPlugin) -> None:
        self._plugin = plugin

    async def GetInfo(self, request: reg.InfoRequest, context: ServicerContext[Any, Any]) -> reg.PluginInfo:
        plugin = self._plugin
        log.info("kubelet asked for our plugin info", event_name="GetInfo", driver=plugin.driver_name)
        return reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=plugin.driver_name,
            endpoint=str(plugin.endpoint),
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    async def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: ServicerContext[Any, Any]
    ) -> reg.RegistrationStatusResponse:
        self._plugin._registration_status(request.plugin_registered, request.error)
        return reg.RegistrationStatusResponse()


class _DraServicer(dra_grpc.DRAPluginServicer):
    def __init__(self, plugin: DraKubeletPlugin) -> None:
        self._plugin = plugin

    async def NodePrepareResources(
        self, request: dra.NodePrepareResourcesRequest, context: ServicerContext[Any, Any]
    ) -> dra.NodePrepareResourcesResponse:
        return await self._plugin._prepare_all(request.claims)

    async def NodeUnprepareResources(
        self, request: dra.NodeUnprepareResourcesRequest, context: ServicerContext[Any, Any]
    ) -> dra.NodeUnprepareResourcesResponse:
        return await self._plugin._unprepare_all(request.claims)


class _HealthServicer(health_grpc.DRAResourceHealthServicer):
    def __init__(self, plugin: DraKubeletPlugin) -> None:
        self._plugin = plugin

    async def NodeWatchResources(
        self, request: health.NodeWatchResourcesRequest, context: ServicerContext[Any, Any]
    ) -> AsyncIterator[health.NodeWatchResourcesResponse]:
        async for message in self._plugin._health_stream("v1"):
            yield message


class _HealthV1Alpha1Servicer(health_alpha_grpc.DRAResourceHealthServicer):
    """The same stream for kubelets that only have the v1alpha1 client: the two versions' messages
    have the same fields and numbers, so each message is v1's bytes read as v1alpha1's type."""

    def __init__(self, plugin: DraKubeletPlugin) -> None:
        self._plugin = plugin

    async def NodeWatchResources(
        self, request: health_alpha.NodeWatchResourcesRequest, context: ServicerContext[Any, Any]
    ) -> AsyncIterator[health_alpha.NodeWatchResourcesResponse]:
        async for message in self._plugin._health_stream("v1alpha1"):
            yield health_alpha.NodeWatchResourcesResponse.FromString(message.SerializeToString())


@dataclass(frozen=True)
class DraPluginSettings:
    """What the kubelet plugin needs of the ``[dra]`` table and the device plugin's device count,
    plus its pacing (tests shorten it). Checked when made: `DraPluginError` says what to fix."""

    driver_name: str
    registry_dir: str | os.PathLike[str]  # kubelet's plugin watcher directory
    plugins_dir: str | os.PathLike[str]  # the service socket is <plugins_dir>/<driver_name>/dra.sock
    cdi_dir: str | os.PathLike[str]
    pool_name: str  # our ResourceSlice pool: the node name
    device_names: tuple[str, ...]  # the devices of that pool, for the health stream
    check_interval: float = CHECK_INTERVAL
    claim_timeout: float = CLAIM_TIMEOUT
    health_refresh: float = HEALTH_REFRESH
    fsync: bool = True  # False only for tests on throw-away directories

    def __post_init__(self) -> None:
        if not is_dns_subdomain(self.driver_name, DRIVER_NAME_MAX):
            raise DraPluginError(
                f"DRA driver name {self.driver_name!r} is not a DNS subdomain of at most 63 "
                "characters (lowercase letters, digits, '-' and '.'); set [dra] driver_name"
            )
        if not self.pool_name:
            raise DraPluginError(
                "the DRA pool name (the node name) is empty; set [dra] node_name or env NODE_NAME"
            )
        for path in (self.registration_socket, self.endpoint):
            problem = socket_path_problem(path)
            if problem is not None:
                raise DraPluginError(f"{problem}; use shorter [dra] registry_dir, plugins_dir or driver_name")

    @property
    def registration_socket(self) -> Path:
        """``<registry_dir>/<driver>-reg.sock``, where kubelet's plugin watcher finds us."""
        return Path(self.registry_dir) / f"{self.driver_name}-reg.sock"

    @property
    def endpoint(self) -> Path:
        """``<plugins_dir>/<driver>/dra.sock``, the ``dra.v1`` and health service."""
        return Path(self.plugins_dir) / self.driver_name / "dra.sock"


@dataclass
class _Served:
    """A gRPC server and the socket file it listens on."""

    server: grpc.aio.Server
    path: str
    file_id: FileId | None = None


class DraKubeletPlugin:
    """Serves the DRA kubelet plugin of the settings' driver and keeps its registration socket there.

    Use as ``async with DraKubeletPlugin(settings, key, claims) as plugin:``. `start()` creates both
    sockets (and their directories) and returns; it raises `DraPluginError` when it cannot. A
    background task then checks every `check_interval` that they are still ours and serves them anew
    if not. `close()` stops both servers and removes the sockets.

    ``registered`` is True once kubelet reported a successful registration, until the registration
    socket had to be re-created (kubelet then registers us again); ``registration_error`` is the last
    error kubelet reported, "" if none. `wait_registered()` waits for it.
    """

    def __init__(
        self, settings: DraPluginSettings, key: HostKey, claims: ClaimSource, *, clock: Clock = LOOP_CLOCK
    ) -> None:
        self.settings = settings
        self.driver_name = settings.driver_name
        self.registration_socket = settings.registration_socket
        self.endpoint = settings.endpoint
        self.cdi_dir = Path(settings.cdi_dir)
        self.key = key
        self.claims = claims
        self.pool_name = settings.pool_name
        self.device_names = settings.device_names
        self.clock = clock
        self.check_interval = settings.check_interval
        self.claim_timeout = settings.claim_timeout
        self.health_refresh = settings.health_refresh
        self.fsync = settings.fsync
        self.registrations = 0  # successful registrations kubelet reported
        self.registration_sockets = 0  # times the registration socket was created
        self.open_health_streams = 0
        # Called at each successful registration kubelet reports (the front door checks the slices).
        self.on_registered: Callable[[], None] | None = None
        self._registration_error = ""
        self._registered = asyncio.Event()
        self._closing = asyncio.Event()
        self._locks = _ClaimLocks()
        self._prepare_slots = asyncio.Semaphore(PREPARE_CONCURRENCY)
        # The spec files are written, read and removed by one thread of our own (made at start): the
        # loop shares the interpreter with one worker at most, never with a pool of them.
        self._files: ThreadPoolExecutor | None = None
        self._published = frozenset(settings.device_names)
        self._serve_failures = 0  # failed attempts to serve the sockets again, since the last success
        self._serve_warned_at: float | None = None
        self._service: _Served | None = None
        self._registration: _Served | None = None
        self._task: asyncio.Task[None] | None = None

    # -- public state ---------------------------------------------------------------------------------

    @property
    def registered(self) -> bool:
        """True while kubelet's latest word on our registration socket was a success."""
        return self._registered.is_set()

    @property
    def registration_error(self) -> str:
        """The error kubelet last reported for our registration ("" if none)."""
        return self._registration_error

    @property
    def serving(self) -> bool:
        """True while both sockets are served."""
        return self._service is not None and self._registration is not None

    async def wait_registered(self) -> None:
        """Return once kubelet has reported our registration a success (at once if it has)."""
        await self._registered.wait()

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("DraKubeletPlugin already started")
        self._closing.clear()
        self._files = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dra-cdi-files")
        try:
            await self._ensure_served()
        except DraPluginError:
            await self.close()
            raise
        self._task = asyncio.create_task(self._keep_served(), name="dra-kubelet-plugin")

    async def close(self) -> None:
        """Stop serving and remove both sockets. Idempotent."""
        self._closing.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._stop_serving()
        files, self._files = self._files, None
        if files is not None:
            files.shutdown(wait=False)  # a write under way finishes; nothing waits for it any more

    async def __aenter__(self) -> DraKubeletPlugin:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- sockets --------------------------------------------------------------------------------------

    async def _keep_served(self) -> None:
        while not await sleep_unless(self.clock, self._closing, self.check_interval):
            try:
                await self._ensure_served()
            except DraPluginError as exc:
                self._serve_failed(exc)
                continue
            if self._serve_failures:
                log.info("DRA plugin sockets served again", failed_attempts=self._serve_failures)
                self._serve_failures = 0
                self._serve_warned_at = None

    def _serve_failed(self, exc: DraPluginError) -> None:
        """A failed attempt to serve a socket again: a warning for the first, then one every
        `REPEAT_WARNING` seconds while they go on (the others at debug level)."""
        self._serve_failures += 1
        now = self.clock.monotonic()
        if self._serve_warned_at is not None and now - self._serve_warned_at < REPEAT_WARNING:
            log.debug("DRA plugin socket still cannot be re-created", error=str(exc))
            return
        self._serve_warned_at = now
        log.warning(
            "DRA plugin socket could not be re-created; trying again every "
            f"{self.check_interval:g} s (said again every {REPEAT_WARNING:g} s while it fails)",
            error=str(exc),
            failed_attempts=self._serve_failures,
        )

    async def _ensure_served(self) -> None:
        """Serve whichever socket is not (yet, or any more) ours: the service socket first, so kubelet
        can dial the endpoint as soon as it sees the registration socket."""
        if not _still_ours(self._service):
            if self._service is not None:
                log.warning("DRA service socket gone; serving it again", socket=str(self.endpoint))
            await _stop(self._service)
            self._service = None
            server = grpc.aio.server()
            dra_grpc.add_DRAPluginServicer_to_server(_DraServicer(self), server)
            health_grpc.add_DRAResourceHealthServicer_to_server(_HealthServicer(self), server)
            health_alpha_grpc.add_DRAResourceHealthServicer_to_server(_HealthV1Alpha1Servicer(self), server)
            self._service = await _serve(server, self.endpoint, dir_mode=0o750)
            log.info("DRA plugin serving", socket=str(self.endpoint), driver=self.driver_name)
        if not _still_ours(self._registration):
            if self._registration is not None:
                log.warning(
                    "DRA registration socket gone; serving it again so kubelet registers us again",
                    socket=str(self.registration_socket),
                )
                self._registered.clear()
            await _stop(self._registration)
            self._registration = None
            server = grpc.aio.server()
            reg_grpc.add_RegistrationServicer_to_server(_RegistrationServicer(self), server)
            self._registration = await _serve(server, self.registration_socket, dir_mode=0o750)
            self.registration_sockets += 1
            log.info("DRA registration socket ready", socket=str(self.registration_socket))

    async def _stop_serving(self) -> None:
        served = [s for s in (self._registration, self._service) if s is not None]
        self._registration = self._service = None
        for each in served:  # the names first, before anything that awaits (and may be cancelled)
            remove_if_ours(each.path, each.file_id)  # a file someone put there since is left alone
        for each in served:
            await _stop(each)
        self._registered.clear()

    # -- registration ---------------------------------------------------------------------------------

    def _registration_status(self, registered: bool, error: str) -> None:
        if registered:
            self.registrations += 1
            self._registration_error = ""
            self._registered.set()
            log.info("registered with kubelet", driver=self.driver_name, endpoint=str(self.endpoint))
            if self.on_registered is not None:
                self.on_registered()
        else:
            self._registration_error = clip(error) if error else "kubelet gave no reason"
            self._registered.clear()
            log.error(
                "kubelet refused our DRA plugin", driver=self.driver_name, error=self._registration_error
            )

    # -- dra.v1 -----------------------------------------------------------------------------------------

    async def _in_file_thread(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`call(*args, **kwargs)` on the plugin's file thread (or the loop's default executor
        when the plugin is not started)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._files, functools.partial(call, *args, **kwargs)
        )

    async def _prepare_all(self, claims: Sequence[dra.Claim]) -> dra.NodePrepareResourcesResponse:
        """The claims of one NodePrepareResources call, at most `PREPARE_CONCURRENCY` at a time over
        all calls, the loop given back after each one; never raises."""
        response = dra.NodePrepareResourcesResponse()
        pending: Iterator[dra.Claim] = iter(claims)
        report = _CallReport("NodePrepareResources")
        started = self.clock.monotonic()

        async def worker() -> None:
            for claim in pending:  # one iterator shared by the workers: each claim is taken once
                async with self._prepare_slots:
                    answer = await self._prepare(claim.namespace, claim.name, claim.uid, report)
                response.claims[claim.uid].CopyFrom(answer)
                await asyncio.sleep(0)  # an NRI request waiting behind this claim goes first

        await asyncio.gather(*(worker() for _ in range(min(PREPARE_CONCURRENCY, len(claims)))))
        report.summary(len(claims), seconds=round(self.clock.monotonic() - started, 3))
        return response

    async def _prepare(
        self, namespace: str, name: str, uid: str, report: _CallReport | None = None
    ) -> dra.NodePrepareResourceResponse:
        """One claim of a NodePrepareResources call; never raises."""
        report = report if report is not None else _CallReport("NodePrepareResources")
        claim = cdi.ClaimRef(namespace=namespace, name=name, uid=uid)
        try:
            cdi.check_claim(claim)
            async with self._locks.hold(uid):
                devices = await self._allocated_devices(claim)
                self._check_published(devices)
                spec = cdi.build_spec(claim, devices, self.key)
                await self._in_file_thread(cdi.write_spec, self.cdi_dir, claim, spec, fsync=self.fsync)
        except (ClaimError, cdi.CdiError, OSError) as exc:
            return dra.NodePrepareResourceResponse(error=report.failure(claim, clip(str(exc), _ERROR_LIMIT)))
        except Exception as exc:  # a bug must cost one claim, never the daemon
            log.exception("NodePrepareResources: unexpected failure", uid=clip(uid, 80))
            reason = f"internal error in the DRA driver: {clip(repr(exc), _ERROR_LIMIT)}"
            return dra.NodePrepareResourceResponse(error=report.failure(claim, reason))
        answer = dra.NodePrepareResourceResponse()
        for prepared in cdi.prepared_devices(uid, devices):
            answer.devices.add(
                request_names=list(prepared.requests),
                pool_name=prepared.pool,
                device_name=prepared.device,
                cdi_device_ids=[prepared.cdi_device_id],
            )
        report.done += 1
        log.debug(
            "NodePrepareResources: claim prepared",
            event_name="NodePrepareResources",
            claim=f"{namespace}/{name}",
            uid=uid,
            devices=[d.device for d in devices],
        )
        return answer

    async def _allocated_devices(self, claim: cdi.ClaimRef) -> tuple[AllocatedDevice, ...]:
        """The claim's devices from the ClaimSource. Only while it cannot reach the API server (no
        connection, no answer in time), from the spec written earlier, if it proves to be ours
        (ClaimError if there is none); any answer of the API server is final."""
        try:
            devices = await within(
                self.clock,
                self.claim_timeout,
                self.claims.allocated_devices(claim.namespace, claim.name, claim.uid),
            )
        except (ClaimSourceUnreachable, TimeoutError) as exc:
            reason = (
                str(exc)
                if isinstance(exc, ClaimSourceUnreachable)
                else f"the claim source gave no answer within {self.claim_timeout} s"
            )
            recorded = await self._in_file_thread(
                cdi.read_recorded,
                self.cdi_dir,
                claim,
                key=self.key,
                pool=self.pool_name,
                devices=self._published,
            )
            if recorded is None:
                raise ClaimError(reason) from None
            log.warning(
                "NodePrepareResources: the API server cannot be reached; answering from our spec",
                claim=f"{claim.namespace}/{claim.name}",
                uid=claim.uid,
                reason=clip(reason),
            )
            return recorded
        except ClaimError:
            raise
        except Exception as exc:  # a broken claim source is the claim's error, never a file's say
            log.warning("claim source failed unexpectedly", exc_info=exc, uid=claim.uid)
            raise ClaimError(f"the claim source failed: {clip(repr(exc))}") from None
        if not devices:
            raise ClaimError("its allocation names no device of this driver; check the claim's status")
        return tuple(devices)

    def _check_published(self, devices: Sequence[AllocatedDevice]) -> None:
        """Refuse a device this node did not publish: another node's pool, or a name our pool lacks."""
        for device in devices:
            if device.pool != self.pool_name:
                raise cdi.CdiError(
                    f"device {clip(device.device, 80)} was allocated from pool {clip(device.pool, 80)!r}, "
                    f"but this node's pool is {self.pool_name!r}: the claim was allocated for another node"
                )
            if device.device not in self._published:
                raise cdi.CdiError(
                    f"device {clip(device.device, 80)} is not one this node published (its pool has "
                    f"{len(self._published)} devices): the allocation is stale or forged; check the "
                    "claim's status and the node's ResourceSlices"
                )

    async def _unprepare_all(self, claims: Sequence[dra.Claim]) -> dra.NodeUnprepareResourcesResponse:
        """The claims of one NodeUnprepareResources call, one after another (each waits for the file
        thread, so the loop turns between them); logged as prepares are. Never raises."""
        response = dra.NodeUnprepareResourcesResponse()
        report = _CallReport("NodeUnprepareResources")
        for claim in claims:
            response.claims[claim.uid].error = await self._unprepare(
                claim.namespace, claim.name, claim.uid, report
            )
        report.summary(len(claims))
        return response

    async def _unprepare(self, namespace: str, name: str, uid: str, report: _CallReport) -> str:
        """One claim of a NodeUnprepareResources call: "" or the error; never raises."""
        try:
            async with self._locks.hold(uid):
                removed = await self._in_file_thread(cdi.remove_spec, self.cdi_dir, uid)
        except (cdi.CdiError, OSError) as exc:
            return report.failure(cdi.ClaimRef(namespace, name, uid), clip(str(exc), _ERROR_LIMIT))
        report.done += 1
        log.debug(
            "NodeUnprepareResources: claim unprepared",
            event_name="NodeUnprepareResources",
            claim=f"{namespace}/{name}",
            uid=uid,
            removed=removed,
        )
        return ""

    # -- health -----------------------------------------------------------------------------------------

    async def _health_stream(self, version: str) -> AsyncIterator[health.NodeWatchResourcesResponse]:
        """The health list now and every `health_refresh` seconds, until the plugin closes."""
        self.open_health_streams += 1
        log.debug("NodeWatchResources opened", event_name="NodeWatchResources", version=version)
        try:
            while True:
                yield self._health()
                if await sleep_unless(self.clock, self._closing, self.health_refresh):
                    return
        finally:
            self.open_health_streams -= 1

    def _health(self) -> health.NodeWatchResourcesResponse:
        now = int(time.time())
        return health.NodeWatchResourcesResponse(
            devices=[
                health.DeviceHealth(
                    device=health.DeviceIdentifier(pool_name=self.pool_name, device_name=name),
                    health=health.HEALTHY,
                    last_updated_time=now,
                )
                for name in self.device_names
            ]
        )


@dataclass
class _CallReport:
    """What became of the claims of one NodePrepareResources (or NodeUnprepareResources) call: the
    first `FAILURE_LINES` failures logged one by one, then one summary line."""

    call: str  # the method, as the log lines name it
    done: int = 0  # claims that succeeded
    failed: int = 0

    def failure(self, claim: cdi.ClaimRef, reason: str) -> str:
        """The error answered for `claim` (its names from kubelet capped); logged while the budget lasts."""
        where = f"{clip(claim.namespace, 80)}/{clip(claim.name, 80)} ({clip(claim.uid, 80)})"
        message = f"claim {where}: {reason}"
        self.failed += 1
        if self.failed <= FAILURE_LINES:
            log.warning(f"{self.call}: claim failed", event_name=self.call, error=message)
        return message

    def summary(self, claims: int, **more: object) -> None:
        log.info(
            f"{self.call} done",
            event_name=self.call,
            claims=claims,
            succeeded=self.done,
            failed=self.failed,
            failures_not_logged=max(0, self.failed - FAILURE_LINES),
            **more,
        )


def _still_ours(served: _Served | None) -> bool:
    return served is not None and served.file_id is not None and file_id(served.path) == served.file_id


async def _serve(server: grpc.aio.Server, path: Path, *, dir_mode: int) -> _Served:
    """Start `server` on a fresh unix socket at `path` (mode 0600), creating its directory."""
    where = str(path)
    try:
        path.parent.mkdir(mode=dir_mode, parents=True, exist_ok=True)
        identity = bind_socket(where, lambda temporary: server.add_insecure_port(f"unix:{temporary}"))
        await server.start()
    except (OSError, RuntimeError) as exc:
        await server.stop(None)
        raise DraPluginError(f"cannot serve the DRA plugin on {where}: {exc}") from None
    return _Served(server, where, identity)


async def _stop(served: _Served | None) -> None:
    if served is not None:
        await served.server.stop(STOP_GRACE)
