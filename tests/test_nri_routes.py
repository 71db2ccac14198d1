"""The NRI layer's tables: the routes (one row per Plugin method), the connection's states, the
identity rules; and the typed seam they give a plugin, checked by running mypy."""

from __future__ import annotations

import inspect
import os
import textwrap
import typing
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from mypy import api as mypy_api

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.daemon import config
from nri_plugin.nri import handlers, identity, routes, stub
from nri_plugin.nri.connection import (
    CONNECTED,
    TRANSITIONS,
    ConnectionMachine,
    ConnectionState,
    IllegalTransition,
)
from nri_plugin.nri.events import Event, mask_of
from nri_plugin.nri.routes import EVENT_ROUTES, ROUTES, Route
from nri_plugin.ttrpc.aio import CallContext

ROOT = Path(__file__).resolve().parent.parent
S = ConnectionState


# -- the routes -----------------------------------------------------------------------------------------


def _protocols() -> list[type[Any]]:
    return [
        value
        for value in vars(handlers).values()
        if inspect.isclass(value)
        and getattr(value, "_is_protocol", False)
        and value.__module__ == handlers.__name__
    ]


def test_one_row_per_event_and_per_handler_protocol() -> None:
    assert sorted(EVENT_ROUTES) == sorted(Event)
    assert sorted(route.handler.__name__ for route in ROUTES) == sorted(p.__name__ for p in _protocols())
    assert len({route.method for route in ROUTES}) == len(ROUTES)
    assert len({route.label for route in ROUTES}) == len(ROUTES)


def test_each_label_names_the_handler_its_protocol_declares() -> None:
    for route in ROUTES:
        members = [name for name in vars(route.handler) if not name.startswith("_")]
        assert members == [route.label], route.method


def test_each_answering_call_takes_and_gives_the_types_its_row_derives_from_the_name() -> None:
    # A row's types come from its name at run time, its call's from the annotations mypy checks.
    answering = [route for route in EVENT_ROUTES.values() if not route.state_change]
    assert len(answering) == 5
    for route in answering:
        hints = typing.get_type_hints(route.call)
        assert hints == {
            "plugin": route.handler,
            "request": route.request_type,
            "return": route.response_type,
        }, route.method


def test_a_row_named_for_the_wrong_kind_of_method_is_refused() -> None:
    # The protocols as plain classes: mypy accepts only concrete classes for `type[P]` otherwise.
    create: type[Any] = handlers.CreateContainer
    configure: type[Any] = handlers.Configure
    with pytest.raises(ValueError, match="CreateContainer is an event"):
        routes._connection(create)
    with pytest.raises(ValueError, match="Configure is not an NRI event"):
        routes._notification(configure, lambda plugin, pod, container: plugin.configure(pod))


def test_connection_methods_have_no_event_and_events_have_a_call() -> None:
    connection = [route for route in ROUTES if route.event is None]
    assert [route.method for route in connection] == ["Configure", "Synchronize", "Shutdown"]
    assert all(route.call is None and route.notify is None for route in connection)
    assert all(route.call is not None for route in EVENT_ROUTES.values())


def test_derived_sets_follow_the_rows() -> None:
    assert {
        Event.RUN_POD_SANDBOX,
        Event.STOP_POD_SANDBOX,
        Event.REMOVE_POD_SANDBOX,
        Event.POST_UPDATE_POD_SANDBOX,
    } == routes.POD_EVENTS
    # The events NRI v0.12 moved from StateChange to methods of their own: nothing to answer.
    assert (
        set(Event)
        - {
            Event.CREATE_CONTAINER,
            Event.UPDATE_CONTAINER,
            Event.STOP_CONTAINER,
            Event.UPDATE_POD_SANDBOX,
            Event.VALIDATE_CONTAINER_ADJUSTMENT,
        }
        == routes.STATE_CHANGE_EVENTS
    )
    assert routes.DEDICATED_METHODS[Event.START_CONTAINER] == (
        "StartContainer",
        api.StartContainerRequest,
        api.StartContainerResponse,
    )
    assert routes.METHOD_LABELS["CreateContainer"] == "create_container"
    assert routes.EVENT_LABELS[int(Event.REMOVE_POD_SANDBOX)] == "remove_pod_sandbox"


