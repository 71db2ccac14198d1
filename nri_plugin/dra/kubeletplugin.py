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
restarts. A prepare repeated while the API server cannot be asked (the daemon restarted during an
outage) is answered from the spec file written the first time, whose annotations record the claim's
devices; the spec is then rewritten from that record with the current key.

A starting kubelet's plugin watcher only notices sockets created after it watches, and an operator or
a clean-up may delete ours: the registration socket is checked every `CHECK_INTERVAL` (an ``lstat``)
and served anew when it is gone or another file, so kubelet calls GetInfo again. The service socket is
checked likewise. Both sockets are mode 0600 (kubelet runs as root).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import grpc
import structlog

from api.dra.v1 import api_pb2 as dra
from api.dra.v1 import api_pb2_grpc as dra_grpc
from api.drahealth.v1 import api_pb2 as health
from api.drahealth.v1 import api_pb2_grpc as health_grpc
from api.drahealth.v1alpha1 import api_pb2 as health_alpha
from api.drahealth.v1alpha1 import api_pb2_grpc as health_alpha_grpc
from api.pluginregistration.v1 import api_pb2 as reg
from api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from nri_plugin.common.clock import LOOP_CLOCK, Clock, sleep_unless, within
from nri_plugin.common.k8snames import is_dns_subdomain
from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.dra import cdi
from nri_plugin.dra.claims import AllocatedDevice, ClaimError, ClaimSource
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

