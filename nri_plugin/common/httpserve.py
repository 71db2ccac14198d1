"""One small HTTP/1.1 server for the daemon's two endpoints: the probes and metrics (TCP,
`nri_plugin.daemon.probes`) and the status socket (unix, `nri_plugin.daemon.status`).

h11 parses and writes HTTP (sans-I/O: bytes in, events out; the one request parser). This module
does the I/O and the defences, the same for both servers, each choosing its numbers (`Limits`):

* One request per connection, answered with ``Connection: close``. Routes are paths (the query is
  ignored), each a plain function giving the `Answer`; other paths 404, methods other than the
  server's 405, HEAD answered without the body. What h11 will not parse, another HTTP version than
  1.0 and 1.1, a target that is not a path: 400 and one line. A request head over `Limits.max_head`
  bytes: 431. A request body is never read: after an error answer, what the client still sends is
  read and dropped (`LINGER_BYTES`, for `LINGER_TIME` at most) so that closing does not reset the
  connection before the client has read the answer.
* Two deadlines per connection: `Limits.request_timeout` for the whole request head, however it
  trickles in (408 then, checked a few times per deadline: up to a quarter late), and
  `Limits.write_timeout` for the whole answer (the connection dropped then).
* No task per connection: each connection is a socket the loop watches, its request parsed and
  answered in the loop's callbacks. One that has said nothing costs its socket and its entry in the
  table (no timer, no parser), so a churn of idle connections is cheap to take and to drop. A
  request that is there whole is answered in the very callback that reads it: it is never the one
  evicted.
* Connections beyond the limits are not refused: each newcomer is taken and an older one closed,
  as `nri_plugin.common.connections.ConnectionTable` chooses (a peer's own oldest at its limit; in
  all, the oldest that has said nothing, then the oldest still sending its request; each only once
  it had its chance to be read; up to a hard limit). A connection taking its answer is never
  evicted, unless `Limits.evict_slow_readers` (the status socket: a client not reading a large
  document would keep `status` out). A newcomer that finds no room at the hard limit is closed, or
  with `Limits.waiting` waits for room, asking again every `Limits.fair_time`.
* Every connection closed to make room is told to `dropped` (peer, reason), and at most once per
  `Limits.warning_period` the counts since the last time to `warn`: this module does not log.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final

import h11

from nri_plugin.common.connections import FAIR_TURNS, ConnectionTable

__all__ = ["LINGER_BYTES", "LINGER_TIME", "NO_ROOM", "TEXT", "Answer", "HttpServer", "Limits", "Route"]

TEXT: Final = "text/plain; charset=utf-8"
# Why a waiting newcomer was closed (`Limits.waiting`): no room came for it in time, or a newer one
# took its place in the line. The other reasons are `nri_plugin.common.connections.EVICTION_REASONS`.
NO_ROOM: Final = "no_room"
# After an error answer, what the client may still be sending is read and dropped (this much, for at
# most this long) before the socket closes: closing on unread data would reset the connection, and
# the client could lose the answer.
LINGER_BYTES: Final = 64 * 1024
LINGER_TIME: Final = 1.0
_CHUNK: Final = 64 * 1024
# The request deadline is checked this many times per its length: a request is cut off between
# `request_timeout` and a quarter more.
_SWEEPS: Final = 4
_VERSIONS: Final = (b"1.0", b"1.1")


@dataclass(frozen=True)
class Answer:
    """What a route answers: the status, the body and its type."""

    status: int
    body: bytes
    content_type: str = TEXT


Route = Callable[[], Answer]


@dataclass(frozen=True)
class Limits:
    """A server's numbers. Seconds: `request_timeout` to send the whole request head,
    `write_timeout` to take the whole answer. Connections: `per_peer` from one source address and
    `total` in all before an older one is evicted, `hard_total` beyond which only those taken in
    an earlier turn of the loop may go. A connection may be evicted once it had `fair_turns` turns
    of the loop and `fair_time` seconds (`heard_time` once its request began, or while it takes its
    answer with `evict_slow_readers`). `waiting`: newcomers kept waiting for room at the hard limit
    (0: closed at once). `warning_period`: seconds between two calls of the server's `warn`."""

    request_timeout: float
    write_timeout: float
    max_head: int
    total: int
    per_peer: int
    hard_total: int
    fair_time: float
    heard_time: float
    fair_turns: int = FAIR_TURNS
    waiting: int = 0
    evict_slow_readers: bool = False
    warning_period: float = 60.0
    accept_batch: int = 100  # connections taken in one turn of the loop, at most