class EveryHandler:
    """A plugin handling every event (duck-typed: the protocols are checked structurally). Its
    handlers are attributes of the class, not made by __getattr__: from Python 3.12 a runtime
    protocol's isinstance looks attributes up statically (inspect.getattr_static)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []


def _recording(name: str) -> Callable[..., Awaitable[None]]:
    async def handler(self: EveryHandler, *args: Any) -> None:
        self.calls.append((name, args))

    return handler


for _name in routes.METHOD_LABELS.values():
    setattr(EveryHandler, _name, _recording(_name))


def test_the_stub_serves_and_subscribes_to_what_the_table_says() -> None:
    served = stub.Stub(
        EveryHandler(), identity=identity.Identity(name="x", index="10"), socket_path="/nonexistent"
    )
    methods = served._methods()
    assert set(methods) == {route.method for route in ROUTES} | {routes.STATE_CHANGE}
    assert served.subscribed == mask_of(Event)
    for route in ROUTES:
        assert methods[route.method].request_type is route.request_type


def test_a_plugin_missing_a_handler_is_not_subscribed_nor_served() -> None:
    class Creates:
        async def create_container(
            self, pod: api.PodSandbox, container: api.Container
        ) -> api.CreateContainerResponse | None:
            return None

    served = stub.Stub(
        Creates(), identity=identity.Identity(name="x", index="10"), socket_path="/nonexistent"
    )
    assert served.subscribed == Event.CREATE_CONTAINER.bit
    assert set(served._methods()) == {
        "Configure",
        "Synchronize",
        "Shutdown",
        "StateChange",
        "CreateContainer",
    }


@pytest.mark.asyncio
async def test_rows_pass_the_request_fields_to_the_handler() -> None:
    plugin = EveryHandler()
    pod = api.PodSandbox(id="p")
    container = api.Container(id="c")
    resources = api.LinuxResources()
    resources.cpu.cpus = "1"
    update = EVENT_ROUTES[Event.UPDATE_CONTAINER].bind(plugin)
    assert update is not None
    reply = await update(api.UpdateContainerRequest(pod=pod, container=container, linux_resources=resources))
    assert reply == api.UpdateContainerResponse()
    removed = EVENT_ROUTES[Event.REMOVE_POD_SANDBOX].bind(plugin)
    assert removed is not None
    assert await removed(api.RemovePodSandboxRequest(pod=pod)) == api.RemovePodSandboxResponse()
    started = EVENT_ROUTES[Event.START_CONTAINER].bind_notify(plugin)
    assert started is not None
    await started(pod, container)
    assert plugin.calls == [
        ("update_container", (pod, container, resources)),
        ("remove_pod_sandbox", (pod,)),
        ("start_container", (pod, container)),
    ]


# -- the typed seam, as mypy sees it -------------------------------------------------------------------

SEAM_WRONG = """
# mypy: disable-error-code="type-abstract"
from collections.abc import Sequence

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.nri import handlers
from nri_plugin.nri import routes
from nri_plugin.nri.routes import Route


class Plugin(handlers.UpdateContainer):
    async def update_container(self, pod: api.PodSandbox, container: api.Container) -> None:
        return None


async def create(
    plugin: handlers.CreateContainer, request: api.CreateContainerRequest
) -> api.CreateContainerResponse:
    return api.CreateContainerResponse()


ROW = Route(
    method="UpdateContainer",
    label="update_container",
    handler=handlers.UpdateContainer,
    request_type=api.CreateContainerRequest,
    response_type=api.CreateContainerResponse,
    call=create,
)

# The builders the table uses check the same: a handler paired with another handler's call.
ANSWERING = routes._answering(handlers.UpdateContainer, create)
"""

SEAM_RIGHT = """
from collections.abc import Sequence

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.nri import handlers
from nri_plugin.nri.identity import Identity
from nri_plugin.nri.stub import Stub


class Plugin(handlers.UpdateContainer):
    async def update_container(
        self, pod: api.PodSandbox, container: api.Container, resources: api.LinuxResources
    ) -> Sequence[api.ContainerUpdate]:
        return ()


STUB = Stub(Plugin(), identity=Identity(name="typed", index="10"))
"""


def _mypy(tmp_path: Path, **modules: str) -> dict[str, list[str]]:
    """Run mypy --strict on the given modules, with this repository importable; each one's errors."""
    for name, text in modules.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    settings = tmp_path / "mypy.ini"
    settings.write_text(f"[mypy]\nstrict = True\nmypy_path = {ROOT}\nfollow_imports = silent\n")
    stdout, stderr, _status = mypy_api.run(
        [
            "--config-file",
            str(settings),
            "--no-error-summary",
            "--cache-dir",
            os.devnull,
            *(str(tmp_path / f"{name}.py") for name in modules),
        ]
    )
    assert stderr == ""
    errors: dict[str, list[str]] = {name: [] for name in modules}
    for line in stdout.splitlines():
        if ": error: " in line:
            errors[Path(line.partition(":")[0]).stem].append(line.partition(": error: ")[2])
    return errors


def test_mypy_checks_a_handler_against_its_protocol_and_a_row_against_its_handler(tmp_path: Path) -> None:
    errors = _mypy(tmp_path, seam_wrong=SEAM_WRONG, seam_right=SEAM_RIGHT)
    assert errors["seam_right"] == []
    wrong = errors["seam_wrong"]
    assert any('Signature of "update_container" incompatible with supertype' in e for e in wrong), wrong
    assert any('Argument "call" to "Route" has incompatible type' in e for e in wrong), wrong
    assert any('Argument 2 to "_answering" has incompatible type' in e for e in wrong), wrong
    assert len(wrong) == 3, wrong


