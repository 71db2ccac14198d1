"""kubelet's PodResources API (gRPC v1 on a unix socket): which devices kubelet allocated to whom.

The NRI side's proof of a request for shared CPUs (`nri_plugin.mixedcpu.allocations`): for a
container that presents our allocation marker, the device ids of our resource that kubelet's own
record gives *that* container (pod namespace and name, container name). A marker copied from
kubelet's checkpoint file, replayed after its holder's pod stopped, or planted on a sibling then
proves nothing: kubelet did not allocate the device to it.

How it asks
    ``Get`` for one pod where kubelet serves it (the ``KubeletPodResourcesGet`` feature gate, on by
    default from Kubernetes 1.34), else ``List``. ``Get`` answered "disabled" or Unimplemented is
    asked again after a backoff (`GET_RETRY_FIRST` seconds, doubling up to `GET_RETRY_MAX`), never
    given up for good: a kubelet restarted with the gate on, or one answering mid-upgrade, gets
    ``Get`` back. ``List`` answers are taken up to `MAX_ANSWER` bytes. Each lookup dials the
    socket afresh with a deadline of `LOOKUP_TIMEOUT` seconds, well inside the runtime's 2 s
    request budget: no channel stays open to go stale across a kubelet
    restart, and no gRPC reconnect backoff delays the first question after one. A pod found with a
    device of our resource is remembered for `CACHE_TTL` seconds (several shared containers of one
    pod, and the List of a Synchronize, cost one question); anything else is asked again each time.

Requests served through DRA
    Given our DRA driver's devices (`DraDevices`: its name, this node's pool, the devices it
    published), a container's ids of our resource also hold ``dra.<device name>``
    (`marker.dra_device_id`) for every device kubelet's record lists under the container's dynamic
    resources (KEP-3695) with that driver, from that pool, among those devices: the id the DRA
    marker signs.
    Devices of other drivers, of another node's pool, or that our pool never had are not ours,
    whatever their names: kubelet's record of them proves nothing here.

When kubelet cannot be asked
    No socket, a refused connection, an error, or no answer in time: the lookup answers None, and the
    plugin falls back to the marker binding alone. It says so: a warning when kubelet stops answering
    (and at start when the socket is absent), an info line when it answers again, the
    ``mixed_cpu_pod_resources_lookups_total{outcome="unavailable"}`` counter and the
    ``mixed_cpu_pod_resources_reachable`` gauge (`PodResourcesObserver`), and ``check``.

Degraded proof (by ``List``, or by the marker alone) is never quiet: a warning when it begins, then
one per `DEGRADED_WARNING_PERIOD` while lookups keep being degraded (with how many were), the
lookups counted by outcome (``list``, ``unavailable``), the `degraded` property for the
``mixed_cpu_pod_resources_degraded`` gauge, and ``check`` asks ``Get`` itself (`get_served`).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Protocol, TypeVar

import grpc
import structlog
from google.protobuf.message import Message

from nri_plugin.api.podresources.v1 import api_pb2 as api
from nri_plugin.api.podresources.v1 import api_pb2_grpc as api_grpc
from nri_plugin.common.backoff import Backoff
from nri_plugin.common.clock import LOOP_CLOCK, Clock
from nri_plugin.deviceplugin.marker import dra_device_id

__all__ = [
    "CACHE_TTL",
    "DEGRADED_WARNING_PERIOD",
    "GET_RETRY_FIRST",
    "GET_RETRY_MAX",
    "LOOKUP_TIMEOUT",
    "MAX_ANSWER",
    "DraDevices",
    "PodResourcesClient",
    "PodResourcesObserver",
    "get_served",
    "socket_state",
]

log = structlog.get_logger("nri_plugin.deviceplugin.podresources")

# Seconds a lookup may take: kubelet answers in milliseconds; the runtime gives a request 2 s.
LOOKUP_TIMEOUT: Final = 0.5
# Seconds a pod found with our devices is answered from memory.
CACHE_TTL: Final = 2.0
# kubelet's Get answers a plain Go error, which gRPC sends as status Unknown with the error's text,
# in two cases: the KubeletPodResourcesGet feature gate is off (this text), or it runs no pod of
# that name (`_pod_not_found`). Only these exact answers are taken as such; any other Unknown is an
# error of kubelet's like any other.
_GET_DISABLED: Final = "PodResources API Get method disabled"
# Remembered pods past this many: the stale ones are forgotten.
_PRUNE_AT: Final = 256
# Seconds before Get is asked again once kubelet said it does not serve it (doubled each time).
GET_RETRY_FIRST: Final = 30.0
GET_RETRY_MAX: Final = 600.0
# While the proof is degraded, a warning at most this often (seconds).
DEGRADED_WARNING_PERIOD: Final = 60.0
# The largest answer taken, in bytes. A List answer holds every pod of the node: at kubelet's
# default of 110 pods, with (say) 10 containers each listing their CPU ids, memory blocks and
# devices with their NUMA topology, a few KB a container, that is about 5 MB at worst: past gRPC's
# 4 MB default, which turned such an answer into "kubelet cannot be asked" and the proof into the
# marker alone. 16 MiB is three times that, and still bounds what the socket's owner can make the
# daemon hold.
MAX_ANSWER: Final = 16 * 1024 * 1024
# Each lookup dials afresh (see the module docstring), never through a shared subchannel.
_CHANNEL_OPTIONS: Final = (
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_receive_message_length", MAX_ANSWER),
)

ContainerDevices = Mapping[str, frozenset[str]]
PodRef = tuple[str, str]
T = TypeVar("T", bound=Message)


class PodResourcesObserver(Protocol):
    """Told of every lookup's outcome (`nri_plugin.daemon.metrics`)."""

    def pod_resources_lookup(self, outcome: str) -> None:
        """`outcome`: ``ok`` (kubelet's Get answered), ``list`` (kubelet answered, by List: Get not
        served) or ``unavailable`` (the marker alone decided)."""