class HttpServer:
    """Serves `routes` on the listening sockets given to `start`, within `limits`. `methods`: those
    answered (the first is the one a 405 names; a 400 names the first route). `dropped(peer,
    reason)` is told of each connection closed to make room; `warn(counts by reason, last peer)` at
    most once per warning period."""

    def __init__(
        self,
        routes: Mapping[str, Route],
        limits: Limits,
        *,
        methods: Sequence[str] = ("GET", "HEAD"),
        dropped: Callable[[str, str], None] | None = None,
        warn: Callable[[dict[str, int], str], None] | None = None,
    ) -> None:
        self.routes = dict(routes)
        self.limits = limits
        self.methods = tuple(methods)
        self._dropped = dropped
        self._warn = warn
        self.open: ConnectionTable[_Connection] = ConnectionTable(
            total=limits.total,
            per_peer=limits.per_peer,
            hard_total=limits.hard_total,
            fair_turns=limits.fair_turns,
            fair_time=limits.fair_time,
            heard_time=limits.heard_time,
        )
        self.evicted = 0  # connections closed to make room for a newcomer (or the newcomer itself)
        self.refused = 0  # waiting newcomers closed for want of room (`NO_ROOM`)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listeners: list[socket.socket] = []
        self._waiting: dict[_Connection, float] = {}  # newcomers with no room yet -> since, oldest first
        self._retry: asyncio.TimerHandle | None = None
        self._sweep: asyncio.TimerHandle | None = None
        # The loop's turns, as far as connections are concerned: one more each turn after one in
        # which a connection was taken (a tick per turn for ever would keep the loop from sleeping).
        self._turn = 0
        self._tick_pending = False
        self._unreported: dict[str, int] = {}
        self._warned_at: float | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "not started"
        return self._loop

    @property
    def connections(self) -> int:
        """Connections open now (not counting newcomers waiting for room)."""
        return len(self.open)

    def start(self, listeners: Sequence[socket.socket]) -> None:
        """Serve on `listeners` (bound, listening, non-blocking), on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._listeners = list(listeners)
        for listener in self._listeners:
            self._loop.add_reader(listener.fileno(), self._accept, listener)

    def close(self) -> None:
        """Stop listening and close every connection (nothing if it never started)."""
        if self._loop is None:
            return
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            self.loop.remove_reader(listener.fileno())
            listener.close()
        for timer in (self._retry, self._sweep):
            if timer is not None:
                timer.cancel()
        for connection in [*self.open, *self._waiting]:
            connection.close()
        self._waiting.clear()

    def _accept(self, listener: socket.socket) -> None:
        """Take what the kernel has queued (`Limits.accept_batch` at most), each with what it sent
        already; one that came and left is closed at once."""
        for _ in range(self.limits.accept_batch):
            try:
                sock, address = listener.accept()
            except OSError:  # none left (BlockingIOError), out of file descriptors, or gone already
                return
            sock.setblocking(False)
            try:
                first: bytes | None = sock.recv(self.limits.max_head + 1)
            except (BlockingIOError, InterruptedError):
                first = None
            except OSError:
                first = b""
            if first == b"":
                sock.close()
                continue
            peer = str(address[0]) if isinstance(address, tuple) and address else "local"
            connection = _Connection(self, sock, peer)
            if self._admit(connection):
                connection.begin(first)
            elif self.limits.waiting:
                self._wait(connection, first)
            else:
                sock.close()

    def _admit(self, connection: _Connection) -> bool:
        """Count the connection as open, closing the one that makes room for it if the limits call for
        one; False when there is no room for it (`ConnectionTable.admit`)."""
        loop = self.loop
        if not self._tick_pending:
            self._tick_pending = True
            loop.call_soon(self._next_turn)
        eviction = self.open.admit(connection.peer, connection, now=loop.time(), turn=self._turn)
        if self._sweep is None:
            self._sweep = loop.call_later(self.limits.request_timeout / _SWEEPS, self._late)
        if eviction is None:
            return True
        if eviction.item is connection:
            if not self.limits.waiting:
                self._drop(connection.peer, eviction.reason)
            return False
        eviction.item.close()
        self._drop(eviction.peer, eviction.reason)
        return True

    def _late(self) -> None:
        """Answer 408 to the connections whose request is not whole by its deadline; again while any
        are open. (One sweep for all rather than a timer each: a churn of idle connections, taken and
        evicted by the thousand, then costs no timer.)"""
        self._sweep = None
        limits = self.limits
        for connection in self.open.taken_before(self.loop.time() - limits.request_timeout):
            if connection.phase is _READING:
                connection.send(
                    Answer(408, f"request head not received within {limits.request_timeout:g} s\n".encode())
                )
        if len(self.open):
            self._sweep = self.loop.call_later(limits.request_timeout / _SWEEPS, self._late)

    def _next_turn(self) -> None:
        self._turn += 1
        self._tick_pending = False

    def _wait(self, connection: _Connection, first: bytes | None) -> None:
        """Keep a newcomer that found no room waiting for it; past `Limits.waiting` of them, the one
        that has waited longest goes (the newest are likeliest still to be there)."""
        if len(self._waiting) >= self.limits.waiting:
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            oldest.close()
            self._drop(oldest.peer, NO_ROOM)
        connection.first = first
        self._waiting[connection] = self.loop.time()
        if self._retry is None:
            self._retry = self.loop.call_later(self.limits.fair_time, self._admit_waiting)

    def _admit_waiting(self) -> None:
        """Ask again for the waiting newcomers, oldest first; one that had no room for as long as an
        open connection may take to have its chance is closed."""
        self._retry = None
        limits = self.limits
        patience = limits.heard_time + limits.fair_turns * limits.fair_time
        now = self.loop.time()
        for connection, since in list(self._waiting.items()):
            if self._admit(connection):
                del self._waiting[connection]
                connection.begin(connection.first)
            elif now - since >= patience:
                del self._waiting[connection]
                connection.close()
                self._drop(connection.peer, NO_ROOM)
        if self._waiting:
            self._retry = self.loop.call_later(limits.fair_time, self._admit_waiting)

    def _drop(self, peer: str, reason: str) -> None:
        """Count a connection closed to make room; tell `dropped`, and `warn` if it is time."""
        if reason == NO_ROOM:
            self.refused += 1
        else:
            self.evicted += 1
        if self._dropped is not None:
            self._dropped(peer, reason)
        self._unreported[reason] = self._unreported.get(reason, 0) + 1
        now = self.loop.time()
        if self._warn is None or (
            self._warned_at is not None and now - self._warned_at < self.limits.warning_period
        ):
            return
        counts, self._unreported, self._warned_at = self._unreported, {}, now
        self._warn(counts, peer)

    def answer(self, method: str, target: str) -> Answer:
        """The answer to a request for `target` by `method` (its route's, or why not)."""
        if method not in self.methods:
            others = f" (or {', '.join(self.methods[1:])})" if len(self.methods) > 1 else ""
            return Answer(405, f"{method} not allowed: use {self.methods[0]}{others}\n".encode())
        path = target.partition("?")[0]
        route = self.routes.get(path)
        if route is None:
            return Answer(404, f"no such path {path!r}; try {', '.join(self.routes)}\n".encode())
        try:
            return route()
        except Exception as exc:  # a bug in a route: said through the loop, answered, served on
            self.loop.call_exception_handler({"message": f"HTTP route {path} failed", "exception": exc})
            return Answer(500, f"cannot answer {path}: {type(exc).__name__}; see the daemon's log\n".encode())

    def malformed(self, reason: str) -> Answer:
        example = next(iter(self.routes), "/")
        return Answer(400, f"malformed request: {reason}; expected e.g. GET {example} HTTP/1.1\n".encode())


# What a connection is doing: waiting for room (new), reading its request, writing its answer,
# reading and dropping what the client still sends after an error answer, or closed.
_NEW, _READING, _WRITING, _LINGERING, _CLOSED = "new", "reading", "writing", "lingering", "closed"


class _Connection:
    """One connection, driven by the loop's callbacks: its socket, h11's state of it (made with its
    first bytes), what is left of its answer to send, and the deadline of that or of its lingering
    (the request's deadline is the server's sweep, `HttpServer._late`)."""

    def __init__(self, server: HttpServer, sock: socket.socket, peer: str) -> None:
        self.server = server
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.phase = _NEW
        self.first: bytes | None = None
        self.parser: h11.Connection | None = None
        self.received = 0  # bytes fed to the parser
        self.timer: asyncio.TimerHandle | None = None
        self.rest = memoryview(b"")  # of the answer, not yet sent
        self.reading = False  # registered with the loop for reading / writing
        self.writing = False
        self.head_only = False
        self.linger = False

    def begin(self, first: bytes | None) -> None:
        """Taken: read its request (what came with it first), within the request deadline."""
        self.phase = _READING
        if first:
            self._received(first)  # answered at once when it came whole (a prober's does)
        if self.phase is _READING:  # the rest when it comes, within the request deadline (`_late`)
            self.server.loop.add_reader(self.fd, self._readable)
            self.reading = True

    def close(self) -> None:
        """Drop the connection now (no waiting on an idle or slow peer) and forget it."""
        if self.phase is _CLOSED:
            return
        self.phase = _CLOSED
        loop = self.server.loop
        if self.timer is not None:
            self.timer.cancel()
        if self.reading:
            loop.remove_reader(self.fd)
        if self.writing:
            loop.remove_writer(self.fd)
        self.sock.close()
        self.server.open.discard(self)

    def _readable(self) -> None:
        try:
            data = self.sock.recv(_CHUNK if self.phase is _LINGERING else self.server.limits.max_head + 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset
            self.close()
            return
        if self.phase is _LINGERING:
            self.received += len(data)
            if not data or self.received > LINGER_BYTES:
                self.close()
            return
        self._received(data)

    def _received(self, data: bytes) -> None:
        """Bytes of the request (none: the client closed its side): answered once it is whole."""
        server = self.server
        limit = server.limits.max_head
        if self.parser is None:
            self.parser = h11.Connection(h11.SERVER, max_incomplete_event_size=limit)
            server.open.heard(self)
        # No more than one byte over the limit reaches the parser: a head that is not whole by then
        # is too large (h11 says so, 431), and what follows a head (a body) is never read.
        data = data[: limit + 1 - self.received]
        self.received += len(data)
        self.parser.receive_data(data)
        try:
            event = self.parser.next_event()
        except h11.RemoteProtocolError as exc:
            self.send(self._refusal(exc, closed=not data))
            return
        if isinstance(event, h11.Request):
            self._request(event)
        elif event is not h11.NEED_DATA:  # ConnectionClosed: came, and left without a word
            self.close()

    def _refusal(self, error: h11.RemoteProtocolError, *, closed: bool) -> Answer:
        if error.error_status_hint == 431:
            return self._too_large()
        if closed:  # h11 raises only for the end of the stream when what came before parsed
            return Answer(400, b"connection closed before the end of the request head\n")
        return self.server.malformed(str(error).partition(": bytearray(")[0])

    def _too_large(self) -> Answer:
        return Answer(431, f"request head larger than {self.server.limits.max_head} bytes\n".encode())

    def _request(self, request: h11.Request) -> None:
        assert self.parser is not None
        server = self.server
        self.head_only = request.method == b"HEAD"
        if self.received - len(self.parser.trailing_data[0]) > server.limits.max_head:
            self.send(self._too_large())  # it came whole in one read
        elif request.http_version not in _VERSIONS:
            version = request.http_version.decode("ascii", "replace")
            self.send(server.malformed(f"HTTP/{version} is not served, only HTTP/1.1 and 1.0"))
        elif not request.target.startswith(b"/"):
            self.send(server.malformed("the target is not a path"))
        else:  # h11 took the method and the target as printable ASCII
            self.send(server.answer(request.method.decode("ascii"), request.target.decode("ascii")))

    def send(self, answer: Answer) -> None:
        """Begin sending `answer`, within the write deadline; read no more of the request."""
        server = self.server
        loop = server.loop
        if self.reading:
            loop.remove_reader(self.fd)
            self.reading = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        said = self.parser is not None
        if self.parser is None:  # 408 to one that said nothing
            self.parser = h11.Connection(h11.SERVER)
        headers = [
            ("Content-Type", answer.content_type),
            ("Content-Length", str(len(answer.body))),
            ("Cache-Control", "no-store"),
            ("Connection", "close"),
        ]
        if answer.status == 405:
            headers.append(("Allow", ", ".join(server.methods)))
        send = self.parser.send
        reason = HTTPStatus(answer.status).phrase.encode("ascii")
        head = send(h11.Response(status_code=answer.status, reason=reason, headers=headers))
        body = send(h11.Data(data=answer.body)) if answer.body and not self.head_only else None
        end = send(h11.EndOfMessage())
        self.rest = memoryview(b"".join(part for part in (head, body, end) if part))
        self.linger = answer.status >= 400 and said  # the client may still be sending its request
        self.phase = _WRITING
        self._write()
        if self.phase is _WRITING:  # the rest when the client takes it, within the write deadline
            self.timer = loop.call_later(server.limits.write_timeout, self.close)
            if server.limits.evict_slow_readers:
                server.open.heard(self)
            else:
                server.open.answering(self, True)

    def _write(self) -> None:
        try:
            sent = self.sock.send(self.rest)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:  # gone
            self.close()
            return
        self.rest = self.rest[sent:]
        loop = self.server.loop
        if self.rest:
            if not self.writing:
                loop.add_writer(self.fd, self._write)
                self.writing = True
            return
        if self.writing:
            loop.remove_writer(self.fd)
            self.writing = False
        if not self.linger:
            self.close()
            return
        # An error answer: the client may still be sending its request. Say we are done, and drop
        # what comes until it closes its side too (or enough of it came, or the time is up).
        self.server.open.answering(self, False)
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.close()
            return
        self.phase = _LINGERING
        self.received = 0
        if self.timer is not None:
            self.timer.cancel()
        self.timer = loop.call_later(LINGER_TIME, self.close)
        loop.add_reader(self.fd, self._readable)
        self.reading = True
