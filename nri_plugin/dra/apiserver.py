"""The DRA driver's conversations with the Kubernetes API server: publishing the node's pool, reading claims.

Two jobs, one client (lightkube's ``AsyncClient``, asyncio over httpx, typed ``resource.k8s.io/v1``
models):

* :class:`ResourceSlicePublisher` keeps the node's ResourceSlices (built by :mod:`.slices`) on the
  API server: it reads the Node (its uid makes the slices owned by it, so they go with the node),
  lists the slices of our driver on this node, and when they differ from what it should publish,
  applies the new set (server-side apply as field manager :data:`FIELD_MANAGER`) with the pool
  generation raised by one, then deletes the slices the new set no longer has (fewer devices, fewer
  slices). A restart with the same configuration finds everything as it should be and writes nothing.
  Then it watches them (from the list's resourceVersion, started anew every :data:`RESYNC_INTERVAL`
  after a fresh check) and publishes again when someone deletes or changes them: kubelet wipes its
  node's slices when it starts, and a driver's when the driver was unusable for 30 s.
  A failed attempt is retried with :class:`~nri_plugin.common.backoff.Backoff`, whatever failed; each
  kind of failure (unreachable, refused credentials, no such node, ...) is logged once per streak as
  one line saying the cause and the fix, the retries after it at debug level.
* :class:`ApiClaimSource` reads a ResourceClaim for kubelet's ``NodePrepareResources`` and returns
  the devices of our driver its allocation names (:class:`.claims.ClaimSource`), or raises
  :class:`.claims.ClaimError` with a message kubelet shows in the pod's events. The whole read is
  bounded (:data:`CLAIM_TIMEOUT`), well inside kubelet's own deadline for the call, so a slow API server
  fails the prepare with a reason instead of letting kubelet's deadline expire silently.

:func:`make_client` builds the client: the pod's service account (in-cluster), or a kubeconfig file.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncGenerator, Callable
from typing import Any, Final, cast

import httpx2
import structlog
from lightkube import ApiError, AsyncClient, ConfigError, KubeConfig
from lightkube.core.exceptions import NotReadyError
from lightkube.resources.core_v1 import Node
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice
from lightkube.types import PatchType

from nri_plugin.common.backoff import Backoff
from nri_plugin.common.text import clip
from nri_plugin.dra import slices
from nri_plugin.dra.claims import AllocatedDevice, ClaimError, ClaimSourceUnreachable

__all__ = [
    "CLAIM_TIMEOUT",
    "FIELD_MANAGER",
    "REQUEST_TIMEOUT",
    "RESYNC_INTERVAL",
    "SERVICE_ACCOUNT_DIR",
    "ApiClaimSource",
    "ClientConfigError",
    "LazyClient",
    "PublishError",
    "ResourceSlicePublisher",
    "default_backoff",
    "make_client",
]

log = structlog.get_logger("nri_plugin.dra")

# Who owns the fields we apply (server-side apply), and what `kubectl get --show-managed-fields` shows.
FIELD_MANAGER: Final = "mixed-cpu-nri-plugin"
# One HTTP request to the API server (connect, send, answer): a healthy server answers in milliseconds.
REQUEST_TIMEOUT: Final = 10.0
# A whole claim read for a prepare. kubelet waits much longer for the prepare call itself; within
# this bound the prepare fails with a reason kubelet reports, and kubelet retries it.
CLAIM_TIMEOUT: Final = 10.0
BACKOFF_INITIAL: Final = 0.5
BACKOFF_MAX: Final = 30.0
# How often the slices are compared with the API server's even when the watch reported nothing (the
# watch is then started anew from a fresh list).
RESYNC_INTERVAL: Final = 300.0


def default_backoff() -> Backoff:
    """The publisher's retry pacing: 0.5 s doubling to 30 s, jittered."""
    return Backoff(BACKOFF_INITIAL, BACKOFF_MAX)


class ClientConfigError(Exception):
    """No way to reach the API server could be configured: the message says what was missing."""


# Where kubelet mounts a pod's service account token, namespace and the cluster's CA.
SERVICE_ACCOUNT_DIR: Final = "/var/run/secrets/kubernetes.io/serviceaccount"