class _Unavailable(Exception):
    """kubelet could not be asked; the message says why."""


def socket_state(path: str) -> str | None:
    """None when `path` is a socket (kubelet may be asked), else why not, in words."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"{path} does not exist"
    except OSError as exc:
        return f"{path} cannot be looked at: {exc.strerror}"
    return None if stat.S_ISSOCK(mode) else f"{path} is not a socket"


@dataclass(frozen=True)
class DraDevices:
    """Our DRA driver's devices as kubelet's record must name them to prove a request: the driver,
    this node's pool (the node's name) and the device names the pool published."""

    driver: str
    pool: str
    devices: frozenset[str]


class PodResourcesClient:
    """kubelet's record of the devices of `resource_name` it allocated (an
    `nri_plugin.mixedcpu.allocations.AllocationRecord`), and of our DRA driver's devices `dra` (None:
    no DRA) as ``dra.<device name>``; see the module docstring."""

    def __init__(
        self,
        socket_path: str,
        resource_name: str,
        *,
        dra: DraDevices | None = None,
        timeout: float = LOOKUP_TIMEOUT,
        ttl: float = CACHE_TTL,
        observer: PodResourcesObserver | None = None,
        clock: Clock = LOOP_CLOCK,
    ) -> None:
        self.socket_path = socket_path
        self.resource_name = resource_name
        self.dra = dra
        self.timeout = timeout
        self.ttl = ttl
        self.observer = observer
        self.clock = clock
        # None until kubelet answered Get once or refused it (then List until `_get_again_at`).
        self.get_supported: bool | None = None
        self._get_backoff = Backoff(GET_RETRY_FIRST, GET_RETRY_MAX)
        self._get_again_at = 0.0
        # How the last lookup was proven: "get", "list" or "marker" (None: none yet).
        self.proof: str | None = None
        self._degraded_since_warning = 0
        self._warned_at: float | None = None
        self._warned_unstamped = False  # warned where the loop's clock could not be read (at start)
        # Whether kubelet answered the last question (None: not asked yet).
        self.reachable: bool | None = None
        self._pods: dict[PodRef, tuple[float, ContainerDevices]] = {}

    # -- the record --------------------------------------------------------------------------------

    async def pod_allocations(self, namespace: str, name: str) -> ContainerDevices | None:
        """The pod's containers and their device ids of our resource ({} when kubelet runs no such
        pod, or gave it none); None when kubelet cannot be asked."""
        remembered = self._pods.get((namespace, name))
        if remembered is not None and self.clock.monotonic() - remembered[0] < self.ttl:
            return remembered[1]
        try:
            found, proof = await self._pod(namespace, name)
        except _Unavailable as exc:
            self._unavailable(str(exc))
            return None
        self._answered(proof)
        return found

    async def node_allocations(self) -> Mapping[PodRef, ContainerDevices] | None:
        """Every pod kubelet runs, its containers and their device ids of our resource; None when
        kubelet cannot be asked."""
        try:
            found = await self._list()
        except _Unavailable as exc:
            self._unavailable(str(exc))
            return None
        self._answered(None)
        return found

    @property
    def degraded(self) -> bool:
        """For the gauge: the last lookup was proven by List (Get not served) or the marker alone."""
        return self.proof in ("list", "marker")

    @property
    def answering(self) -> bool:
        """For the gauge: kubelet answered the last question, or (none asked yet) its socket is there."""
        if self.reachable is None:
            return socket_state(self.socket_path) is None
        return self.reachable

    def log_start(self) -> None:
        """At start: say which proof the NRI side will use, as far as the socket tells."""
        why = socket_state(self.socket_path)
        if why is None:
            log.info("kubelet's pod-resources API proves requests for shared CPUs", socket=self.socket_path)
            return
        self._say_unavailable(why)

    # -- asking kubelet ---------------------------------------------------------------------------

    async def _pod(self, namespace: str, name: str) -> tuple[ContainerDevices, str]:
        """The pod's devices, and how they were proven ("get" or "list")."""
        if self.get_supported is not False or self.clock.monotonic() >= self._get_again_at:
            found = await self._get(namespace, name)
            if found is not None:
                return found, "get"
        return (await self._list()).get((namespace, name), {}), "list"

    async def _get(self, namespace: str, name: str) -> ContainerDevices | None:
        """One pod by Get; None when kubelet does not serve Get (then List, until Get is due again)."""
        request = api.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace)
        try:
            response = await self._call("Get", request, api.GetPodResourcesResponse)
        except grpc.aio.AioRpcError as exc:
            details = exc.details() or ""
            if _get_refused(exc.code(), details):
                self._get_refused(details)
                return None
            if _pod_not_found(exc.code(), details, namespace, name):
                self._get_served()
                return {}  # kubelet runs no such pod: it allocated nothing to it
            raise _Unavailable(f"Get: {exc.code().name}: {details}") from None
        self._get_served()
        found = self._devices(response.pod_resources)
        self._remember((namespace, name), found)
        return found

    def _get_refused(self, details: str) -> None:
        delay = self._get_backoff.next()
        self._get_again_at = self.clock.monotonic() + delay
        if self.get_supported is not False:
            self._warned_at = self.clock.monotonic()
            log.warning(
                "kubelet does not serve the pod-resources Get: requests for shared CPUs are proven by "
                "List, a whole-node answer per lookup, until it does; turn on kubelet's "
                "KubeletPodResourcesGet feature gate",
                reason=details,
                asked_again_in=round(delay),
            )
        self.get_supported = False

    def _get_served(self) -> None:
        if self.get_supported is False:
            log.info("kubelet serves the pod-resources Get again: requests are proven by Get")
        self.get_supported = True
        self._get_backoff.reset()

    async def _list(self) -> dict[PodRef, ContainerDevices]:
        try:
            response = await self._call("List", api.ListPodResourcesRequest(), api.ListPodResourcesResponse)
        except grpc.aio.AioRpcError as exc:
            raise _Unavailable(f"List: {exc.code().name}: {exc.details()}") from None
        found = {(pod.namespace, pod.name): self._devices(pod) for pod in response.pod_resources}
        self._pods.clear()
        for ref, devices in found.items():
            self._remember(ref, devices)
        return found

    async def _call(self, method: str, request: Message, response_type: type[T]) -> T:
        """One call on a fresh connection, within `timeout`. Raises `_Unavailable` when there is no
        socket, `grpc.aio.AioRpcError` for kubelet's answer or a failed connection."""
        why = socket_state(self.socket_path)
        if why is not None:
            raise _Unavailable(why)
        async with grpc.aio.insecure_channel(f"unix:{self.socket_path}", options=_CHANNEL_OPTIONS) as channel:
            stub = api_grpc.PodResourcesListerStub(channel)
            response = await getattr(stub, method)(request, timeout=self.timeout)
            if not isinstance(response, response_type):
                raise _Unavailable(f"{method}: an answer of type {type(response).__name__}")
            return response

    def _devices(self, pod: api.PodResources) -> ContainerDevices:
        """Container name -> its device ids of our resource, device plugin's and DRA's (containers
        with none left out)."""
        found: dict[str, frozenset[str]] = {}
        for container in pod.containers:
            ids = {
                device_id
                for devices in container.devices
                if devices.resource_name == self.resource_name
                for device_id in devices.device_ids
            }
            dra = self.dra
            if dra is not None:
                ids.update(
                    dra_device_id(device.device_name)
                    for claim in container.dynamic_resources
                    for device in claim.claim_resources
                    if device.driver_name == dra.driver
                    and device.pool_name == dra.pool
                    and device.device_name in dra.devices
                )
            if ids:
                found[container.name] = frozenset(ids)
        return found

    def _remember(self, ref: PodRef, devices: ContainerDevices) -> None:
        now = self.clock.monotonic()
        if len(self._pods) >= _PRUNE_AT:  # pods come and go: forget the ones no longer fresh
            for stale in [key for key, (at, _) in self._pods.items() if now - at >= self.ttl]:
                del self._pods[stale]
        if devices:
            self._pods[ref] = (now, devices)
        else:
            self._pods.pop(ref, None)

    # -- saying so ---------------------------------------------------------------------------------

    def _answered(self, proof: str | None) -> None:
        """kubelet answered: a lookup proven by `proof` ("get", "list"), or (None) the whole node."""
        if self.reachable is False:
            log.info(
                "kubelet's pod-resources API answers again: kubelet's record proves requests",
                socket=self.socket_path,
            )
        self.reachable = True
        if proof is None:
            if self.proof == "marker":
                self.proof = None
            return
        self.proof = proof
        if proof == "list":
            self._still_degraded("Get not served")
        if self.observer is not None:
            self.observer.pod_resources_lookup("ok" if proof == "get" else proof)

    def _unavailable(self, why: str) -> None:
        if self.reachable is not False:
            self._say_unavailable(why)
        self._still_degraded(why)
        self.reachable = False
        self.proof = "marker"
        if self.observer is not None:
            self.observer.pod_resources_lookup("unavailable")

    def _still_degraded(self, why: str) -> None:
        """One more lookup proven by less than Get: said at warning at most once per
        `DEGRADED_WARNING_PERIOD`, with how many there were since the last warning (the lookup
        that warned included)."""
        self._degraded_since_warning += 1
        now = self.clock.monotonic()
        if self._warned_unstamped:
            self._warned_at, self._warned_unstamped = now, False
        if self._warned_at is not None and now - self._warned_at < DEGRADED_WARNING_PERIOD:
            return
        log.warning(
            "kubelet's pod-resources proof is still degraded",
            proof="the allocation marker alone" if self.reachable is False else "List",
            lookups=self._degraded_since_warning,  # since the last such warning
            reason=why,
        )
        self._warned_at, self._degraded_since_warning = now, 0

    def _say_unavailable(self, why: str) -> None:
        self.reachable = False
        self._warned_unstamped, self._degraded_since_warning = True, 0
        log.warning(
            "kubelet's pod-resources API cannot be asked: the allocation marker alone proves requests "
            "for shared CPUs until it can (a copied marker is then refused only if another container "
            "presented its allocation first); mount kubelet's pod-resources directory",
            socket=self.socket_path,
            reason=why,
        )


