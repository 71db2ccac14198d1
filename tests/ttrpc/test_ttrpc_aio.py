"""The asyncio Server and Client: over real unix sockets, plus a few in-memory channel cases."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import struct
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import pytest_asyncio
from google.protobuf.wrappers_pb2 import StringValue

from nri_plugin.api.ttrpc import request_pb2
from nri_plugin.ttrpc.aio import (
    CallContext,
    Client,
    Server,
    Services,
    UnaryMethod,
    UnixServer,
    connect_unix,
    decode_payload,
    serve_unix,
)
from nri_plugin.ttrpc.errors import Code, ConnectionClosed, OversizedMessage, TtrpcError
from nri_plugin.ttrpc.protocol import LARGE_REQUEST, MessageType, encode_frame

ECHO = "test.Echo"
BIG = 5 << 20
T = TypeVar("T")


async def guard(awaitable: Awaitable[T]) -> T:
    """Fail instead of hanging when something that must happen does not (not a timing check)."""
    return await asyncio.wait_for(awaitable, 10)


class EchoService:
    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.blocked = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.contexts: list[CallContext] = []
        self.relay_to: Client | None = None

    async def echo(self, request: StringValue, ctx: CallContext) -> StringValue:
        self.contexts.append(ctx)
        return StringValue(value=request.value)

    async def block(self, request: StringValue, ctx: CallContext) -> StringValue:
        self.blocked.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return StringValue(value=request.value)

    async def fail(self, request: StringValue, ctx: CallContext) -> StringValue:
        raise ValueError(request.value)

    async def status(self, request: StringValue, ctx: CallContext) -> StringValue:
        raise TtrpcError(Code.NOT_FOUND, request.value)

    async def meta(self, request: StringValue, ctx: CallContext) -> StringValue:
        return StringValue(value=";".join(f"{k}={v}" for k, v in ctx.metadata))

    async def big(self, request: StringValue, ctx: CallContext) -> StringValue:
        return StringValue(value="x" * BIG)

    async def relay(self, request: StringValue, ctx: CallContext) -> StringValue:
        assert self.relay_to is not None
        return await self.relay_to.call(ECHO, "Block", request, StringValue)

    def services(self) -> Services:
        handlers: dict[str, Callable[[StringValue, CallContext], Awaitable[StringValue]]] = {
            "Echo": self.echo,
            "Block": self.block,
            "Fail": self.fail,
            "Status": self.status,
            "Meta": self.meta,
            "Big": self.big,
            "Relay": self.relay,
        }
        return {ECHO: {name: UnaryMethod(StringValue, handler) for name, handler in handlers.items()}}


@pytest.fixture
def service() -> EchoService:
    return EchoService()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "ttrpc.sock"


@pytest_asyncio.fixture
async def server(service: EchoService, path: Path) -> AsyncIterator[UnixServer]:
    async with await serve_unix(path, service.services()) as listening:
        yield listening


@pytest_asyncio.fixture
async def client(server: UnixServer, path: Path) -> AsyncIterator[Client]:
    connected = await connect_unix(path)
    yield connected
    connected.close()
    await guard(connected.wait_closed())


async def echo(client: Client, value: str, method: str = "Echo", **kwargs: Any) -> str:
    reply = await client.call(ECHO, method, StringValue(value=value), StringValue, **kwargs)
    return reply.value


# --- raw peers -----------------------------------------------------------------------------------


def raw_request(stream_id: int, method: str, payload: bytes = b"", timeout_nano: int = 0) -> bytes:
    request = request_pb2.Request(service=ECHO, method=method, payload=payload, timeout_nano=timeout_nano)
    return encode_frame(stream_id, MessageType.REQUEST, 0, request.SerializeToString())


async def read_response(reader: asyncio.StreamReader) -> tuple[int, request_pb2.Response]:
    length, stream_id, type_, _ = struct.unpack(">IIBB", await guard(reader.readexactly(10)))
    assert type_ == MessageType.RESPONSE
    return stream_id, request_pb2.Response.FromString(await guard(reader.readexactly(length)))


@pytest_asyncio.fixture
async def raw(
    server: UnixServer, path: Path
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_unix_connection(path)
    yield reader, writer
    writer.close()
    await writer.wait_closed()


# --- calls over a unix socket --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_echo(client: Client, service: EchoService) -> None:
    assert await echo(client, "hello") == "hello"
    assert await echo(client, "") == ""
    [first, second] = service.contexts
    assert (first.service, first.method, first.stream_id, second.stream_id) == (ECHO, "Echo", 1, 3)
    assert (first.timeout_nano, first.deadline, first.time_remaining()) == (0, None, None)


@pytest.mark.asyncio
async def test_concurrent_calls_answered_out_of_order(client: Client, service: EchoService) -> None:
    slow = asyncio.create_task(echo(client, "slow", "Block"))
    await guard(service.blocked.wait())
    assert await echo(client, "fast") == "fast"
    assert not slow.done()
    service.gate.set()
    assert await guard(slow) == "slow"


@pytest.mark.asyncio
async def test_many_concurrent_calls_are_matched(client: Client) -> None:
    values = [f"v{i}" * i for i in range(30)]
    assert await guard(asyncio.gather(*(echo(client, v) for v in values))) == values


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("service_name", "method", "text"),
    [("test.Nope", "Echo", "service test.Nope"), (ECHO, "Nope", "method Nope")],
)
async def test_unknown_service_or_method_is_unimplemented(
    client: Client, service_name: str, method: str, text: str
) -> None:
    with pytest.raises(TtrpcError) as info:
        await client.call(service_name, method, StringValue(), StringValue)
    assert (info.value.code, info.value.message) == (Code.UNIMPLEMENTED, text)
    assert await echo(client, "still there") == "still there"


@pytest.mark.asyncio
async def test_handler_exception_is_unknown_and_logged(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(TtrpcError) as info:
        await echo(client, "boom", "Fail")
    assert (info.value.code, info.value.message) == (Code.UNKNOWN, "boom")
    [record] = [r for r in caplog.records if r.name == "nri_plugin.ttrpc.aio"]
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None


@pytest.mark.asyncio
async def test_ttrpc_error_passes_through(client: Client) -> None:
    with pytest.raises(TtrpcError) as info:
        await echo(client, "no such thing", "Status")
    assert (info.value.code, info.value.message) == (Code.NOT_FOUND, "no such thing")


@pytest.mark.asyncio
async def test_metadata_is_tolerated_and_passed_on(client: Client) -> None:
    metadata = [("traceparent", "00-abc-01"), ("k", "1"), ("k", "2")]
    assert await echo(client, "", "Meta", metadata=metadata) == "traceparent=00-abc-01;k=1;k=2"


@pytest.mark.asyncio
async def test_client_timeout_is_sent_as_budget(client: Client, service: EchoService) -> None:
    assert await echo(client, "x", timeout=30) == "x"
    [ctx] = service.contexts
    assert 0 < ctx.timeout_nano <= 30_000_000_000
    assert ctx.deadline is not None
    assert ctx.time_remaining() is not None


@pytest.mark.asyncio
async def test_call_over_budget_is_deadline_exceeded(client: Client, service: EchoService) -> None:
    with pytest.raises(TtrpcError) as info:
        await echo(client, "x", "Block", timeout=0.02)
    assert info.value.code == Code.DEADLINE_EXCEEDED
    await guard(service.cancelled.wait())
    assert await echo(client, "after") == "after"


@pytest.mark.asyncio
async def test_server_enforces_timeout_nano(
    raw: tuple[asyncio.StreamReader, asyncio.StreamWriter], service: EchoService
) -> None:
    reader, writer = raw
    writer.write(raw_request(1, "Block", timeout_nano=20_000_000))
    stream_id, response = await read_response(reader)
    assert (stream_id, response.status.code) == (1, Code.DEADLINE_EXCEEDED)
    assert response.status.message == "context deadline exceeded"
    assert service.cancelled.is_set()


@pytest.mark.asyncio
async def test_undecodable_payload_is_internal(
    raw: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    reader, writer = raw
    writer.write(raw_request(1, "Echo", payload=b"\xff"))
    _, response = await read_response(reader)
    assert response.status.code == Code.INTERNAL
    assert response.status.message.startswith("ttrpc: error unmarshalling payload: ")


@pytest.mark.asyncio
async def test_oversized_request_is_refused_by_the_client(client: Client, service: EchoService) -> None:
    with pytest.raises(OversizedMessage) as info:
        await echo(client, "x" * BIG)
    assert info.value.code == Code.RESOURCE_EXHAUSTED
    assert await echo(client, "next") == "next"
    assert [ctx.stream_id for ctx in service.contexts] == [1]


@pytest.mark.asyncio
async def test_oversized_response_becomes_resource_exhausted(client: Client) -> None:
    with pytest.raises(TtrpcError) as info:
        await echo(client, "", "Big")
    assert info.value.code == Code.RESOURCE_EXHAUSTED
    assert info.value.message.startswith("message length ")
    assert await echo(client, "next") == "next"


@pytest.mark.asyncio
async def test_oversized_data_from_a_raw_peer(raw: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
    reader, writer = raw
    writer.write(struct.pack(">IIBB", BIG, 1, MessageType.REQUEST, 0))
    for _ in range(BIG // (1 << 20)):
        writer.write(bytes(1 << 20))
        await guard(writer.drain())
    writer.write(raw_request(3, "Echo", StringValue(value="ok").SerializeToString()))
    stream_id, response = await read_response(reader)
    assert (stream_id, response.status.code) == (1, Code.RESOURCE_EXHAUSTED)
    assert response.status.message == "message length 5242880 exceed maximum message size of 4194304"
    stream_id, response = await read_response(reader)
    assert (stream_id, response.HasField("status")) == (3, False)
    assert StringValue.FromString(response.payload).value == "ok"


@pytest.mark.asyncio
async def test_protocol_violation_closes_the_connection(
    raw: tuple[asyncio.StreamReader, asyncio.StreamWriter], client: Client
) -> None:
    reader, writer = raw
    writer.write(struct.pack(">IIBB", 0, 1, 9, 0))
    assert await guard(reader.read()) == b""
    assert await echo(client, "other connections are fine") == "other connections are fine"


@pytest.mark.asyncio
async def test_handler_calling_out_does_not_block_the_receive_side(
    tmp_path: Path, service: EchoService, client: Client
) -> None:
    backend = EchoService()
    async with await serve_unix(tmp_path / "backend.sock", backend.services()):
        service.relay_to = await connect_unix(tmp_path / "backend.sock")
        relay = asyncio.create_task(echo(client, "relayed", "Relay"))
        await guard(backend.blocked.wait())
        # The Relay handler is waiting on the backend; this connection still serves requests.
        assert await echo(client, "meanwhile") == "meanwhile"
        assert not relay.done()
        backend.gate.set()
        assert await guard(relay) == "relayed"
        service.relay_to.close()
        await guard(service.relay_to.wait_closed())


# --- connection loss and lifecycle ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_peer_closing_mid_request_fails_the_pending_call(path: Path) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(10)
        writer.close()
        await writer.wait_closed()

    peer = await asyncio.start_unix_server(hang_up, path)
    try:
        client = await connect_unix(path)
        with pytest.raises(ConnectionClosed):
            await guard(echo(client, "x"))
        with pytest.raises(ConnectionClosed):
            await echo(client, "later calls fail at once")
        await guard(client.wait_closed())
    finally:
        peer.close()
        await peer.wait_closed()


@pytest.mark.asyncio
async def test_client_close_fails_pending_calls_and_cancels_handlers(
    client: Client, service: EchoService
) -> None:
    pending = asyncio.create_task(echo(client, "x", "Block"))
    await guard(service.blocked.wait())
    client.close()
    with pytest.raises(ConnectionClosed):
        await guard(pending)
    await guard(client.wait_closed())
    await guard(service.cancelled.wait())
    with pytest.raises(ConnectionClosed):
        await echo(client, "closed")


@pytest.mark.asyncio
async def test_closing_the_unix_server_drops_its_connections(path: Path, service: EchoService) -> None:
    async with await serve_unix(path, service.services()):
        client = await connect_unix(path)
        pending = asyncio.create_task(echo(client, "x", "Block"))
        await guard(service.blocked.wait())
    assert service.cancelled.is_set()
    with pytest.raises(ConnectionClosed):
        await guard(pending)
    await guard(client.wait_closed())


# --- in-memory channels --------------------------------------------------------------------------


def decode_responses(messages: list[bytes]) -> list[tuple[int, int, str, bytes]]:
    out = []
    for message in messages:
        length, stream_id, type_, _ = struct.unpack_from(">IIBB", message)
        assert type_ == MessageType.RESPONSE
        assert len(message) == 10 + length
        response = request_pb2.Response.FromString(message[10:])
        out.append((stream_id, response.status.code, response.status.message, response.payload))
    return out


def ok_response(stream_id: int, value: str) -> bytes:
    response = request_pb2.Response(payload=StringValue(value=value).SerializeToString())
    return encode_frame(stream_id, MessageType.RESPONSE, 0, response.SerializeToString())


@pytest.mark.asyncio
async def test_client_timeout_drops_the_late_response(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nri_plugin.ttrpc.aio")
    sent: list[bytes] = []
    client = Client(sent.append)
    with pytest.raises(TtrpcError) as info:
        await echo(client, "a", timeout=0.01)
    assert info.value.code == Code.DEADLINE_EXCEEDED
    assert request_pb2.Request.FromString(sent[0][10:]).timeout_nano == 10_000_000
    client.data_received(ok_response(1, "late"))
    assert "inactive stream 1" in caplog.text
    call = asyncio.create_task(echo(client, "b"))
    await asyncio.sleep(0)  # the task's first step writes the request
    assert len(sent) == 2
    client.data_received(ok_response(3, "b"))
    assert await guard(call) == "b"


@pytest.mark.asyncio
async def test_client_writes_nothing_for_an_oversized_request() -> None:
    sent: list[bytes] = []
    client = Client(sent.append)
    with pytest.raises(OversizedMessage):
        await echo(client, "x" * BIG)
    with pytest.raises(TtrpcError):
        await echo(client, "no time", timeout=0)
    assert sent == []


@pytest.mark.asyncio
async def test_client_and_server_wired_back_to_back(service: EchoService) -> None:
    server: Server | None = None
    client = Client(lambda message: server.data_received(message) if server else None)
    server = Server(service.services(), client.data_received)
    assert await guard(echo(client, "direct")) == "direct"
    with pytest.raises(TtrpcError) as info:
        await guard(echo(client, "", "Nope"))
    assert info.value.code == Code.UNIMPLEMENTED


@pytest.mark.asyncio
async def test_server_close_refuses_new_requests_and_waits_for_running_ones(service: EchoService) -> None:
    sent: list[bytes] = []
    server = Server(service.services(), sent.append)
    server.data_received(raw_request(1, "Block", StringValue(value="x").SerializeToString()))
    await guard(service.blocked.wait())
    server.close()
    server.data_received(raw_request(3, "Echo"))
    assert decode_responses(sent) == [(3, Code.UNAVAILABLE, "ttrpc: server closed", b"")]
    waiting = asyncio.create_task(server.wait_closed())
    await asyncio.sleep(0)
    assert not waiting.done()
    service.gate.set()
    await guard(waiting)
    assert decode_responses(sent)[1] == (1, 0, "", StringValue(value="x").SerializeToString())


@pytest.mark.asyncio
async def test_nothing_is_written_after_the_connection_is_lost() -> None:
    started = asyncio.Event()

    async def stubborn(request: StringValue, ctx: CallContext) -> StringValue:
        started.set()
        with contextlib.suppress(asyncio.CancelledError):  # a bad handler that answers anyway
            await asyncio.Event().wait()
        return StringValue(value="late")

    sent: list[bytes] = []
    server = Server({ECHO: {"Stubborn": UnaryMethod(StringValue, stubborn)}}, sent.append)
    server.data_received(raw_request(1, "Stubborn"))
    await guard(started.wait())
    server.connection_lost(None)
    await guard(server.wait_closed())
    server.data_received(raw_request(3, "Stubborn"))
    assert sent == []


@pytest.mark.asyncio
async def test_after_reply_runs_once_each_reply_is_sent_and_its_failure_is_only_logged(
    service: EchoService, caplog: pytest.LogCaptureFixture
) -> None:
    """The hook sees each reply already handed to `send` (the caller need not wait for its work),
    after a refused request too; one that raises is logged, and the next request is served."""
    sent: list[bytes] = []
    seen: list[list[int]] = []

    def after_reply() -> None:
        seen.append([stream for stream, *_ in decode_responses(sent)])
        if len(seen) == 2:
            raise RuntimeError("hook broke")

    server = Server(service.services(), sent.append, after_reply=after_reply)
    for n, (stream, method) in enumerate(((1, "Echo"), (3, "Fail"), (5, "Echo")), 1):
        server.data_received(raw_request(stream, method, StringValue(value="x").SerializeToString()))
        await guard(_until_holds(seen, n))
    assert seen == [[1], [1, 3], [1, 3, 5]]
    assert [code for _, code, _, _ in decode_responses(sent)] == [Code.OK, Code.UNKNOWN, Code.OK]
    assert "the work after a reply failed" in caplog.text


async def _until_holds(items: list[Any], count: int) -> None:
    while len(items) < count:  # noqa: ASYNC110 - a few turns of the loop (3.10, 3.11: the handler's task)
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_server_protocol_error_asks_the_owner_to_close() -> None:
    closed: list[bool] = []
    server = Server({}, lambda message: None, close_channel=lambda: closed.append(True))
    server.data_received(struct.pack(">IIBB", 0, 1, 7, 0))
    assert closed == [True]


@pytest.mark.asyncio
async def test_client_protocol_error_fails_pending_calls() -> None:
    closed: list[bool] = []
    client = Client(lambda message: None, close_channel=lambda: closed.append(True))
    call = asyncio.create_task(echo(client, "x"))
    await asyncio.sleep(0)
    client.data_received(struct.pack(">IIBB", 0, 1, 7, 0))
    with pytest.raises(ConnectionClosed):
        await guard(call)
    assert closed == [True]
    assert client.closed


@pytest.mark.asyncio
async def test_handler_that_never_waits_is_answered_inside_data_received_from_3_12() -> None:
    """Eager start (Python 3.12 and later): no event-loop turn between the request and its
    response. Before 3.12 the handler's task first runs at the loop's next turn."""
    sent: list[bytes] = []
    server = Server(EchoService().services(), sent.append)
    server.data_received(raw_request(1, "Echo", StringValue(value="now").SerializeToString()))
    answered = [(1, 0, "", StringValue(value="now").SerializeToString())]
    if sys.version_info >= (3, 12):
        assert decode_responses(sent) == answered
    else:
        assert sent == []
        await guard(server.wait_closed())
        assert decode_responses(sent) == answered


@pytest.mark.asyncio
async def test_a_handler_whose_first_step_is_wait_for_runs_in_a_task() -> None:
    """Whatever needs a current task works from a handler's very first step, eager start or not:
    from Python 3.12, asyncio.wait_for (and asyncio.timeout) raise outside a task."""
    seen: list[asyncio.Task[Any] | None] = []

    async def times_out_first(request: StringValue, ctx: CallContext) -> StringValue:
        seen.append(asyncio.current_task())
        done = await asyncio.wait_for(asyncio.sleep(0, result="in time"), 5)
        try:
            await asyncio.wait_for(asyncio.Event().wait(), 0.001)
        except asyncio.TimeoutError:
            return StringValue(value=f"{done}, then timed out")
        return StringValue(value="never")

    sent: list[bytes] = []
    server = Server({ECHO: {"Wait": UnaryMethod(StringValue, times_out_first)}}, sent.append)
    server.data_received(raw_request(1, "Wait"))
    await guard(server.wait_closed())
    assert decode_responses(sent) == [
        (1, 0, "", StringValue(value="in time, then timed out").SerializeToString())
    ]
    assert seen[0] is not None


@pytest.mark.asyncio
async def test_a_large_request_is_answered_from_a_task_without_its_envelope() -> None:
    """A request of 64 KiB or more (a Synchronize chunk) is not handled inside data_received: it
    starts at the next turn of the loop, once the buffers that carried it are let go; its handler
    gets the decoded message and the request's size, and holds no ttrpc envelope."""
    sent: list[bytes] = []
    seen: list[tuple[int, int]] = []

    async def measure(request: StringValue, ctx: CallContext) -> StringValue:
        seen.append((len(request.value), ctx.request_size))
        return StringValue(value="ok")

    server = Server({ECHO: {"Measure": UnaryMethod(StringValue, measure)}}, sent.append)
    big = StringValue(value="x" * (64 * 1024)).SerializeToString()
    message = raw_request(1, "Measure", big)
    server.data_received(message)
    assert sent == []  # not yet: it waits for the loop
    await guard(server.wait_closed())
    assert decode_responses(sent) == [(1, 0, "", StringValue(value="ok").SerializeToString())]
    assert seen == [(64 * 1024, len(message) - 10)]  # the size: the frame's data, its header aside


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [10, 64 * 1024], ids=["small", "large"])
async def test_a_raw_method_gets_the_payload_undecoded(size: int) -> None:
    """`UnaryMethod(raw=True)`: the handler gets the payload's bytes (a view of those received for a
    large request, which it may release) and decodes them itself."""
    sent: list[bytes] = []
    got: list[tuple[type, str]] = []

    async def raw(data: Any, ctx: CallContext) -> StringValue:
        got.append((type(data), decode_payload(StringValue, data).value))
        if isinstance(data, memoryview):
            data.release()
        return StringValue(value="ok")

    server = Server({ECHO: {"Raw": UnaryMethod(StringValue, raw, raw=True)}}, sent.append)
    server.data_received(raw_request(1, "Raw", StringValue(value="x" * size).SerializeToString()))
    await guard(server.wait_closed())
    assert got == [(memoryview if size >= LARGE_REQUEST else bytes, "x" * size)]
    assert decode_responses(sent) == [(1, 0, "", StringValue(value="ok").SerializeToString())]