def make_client(
    kubeconfig: str = "", *, timeout: float = REQUEST_TIMEOUT, service_account_dir: str = SERVICE_ACCOUNT_DIR
) -> AsyncClient:
    """A client with the pod's service account (`kubeconfig` ""), or with a kubeconfig file's current
    context. The token file is read again for each request, so a rotated token is picked up. Raises
    :class:`ClientConfigError` naming the cause and the fix."""
    try:
        if kubeconfig:
            config = KubeConfig.from_file(kubeconfig)
        else:
            config = KubeConfig.from_service_account(service_account_dir)
        # The client loads the cluster's CA (and a client certificate, if any) here.
        return AsyncClient(config, timeout=httpx2.Timeout(timeout), field_manager=FIELD_MANAGER)
    except (ConfigError, OSError, ValueError, KeyError) as exc:
        where = (
            f"kubeconfig {kubeconfig}"
            if kubeconfig
            else f"the in-cluster service account (token under {service_account_dir},"
            " KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT in the environment)"
        )
        fix = (
            "point [dra] kubeconfig at a readable kubeconfig file"
            if kubeconfig
            else "run in a pod with a service account token mounted, or set [dra] kubeconfig"
        )
        raise ClientConfigError(
            f"cannot configure the API client from {where}: {_describe(exc)}; {fix}"
        ) from exc


class LazyClient:
    """An API client, or what makes one: made at the first :meth:`get` (so missing credentials fail
    that use, logged and retried, instead of the daemon's start), then kept and shared."""

    def __init__(self, client: AsyncClient | Callable[[], AsyncClient]) -> None:
        self._make = client
        self.client: AsyncClient | None = client if isinstance(client, AsyncClient) else None

    def get(self) -> AsyncClient:
        """The client; raises :class:`ClientConfigError` when it cannot be made (tried again next time)."""
        if self.client is None:
            assert not isinstance(self._make, AsyncClient)
            self.client = self._make()
        return self.client

    def __call__(self) -> AsyncClient:
        return self.get()

    async def close(self) -> None:
        """Close the client if it was made; an error closing it is logged, never raised."""
        client, self.client = self.client, None
        if client is None:
            return
        try:
            await client.close()
        except Exception as exc:  # closing must not keep the daemon from stopping
            log.warning("the API client did not close cleanly", error=f"{type(exc).__name__}: {exc}")


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if isinstance(exc, KeyError) else text


class PublishError(Exception):
    """One publish attempt failed; `kind` groups failures for logging, the message says why and what
    to do."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _publish_error(exc: BaseException, doing: str) -> PublishError:
    """What a failed API call while `doing` means for the operator."""
    if isinstance(exc, ApiError):
        return _api_error(exc, doing)
    if isinstance(exc, httpx2.TimeoutException):
        return PublishError("unreachable", f"the API server did not answer {doing} in time")
    if isinstance(exc, httpx2.HTTPError):
        return PublishError(
            "unreachable", f"the API server could not be reached for {doing}: {type(exc).__name__}: {exc}"
        )
    if isinstance(exc, ConfigError):
        return PublishError("credentials", f"no credentials for {doing}: {exc}")
    return PublishError("unexpected answer", f"unexpected answer to {doing}: {type(exc).__name__}: {exc}")


def _status_code(exc: ApiError) -> int:
    """The HTTP status of an API error; one from a watch's ERROR event has a Status but no response."""
    response = getattr(exc, "response", None)
    return exc.status.code or (response.status_code if response is not None else 0)


def _api_error(exc: ApiError, doing: str) -> PublishError:
    code = _status_code(exc)
    message = clip(exc.status.message or "")  # the server's words: capped and escaped
    if code in (401, 403):
        return PublishError(
            "refused",
            f"the API server refused {doing} ({code}: {message}): grant the daemon's service account"
            " get on nodes and get, list, create, update, patch and delete on resourceslices"
            " (the chart's ClusterRole with dra.enabled)",
        )
    if code >= 500:
        return PublishError("server error", f"the API server failed {doing} ({code}: {message})")
    return PublishError("rejected", f"the API server rejected {doing} ({code}: {message})")


