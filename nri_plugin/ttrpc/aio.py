"""asyncio edge of ttrpc: a `Server` and a `Client` over a *channel*.

A channel is anything that takes one whole ttrpc message per `send(message)` call and feeds what it
receives back through the receiver's `data_received(data)` and `connection_lost(exc)`. Whole messages
matter: the NRI multiplexer frames each message on its own, the way Go peers expect. A plain unix
socket is one channel (`serve_unix`, `connect_unix`); an NRI mux connection id is another.

The receive side never waits: `data_received` only feeds the sans-I/O session, writes the replies the
session made by itself and starts one task per request. So a handler may itself make calls (on this
or another channel) without blocking the requests that come after it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar, cast

from google.protobuf.message import DecodeError, Message

from nri_plugin.ttrpc.errors import (
    Code,
    ConnectionClosed,
    OversizedMessage,
    ProtocolError,
    TtrpcError,
)
from nri_plugin.ttrpc.logbudget import LogBudget, suppressed_note
from nri_plugin.ttrpc.protocol import (
    LARGE_REQUEST,
    ClientSession,
    RequestReceived,
    ResponseReceived,
    ServerSession,
    UnexpectedResponse,
)

__all__ = [
    "CallContext",
    "Client",
    "Receiver",
    "Send",
    "Server",
    "Services",
    "UnaryMethod",
    "UnixServer",
    "connect_unix",
    "decode_payload",
    "serve_unix",
]

logger = logging.getLogger(__name__)

# Writes one whole ttrpc message to the channel.
Send = Callable[[bytes], None]
CloseChannel = Callable[[], None]

ReqT = TypeVar("ReqT", bound=Message)
RespT = TypeVar("RespT", bound=Message)

# Go's context error text, which Go servers send for an expired budget.
_DEADLINE_TEXT = "context deadline exceeded"
_NANO = 1_000_000_000


class Receiver(Protocol):
    """What a channel feeds: a `Server` or a `Client`."""

    def data_received(self, data: bytes | memoryview) -> None: ...

    def connection_lost(self, exc: BaseException | None) -> None: ...

    async def wait_closed(self) -> None: ...


class CallContext(NamedTuple):
    """What a handler knows about the call besides the request message."""

    service: str
    method: str
    stream_id: int
    # Request metadata in wire order; a key may repeat.
    metadata: tuple[tuple[str, str], ...]
    # The caller's remaining budget when it sent the request; 0 means none.
    timeout_nano: int
    # `loop.time()` at which the server gives up on the handler; None when there is no budget.
    deadline: float | None
    # Bytes of the request as received (its ttrpc envelope and payload): what a handler that
    # gathers several requests counts against its limit, without serializing them again.
    request_size: int = 0

    def time_remaining(self) -> float | None:
        """Seconds left of the budget (never negative), or None when unbounded."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - asyncio.get_running_loop().time())


@dataclass(frozen=True)
class UnaryMethod(Generic[ReqT, RespT]):
    """One method: how to decode its request and the coroutine that answers it.

    `raw`: the handler gets the request's payload undecoded (bytes, or for a large request a view of
    the bytes received, which it may release once decoded) and decodes it itself (`decode_payload`):
    a handler that keeps only part of a large message can then let the rest go while it works."""

    request_type: type[ReqT]
    handler: Callable[[ReqT, CallContext], Awaitable[RespT]]
    raw: bool = False


# Fully qualified service name -> bare method name -> method.
Services = Mapping[str, Mapping[str, UnaryMethod[Any, Any]]]


# --- server --------------------------------------------------------------------------------------


