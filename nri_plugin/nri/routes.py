# Passing a Protocol class where `type[P]` is expected is what this table is for (the stub tests
# plugins with `isinstance` against the runtime-checkable protocols); mypy flags any such use.
# mypy: disable-error-code="type-abstract"
"""The one table of the NRI requests a plugin handles: everything about them is derived from it.

Each `Route` is one method of NRI's Plugin service: its name on the wire, the handler `Protocol` of
`nri_plugin.nri.handlers` a plugin implements for it, the handler's name (also the metrics label),
its request and response types, and for lifecycle events the event number, whether it is about a pod
alone, and whether older runtimes deliver it in a ``StateChange`` instead. From the table come the
stub's method map and subscription mask, the simulator's dispatch, and the metrics labels: adding an
event means adding one row.

Each event row also carries the typed call from the request to the plugin's handler, so mypy checks
the arguments passed to and the reply taken from every handler against its `Protocol`.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, cast

from google.protobuf.message import Message

from api.nri import api_pb2 as api
from nri_plugin.nri import handlers as h
from nri_plugin.nri.events import Event

__all__ = [
    "CONFIGURE",
    "DEDICATED_METHODS",
    "EVENT_LABELS",
    "EVENT_ROUTES",
    "METHOD_LABELS",
    "POD_EVENTS",
    "ROUTES",
    "SHUTDOWN",
    "STATE_CHANGE",
    "STATE_CHANGE_EVENTS",
    "SYNCHRONIZE",
    "Call",
    "Deliver",
    "Route",
]

P = TypeVar("P")
Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)

# The plugin's handler bound to the plugin: what the stub runs for one request.
Call = Callable[[Req], Awaitable[Resp]]
# A lifecycle event as a StateChange carries it: the pod and (unless a pod event) the container.
Notify = Callable[[P, api.PodSandbox, api.Container], Awaitable[None]]
# The same bound to the plugin.
Deliver = Callable[[api.PodSandbox, api.Container], Awaitable[None]]

# The method carrying the events of the rows marked `state_change` for runtimes before NRI v0.12.
STATE_CHANGE = "StateChange"

# Given to the `notify` of pod events, which never look at it.
_NO_CONTAINER = api.Container()


@dataclass(frozen=True, kw_only=True, slots=True)
class Route(Generic[P, Req, Resp]):
    """One method of the Plugin service; see the module docstring."""

    method: str
    # The handler's method name on the plugin, and the `event` label of the request metrics.
    label: str
    handler: type[P]
    request_type: type[Req]
    response_type: type[Resp]
    # None for the three methods of the connection itself (Configure, Synchronize, Shutdown), which
    # the stub answers in its own way; they have no `call`.
    event: Event | None = None
    # The request carries a pod and no container.
    pod_only: bool = False
    call: Callable[[P, Req], Awaitable[Resp]] | None = None
    # Set for the events older runtimes send in a StateChange (and NRI v0.12 on their own method).
    notify: Notify[P] | None = None

    @property
    def state_change(self) -> bool:
        return self.notify is not None

    def bind(self, plugin: object) -> Call[Req, Resp] | None:
        """The plugin's handler for this method, or None when the plugin does not implement it."""
        if self.call is None or not isinstance(plugin, self.handler):
            return None
        return functools.partial(self.call, plugin)

    def bind_notify(self, plugin: object) -> Deliver | None:
        """The plugin's handler for this event as a StateChange delivers it, or None."""
        if self.notify is None or not isinstance(plugin, self.handler):
            return None
        return functools.partial(self.notify, plugin)


class _ContainerEventRequest(Protocol):
    # The dedicated requests of StateChange-class events; pod events have no `container`.
    @property
    def pod(self) -> api.PodSandbox: ...

    @property
    def container(self) -> api.Container: ...


def _notification(
    *,
    event: Event,
    method: str,
    label: str,
    handler: type[P],
    request_type: type[Req],
    response_type: type[Resp],
    notify: Notify[P],
    pod_only: bool = False,
) -> Route[P, Req, Resp]:
    """A row for an event with nothing to answer: its dedicated method calls `notify` too."""

    async def call(plugin: P, request: Req) -> Resp:
        carried = cast(_ContainerEventRequest, request)
        await notify(plugin, carried.pod, _NO_CONTAINER if pod_only else carried.container)
        return response_type()

    return Route(
        event=event,
        method=method,
        label=label,
        handler=handler,
        request_type=request_type,
        response_type=response_type,
        pod_only=pod_only,
        call=call,
        notify=notify,
    )