# What a publish attempt or a watch may run into from the API server and the client.
_API_FAILURES = (httpx2.HTTPError, ConfigError, ValueError)


def _unexpected(exc: BaseException, doing: str) -> PublishError:
    """Anything else (a bug, an answer nobody foresaw): still a retried failure, never the end."""
    return PublishError("unexpected", f"unexpected failure {doing}: {type(exc).__name__}: {exc}")


def _report(
    what: str, error: PublishError, cause: BaseException, previous: str | None, attempt: int, delay: float
) -> None:
    """A failure that will be retried: a warning for the first of a streak of one kind (with the
    traceback when nobody foresaw it), debug lines for the retries after it."""
    first = error.kind != previous
    (log.warning if first else log.debug)(
        what,
        error=str(error),
        attempt=attempt,
        retry_in=round(delay, 2),
        exc_info=cause if first and error.kind == "unexpected" else None,
    )


class ResourceSlicePublisher:
    """Keeps the node's ResourceSlices on the API server: :meth:`run` publishes (retrying until it
    succeeds), then watches our slices and publishes again whenever they are deleted or changed by
    someone else, at every :meth:`republish` and :meth:`check`, and every `resync_interval` seconds.

    kubelet deletes all of its node's ResourceSlices when it starts, and a driver's slices once the
    driver has been unusable for a while (30 s); the watch sees those deletions and the pool is back
    after one publish round. A watch that fails (the API server gone, its history expired) is started
    again after a fresh check, with backoff. Every failure is retried, an unexpected one too (logged
    with its traceback): publishing never gives up while the daemon runs.

    `client` is an ``AsyncClient`` (see :func:`make_client`), or a callable making one on the first
    attempt (so a missing service account is a retried, logged failure, not a crash at start)."""

    def __init__(
        self,
        *,
        client: AsyncClient | Callable[[], AsyncClient],
        driver: str,
        node_name: str,
        device_count: int,
        backoff: Backoff | None = None,
        watch_backoff: Backoff | None = None,
        resync_interval: float = RESYNC_INTERVAL,
    ) -> None:
        slices.slice_name(node_name, driver, 0)  # checks both names; raises ValueError
        slices.device_names(device_count)  # checks the count
        if not resync_interval > 0:
            raise ValueError(f"resync interval {resync_interval!r} must be positive (seconds)")
        self._client = LazyClient(client)
        self.driver = driver
        self.node_name = node_name
        self._device_count = device_count
        self.backoff = backoff if backoff is not None else default_backoff()
        self.watch_backoff = watch_backoff if watch_backoff is not None else default_backoff()
        self.resync_interval = resync_interval
        self.failures = 0  # failed attempts since the last success
        self.last_error: str | None = None
        self.restores = 0  # publish rounds a watch event asked for (our slices deleted or changed)
        self.watch_failures = 0  # watches that ended on an error since one last ran well
        self._generation: int | None = None
        self._published = False
        self._expected: dict[str, tuple[object, ...]] = {}  # name -> shape of what we last wrote
        self._list_version: str | None = None  # resourceVersion of the last round's list
        self._wanted = asyncio.Event()
        self._wanted.set()
        self._done = asyncio.Event()

    @property
    def published(self) -> bool:
        """True once the API server holds the slices for the current device count, until they are
        seen deleted or changed (or a :meth:`republish` asks for another round)."""
        return self._published

    @property
    def generation(self) -> int | None:
        """The pool generation the API server holds, once published."""
        return self._generation

    @property
    def device_count(self) -> int:
        return self._device_count

    def republish(self, device_count: int | None = None) -> None:
        """Publish again (with a new device count, if given) as soon as :meth:`run` can."""
        if device_count is not None:
            slices.device_names(device_count)
            self._device_count = device_count
        self._published = False
        self.check()

    def check(self) -> None:
        """Compare the API server's slices with ours as soon as :meth:`run` can, and restore them if
        they differ (a round that finds them as they should be writes nothing)."""
        self._done.clear()
        self._wanted.set()

    async def wait_published(self) -> None:
        """Return once the current round has published (callers bound the wait)."""
        await self._done.wait()

    async def run(self) -> None:
        """Publish and keep the slices published (see the class), until cancelled."""
        watcher = asyncio.create_task(self._keep_watching(), name="dra-resource-slices-watch")
        try:
            await self._keep_publishing()
        finally:
            watcher.cancel()
            await asyncio.wait([watcher])

    async def _keep_publishing(self) -> None:
        kind: str | None = None
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            try:
                await self.publish()
            except Exception as exc:  # every failure is retried; CancelledError is not an Exception
                error = exc if isinstance(exc, PublishError) else _unexpected(exc, "publishing")
                self.failures += 1
                self.last_error = str(error)
                delay = self.backoff.next()
                _report(
                    "publishing the ResourceSlices failed, retrying", error, exc, kind, self.failures, delay
                )
                kind = error.kind
                await self._sleep_unless_wanted(delay)
                self._wanted.set()
                continue
            if self.failures:
                log.info("ResourceSlices published after failed attempts", failed_attempts=self.failures)
            self.failures = 0
            self.last_error = None
            kind = None
            self.backoff.reset()

    async def _sleep_unless_wanted(self, delay: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wanted.wait(), delay)

    async def _keep_watching(self) -> None:
        """After each published round, watch our slices from that round's list on; when the watch
        ends (resync, an error), check again and watch from the new list."""
        kind: str | None = None
        while True:
            await self._done.wait()
            version = self._list_version
            try:
                await asyncio.wait_for(self._follow(version), self.resync_interval)
            except asyncio.TimeoutError:  # the resync: look at the whole set again
                kind = None
                self.watch_failures = 0
                self.watch_backoff.reset()
            except Exception as exc:
                error = exc if isinstance(exc, PublishError) else _describe_watch_failure(exc)
                self.watch_failures += 1
                delay = self.watch_backoff.next()
                _report(
                    "watching the ResourceSlices failed; checking them and watching again",
                    error,
                    exc,
                    kind,
                    self.watch_failures,
                    delay,
                )
                kind = error.kind
                await asyncio.sleep(delay)
            self.check()

    async def _follow(self, version: str | None) -> None:
        """Watch our driver's slices on this node from `version` and start a publish round for each
        event that leaves them unlike what we wrote. Raises what the watch raises."""
        client = self._get_client()
        stream = cast(
            AsyncGenerator[tuple[str, ResourceSlice], None],
            client.watch(
                ResourceSlice,
                fields=self._fields(),
                resource_version=version,
                server_timeout=max(1, math.ceil(self.resync_interval)),
            ),
        )
        try:
            async for event_type, obj in stream:
                as_dict = obj.to_dict()
                if slices.event_needs_publish(event_type, as_dict, self._expected):
                    self.restores += 1
                    report = log.warning if self._published else log.debug  # once per round
                    report(
                        "our ResourceSlices were deleted or changed on the API server; publishing them again",
                        watch_event=event_type,
                        slice=(as_dict.get("metadata") or {}).get("name"),
                        node=self.node_name,
                    )
                    self.republish()
                self.watch_failures = 0
                self.watch_backoff.reset()
        finally:
            await stream.aclose()

    async def publish(self) -> None:
        """One attempt: make the API server hold exactly our slices. Raises :class:`PublishError`."""
        count = self._device_count
        client = self._get_client()
        node_uid = await self._node_uid(client)
        existing = await self._existing(client)
        current = max((slices.pool_generation(obj) for obj in existing.values()), default=0)
        if current:
            wanted = self._slices(node_uid, count, current)
            if {slices.slice_shape(obj) for obj in wanted} == {
                slices.slice_shape(obj) for obj in existing.values()
            }:
                self._expect(wanted)
                self._finish(current, count, changed=False)
                return
        generation = current + 1
        wanted = self._slices(node_uid, count, generation)
        # What the watch sees of our own writes below is what we expect: no new round for them.
        self._expect(wanted)
        # The new generation first: the scheduler then sees the whole new pool and ignores the
        # older slices, which go after.
        for obj in wanted:
            await self._call(
                client.patch(
                    ResourceSlice,
                    obj["metadata"]["name"],
                    obj,
                    patch_type=PatchType.APPLY,
                    field_manager=FIELD_MANAGER,
                    force=True,
                ),
                f"applying ResourceSlice {obj['metadata']['name']}",
            )
        names = {obj["metadata"]["name"] for obj in wanted}
        for stale in sorted(set(existing) - names):
            await self._call(
                client.delete(ResourceSlice, stale),
                f"deleting stale ResourceSlice {stale}",
                gone_is_done=True,
            )
        self._finish(generation, count, changed=True)

    def _expect(self, wanted: tuple[dict[str, Any], ...]) -> None:
        self._expected = {obj["metadata"]["name"]: slices.slice_shape(obj) for obj in wanted}

    def _fields(self) -> dict[str, Any]:
        return {"spec.driver": self.driver, "spec.nodeName": self.node_name}

    def _slices(self, node_uid: str, count: int, generation: int) -> tuple[dict[str, Any], ...]:
        return slices.resource_slices(
            node_name=self.node_name,
            node_uid=node_uid,
            driver=self.driver,
            device_count=count,
            generation=generation,
        )

    def _finish(self, generation: int, count: int, *, changed: bool) -> None:
        self._generation = generation
        if count == self._device_count:  # no republish with another count came in meanwhile
            self._published = True
            self._done.set()
        if changed:
            log.info(
                "ResourceSlices published",
                node=self.node_name,
                driver=self.driver,
                devices=count,
                slices=math.ceil(count / slices.MAX_DEVICES_PER_SLICE),
                generation=generation,
            )
        else:
            log.info("ResourceSlices already up to date", node=self.node_name, generation=generation)

    def _get_client(self) -> AsyncClient:
        try:
            return self._client.get()
        except ClientConfigError as exc:
            raise PublishError("credentials", str(exc)) from exc

    async def _call(self, call: Any, doing: str, *, gone_is_done: bool = False) -> Any:
        """Await one API call; `gone_is_done`: a 404 (a delete of what is already gone) is success."""
        try:
            return await call
        except ApiError as exc:
            if gone_is_done and _status_code(exc) == 404:
                return None
            raise _publish_error(exc, doing) from exc
        except _API_FAILURES as exc:
            raise _publish_error(exc, doing) from exc

    async def _node_uid(self, client: AsyncClient) -> str:
        doing = f"reading Node {self.node_name}"
        try:
            node = await client.get(Node, self.node_name)
        except ApiError as exc:
            if _status_code(exc) == 404:
                raise PublishError(
                    "no node",
                    f"Node {self.node_name} does not exist: the node name must be this node's"
                    " (set NODE_NAME from the pod's spec.nodeName, or [dra] node_name)",
                ) from exc
            raise _publish_error(exc, doing) from exc
        except _API_FAILURES as exc:
            raise _publish_error(exc, doing) from exc
        uid = node.metadata.uid if node.metadata is not None else None
        if not uid:
            raise PublishError("unexpected answer", f"Node {self.node_name} came back without a uid")
        return uid

    async def _existing(self, client: AsyncClient) -> dict[str, dict[str, Any]]:
        """Our driver's slices on this node, by name; the list's resourceVersion is kept for the
        watch that follows the round."""
        found: dict[str, dict[str, Any]] = {}
        listing = client.list(ResourceSlice, fields=self._fields())
        try:
            async for obj in listing:
                as_dict = obj.to_dict()
                found[as_dict["metadata"]["name"]] = as_dict
            try:
                self._list_version = listing.resourceVersion
            except NotReadyError:  # the answer carried none: the watch then starts from "now"
                self._list_version = None
        except _API_FAILURES as exc:
            raise _publish_error(exc, "listing our ResourceSlices") from exc
        return found