@pytest.mark.asyncio
async def test_handler_suspending_after_an_eager_start_keeps_its_context() -> None:
    """A handler started eagerly and resumed in a task sees one context throughout (tokens stay valid)."""
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    release = asyncio.Event()
    seen: list[str] = []

    async def handler(request: StringValue, ctx: CallContext) -> StringValue:
        token = var.set(request.value)
        await release.wait()  # suspends: the rest runs in a task
        await asyncio.sleep(0)  # a bare yield, also handed through
        seen.append(var.get())
        var.reset(token)  # would raise if the task ran in another context
        return StringValue(value=var.get())

    sent: list[bytes] = []
    server = Server({ECHO: {"Ctx": UnaryMethod(StringValue, handler)}}, sent.append)
    server.data_received(raw_request(1, "Ctx", StringValue(value="a").SerializeToString()))
    server.data_received(raw_request(3, "Ctx", StringValue(value="b").SerializeToString()))
    assert sent == []
    assert var.get() == "unset"  # nothing leaked into the receiving side's context
    release.set()
    await guard(server.wait_closed())
    assert sorted(seen) == ["a", "b"]
    assert sorted(decode_responses(sent)) == [
        (1, 0, "", StringValue(value="unset").SerializeToString()),
        (3, 0, "", StringValue(value="unset").SerializeToString()),
    ]