class Server:
    """Serves `services` on one channel.

    Lifecycle: `close()` stops taking new requests (they get Unavailable), `wait_closed()` waits for
    the handlers still running. `connection_lost` cancels the running handlers; nothing is written
    after it. A protocol violation by the peer counts as a lost connection and asks the channel's
    owner to close it through `close_channel`.

    `after_reply`, when given, is called right after each handler's reply has been handed to `send`
    (and so to the socket), in the same turn of the event loop: the place for work the caller need
    not wait for, at no extra turn of the loop. What it raises is logged, not answered.
    """

    def __init__(
        self,
        services: Services,
        send: Send,
        *,
        close_channel: CloseChannel | None = None,
        after_reply: Callable[[], None] | None = None,
    ) -> None:
        self._services = services
        self._send = send
        self._close_channel = close_channel
        self._after_reply = after_reply
        self._session = ServerSession()
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepting = True
        self._lost = False
        # A handler failing for every request of a hostile peer must not flood the log.
        self._failure_log = LogBudget()

    def data_received(self, data: bytes | memoryview) -> None:
        if self._lost:
            return
        try:
            events = self._session.receive_data(data)
        except ProtocolError as exc:
            logger.error("ttrpc server: peer broke the protocol, closing: %s", exc)
            self._abort()
            return
        for message in self._session.messages_to_send():
            self._write(message)
        for event in events:
            self._start(event)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._lost:
            return
        self._lost = True
        self._accepting = False
        for task in self._tasks:
            task.cancel()

    def close(self) -> None:
        """Stop taking requests; those already running go on and are answered."""
        self._accepting = False

    async def wait_closed(self) -> None:
        """Wait until no handler is running (call after `close()` or a lost connection)."""
        while self._tasks:
            # asyncio.wait, not gather: cancelling this wait must not cancel the handlers.
            await asyncio.wait(set(self._tasks))

    def _abort(self) -> None:
        self.connection_lost(None)
        if self._close_channel is not None:
            self._close_channel()

    def _start(self, event: RequestReceived) -> None:
        stream_id = event.stream_id
        if not self._accepting:
            self._respond(stream_id, b"", Code.UNAVAILABLE, "ttrpc: server closed")
            return
        # The budget counts from arrival, not from when the handler first runs.
        ctx = _context(event)
        running = _Running()
        loop = asyncio.get_running_loop()
        if event.size >= LARGE_REQUEST:
            # A large request (a Synchronize chunk) is decoded and handled at the next turn of the
            # loop: by then the buffers that carried its bytes here are gone.
            task = loop.create_task(self._decode_and_serve(event, ctx, running), name=_task_name(event))
        else:
            try:
                method, request = self._decode(event, ctx)
            except TtrpcError as exc:
                self._respond(stream_id, b"", exc.code, exc.message)
                return
            task = _handler_task(
                loop, self._serve(stream_id, method, request, ctx, running), _task_name(event)
            )
            if task.done():
                return  # started eagerly and answered without waiting: nothing to time or track
        running.task = task
        running.arm(loop, ctx.deadline)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _decode(self, event: RequestReceived, ctx: CallContext) -> tuple[UnaryMethod[Any, Any], Message]:
        """The method called and its request message; `TtrpcError` for an unknown one or bad bytes."""
        # Code 12 and these exact texts, like Go: NRI runtimes fall back to older RPCs on 12.
        methods = self._services.get(ctx.service)
        if methods is None:
            raise TtrpcError(Code.UNIMPLEMENTED, f"service {ctx.service}")
        method = methods.get(ctx.method)
        if method is None:
            raise TtrpcError(Code.UNIMPLEMENTED, f"method {ctx.method}")
        payload = event.request.payload if event.payload is None else event.payload
        if method.raw:
            return method, payload  # type: ignore[return-value]  # (the handler decodes it)
        return method, decode_payload(method.request_type, payload)

    async def _decode_and_serve(self, event: RequestReceived, ctx: CallContext, running: _Running) -> None:
        stream_id = event.stream_id
        try:
            method, request = self._decode(event, ctx)
        except TtrpcError as exc:
            self._respond(stream_id, b"", exc.code, exc.message)
            return
        # The handler holds the decoded message, not the bytes it came in (nor the ttrpc envelope).
        del event
        await self._serve(stream_id, method, request, ctx, running)

    async def _serve(
        self,
        stream_id: int,
        method: UnaryMethod[Any, Any],
        request: Message,
        ctx: CallContext,
        running: _Running,
    ) -> None:
        """Run the handler within the caller's budget and answer with what it gave or raised.

        The budget is a timer that cancels the request's own task (`_Running.arm`, set by `_start`
        once the task exists), rather than asyncio.wait_for: no extra task per request, and no timer
        at all for a handler started eagerly that answers without waiting (the timer could not have
        fired before it answered anyway).
        """
        code: int
        try:
            reply = await method.handler(request, ctx)
            payload = reply.SerializeToString()
        except asyncio.CancelledError:
            if not running.expired:
                raise
            running.uncancel()
            code, message, payload = Code.DEADLINE_EXCEEDED, _DEADLINE_TEXT, b""
        except Exception as exc:
            code, message = self._failure(exc, ctx)
            payload = b""
        else:
            code, message = Code.OK, ""
        finally:
            running.disarm()
        self._respond(stream_id, payload, code, message)
        if self._after_reply is not None:
            try:
                self._after_reply()
            except Exception:
                logger.exception("ttrpc server: the work after a reply failed")

    def _failure(self, exc: Exception, ctx: CallContext) -> tuple[int, str]:
        """The status of a handler's exception: (code, message)."""
        if isinstance(exc, TtrpcError):
            return exc.code, exc.message
        if isinstance(exc, asyncio.TimeoutError):
            return Code.DEADLINE_EXCEEDED, _DEADLINE_TEXT
        suppressed = self._failure_log.take()
        if suppressed is not None:
            logger.exception(
                "ttrpc handler %s/%s failed%s",
                ctx.service,
                ctx.method,
                suppressed_note(suppressed),
                exc_info=exc,
            )
        # Go sends err.Error(); an exception without text still needs a readable message.
        return Code.UNKNOWN, str(exc) or repr(exc)

    def _respond(self, stream_id: int, payload: bytes, code: int, message: str) -> None:
        if self._lost:
            logger.debug("ttrpc server: connection lost, dropping the response of stream %d", stream_id)
            return
        try:
            out = self._session.send_response(stream_id, payload=payload, code=code, message=message)
        except OversizedMessage as exc:
            # The reply cannot go out; tell the caller why instead of leaving it waiting.
            logger.error("ttrpc server: response of stream %d too large: %s", stream_id, exc.message)
            out = self._session.send_response(stream_id, code=exc.code, message=exc.message)
        self._write(out)

    def _write(self, message: bytes) -> None:
        try:
            self._send(message)
        except ConnectionClosed:
            logger.debug("ttrpc server: channel closed, response dropped")
        except Exception:
            logger.exception("ttrpc server: cannot write a response")