def _describe_watch_failure(exc: BaseException) -> PublishError:
    if isinstance(exc, ApiError) and _status_code(exc) == 410:
        return PublishError("expired", "the watch's starting point expired on the API server (410 Gone)")
    if isinstance(exc, (ApiError, *_API_FAILURES)):
        return _publish_error(exc, "watching our ResourceSlices")
    return _unexpected(exc, "watching our ResourceSlices")


class ApiClaimSource:
    """:class:`.claims.ClaimSource` reading ResourceClaims from the API server.

    `client` as for :class:`ResourceSlicePublisher`; `timeout` bounds one whole read."""

    def __init__(
        self,
        *,
        client: AsyncClient | Callable[[], AsyncClient],
        driver: str,
        timeout: float = CLAIM_TIMEOUT,
    ) -> None:
        self._client = LazyClient(client)
        self.driver = driver
        self.timeout = timeout

    def _get_client(self) -> AsyncClient:
        try:
            return self._client.get()
        except ClientConfigError as exc:
            raise ClaimError(str(exc)) from exc

    async def allocated_devices(self, namespace: str, name: str, uid: str) -> tuple[AllocatedDevice, ...]:
        claim_ref = f"ResourceClaim {namespace}/{name}"
        client = self._get_client()
        try:
            claim = await asyncio.wait_for(client.get(ResourceClaim, name, namespace=namespace), self.timeout)
        except asyncio.TimeoutError as exc:
            raise ClaimSourceUnreachable(
                f"the API server did not answer reading {claim_ref} within {self.timeout:g} s;"
                " kubelet retries"
            ) from exc
        except ApiError as exc:
            code = _status_code(exc)
            if code == 404:
                raise ClaimError(f"{claim_ref} does not exist (deleted?); nothing to prepare") from exc
            if code in (401, 403):
                raise ClaimError(
                    f"the API server refused reading {claim_ref} ({code}: {clip(exc.status.message or '')}):"
                    " grant"
                    " the daemon's service account get on resourceclaims (the chart's ClusterRole with"
                    " dra.enabled)"
                ) from exc
            raise ClaimError(
                f"the API server failed reading {claim_ref} ({code}: {clip(exc.status.message or '')})"
            ) from exc
        except httpx2.TimeoutException as exc:
            raise ClaimSourceUnreachable(
                f"the API server did not answer reading {claim_ref} in time; kubelet retries"
            ) from exc
        except httpx2.TransportError as exc:
            raise ClaimSourceUnreachable(
                f"the API server could not be reached to read {claim_ref} ({type(exc).__name__}: {exc});"
                " kubelet retries"
            ) from exc
        except httpx2.HTTPError as exc:
            raise ClaimError(
                f"the API server could not be reached to read {claim_ref} ({type(exc).__name__}: {exc});"
                " kubelet retries"
            ) from exc
        except (ConfigError, ValueError) as exc:
            raise ClaimError(f"cannot read {claim_ref}: {type(exc).__name__}: {exc}") from exc
        return self._devices(claim_ref, claim, uid)

    def _devices(self, claim_ref: str, claim: ResourceClaim, uid: str) -> tuple[AllocatedDevice, ...]:
        found_uid = claim.metadata.uid if claim.metadata is not None else None
        if found_uid != uid:
            raise ClaimError(
                f"{claim_ref} has uid {found_uid}, not {uid}: the claim was re-created; kubelet prepares"
                " the new one for the pods that use it"
            )
        allocation = claim.status.allocation if claim.status is not None else None
        results = (
            allocation.devices.results if allocation is not None and allocation.devices is not None else None
        )
        if allocation is None:
            raise ClaimError(
                f"{claim_ref} is not allocated yet: the scheduler allocates it before kubelet prepares"
            )
        pods = _reserved_pods(claim)
        ours = tuple(
            AllocatedDevice(
                request=result.request,
                pool=result.pool,
                device=result.device,
                admin_access=bool(result.adminAccess),
                reserved_for=pods,
            )
            for result in results or ()
            if result.driver == self.driver
        )
        if not ours:
            raise ClaimError(
                f"{claim_ref} is allocated no device of driver {self.driver}: kubelet should not have asked"
                " this driver to prepare it"
            )
        return ours


def _reserved_pods(claim: ResourceClaim) -> tuple[str, ...]:
    """The uids of the pods the claim is reserved for (``status.reservedFor`` entries naming core
    pods; other consumers are not pods and prove nothing), sorted, each once."""
    consumers = claim.status.reservedFor if claim.status is not None else None
    return tuple(
        sorted(
            {
                consumer.uid
                for consumer in consumers or ()
                if consumer.resource == "pods" and not consumer.apiGroup and consumer.uid
            }
        )
    )