@pytest.mark.asyncio
async def test_budget_spent_before_the_first_wait_ends_the_call_at_that_wait() -> None:
    """The budget timer is armed only once a handler waits; a budget already spent by then still
    counts from arrival, and the call ends at that first wait."""
    reached: list[str] = []

    async def busy_then_waits(request: StringValue, ctx: CallContext) -> StringValue:
        deadline = ctx.deadline
        assert deadline is not None
        while asyncio.get_running_loop().time() <= deadline:  # spends its whole budget without waiting
            pass
        reached.append("wait")
        await asyncio.Event().wait()
        reached.append("never")
        return StringValue()

    sent: list[bytes] = []
    server = Server({ECHO: {"Busy": UnaryMethod(StringValue, busy_then_waits)}}, sent.append)
    server.data_received(raw_request(1, "Busy", timeout_nano=1_000_000))
    assert sent == []  # it waits: not answered inside data_received
    await guard(server.wait_closed())
    assert reached == ["wait"]
    assert decode_responses(sent) == [(1, Code.DEADLINE_EXCEEDED, "context deadline exceeded", b"")]


@pytest.mark.asyncio
async def test_exception_after_suspension_and_budget_after_eager_start() -> None:
    async def fails_later(request: StringValue, ctx: CallContext) -> StringValue:
        await asyncio.sleep(0)
        raise ValueError("broke after waiting")

    async def too_slow(request: StringValue, ctx: CallContext) -> StringValue:
        await asyncio.Event().wait()
        return StringValue()

    sent: list[bytes] = []
    services = {
        ECHO: {"Fails": UnaryMethod(StringValue, fails_later), "Slow": UnaryMethod(StringValue, too_slow)}
    }
    server = Server(services, sent.append)
    server.data_received(raw_request(1, "Fails"))
    server.data_received(raw_request(3, "Slow", timeout_nano=20_000_000))
    await guard(server.wait_closed())
    assert sorted(decode_responses(sent)) == [
        (1, Code.UNKNOWN, "broke after waiting", b""),
        (3, Code.DEADLINE_EXCEEDED, "context deadline exceeded", b""),
    ]
