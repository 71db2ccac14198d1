"""``/metrics``, ``/healthz`` and ``/readyz`` over HTTP/1.1, served on the daemon's own event loop.

* ``GET /metrics``: the Prometheus text exposition (`nri_plugin.daemon.metrics.Metrics.render`).
* ``GET /healthz``: 200 ``ok`` when the loop answers and the NRI connection is not stuck
  (`liveness`): 503 and one line once the stub has spent more than ``nri_stall_limit`` seconds
  neither serving the runtime nor waiting between reconnect attempts (`Stub.stalled_for`), which no
  waiting mends and a restart may. Because it is served on the loop that also serves NRI, a wedged
  loop fails liveness too, instead of looking healthy from another thread. A runtime that is away
  (its socket absent, refusing) keeps the daemon healthy: it reconnects by design.
* ``GET /readyz``: 200 ``ok`` when registered and synchronized with the runtime and, with the device
  plugin on, registered with kubelet; otherwise 503 and one line saying what is missing (after a lost
  NRI connection: why it was lost and since when). The same line goes to the log at warning every
  30 s while it lasts (`NotReadyWarnings`), metrics on or off.

Deliberately small: one request per connection (``Connection: close``), GET and HEAD only (405 for
other methods), no request body read, the request head limited to `MAX_HEAD` bytes (431) and
`READ_TIMEOUT` seconds in all (408), anything unparsable answered 400. A client sending garbage costs
one short-lived task, never the server.

Nobody can starve the probes by holding connections open (issue 13): the port listens on the pod IP,
and kubelet restarts a daemon whose ``/healthz`` fails. Refusing connections beyond a limit would let
any pod keep liveness failing with a few dozen idle sockets; instead every new connection is taken,
and when that goes over a limit, an older one is closed (`ConnectionTable`): a peer (one source
address) holding `MAX_PER_PEER` gives up its own oldest; at `MAX_CONNECTIONS` in all, the oldest
connection that has said nothing goes first, then the oldest still sending its head.

Nor by a churn of new connections from many addresses (issue 25): a connection is evicted only
after it has had its chance to be read (`FAIR_TURNS` turns of the loop and `FAIR_TIME` seconds), so
kubelet's probe, whose request comes with its connection, is read before it could go; and one whose
whole request head has arrived counts as being answered, never evicted, however long a loop short
of CPU takes to read it. Until then newcomers are taken beyond the limit, up to
`HARD_MAX_CONNECTIONS`. A connection costs no task until its first bytes arrive (a bare socket
waiting for them), so a churn of idle ones is cheap to take and drop, and the kernel queues
`BACKLOG` of them between two turns of the loop. One that says nothing for
`READ_TIMEOUT` is closed; one whose head is not complete by then is answered 408 (the deadline is for
the whole head: trickling bytes does not extend it). Evictions are logged at warning, at most once
per `EVICTION_WARNING_PERIOD`, with their count, and each is counted by its reason (`ProbeObserver`:
``mixed_cpu_probe_connections_evicted_total``), so that an alert need not parse logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import structlog
from prometheus_client import CONTENT_TYPE_LATEST

from nri_plugin.common import connections
from nri_plugin.common.clock import LOOP_CLOCK, Clock
from nri_plugin.common.connections import EVICTION_REASONS, ConnectionTable, Eviction
from nri_plugin.daemon.config import DEFAULT_NRI_STALL_LIMIT, metrics_address_problem, split_host_port
from nri_plugin.mixedcpu.status import rfc3339

if TYPE_CHECKING:
    from nri_plugin.deviceplugin.server import DevicePluginServer
    from nri_plugin.nri.stub import Stub

__all__ = [
    "EVICTION_REASONS",
    "MAX_CONNECTIONS",
    "MAX_HEAD",
    "MAX_PER_PEER",
    "ConnectionTable",
    "Eviction",
    "NotReadyWarnings",
    "ProbeError",
    "ProbeObserver",
    "ProbeServer",
    "liveness",
    "parse_address",
    "readiness",
]

log = structlog.get_logger("nri_plugin.daemon.probes")

MAX_HEAD = 8 * 1024  # request line and headers, in bytes
READ_TIMEOUT = 2.0  # seconds to send the whole request head (kubelet sends it at once)
WRITE_TIMEOUT = 5.0  # seconds to take the answer
# Open connections: from one source address, and in all. Beyond either, an older one is evicted.
MAX_PER_PEER = 8
MAX_CONNECTIONS = 64
# A connection is evicted only after its chance to be read: this many turns of the loop and seconds
# since it was taken (a prober sends its request head with the connection; it is read within two
# turns). Until then newcomers are taken beyond MAX_CONNECTIONS, up to HARD_MAX_CONNECTIONS (file
# descriptors are finite), where only those taken within the current turn are kept.
FAIR_TURNS = connections.FAIR_TURNS
FAIR_TIME = 0.1
HEARD_TIME = 0.5  # for one whose request has begun to arrive (slow-loris, or a prober's on a busy loop)
HARD_MAX_CONNECTIONS = 4 * MAX_CONNECTIONS
# Connections the kernel queues until they are taken: a churn fills a short queue between two turns
# of the loop, and a prober's connection then waits for its SYN to be sent again (1 s, then 3 s).
BACKLOG = 1024
ACCEPT_BATCH = 100  # connections taken in one turn of the loop, at most
# Evictions are said at warning at most this often (seconds), with how many there were since.
EVICTION_WARNING_PERIOD = 60.0
# After an error answer, what the client may still be sending is read and dropped (this much, for at
# most this long) before the socket closes: closing on unread data would reset the connection, and
# the client could lose the answer.
LINGER_BYTES = 64 * 1024
LINGER_TIME = 1.0
PATHS = ("/metrics", "/healthz", "/readyz")

_TEXT = "text/plain; charset=utf-8"
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VERSION = re.compile(r"HTTP/1\.[01]")
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class ProbeError(Exception):
    """The endpoint cannot be served (address in use, unknown host, ...); one line for the operator."""


def parse_address(text: str) -> tuple[str, int]:
    """``"host:port"``, ``"[v6]:port"`` or ``":port"`` (every address) → (host, port). Port 0 asks for
    any free port."""
    parsed = split_host_port(text)
    if parsed is None:
        raise ProbeError(
            f"metrics address {json.dumps(text)} is not host:port: {metrics_address_problem(text)}; use "
            'e.g. "127.0.0.1:8891", "[::1]:8891" or ":8891"'
        )
    return parsed


class DraRegistration(Protocol):
    """What readiness reads of the DRA front door (`nri_plugin.dra.frontdoor.DraFrontDoor`)."""

    @property
    def registered(self) -> bool: ...


def readiness(
    stub: Stub, device_plugin: DevicePluginServer | None, dra: DraRegistration | None = None
) -> Callable[[], str | None]:
    """What ``/readyz`` asks: None when ready, else what is missing."""

    def check() -> str | None:
        missing = []
        if not stub.ready.is_set():
            missing.append(_nri_missing(stub))
        if device_plugin is not None and device_plugin.config.enabled and not device_plugin.registered:
            missing.append(_kubelet_missing(str(device_plugin.config.plugin_dir)))
        if dra is not None and not dra.registered:
            missing.append("the DRA driver is not registered with kubelet yet (its plugin watcher)")
        return "; ".join(missing) or None

    return check


def _nri_missing(stub: Stub) -> str:
    """Not serving the runtime: not yet, or since a lost connection (its cause and when)."""
    lost = stub.lost
    if lost is None:
        return "not registered with the runtime (NRI) yet"
    ago = max(0, round(time.time() - lost.at))
    return (
        f"the connection to the runtime (NRI) was lost at {rfc3339(lost.at)} ({ago} s ago): {lost.cause}; "
        f"reconnecting (now {stub.state.value})"
    )


def liveness(stub: Stub, limit: float = DEFAULT_NRI_STALL_LIMIT) -> Callable[[], str | None]:
    """What ``/healthz`` asks: None while healthy, else why not: the NRI connection stuck for more
    than `limit` seconds (`Stub.stalled_for`). Said at error when it turns unhealthy, at info when it
    recovers (once each, however often the probe asks)."""
    failing = False

    def check() -> str | None:
        nonlocal failing
        stalled = stub.stalled_for
        if stalled <= limit:
            if failing:
                log.info("NRI connection moving again: /healthz ok", state=stub.state.value)
                failing = False
            return None
        why = (
            f"the NRI connection has been stuck for {stalled:.0f} s (over nri_stall_limit = {limit:g}), "
            f"now {stub.state.value}: neither serving the runtime nor waiting to reconnect"
        )
        if not failing:
            log.error(
                "NRI connection stuck: /healthz fails, so kubelet restarts the daemon",
                state=stub.state.value,
                stalled_seconds=round(stalled),
                nri_stall_limit=limit,
                last_lost=stub.lost.cause if stub.lost is not None else None,
            )
            failing = True
        return why

    return check


def _kubelet_missing(plugin_dir: str) -> str:
    """Not registered with kubelet: and when kubelet's directory itself is missing, which no waiting
    mends (a mount or a config to fix), that too."""
    if os.path.isdir(plugin_dir):
        return "not registered with kubelet yet"
    return (
        f"not registered with kubelet yet: its device-plugin directory {plugin_dir} does not exist; "
        "mount the host's directory there, or set [device_plugin] plugin_dir"
    )


class NotReadyWarnings:
    """Says at warning, every `period` seconds, what keeps the daemon from being ready.

    ``/readyz`` answers 503 while the daemon is not ready, and a rolling update waits on it. That
    wait must not be quiet: a missing kubelet directory or an NRI socket nobody serves otherwise
    shows only as a rolling update that stalls. A daemon that becomes ready within `period`
    (every normal start) never warns; one that recovers after warning says so at info.
    """

    def __init__(
        self, readiness: Callable[[], str | None], *, clock: Clock = LOOP_CLOCK, period: float = 30.0
    ) -> None:
        self._readiness = readiness
        self._clock = clock
        self.period = period
        self.warnings = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._watch())

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _watch(self) -> None:
        warned = False
        while True:
            await self._clock.sleep(self.period)
            missing = self._readiness()
            if missing is not None:
                self.warnings += 1
                log.warning("not ready", missing=missing, readyz=503)
                warned = True
            elif warned:
                log.info("ready", readyz=200)
                warned = False


class ProbeObserver(Protocol):
    """Told of every connection evicted (`nri_plugin.daemon.metrics`)."""

    def probe_connection_evicted(self, reason: str) -> None:
        """`reason`: one of `EVICTION_REASONS`."""


@dataclass(eq=False)
class _Connection:
    """One connection: only its socket while nothing has arrived on it (a connection that never
    speaks costs no task and no stream), then its handler task and stream too."""

    sock: socket.socket
    loop: asyncio.AbstractEventLoop
    task: asyncio.Task[None] | None = None
    writer: asyncio.StreamWriter | None = None
    started: bool = False  # its handler has begun to run (a task cancelled before that never runs)
    ended: bool = False

    def end(self) -> None:
        """Drop the connection (no FIN dance with an idle or slow peer: the socket goes now) and stop
        its handler, if it has one, which then returns quietly (see `ProbeServer._serve`)."""
        self.ended = True
        if self.writer is not None:
            self.writer.transport.abort()
        elif not self.started:  # nothing else will close it
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
        if self.task is not None:
            self.task.cancel()


def _said(sock: socket.socket) -> bool | None:
    """Whether bytes wait on `sock` (True), it was closed or reset (False), or neither yet (None)."""
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return False


def _whole_head(sock: socket.socket) -> bool:
    """Whether a whole request head (up to its blank line) waits on `sock`, not yet read."""
    try:
        return b"\r\n\r\n" in sock.recv(MAX_HEAD, socket.MSG_PEEK)
    except OSError:
        return False


async def _listen(host: str, port: int) -> list[socket.socket]:
    """Non-blocking listening sockets on every address `host` names (every address when ""), as
    asyncio's own servers bind them."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    listeners: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # a family this host does not have
                continue
            listeners.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
            sock.setblocking(False)
    except OSError:
        for sock in listeners:
            sock.close()
        raise
    return listeners


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ProbeServer:
    """The HTTP endpoint; ``async with ProbeServer(address, metrics=..., readiness=...) as server``.
    `liveness` (default: always healthy) is what ``/healthz`` asks; `observer` is told of each
    connection evicted."""

    def __init__(
        self,
        address: str,
        *,
        metrics: Callable[[], bytes],
        readiness: Callable[[], str | None],
        liveness: Callable[[], str | None] | None = None,
        observer: ProbeObserver | None = None,
    ) -> None:
        self.address = address
        self.host, self.port = parse_address(address)
        self._metrics = metrics
        self._readiness = readiness
        self._liveness = liveness
        self.observer = observer
        self._listeners: list[socket.socket] = []
        self._open: ConnectionTable[_Connection] = ConnectionTable(
            total=MAX_CONNECTIONS,
            per_peer=MAX_PER_PEER,
            hard_total=max(HARD_MAX_CONNECTIONS, MAX_CONNECTIONS),
            fair_turns=FAIR_TURNS,
            fair_time=FAIR_TIME,
            heard_time=HEARD_TIME,
        )
        # The loop's turns, as far as connections are concerned: one more each turn after one in
        # which a connection was taken (a tick per turn for ever would keep the loop from sleeping).
        self._turn = 0
        self._tick_pending = False
        self._sweep: asyncio.TimerHandle | None = None
        self._evicted_unreported = 0
        self._warned_at: float | None = None

    @property
    def bound(self) -> list[str]:
        """Where it listens, as ``host:port`` / ``[v6]:port`` (with the real port when 0 was asked)."""
        names = []
        for sock in self._listeners:
            host, port = sock.getsockname()[:2]
            names.append(f"[{host}]:{port}" if sock.family == socket.AF_INET6 else f"{host}:{port}")
        return names

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._open)

    @property
    def evicted(self) -> int:
        """Connections closed so far to make room for newer ones (see the module docstring)."""
        return self._open.evicted

    async def start(self) -> None:
        """Listen; `ProbeError` with one line if that is not possible."""
        try:
            self._listeners = await _listen(self.host, self.port)
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else (exc.strerror or str(exc))
            raise ProbeError(
                f"cannot serve metrics and probes on {self.address}: {reason}; set metrics_address to a "
                'free host:port, or "" to turn them off'
            ) from None
        loop = asyncio.get_running_loop()
        for listener in self._listeners:
            loop.add_reader(listener.fileno(), self._accept, listener)
        log.info("serving metrics and probes", address=" ".join(self.bound), paths=" ".join(PATHS))

    async def close(self) -> None:
        listeners, self._listeners = self._listeners, []
        loop = asyncio.get_running_loop()
        for listener in listeners:
            loop.remove_reader(listener.fileno())
            listener.close()
        if self._sweep is not None:
            self._sweep.cancel()
        handlers = []
        for connection in self._open:
            connection.end()
            if connection.task is not None:
                handlers.append(connection.task)
        await asyncio.gather(*handlers, return_exceptions=True)

    async def __aenter__(self) -> ProbeServer:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    # -- one connection ------------------------------------------------------------------------------

    def _accept(self, listener: socket.socket) -> None:
        """Take what the kernel has queued (up to `ACCEPT_BATCH` a turn). A connection whose request
        is there already is served; one that says nothing yet waits, as a bare socket, for its first
        bytes; one that left already is closed."""
        loop = asyncio.get_running_loop()
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, or the peer left already
                log.debug("cannot take a probe connection", reason=os.strerror(exc.errno or 0))
                return
            sock.setblocking(False)
            said = _said(sock)
            if said is False:
                sock.close()
                continue
            peer = str(address[0]) if isinstance(address, tuple) and address else "unknown"
            connection = _Connection(sock, loop)
            if not self._admit(peer, connection):
                continue
            if said is None:
                loop.add_reader(sock.fileno(), self._heard, peer, connection)
            else:
                self._serve_now(peer, connection)

    def _heard(self, peer: str, connection: _Connection) -> None:
        """Bytes arrived (or the end): the connection gets its handler (or is closed)."""
        connection.loop.remove_reader(connection.sock.fileno())
        if _said(connection.sock) is False:
            self._open.discard(connection)
            connection.sock.close()
            return
        self._serve_now(peer, connection)

    def _serve_now(self, peer: str, connection: _Connection) -> None:
        """Its handler, for a connection whose bytes arrived. One whose whole request head is there
        already (kubelet's probe) counts as being answered from now: on a loop short of CPU its
        handler may take longer than `HEARD_TIME` to read it, and it must not be evicted meanwhile."""
        self._open.heard(connection)
        if _whole_head(connection.sock):
            self._open.answering(connection, True)
        connection.task = asyncio.ensure_future(self._serve(peer, connection))

    async def _serve(self, peer: str, me: _Connection) -> None:
        me.started = True
        writer = None
        try:
            reader, writer = await asyncio.open_connection(sock=me.sock, limit=MAX_HEAD)
            me.writer = writer
            status, head_only, body, kind = await self._answer(reader)
            self._open.answering(me, True)
            writer.write(_response(status, body, kind, head_only))
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
            self._open.answering(me, False)
            if status >= 400 and writer.can_write_eof():
                writer.write_eof()
                await asyncio.wait_for(_discard(reader, LINGER_BYTES), LINGER_TIME)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            if not me.ended:  # ended on purpose (evicted, or the server closing): nothing to say
                raise
        finally:
            self._open.discard(me)
            if writer is None:
                me.sock.close()
            else:
                writer.close()
                with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                    await writer.wait_closed()

    def _admit(self, peer: str, connection: _Connection) -> bool:
        """Take the new connection; close the one that makes room for it, if the limits call for one.
        False when that is the new one itself (see `ConnectionTable`)."""
        loop = connection.loop
        if not self._tick_pending:
            self._tick_pending = True
            loop.call_soon(self._next_turn)
        eviction = self._open.admit(peer, connection, now=loop.time(), turn=self._turn)
        if self._sweep is None:
            self._sweep = loop.call_later(READ_TIMEOUT / 2, self._close_silent)
        if eviction is None:
            return True
        eviction.item.end()
        if self.observer is not None:
            self.observer.probe_connection_evicted(eviction.reason)
        self._warn_of_evictions(eviction.peer)
        return eviction.item is not connection

    def _close_silent(self) -> None:
        """Close the connections that said nothing for `READ_TIMEOUT` (as one whose request is late
        is answered 408); again while any are open."""
        self._sweep = None
        loop = asyncio.get_running_loop()
        for connection in self._open.silent_since(loop.time() - READ_TIMEOUT):
            connection.end()
            self._open.discard(connection)
        if len(self._open):
            self._sweep = loop.call_later(READ_TIMEOUT / 2, self._close_silent)

    def _next_turn(self) -> None:
        self._turn += 1
        self._tick_pending = False

    def _warn_of_evictions(self, peer: str) -> None:
        """Say at warning, at most once per `EVICTION_WARNING_PERIOD`, that connections are being
        evicted (with how many since the last warning): probes and scrapes still get through, but
        something holds the port's connections open, which an operator wants to know and keep out."""
        self._evicted_unreported += 1
        now = asyncio.get_running_loop().time()
        if self._warned_at is not None and now - self._warned_at < EVICTION_WARNING_PERIOD:
            return
        log.warning(
            "connections to the metrics and probe port are evicted to make room: something holds "
            "them open; a NetworkPolicy admitting only the scraper keeps others out (docs/deploy.md)",
            evicted=self._evicted_unreported,  # since the last such warning
            last_from=peer,
        )
        self._warned_at, self._evicted_unreported = now, 0

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, bool, bytes, str]:
        """(status, HEAD?, body, content type) for the request on `reader`."""
        try:
            try:
                head = await asyncio.wait_for(_read_head(reader), READ_TIMEOUT)
            except asyncio.TimeoutError:
                raise _Refused(408, f"request head not received within {READ_TIMEOUT:g} s") from None
            method, path = _parse(head)
            if method not in ("GET", "HEAD"):
                raise _Refused(405, f"{method} not allowed: use GET (or HEAD)")
            status, body, kind = self._route(path)
            return status, method == "HEAD", body, kind
        except _Refused as exc:
            log.debug("probe request refused", status=exc.status, reason=str(exc))
            return exc.status, False, f"{exc}\n".encode(), _TEXT

    def _route(self, path: str) -> tuple[int, bytes, str]:
        if path == "/healthz":
            unhealthy = self._liveness() if self._liveness is not None else None
            if unhealthy:
                return 503, f"unhealthy: {unhealthy}\n".encode(), _TEXT
            return 200, b"ok\n", _TEXT
        if path == "/readyz":
            missing = self._readiness()
            if missing:
                return 503, f"not ready: {missing}\n".encode(), _TEXT
            return 200, b"ok\n", _TEXT
        if path == "/metrics":
            try:
                return 200, self._metrics(), CONTENT_TYPE_LATEST
            except Exception as exc:  # a metric's reader failed: say so, keep serving
                log.error("cannot render the metrics", error=str(exc))
                return 500, f"cannot render the metrics: {exc}\n".encode(), _TEXT
        raise _Refused(404, f"no such path {path!r}; try {', '.join(PATHS)}")