# -- the typed calls of the events that answer something ----------------------------------------------


async def _create_container(
    plugin: h.CreateContainer, request: api.CreateContainerRequest
) -> api.CreateContainerResponse:
    reply = await plugin.create_container(request.pod, request.container)
    return reply if reply is not None else api.CreateContainerResponse()


async def _update_container(
    plugin: h.UpdateContainer, request: api.UpdateContainerRequest
) -> api.UpdateContainerResponse:
    updates = await plugin.update_container(request.pod, request.container, request.linux_resources)
    return api.UpdateContainerResponse(update=updates or ())


async def _stop_container(
    plugin: h.StopContainer, request: api.StopContainerRequest
) -> api.StopContainerResponse:
    updates = await plugin.stop_container(request.pod, request.container)
    return api.StopContainerResponse(update=updates or ())


async def _update_pod_sandbox(
    plugin: h.UpdatePodSandbox, request: api.UpdatePodSandboxRequest
) -> api.UpdatePodSandboxResponse:
    await plugin.update_pod_sandbox(request.pod, request.overhead_linux_resources, request.linux_resources)
    return api.UpdatePodSandboxResponse()


async def _validate_container_adjustment(
    plugin: h.ValidateContainerAdjustment, request: api.ValidateContainerAdjustmentRequest
) -> api.ValidateContainerAdjustmentResponse:
    reason = await plugin.validate_container_adjustment(request)
    if reason:
        return api.ValidateContainerAdjustmentResponse(reject=True, reason=str(reason))
    return api.ValidateContainerAdjustmentResponse()


# -- the table ----------------------------------------------------------------------------------------

CONFIGURE = Route(
    method="Configure",
    label="configure",
    handler=h.Configure,
    request_type=api.ConfigureRequest,
    response_type=api.ConfigureResponse,
)
SYNCHRONIZE = Route(
    method="Synchronize",
    label="synchronize",
    handler=h.Synchronize,
    request_type=api.SynchronizeRequest,
    response_type=api.SynchronizeResponse,
)
SHUTDOWN = Route(
    method="Shutdown", label="shutdown", handler=h.Shutdown, request_type=api.Empty, response_type=api.Empty
)