PLUGIN_TYPE: Final = "DRAPlugin"  # kubelet's plugin handler for DRA drivers
# The gRPC services we serve on the endpoint, as kubelet names them in supported_versions. kubelets
# 1.34-1.36 open the health stream as v1alpha1 (whatever we announce); later ones pick v1 when announced.
SUPPORTED_VERSIONS: Final = ("v1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
CHECK_INTERVAL: Final = 0.5  # seconds between the socket checks
HEALTH_REFRESH: Final = 10.0  # seconds between repeats of the (unchanging) health list
CLAIM_TIMEOUT: Final = 10.0  # how long a prepare waits for the ClaimSource before it uses the file
STOP_GRACE: Final = 1.0  # how long close() lets an in-flight call finish
# A driver name is a DNS subdomain (resource.k8s.io/v1); it names a directory and a socket here.
_SOCKET_PATH_MAX: Final = 107  # sun_path holds 108 bytes with the terminating NUL


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
        claims = list(request.claims)
        answers = await asyncio.gather(*(self._plugin._prepare(c.namespace, c.name, c.uid) for c in claims))
        response = dra.NodePrepareResourcesResponse()
        for claim, answer in zip(claims, answers, strict=True):
            response.claims[claim.uid].CopyFrom(answer)
        return response

    async def NodeUnprepareResources(
        self, request: dra.NodeUnprepareResourcesRequest, context: ServicerContext[Any, Any]
    ) -> dra.NodeUnprepareResourcesResponse:
        response = dra.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            error = await self._plugin._unprepare(claim.namespace, claim.name, claim.uid)
            response.claims[claim.uid].error = error
        return response


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
            if len(os.fsencode(path)) > _SOCKET_PATH_MAX:
                raise DraPluginError(
                    f"socket path {path} is longer than {_SOCKET_PATH_MAX} bytes, the unix socket "
                    "limit; use shorter [dra] registry_dir, plugins_dir or driver_name"
                )

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
    file_id: tuple[int, int, int] | None = None


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
        try:
            await self._ensure_served()
        except DraPluginError:
            await self._stop_serving()
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
                log.warning("DRA plugin socket could not be re-created; trying again", error=str(exc))

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
        for each in served:
            await _stop(each)
            # Ours only: a file someone put there since is left alone.
            if each.file_id is not None and _file_id(each.path) == each.file_id:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(each.path)
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
            self._registration_error = error or "kubelet gave no reason"
            self._registered.clear()
            log.error(
                "kubelet refused our DRA plugin", driver=self.driver_name, error=self._registration_error
            )

    # -- dra.v1 -----------------------------------------------------------------------------------------

    async def _prepare(self, namespace: str, name: str, uid: str) -> dra.NodePrepareResourceResponse:
        """One claim of a NodePrepareResources call; never raises."""
        claim = cdi.ClaimRef(namespace=namespace, name=name, uid=uid)
        try:
            cdi.check_claim(claim)
            async with self._locks.hold(uid):
                devices = await self._allocated_devices(claim)
                self._check_pool(claim, devices)
                spec = cdi.build_spec(claim, devices, self.key)
                await asyncio.to_thread(cdi.write_spec, self.cdi_dir, claim, spec, fsync=self.fsync)
        except (ClaimError, cdi.CdiError, OSError) as exc:
            message = f"claim {namespace}/{name} ({uid[:80]}): {exc}"
            log.warning(
                "NodePrepareResources: claim not prepared", event_name="NodePrepareResources", error=message
            )
            return dra.NodePrepareResourceResponse(error=message)
        except Exception as exc:  # a bug must cost one claim, never the daemon
            log.exception(
                "NodePrepareResources: unexpected failure", claim=f"{namespace}/{name}", uid=uid[:80]
            )
            return dra.NodePrepareResourceResponse(
                error=f"claim {namespace}/{name} ({uid[:80]}): internal error in the DRA driver: {exc!r}"
            )
        answer = dra.NodePrepareResourceResponse()
        for prepared in cdi.prepared_devices(uid, devices):
            answer.devices.add(
                request_names=list(prepared.requests),
                pool_name=prepared.pool,
                device_name=prepared.device,
                cdi_device_ids=[prepared.cdi_device_id],
            )
        log.info(
            "NodePrepareResources: claim prepared",
            event_name="NodePrepareResources",
            claim=f"{namespace}/{name}",
            uid=uid,
            devices=[d.device for d in devices],
        )
        return answer

    async def _allocated_devices(self, claim: cdi.ClaimRef) -> tuple[AllocatedDevice, ...]:
        """The claim's devices from the ClaimSource; when it fails, from the spec written earlier
        (ClaimError if there is none)."""
        try:
            devices = await within(
                self.clock,
                self.claim_timeout,
                self.claims.allocated_devices(claim.namespace, claim.name, claim.uid),
            )
        except Exception as exc:  # whatever failed, the spec written before may still answer
            if isinstance(exc, ClaimError):
                reason = str(exc)
            elif isinstance(exc, TimeoutError):
                reason = f"the claim source gave no answer within {self.claim_timeout} s"
            else:
                log.warning("claim source failed unexpectedly", exc_info=exc, uid=claim.uid)
                reason = f"the claim source failed: {exc!r}"
            recorded = await asyncio.to_thread(cdi.read_recorded, self.cdi_dir, claim)
            if recorded is None:
                raise ClaimError(reason) from None
            log.warning(
                "NodePrepareResources: claim source failed; answering from the spec written before",
                claim=f"{claim.namespace}/{claim.name}",
                uid=claim.uid,
                reason=reason,
            )
            return recorded
        if not devices:
            raise ClaimError("its allocation names no device of this driver; check the claim's status")
        return tuple(devices)

    def _check_pool(self, claim: cdi.ClaimRef, devices: Sequence[AllocatedDevice]) -> None:
        for device in devices:
            if device.pool != self.pool_name:
                raise cdi.CdiError(
                    f"device {device.device} was allocated from pool {device.pool!r}, but this node's "
                    f"pool is {self.pool_name!r}: the claim was allocated for another node"
                )

    async def _unprepare(self, namespace: str, name: str, uid: str) -> str:
        """One claim of a NodeUnprepareResources call: "" or the error; never raises."""
        try:
            async with self._locks.hold(uid):
                removed = await asyncio.to_thread(cdi.remove_spec, self.cdi_dir, uid)
        except (cdi.CdiError, OSError) as exc:
            message = f"claim {namespace}/{name} ({uid[:80]}): {exc}"
            log.warning(
                "NodeUnprepareResources: claim not unprepared",
                event_name="NodeUnprepareResources",
                error=message,
            )
            return message
        log.info(
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


_FileId = tuple[int, int, int]


def _file_id(path: str) -> _FileId | None:
    """(device, inode, ctime) of `path` itself, None if it is not there (or cannot be looked at)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_ctime_ns)


def _still_ours(served: _Served | None) -> bool:
    return served is not None and served.file_id is not None and _file_id(served.path) == served.file_id


async def _serve(server: grpc.aio.Server, path: Path, *, dir_mode: int) -> _Served:
    """Start `server` on a fresh unix socket at `path` (mode 0600), creating its directory."""
    where = str(path)
    try:
        path.parent.mkdir(mode=dir_mode, parents=True, exist_ok=True)
        _remove_stale_socket(where)
        umask = os.umask(0o177)  # the socket is 0600 from its first instant
        try:
            server.add_insecure_port(f"unix:{where}")
        finally:
            os.umask(umask)
        os.chmod(where, 0o600)
        await server.start()
    except (OSError, RuntimeError) as exc:
        await server.stop(None)
        raise DraPluginError(f"cannot serve the DRA plugin on {where}: {exc}") from None
    return _Served(server, where, _file_id(where))


async def _stop(served: _Served | None) -> None:
    if served is not None:
        await served.server.stop(STOP_GRACE)


def _remove_stale_socket(path: str) -> None:
    """Remove a socket left at `path` by an earlier run; refuse to remove anything else."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise OSError(f"{path} exists and is not a socket; remove it or set another [dra] directory")
    os.unlink(path)