def _task_name(event: RequestReceived) -> str:
    return f"ttrpc {event.request.service}/{event.request.method} #{event.stream_id}"


def _context(event: RequestReceived) -> CallContext:
    request = event.request
    timeout_nano = request.timeout_nano
    # Like Go, only a positive timeout sets a deadline; 0 (and nonsense below it) means none.
    deadline = asyncio.get_running_loop().time() + timeout_nano / _NANO if timeout_nano > 0 else None
    metadata = tuple((kv.key, kv.value) for kv in request.metadata) if request.metadata else ()
    return CallContext(
        service=request.service,
        method=request.method,
        stream_id=event.stream_id,
        metadata=metadata,
        timeout_nano=timeout_nano,
        deadline=deadline,
        request_size=event.size,
    )


def decode_payload(request_type: type[ReqT], payload: bytes | memoryview) -> ReqT:
    """A request message from its payload; `TtrpcError` (Internal, Go's text) when malformed."""
    try:
        # A view is parsed in place (the stubs say bytes; upb takes any buffer, without a copy).
        return request_type.FromString(cast(bytes, payload))
    except DecodeError as exc:
        raise TtrpcError(Code.INTERNAL, f"ttrpc: error unmarshalling payload: {exc}") from exc


class _Running:
    """One request being handled: its task (once it has one), the timer that ends its budget (once
    it has a task) and whether the budget ran out."""

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.expired = False

    def arm(self, loop: asyncio.AbstractEventLoop, deadline: float | None) -> None:
        """Cancel the task at `deadline` (loop time; a past one fires at the next iteration)."""
        if deadline is not None:
            self.timer = loop.call_at(deadline, self.expire)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def expire(self) -> None:
        self.expired = True
        if self.task is not None:
            self.task.cancel()

    def uncancel(self) -> None:
        """Take back the cancellation `expire` asked for: the task goes on to answer."""
        if sys.version_info >= (3, 11) and self.task is not None:
            self.task.uncancel()


if sys.version_info >= (3, 12):

    def _handler_task(
        loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None], name: str
    ) -> asyncio.Task[None]:
        """A task for one request's handler, started eagerly: it runs at once, inside this call, up to
        its first real wait. A handler that never waits is answered without a turn of the event
        loop (each costs an epoll call), which is most of the plugin's share of a round trip; it
        still runs inside its own task, so everything that needs a current task works."""
        return asyncio.Task(coro, loop=loop, name=name, eager_start=True)

else:

    def _handler_task(
        loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None], name: str
    ) -> asyncio.Task[None]:
        """A task for one request's handler (Python 3.10 and 3.11 have no eager start: the handler
        first runs at the loop's next turn)."""
        return loop.create_task(coro, name=name)


# --- client --------------------------------------------------------------------------------------