# No annotation here: each row's types are inferred from the row alone (a declared element type would
# turn every row's plugin into Any), so mypy checks each handler against its Protocol.
_ROWS = (
    CONFIGURE,
    SYNCHRONIZE,
    SHUTDOWN,
    _notification(
        event=Event.RUN_POD_SANDBOX,
        method="RunPodSandbox",
        label="run_pod_sandbox",
        handler=h.RunPodSandbox,
        request_type=api.RunPodSandboxRequest,
        response_type=api.RunPodSandboxResponse,
        notify=lambda plugin, pod, _: plugin.run_pod_sandbox(pod),
        pod_only=True,
    ),
    _notification(
        event=Event.STOP_POD_SANDBOX,
        method="StopPodSandbox",
        label="stop_pod_sandbox",
        handler=h.StopPodSandbox,
        request_type=api.StopPodSandboxRequest,
        response_type=api.StopPodSandboxResponse,
        notify=lambda plugin, pod, _: plugin.stop_pod_sandbox(pod),
        pod_only=True,
    ),
    _notification(
        event=Event.REMOVE_POD_SANDBOX,
        method="RemovePodSandbox",
        label="remove_pod_sandbox",
        handler=h.RemovePodSandbox,
        request_type=api.RemovePodSandboxRequest,
        response_type=api.RemovePodSandboxResponse,
        notify=lambda plugin, pod, _: plugin.remove_pod_sandbox(pod),
        pod_only=True,
    ),
    Route(
        event=Event.CREATE_CONTAINER,
        method="CreateContainer",
        label="create_container",
        handler=h.CreateContainer,
        request_type=api.CreateContainerRequest,
        response_type=api.CreateContainerResponse,
        call=_create_container,
    ),
    _notification(
        event=Event.POST_CREATE_CONTAINER,
        method="PostCreateContainer",
        label="post_create_container",
        handler=h.PostCreateContainer,
        request_type=api.PostCreateContainerRequest,
        response_type=api.PostCreateContainerResponse,
        notify=lambda plugin, pod, container: plugin.post_create_container(pod, container),
    ),
    _notification(
        event=Event.START_CONTAINER,
        method="StartContainer",
        label="start_container",
        handler=h.StartContainer,
        request_type=api.StartContainerRequest,
        response_type=api.StartContainerResponse,
        notify=lambda plugin, pod, container: plugin.start_container(pod, container),
    ),
    _notification(
        event=Event.POST_START_CONTAINER,
        method="PostStartContainer",
        label="post_start_container",
        handler=h.PostStartContainer,
        request_type=api.PostStartContainerRequest,
        response_type=api.PostStartContainerResponse,
        notify=lambda plugin, pod, container: plugin.post_start_container(pod, container),
    ),
    Route(
        event=Event.UPDATE_CONTAINER,
        method="UpdateContainer",
        label="update_container",
        handler=h.UpdateContainer,
        request_type=api.UpdateContainerRequest,
        response_type=api.UpdateContainerResponse,
        call=_update_container,
    ),
    _notification(
        event=Event.POST_UPDATE_CONTAINER,
        method="PostUpdateContainer",
        label="post_update_container",
        handler=h.PostUpdateContainer,
        request_type=api.PostUpdateContainerRequest,
        response_type=api.PostUpdateContainerResponse,
        notify=lambda plugin, pod, container: plugin.post_update_container(pod, container),
    ),
    Route(
        event=Event.STOP_CONTAINER,
        method="StopContainer",
        label="stop_container",
        handler=h.StopContainer,
        request_type=api.StopContainerRequest,
        response_type=api.StopContainerResponse,
        call=_stop_container,
    ),
    _notification(
        event=Event.REMOVE_CONTAINER,
        method="RemoveContainer",
        label="remove_container",
        handler=h.RemoveContainer,
        request_type=api.RemoveContainerRequest,
        response_type=api.RemoveContainerResponse,
        notify=lambda plugin, pod, container: plugin.remove_container(pod, container),
    ),
    Route(
        event=Event.UPDATE_POD_SANDBOX,
        method="UpdatePodSandbox",
        label="update_pod_sandbox",
        handler=h.UpdatePodSandbox,
        request_type=api.UpdatePodSandboxRequest,
        response_type=api.UpdatePodSandboxResponse,
        call=_update_pod_sandbox,
    ),
    _notification(
        event=Event.POST_UPDATE_POD_SANDBOX,
        method="PostUpdatePodSandbox",
        label="post_update_pod_sandbox",
        handler=h.PostUpdatePodSandbox,
        request_type=api.PostUpdatePodSandboxRequest,
        response_type=api.PostUpdatePodSandboxResponse,
        notify=lambda plugin, pod, _: plugin.post_update_pod_sandbox(pod),
        pod_only=True,
    ),
    Route(
        event=Event.VALIDATE_CONTAINER_ADJUSTMENT,
        method="ValidateContainerAdjustment",
        label="validate_container_adjustment",
        handler=h.ValidateContainerAdjustment,
        request_type=api.ValidateContainerAdjustmentRequest,
        response_type=api.ValidateContainerAdjustmentResponse,
        call=_validate_container_adjustment,
    ),
)


ROUTES: tuple[Route[Any, Any, Any], ...] = _ROWS

# -- derived ------------------------------------------------------------------------------------------


def _by_event(routes: Iterable[Route[Any, Any, Any]]) -> dict[Event, Route[Any, Any, Any]]:
    return {route.event: route for route in routes if route.event is not None}


EVENT_ROUTES: Mapping[Event, Route[Any, Any, Any]] = _by_event(ROUTES)
STATE_CHANGE_EVENTS = frozenset(event for event, route in EVENT_ROUTES.items() if route.state_change)
# Events about a pod as a whole: their requests carry no container.
POD_EVENTS = frozenset(event for event, route in EVENT_ROUTES.items() if route.pod_only)
# The NRI v0.12 method of each StateChange-class event: (name, request type, response type).
DEDICATED_METHODS: Mapping[Event, tuple[str, type[Any], type[Any]]] = {
    event: (route.method, route.request_type, route.response_type)
    for event, route in EVENT_ROUTES.items()
    if route.state_change
}
# What the request metrics' `event` label says for each method (StateChange: see EVENT_LABELS).
METHOD_LABELS: Mapping[str, str] = {route.method: route.label for route in ROUTES}
# ... and for each event number a StateChange carries.
EVENT_LABELS: Mapping[int, str] = {int(event): route.label for event, route in EVENT_ROUTES.items()}