def _get_refused(code: grpc.StatusCode, details: str) -> bool:
    """kubelet's answer when it does not serve Get: Unimplemented from a kubelet older than Get,
    Unknown with `_GET_DISABLED` from one whose feature gate is off."""
    if code is grpc.StatusCode.UNIMPLEMENTED:
        return True
    return code is grpc.StatusCode.UNKNOWN and details == _GET_DISABLED


def _pod_not_found(code: grpc.StatusCode, details: str, namespace: str, name: str) -> bool:
    """kubelet's answer to Get for a pod it does not run, the one we asked about: Unknown with
    "pod <name> in namespace <namespace> not found" (NotFound too, should kubelet ever use the
    proper code). Anything else is not taken for "kubelet allocated nothing": that answer refuses
    the request, where kubelet being unavailable falls back to the marker."""
    if code is grpc.StatusCode.NOT_FOUND:
        return True
    return code is grpc.StatusCode.UNKNOWN and details == f"pod {name} in namespace {namespace} not found"


def get_served(socket_path: str, timeout: float = 1.0) -> str | None:
    """For ``check``: why kubelet at `socket_path` does not serve Get, or None when it does or
    cannot be asked at all (what `socket_state` and the daemon's own warnings tell). Blocking."""
    deadline = time.monotonic() + timeout
    request = api.GetPodResourcesRequest(pod_name="mixed-cpu-nri-check", pod_namespace="-")
    with grpc.insecure_channel(f"unix:{socket_path}", options=_CHANNEL_OPTIONS) as channel:
        try:
            api_grpc.PodResourcesListerStub(channel).Get(request, timeout=deadline - time.monotonic())
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if _get_refused(code, details):
                return details or code.name
    return None