# -- the connection's states ----------------------------------------------------------------------------


def test_every_state_is_reachable_and_only_stopped_is_final() -> None:
    reached = {S.DISCONNECTED}
    frontier = [S.DISCONNECTED]
    while frontier:
        for target in TRANSITIONS[frontier.pop()]:
            if target not in reached:
                reached.add(target)
                frontier.append(target)
    assert reached == set(S)
    assert [state for state in S if not TRANSITIONS[state]] == [S.STOPPED]
    assert all(S.STOPPED in TRANSITIONS[state] for state in S if state is not S.STOPPED)


def test_every_connected_state_can_end_or_resynchronize() -> None:
    for state in CONNECTED:
        assert {S.DISCONNECTED, S.STOPPED} <= TRANSITIONS[state], state
        if state is not S.SYNCHRONIZING:
            assert S.SYNCHRONIZING in TRANSITIONS[state], state


@pytest.mark.parametrize(
    ("path", "illegal"),
    [
        ([], S.READY),  # never ready without a connection
        ([S.CONNECTING], S.BACKING_OFF),  # a failed attempt is DISCONNECTED first
        ([S.CONNECTING, S.REGISTERING], S.READY),  # ready only through a synchronization
        ([S.CONNECTING, S.REGISTERING, S.CONFIGURED], S.REGISTERED),  # no going back
        ([S.BACKING_OFF], S.REGISTERING),
        ([S.STOPPED], S.CONNECTING),  # stopped for good
        ([S.STOPPED], S.STOPPED),
    ],
)
def test_illegal_moves_are_refused(path: list[ConnectionState], illegal: ConnectionState) -> None:
    machine = ConnectionMachine()
    for state in path:
        machine.move(state)
    before = machine.state
    with pytest.raises(IllegalTransition, match=f"from {before.name} to {illegal.name}"):
        machine.move(illegal)
    assert machine.state is before


def test_a_connection_from_start_to_stop() -> None:
    machine = ConnectionMachine()
    for state in (
        S.CONNECTING,
        S.DISCONNECTED,
        S.BACKING_OFF,
        S.CONNECTING,
        S.REGISTERING,
        S.REGISTERED,
        S.CONFIGURED,
        S.SYNCHRONIZING,
        S.READY,
        S.DISCONNECTED,
        S.STOPPED,
    ):
        assert machine.can_move(state)
        machine.move(state)
        assert machine.connected == (state in CONNECTED)


# -- identity: the rules are written once --------------------------------------------------------------


def test_the_daemon_config_and_the_stub_share_the_nri_defaults_and_rules() -> None:
    assert config.DEFAULT_NRI_SOCKET is identity.DEFAULT_SOCKET_PATH is stub.DEFAULT_SOCKET_PATH
    assert inspect.signature(stub.Stub).parameters["socket_path"].default is identity.DEFAULT_SOCKET_PATH
    assert vars(config)["_INDEX"] is identity.PLUGIN_INDEX
    assert vars(config)["_NAME"] is identity.PLUGIN_NAME


@pytest.mark.parametrize("index", ["7", "100", "1a", "10\n", ""])
def test_a_bad_index_is_refused_by_both(index: str) -> None:
    assert not identity.valid_index(index)
    with pytest.raises(identity.IdentityError, match="two digits"):
        identity.Identity(name="x", index=index)


def test_a_route_is_generic_in_its_handler() -> None:
    # The row of an answering event pairs a handler protocol with a call taking that protocol.
    create = EVENT_ROUTES[Event.CREATE_CONTAINER]
    assert isinstance(create, Route)
    assert create.handler is handlers.CreateContainer
    assert create.bind(object()) is None


@pytest.mark.asyncio
async def test_each_method_map_gathers_its_own_synchronize_chunks() -> None:
    """Every map `_methods()` gives (one per connection; the fuzzer and benchmarks serve their own)
    joins the chunks it received only: a chunk sent on one never reaches another's Synchronize."""
    synced: list[list[str]] = []

    class Syncs:
        async def synchronize(
            self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
        ) -> Sequence[api.ContainerUpdate]:
            synced.append([pod.id for pod in pods])
            return ()

    served = stub.Stub(Syncs(), identity=identity.Identity(name="x", index="10"), socket_path="/nonexistent")
    ctx = CallContext(
        service=stub.PLUGIN_SERVICE,
        method="Synchronize",
        stream_id=1,
        metadata=(),
        timeout_nano=0,
        deadline=None,
    )
    lost = served._methods()["Synchronize"].handler
    await lost(api.SynchronizeRequest(pods=[api.PodSandbox(id="stale")], more=True), ctx)
    fresh = served._methods()["Synchronize"].handler
    await fresh(api.SynchronizeRequest(pods=[api.PodSandbox(id="new")]), ctx)
    assert synced == [["new"]]
