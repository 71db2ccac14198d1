# Passing a Protocol class where `type[P]` is expected is what this table is for (the stub tests
# plugins with `isinstance` against the runtime-checkable protocols); mypy flags any such use.
# mypy: disable-error-code="type-abstract"
"""The one table of the NRI requests a plugin handles: everything about them is derived from it.

Each `Route` is one method of NRI's Plugin service: its name on the wire, the handler `Protocol` of
`nri_plugin.nri.handlers` a plugin implements for it, the handler's name (also the metrics label),
its request and response types, and for lifecycle events the event number, whether it is about a pod
alone, and whether older runtimes deliver it in a ``StateChange`` instead. From the table come the
stub's method map and subscription mask, the simulator's dispatch, and the metrics labels: adding an
event means adding one row, named once by its handler `Protocol` (the rest follows NRI's naming).

Each event row also carries the typed call from the request to the plugin's handler, so mypy checks
the arguments passed to and the reply taken from every handler against its `Protocol`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, cast

from google.protobuf.message import Message

from nri_plugin.api.nri import api_pb2 as api
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


# -- building a row from its name ------------------------------------------------------------------------
#
# A row is named once, by its handler `Protocol` (`h.CreateContainer`), whose class name is the method's
# name on the wire. The rest follows NRI's naming: the label is the method in snake case (and the one
# method the Protocol declares), the request and response are `<Method>Request` / `<Method>Response` of
# the NRI API, and the event is the `Event` member of the label's name. Only Shutdown breaks the rule:
# it takes and answers `Empty`. The typed call of a row stays written out, so mypy checks it against
# the Protocol; tests/test_nri_routes.py checks that each call's annotations name the types derived here.

_WORD_START = re.compile(r"(?<!^)(?=[A-Z])")
_TAKES_EMPTY = frozenset({"Shutdown"})


def _fields(handler: type[Any]) -> dict[str, Any]:
    method = handler.__name__
    label = _WORD_START.sub("_", method).lower()
    return {
        "method": method,
        "label": label,
        "handler": handler,
        "request_type": api.Empty if method in _TAKES_EMPTY else getattr(api, f"{method}Request"),
        "response_type": api.Empty if method in _TAKES_EMPTY else getattr(api, f"{method}Response"),
        "event": Event.__members__.get(label.upper()),
    }


def _connection(handler: type[P]) -> Route[P, Any, Any]:
    """A row for a method of the connection itself: no event, answered by the stub in its own way."""
    row: Route[P, Any, Any] = Route(**_fields(handler))
    if row.event is not None:
        raise ValueError(f"{row.method} is an event, not a method of the connection")
    return row


def _answering(handler: type[P], call: Callable[[P, Req], Awaitable[Resp]]) -> Route[P, Req, Resp]:
    """A row for an event the plugin answers (with updates, adjustments or a verdict)."""
    row: Route[P, Req, Resp] = Route(**_fields(handler), call=call)
    if row.event is None:
        raise ValueError(f"{row.method} is not an NRI event")
    return row


def _notification(handler: type[P], notify: Notify[P]) -> Route[P, Any, Any]:
    """A row for an event with nothing to answer: older runtimes send it in a StateChange, NRI v0.12
    on its own method, whose `call` delivers it to `notify` too. A pod event is one whose request
    has no `container` field."""
    fields = _fields(handler)
    response_type = fields["response_type"]
    pod_only = "container" not in fields["request_type"].DESCRIPTOR.fields_by_name

    async def call(plugin: P, request: Any) -> Any:
        carried = cast(_ContainerEventRequest, request)
        await notify(plugin, carried.pod, _NO_CONTAINER if pod_only else carried.container)
        return response_type()

    row: Route[P, Any, Any] = Route(**fields, pod_only=pod_only, call=call, notify=notify)
    if row.event is None:
        raise ValueError(f"{row.method} is not an NRI event")
    return row


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

CONFIGURE = _connection(h.Configure)
SYNCHRONIZE = _connection(h.Synchronize)
SHUTDOWN = _connection(h.Shutdown)

# No annotation here: each row's types are inferred from the row alone (a declared element type would
# turn every row's plugin into Any), so mypy checks each handler against its Protocol.
_ROWS = (
    CONFIGURE,
    SYNCHRONIZE,
    SHUTDOWN,
    _notification(h.RunPodSandbox, lambda plugin, pod, _: plugin.run_pod_sandbox(pod)),
    _notification(h.StopPodSandbox, lambda plugin, pod, _: plugin.stop_pod_sandbox(pod)),
    _notification(h.RemovePodSandbox, lambda plugin, pod, _: plugin.remove_pod_sandbox(pod)),
    _answering(h.CreateContainer, _create_container),
    _notification(h.PostCreateContainer, lambda plugin, pod, ctr: plugin.post_create_container(pod, ctr)),
    _notification(h.StartContainer, lambda plugin, pod, ctr: plugin.start_container(pod, ctr)),
    _notification(h.PostStartContainer, lambda plugin, pod, ctr: plugin.post_start_container(pod, ctr)),
    _answering(h.UpdateContainer, _update_container),
    _notification(h.PostUpdateContainer, lambda plugin, pod, ctr: plugin.post_update_container(pod, ctr)),
    _answering(h.StopContainer, _stop_container),
    _notification(h.RemoveContainer, lambda plugin, pod, ctr: plugin.remove_container(pod, ctr)),
    _answering(h.UpdatePodSandbox, _update_pod_sandbox),
    _notification(h.PostUpdatePodSandbox, lambda plugin, pod, _: plugin.post_update_pod_sandbox(pod)),
    _answering(h.ValidateContainerAdjustment, _validate_container_adjustment),
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