async def _discard(reader: asyncio.StreamReader, limit: int) -> None:
    while limit > 0:
        data = await reader.read(min(limit, 16 * 1024))
        if not data:
            return
        limit -= len(data)


async def _read_head(reader: asyncio.StreamReader) -> list[str]:
    """The request line and header lines, without line ends. Raises `_Refused`."""
    lines: list[str] = []
    size = 0
    while True:
        try:
            raw = await reader.readline()
        except ValueError:  # one line longer than the reader's limit (MAX_HEAD)
            raise _Refused(431, f"request head larger than {MAX_HEAD} bytes") from None
        size += len(raw)
        if size > MAX_HEAD:
            raise _Refused(431, f"request head larger than {MAX_HEAD} bytes")
        if not raw.endswith(b"\n"):
            if not lines and not raw:
                raise asyncio.IncompleteReadError(b"", None)  # connected and left: nothing to answer
            raise _Refused(400, "connection closed before the end of the request head")
        line = raw.rstrip(b"\r\n").decode("latin-1")
        if not line:
            if lines:
                return lines
            continue  # blank lines before the request line are allowed (RFC 9112 2.2)
        lines.append(line)


def _parse(lines: list[str]) -> tuple[str, str]:
    """(method, path) of a request head. Raises `_Refused` (400)."""
    parts = lines[0].split(" ")
    if (
        len(parts) != 3
        or not _TOKEN.fullmatch(parts[0])
        or not _VERSION.fullmatch(parts[2])
        or not parts[1].startswith("/")
        or not parts[1].isprintable()
        or not parts[1].isascii()
    ):
        raise _Refused(400, "malformed request line; expected e.g. GET /metrics HTTP/1.1")
    for line in lines[1:]:
        name, colon, _ = line.partition(":")
        if not colon or not _TOKEN.fullmatch(name):
            raise _Refused(400, "malformed header line")
    method, target = parts[0], parts[1]
    return method, target.partition("?")[0]


def _response(status: int, body: bytes, kind: str, head_only: bool) -> bytes:
    extra = "Allow: GET, HEAD\r\n" if status == 405 else ""
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
        f"Content-Type: {kind}\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"{extra}"
        "Cache-Control: no-store\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + (b"" if head_only else body)