class Client:
    """Makes calls on one channel; concurrent calls are matched to responses by stream id.

    `close()` fails the pending calls and refuses new ones, then asks the channel's owner to close
    (`close_channel`); `wait_closed()` returns once the channel reported `connection_lost` (at once
    when there is no `close_channel`).
    """

    def __init__(self, send: Send, *, close_channel: CloseChannel | None = None) -> None:
        self._send = send
        self._close_channel = close_channel
        self._session = ClientSession()
        self._pending: dict[int, asyncio.Future[ResponseReceived]] = {}
        # Why calls fail once the channel is gone: (message, underlying cause).
        self._closed: tuple[str, BaseException | None] | None = None
        self._lost = asyncio.Event()
        # A peer can send responses nobody asked for as fast as it likes: a few lines, then a count.
        self._stray_log = LogBudget()

    @property
    def closed(self) -> bool:
        return self._closed is not None

    @property
    def pending_calls(self) -> int:
        """Calls sent and not answered yet; a call counts as answered the moment its reply is read."""
        return len(self._pending)

    async def call(
        self,
        service: str,
        method: str,
        request: Message,
        response_type: type[RespT],
        *,
        timeout: float | None = None,
        metadata: Iterable[tuple[str, str]] = (),
    ) -> RespT:
        """One unary call.

        Raises `TtrpcError` for a non-OK status (DEADLINE_EXCEEDED also when `timeout` runs out
        here; a late response is then dropped), `OversizedMessage` when the request is too large
        (nothing is written), `ConnectionClosed` when the channel is gone.
        """
        if self._closed is not None:
            raise self._closed_error()
        if timeout is not None and timeout <= 0:
            raise TtrpcError(Code.DEADLINE_EXCEEDED, _DEADLINE_TEXT)
        stream_id, future = self._start_call(service, method, request, timeout, metadata)
        try:
            response = await _wait_response(future, timeout)
        finally:
            self._forget(stream_id)
        if response.code != Code.OK:
            raise TtrpcError(response.code, response.message)
        try:
            return response_type.FromString(response.payload)
        except DecodeError as exc:
            raise TtrpcError(Code.INTERNAL, f"ttrpc: error unmarshalling response payload: {exc}") from exc

    def _start_call(
        self,
        service: str,
        method: str,
        request: Message,
        timeout: float | None,
        metadata: Iterable[tuple[str, str]],
    ) -> tuple[int, asyncio.Future[ResponseReceived]]:
        # Allocating the id and writing happen with no await in between, so ids on the wire increase.
        stream_id, message = self._session.send_request(
            service, method, request.SerializeToString(), timeout_nano=_to_nano(timeout), metadata=metadata
        )
        future: asyncio.Future[ResponseReceived] = asyncio.get_running_loop().create_future()
        self._pending[stream_id] = future
        try:
            self._send(message)
        except BaseException:
            self._forget(stream_id)
            raise
        return stream_id, future

    def _forget(self, stream_id: int) -> None:
        self._pending.pop(stream_id, None)
        self._session.abandon(stream_id)

    def data_received(self, data: bytes | memoryview) -> None:
        if self._closed is not None:
            return
        try:
            events = self._session.receive_data(data)
        except ProtocolError as exc:
            logger.error("ttrpc client: peer broke the protocol, closing: %s", exc)
            self._fail_all(f"ttrpc: closed: {exc}", exc)
            self._close_owner()
            return
        for event in events:
            self._dispatch(event)

    def _dispatch(self, event: ResponseReceived | UnexpectedResponse) -> None:
        if isinstance(event, UnexpectedResponse):
            # Usually the answer to a call that already timed out here.
            suppressed = self._stray_log.take()
            if suppressed is not None:
                logger.info(
                    "ttrpc client: response on inactive stream %d dropped%s",
                    event.stream_id,
                    suppressed_note(suppressed),
                )
            return
        future = self._pending.pop(event.stream_id, None)
        if future is not None and not future.done():
            future.set_result(event)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._fail_all("ttrpc: closed", exc)
        self._lost.set()
        left_out = self._stray_log.flush()
        if left_out:
            logger.info("ttrpc client: %d more responses on inactive streams were dropped", left_out)

    def close(self) -> None:
        """Fail pending calls with `ConnectionClosed`, refuse new ones and close the channel."""
        self._fail_all("ttrpc: client closed", None)
        self._close_owner()

    async def wait_closed(self) -> None:
        await self._lost.wait()

    def _close_owner(self) -> None:
        if self._close_channel is None:
            self._lost.set()
        else:
            self._close_channel()

    def _fail_all(self, message: str, cause: BaseException | None) -> None:
        if self._closed is None:
            self._closed = (message, cause)
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(self._closed_error())

    def _closed_error(self) -> ConnectionClosed:
        # A fresh exception each time: one instance raised in many tasks would pile up tracebacks.
        assert self._closed is not None
        message, cause = self._closed
        error = ConnectionClosed(message)
        error.__cause__ = cause
        return error


