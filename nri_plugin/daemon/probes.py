"""``/metrics``, ``/healthz`` and ``/readyz`` over HTTP/1.1, served on the daemon's own event loop.

* ``GET /metrics``: the Prometheus text exposition (`nri_plugin.daemon.metrics.Metrics.render`).
* ``GET /healthz``: 200 ``ok`` whenever the loop answers at all. Because it is served on the loop
  that also serves NRI, a wedged loop fails liveness instead of looking healthy from another thread.
* ``GET /readyz``: 200 ``ok`` when registered and synchronized with the runtime and, with the device
  plugin on, registered with kubelet; otherwise 503 and one line saying what is missing. The same
  line goes to the log at warning every 30 s while it lasts (`NotReadyWarnings`), metrics on or off.

Deliberately small: one request per connection (``Connection: close``), GET and HEAD only (405 for
other methods), no request body read, the request head limited to `MAX_HEAD` bytes (431) and
`READ_TIMEOUT` seconds in all (408), anything unparsable answered 400. A client sending garbage costs
one short-lived task, never the server.

Nobody can starve the probes by holding connections open (issue 13): the port listens on the pod IP,
and kubelet restarts a daemon whose ``/healthz`` fails. Refusing connections beyond a limit would let
any pod keep liveness failing with a few dozen idle sockets; instead every new connection is taken,
and when that goes over a limit, an older one is closed (`ConnectionTable`):

* a peer (one source address) holds at most `MAX_PER_PEER` connections: its next one closes its own
  oldest, so a flood from one address only ever evicts itself;
* at most `MAX_CONNECTIONS` in all: a new one closes the oldest connection of the peer holding the
  most, never one of a peer holding fewer (kubelet's probes hold one or two at a time).

A request head arrives within milliseconds of a connection from kubelet or Prometheus, so the newest
connection is served while the idle and slow (slow-loris) ones wait to be evicted or time out (the
deadline is for the whole head: trickling bytes does not extend it). Evictions are logged at warning,
at most once per `EVICTION_WARNING_PERIOD`, with their count, and each is counted by its reason
(`ProbeObserver`: ``mixed_cpu_probe_connections_evicted_total``), so that an alert need not parse logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Generic, Protocol, TypeVar

import structlog
from prometheus_client import CONTENT_TYPE_LATEST

from nri_plugin.common.clock import LOOP_CLOCK, Clock
from nri_plugin.daemon.config import metrics_address_problem, split_host_port

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
# Evictions are said at warning at most this often (seconds), with how many there were since.
EVICTION_WARNING_PERIOD = 60.0
# Why a connection was evicted: its peer held `MAX_PER_PEER` already, or the server `MAX_CONNECTIONS`.
EVICTION_REASONS: Final = ("peer_limit", "total_limit")
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


def readiness(stub: Stub, device_plugin: DevicePluginServer | None) -> Callable[[], str | None]:
    """What ``/readyz`` asks: None when ready, else what is missing."""

    def check() -> str | None:
        missing = []
        if not stub.ready.is_set():
            missing.append("not registered with the runtime (NRI) yet")
        if device_plugin is not None and device_plugin.config.enabled and not device_plugin.registered:
            missing.append(_kubelet_missing(str(device_plugin.config.plugin_dir)))
        return "; ".join(missing) or None

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


_Item = TypeVar("_Item")


@dataclass(frozen=True)
class Eviction(Generic[_Item]):
    """The connection a newcomer makes room by closing: whose, which, and why (`EVICTION_REASONS`)."""

    peer: str
    item: _Item
    reason: str


class ConnectionTable(Generic[_Item]):
    """The open connections, by peer and oldest first, and which one a newcomer evicts.

    Pure bookkeeping (the server closes what `admit` hands back). A newcomer is always admitted: a
    peer at `per_peer` gives up its own oldest connection; when `total` are open, the peer holding the
    most gives up its oldest (on a tie, the one that has held connections the longest). So one address
    flooding the port evicts only its own connections until it holds the most, and a peer holding a
    connection or two, as kubelet's probes do, is the last to lose one.
    """

    def __init__(self, *, total: int, per_peer: int) -> None:
        if total < 1 or per_peer < 1:
            raise ValueError("connection limits must be at least 1")
        self.total = total
        self.per_peer = per_peer
        self.evicted = 0
        self._peers: dict[str, dict[_Item, None]] = {}  # per peer, an ordered set: oldest first
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[_Item]:
        for items in list(self._peers.values()):
            yield from list(items)

    def held_by(self, peer: str) -> int:
        return len(self._peers.get(peer, ()))

    def admit(self, peer: str, item: _Item) -> Eviction[_Item] | None:
        """Count `item` as open from `peer`; the connection it evicts, already forgotten here and for
        the caller to close, if the limits call for one."""
        eviction = self._victim(peer)
        if eviction is not None:
            self.discard(eviction.peer, eviction.item)
            self.evicted += 1
        self._peers.setdefault(peer, {})[item] = None
        self._count += 1
        return eviction

    def discard(self, peer: str, item: _Item) -> None:
        """Forget a closed connection (nothing if it was evicted already)."""
        items = self._peers.get(peer)
        if items is None or item not in items:
            return
        del items[item]
        self._count -= 1
        if not items:
            del self._peers[peer]

    def _victim(self, peer: str) -> Eviction[_Item] | None:
        own = self._peers.get(peer)
        if own is not None and len(own) >= self.per_peer:
            return Eviction(peer, next(iter(own)), "peer_limit")
        if self._count < self.total:
            return None
        greediest = max(self._peers, key=lambda name: len(self._peers[name]))
        return Eviction(greediest, next(iter(self._peers[greediest])), "total_limit")


@dataclass(eq=False)
class _Connection:
    """One connection's handler task and stream, to end it at once (evicted, or the server closing)."""

    task: asyncio.Task[None]
    writer: asyncio.StreamWriter
    ended: bool = False

    def end(self) -> None:
        """Drop the connection (no FIN dance with an idle or slow peer: the socket goes now) and stop
        its handler, which then returns quietly (see `ProbeServer._handle`)."""
        self.ended = True
        self.writer.transport.abort()
        self.task.cancel()