def _to_nano(timeout: float | None) -> int:
    if timeout is None:
        return 0
    # At least 1 ns: 0 on the wire would mean "no deadline".
    return max(1, int(timeout * _NANO))


async def _wait_response(future: asyncio.Future[ResponseReceived], timeout: float | None) -> ResponseReceived:
    if timeout is None:
        return await future
    # A timer on the future itself: cheaper than asyncio.wait_for, which wraps it in a task.
    timer = asyncio.get_running_loop().call_later(timeout, _expire, future)
    try:
        return await future
    finally:
        timer.cancel()


def _expire(future: asyncio.Future[ResponseReceived]) -> None:
    if not future.done():
        future.set_exception(TtrpcError(Code.DEADLINE_EXCEEDED, _DEADLINE_TEXT))


# --- plain unix sockets (no NRI mux) -------------------------------------------------------------

R = TypeVar("R", bound=Receiver)


class _ChannelProtocol(asyncio.Protocol, Generic[R]):
    """Makes one socket connection a channel: each `send` is one `transport.write` of a message."""

    def __init__(
        self,
        make_receiver: Callable[[Send, CloseChannel], R],
        on_done: Callable[[_ChannelProtocol[R]], None] | None = None,
    ) -> None:
        self._make_receiver = make_receiver
        self._on_done = on_done
        self._transport: asyncio.Transport | None = None
        self._receiver: R | None = None
        self._done = asyncio.get_running_loop().create_future()
        self._finishing: asyncio.Task[None] | None = None

    @property
    def receiver(self) -> R:
        assert self._receiver is not None, "not connected yet"
        return self._receiver

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._receiver = self._make_receiver(self._send, transport.close)

    def _send(self, message: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            raise ConnectionClosed()
        self._transport.write(message)

    def data_received(self, data: bytes | memoryview) -> None:
        self.receiver.data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.receiver.connection_lost(exc)
        # Done once the receiver's handlers have wound down too.
        self._finishing = asyncio.get_running_loop().create_task(self._finish())

    async def _finish(self) -> None:
        await self.receiver.wait_closed()
        self._done.set_result(None)
        if self._on_done is not None:
            self._on_done(self)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._done)


class UnixServer:
    """A listening unix socket serving ttrpc; `close()` also drops the open connections."""

    def __init__(self, server: asyncio.AbstractServer, connections: set[_ChannelProtocol[Server]]) -> None:
        self._server = server
        self._connections = connections

    def close(self) -> None:
        self._server.close()
        for connection in list(self._connections):
            connection.close()

    async def wait_closed(self) -> None:
        await self._server.wait_closed()
        while self._connections:
            await asyncio.wait([asyncio.ensure_future(c.wait_closed()) for c in list(self._connections)])

    async def __aenter__(self) -> UnixServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()
        await self.wait_closed()


async def serve_unix(path: str | os.PathLike[str], services: Services) -> UnixServer:
    """Listen on a unix socket; every connection gets its own `Server` (plain ttrpc, no NRI mux)."""
    connections: set[_ChannelProtocol[Server]] = set()

    def make_server(send: Send, close: CloseChannel) -> Server:
        return Server(services, send, close_channel=close)

    def factory() -> _ChannelProtocol[Server]:
        protocol = _ChannelProtocol(make_server, on_done=connections.discard)
        connections.add(protocol)
        return protocol

    server = await asyncio.get_running_loop().create_unix_server(factory, os.fspath(path))
    return UnixServer(server, connections)


async def connect_unix(path: str | os.PathLike[str]) -> Client:
    """Connect to a plain ttrpc server on a unix socket; `client.close()` closes the socket."""

    def make_client(send: Send, close: CloseChannel) -> Client:
        return Client(send, close_channel=close)

    _, protocol = await asyncio.get_running_loop().create_unix_connection(
        lambda: _ChannelProtocol(make_client), os.fspath(path)
    )
    return protocol.receiver