def _peer_of(writer: asyncio.StreamWriter) -> str:
    """The source address of a connection (its port left out: one address, one peer)."""
    name = writer.get_extra_info("peername")
    return str(name[0]) if isinstance(name, tuple) and name else "unknown"


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ProbeServer:
    """The HTTP endpoint; ``async with ProbeServer(address, metrics=..., readiness=...) as server``.
    `observer` is told of each connection evicted."""

    def __init__(
        self,
        address: str,
        *,
        metrics: Callable[[], bytes],
        readiness: Callable[[], str | None],
        observer: ProbeObserver | None = None,
    ) -> None:
        self.address = address
        self.host, self.port = parse_address(address)
        self._metrics = metrics
        self._readiness = readiness
        self.observer = observer
        self._server: asyncio.Server | None = None
        self._open: ConnectionTable[_Connection] = ConnectionTable(
            total=MAX_CONNECTIONS, per_peer=MAX_PER_PEER
        )
        self._evicted_unreported = 0
        self._warned_at: float | None = None

    @property
    def bound(self) -> list[str]:
        """Where it listens, as ``host:port`` / ``[v6]:port`` (with the real port when 0 was asked)."""
        if self._server is None:
            return []
        names = []
        for sock in self._server.sockets:
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
            self._server = await asyncio.start_server(
                self._handle, self.host, self.port, limit=MAX_HEAD, reuse_address=True
            )
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else (exc.strerror or str(exc))
            raise ProbeError(
                f"cannot serve metrics and probes on {self.address}: {reason}; set metrics_address to a "
                'free host:port, or "" to turn them off'
            ) from None
        log.info("serving metrics and probes", address=" ".join(self.bound), paths=" ".join(PATHS))

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for connection in self._open:
            connection.end()
        await server.wait_closed()

    async def __aenter__(self) -> ProbeServer:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    # -- one connection ------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        me, peer = _Connection(task, writer), _peer_of(writer)
        self._admit(peer, me)
        try:
            status, head_only, body, kind = await self._answer(reader)
            writer.write(_response(status, body, kind, head_only))
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
            if status >= 400 and writer.can_write_eof():
                writer.write_eof()
                await asyncio.wait_for(_discard(reader, LINGER_BYTES), LINGER_TIME)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # Ended on purpose: return, not re-raise, since Python 3.11's asyncio.start_server logs a
            # handler task that ends cancelled as an error.
            if not me.ended:
                raise
        finally:
            self._open.discard(peer, me)
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()

    def _admit(self, peer: str, connection: _Connection) -> None:
        """Take the new connection; close the one that makes room for it, if the limits call for one."""
        eviction = self._open.admit(peer, connection)
        if eviction is None:
            return
        eviction.item.end()
        if self.observer is not None:
            self.observer.probe_connection_evicted(eviction.reason)
        log.debug(
            "probe connection evicted to make room",
            peer=eviction.peer,
            reason=eviction.reason,
            held=self._open.held_by(eviction.peer),
            open=len(self._open),
            newcomer=peer,
        )
        self._warn_of_evictions(eviction.peer)

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
