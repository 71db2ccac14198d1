"""The daemon's status: the whole document (`status_document`) and the socket it is served on
(`StatusServer`), for ``mixed-cpu-nri-plugin status`` (`nri_plugin.daemon.status_client`).

The socket is ``status.sock`` in the state dir (`status_socket_path`): a unix socket of mode 0600
in a directory only root may write, so only root on the node (or in the daemon's own container) can
ask; never the metrics port, which listens on the pod network. It answers one HTTP/1.0 request per
connection, ``GET /status``, with the JSON document (docs/status.md; its JSON Schema is
docs/status.schema.json), so ``curl --unix-socket <state_dir>/status.sock http://localhost/status``
reads it too. The document is made on the event loop when asked: nothing is kept up to date for it
between questions, and asking costs one quota read per pod in the books, and with the DRA front door
one listing of the CDI spec directory (its prepared claims are counted from the file names there).

Idle or slow clients cannot keep ``status`` out (issue 32). Each connection has `REQUEST_TIMEOUT`
seconds to send its request (408 after) and `WRITE_TIMEOUT` to take the whole answer (dropped
after). A newcomer is always taken: at `MAX_CONNECTIONS` open, the oldest connection that has not
sent its request yet is closed to make room, else the oldest still taking its answer; either only
once it had its chance (the rules and `ConnectionTable` of `nri_plugin.common.connections`: a few turns
of the loop, and `FAIR_TIME` seconds for one still to send its request, `SLOW_TIME` for one taking
its answer). While none had it, newcomers are taken beyond `MAX_CONNECTIONS`, up to
`HARD_MAX_CONNECTIONS`. ``status`` sends its request with its connection and reads its answer at
once, so it is neither the one to go nor kept waiting. Evictions are said at warning, at most once
per `EVICTION_WARNING_PERIOD`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import structlog

from nri_plugin import __version__
from nri_plugin.cgroups import CgroupError, CgroupNotFound, read_cpu_quota
from nri_plugin.common.connections import FAIR_TURNS, ConnectionTable
from nri_plugin.common.unixsocket import FileId, bind_socket, remove_if_ours
from nri_plugin.deviceplugin.podresources import PodResourcesClient
from nri_plugin.deviceplugin.server import DevicePluginServer
from nri_plugin.dra import cdi
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin
from nri_plugin.mixedcpu.status import SCHEMA, QuotaReading, domain_snapshot, rfc3339
from nri_plugin.nri.stub import Stub

if TYPE_CHECKING:
    from nri_plugin.dra.frontdoor import DraFrontDoor  # lightkube: imported only where DRA is on

__all__ = [
    "HARD_MAX_CONNECTIONS",
    "MAX_CLAIMS_COUNTED",
    "MAX_CONNECTIONS",
    "REQUEST_TIMEOUT",
    "STATUS_SOCKET_NAME",
    "WRITE_TIMEOUT",
    "StatusParts",
    "StatusServer",
    "count_prepared_claims",
    "dra_status",
    "read_pod_quotas",
    "status_document",
    "status_socket_path",
]

log = structlog.get_logger("nri_plugin.daemon.status")

STATUS_SOCKET_NAME: Final = "status.sock"
# Seconds a client has to send its request, and to take the whole answer (a big node's document is
# a few MB; `status` reads it in milliseconds).
REQUEST_TIMEOUT: Final = 2.0
WRITE_TIMEOUT: Final = 5.0
# Connections open at once: beyond MAX_CONNECTIONS an older one is evicted for a newcomer, once it had
# its chance (FAIR_TIME seconds to send its request, SLOW_TIME to take its answer, and FAIR_TURNS turns
# of the loop); until then newcomers are taken up to HARD_MAX_CONNECTIONS (file descriptors are finite,
# and only root connects).
MAX_CONNECTIONS: Final = 8
HARD_MAX_CONNECTIONS: Final = 8 * MAX_CONNECTIONS
FAIR_TIME: Final = 0.1
SLOW_TIME: Final = 1.0
BACKLOG: Final = 2 * HARD_MAX_CONNECTIONS
EVICTION_WARNING_PERIOD: Final = 60.0
# Every connection is a local one: one peer, as far as the table goes.
_PEER: Final = "local"
# A request's head (its line and headers) is at most this long: a status request is one line.
_MAX_HEAD: Final = 4096
_MAX_HEADER_LINES: Final = 32
# The longest unix socket path the kernel takes (sun_path is 108 bytes with its terminating NUL).
_MAX_SOCKET_PATH: Final = 107
# The prepared claims are counted up to this many: past it the count says "at least".
MAX_CLAIMS_COUNTED: Final = 10000
# The name of a prepared claim's CDI spec (`nri_plugin.dra.cdi.spec_path`): our vendor and class, the
# claim's UID. Other vendors' specs, and the temporary files of a spec being written, do not match.
_CLAIM_SPEC: Final = re.compile(
    re.escape(f"{cdi.VENDOR}-{cdi.CLASS}_")
    + r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\.json"
)


def status_socket_path(state_dir: str) -> str:
    """Where the daemon with this state dir serves its status."""
    return os.path.join(state_dir, STATUS_SOCKET_NAME)


@dataclass(frozen=True)
class StatusParts:
    """The parts of a running daemon the status reads (the wiring hands them over)."""

    plugin: MixedCpuPlugin
    stub: Stub
    device_plugin: DevicePluginServer | None
    config_path: str
    state_dir: str
    dra: DraFrontDoor | None = None


def read_pod_quotas(plugin: MixedCpuPlugin) -> dict[str, QuotaReading]:
    """Each pod in the books -> its cgroup's CFS quota now, or why it cannot be read."""
    readings: dict[str, QuotaReading] = {}
    for key, record in plugin.books.pods.items():
        try:
            with plugin.quotas.open_pod(record.cgroup_parent) as pod_dir:
                readings[key] = QuotaReading(read_cpu_quota(pod_dir).quota)
        except CgroupNotFound:
            readings[key] = QuotaReading(None, "its cgroup directory is gone")
        except CgroupError as exc:
            readings[key] = QuotaReading(None, str(exc))
    return readings


def status_document(parts: StatusParts, now: float | None = None) -> dict[str, Any]:
    """The status document (docs/status.md) as the daemon's parts say it now."""
    plugin, stub, device_plugin = parts.plugin, parts.stub, parts.device_plugin
    domain = domain_snapshot(
        plugin.books,
        plugin.roster,
        plugin.pool,
        quotas_now=read_pod_quotas(plugin),
        retries=plugin.quotas.retries_pending,
        heals=list(plugin.healer.recent),
    )
    runtime = stub.runtime
    record = plugin.allocations
    resources = record if isinstance(record, PodResourcesClient) else None
    return {
        "schema": SCHEMA,
        "version": __version__,
        "time": rfc3339(time.time() if now is None else now),
        "daemon": {"pid": os.getpid(), "config": parts.config_path, "state_dir": parts.state_dir},
        "runtime": {
            "state": stub.state.value,
            "plugin": stub.identity.full_name,  # as this daemon registers with the runtime
            "name": runtime.name or None,
            "version": runtime.version or None,
            "nri_version": runtime.nri_version or None,
            "connected_since": rfc3339(stub.connected_since),
            "connections": stub.connections,
            "synchronizations": stub.synchronizations,
            "last_lost": _last_lost(stub),
            "stalled_seconds": round(stub.stalled_for),
        },
        "device_plugin": {
            "enabled": device_plugin is not None,
            "state": device_plugin.state.value if device_plugin is not None else None,
            "resource_name": device_plugin.config.resource_name if device_plugin is not None else None,
            "registered": device_plugin.registered if device_plugin is not None else False,
            "registrations": device_plugin.registrations if device_plugin is not None else 0,
        },
        "pod_resources": {
            "configured": resources is not None,
            "socket": resources.socket_path if resources is not None else None,
            "reachable": resources.answering if resources is not None else None,
            "proof": resources.proof if resources is not None else None,
        },
        "dra": dra_status(parts.dra),
        **domain,
    }


def _last_lost(stub: Stub) -> dict[str, Any] | None:
    """Why and when the last connection to the runtime ended (`Stub.lost`); None before any."""
    lost = stub.lost
    return None if lost is None else {"cause": lost.cause, "at": rfc3339(lost.at)}


def dra_status(dra: DraFrontDoor | None) -> dict[str, Any]:
    """The document's ``dra`` section: the DRA front door's driver, its registration with kubelet, the
    node's ResourceSlices and the claims prepared now; ``enabled`` false and the rest null when off."""
    if dra is None:
        return {
            "enabled": False,
            "driver": None,
            "node": None,
            "kubelet": None,
            "resource_slices": None,
            "prepared_claims": None,
        }
    plugin, publisher = dra.kubelet_plugin, dra.publisher
    return {
        "enabled": True,
        "driver": dra.config.driver_name,
        "node": dra.node_name,
        "kubelet": {
            "registered": plugin.registered,
            "registrations": plugin.registrations,
            "last_error": plugin.registration_error or None,
            "registration_socket": str(plugin.registration_socket),
            "endpoint": str(plugin.endpoint),
        },
        "resource_slices": {
            "published_here": publisher is not None,
            "published": publisher.published if publisher is not None else None,
            "generation": publisher.generation if publisher is not None else None,
            "devices": publisher.device_count if publisher is not None else None,
            "failures": publisher.failures if publisher is not None else None,
            "last_error": publisher.last_error if publisher is not None else None,
            "restores": publisher.restores if publisher is not None else None,
        },
        "prepared_claims": count_prepared_claims(str(dra.config.cdi_dir)),
    }


def count_prepared_claims(cdi_dir: str, limit: int = MAX_CLAIMS_COUNTED) -> dict[str, Any]:
    """How many claims are prepared on the node now: the CDI spec files of our kind in `cdi_dir`, by
    their names alone (none is opened), counted up to `limit` (``capped``: there are more). A
    directory that is not there holds none (the first prepare makes it)."""
    count = 0
    try:
        with os.scandir(cdi_dir) as entries:
            for entry in entries:
                if _CLAIM_SPEC.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    if count == limit:
                        return {"count": count, "capped": True, "read_error": None}
                    count += 1
    except FileNotFoundError:
        return {"count": 0, "capped": False, "read_error": None}
    except OSError as exc:
        return {"count": None, "capped": False, "read_error": f"cannot list {cdi_dir}: {exc.strerror or exc}"}
    return {"count": count, "capped": False, "read_error": None}


@dataclass(eq=False)
class _Connection:
    """One open connection: its stream, and the task that answers it."""

    writer: asyncio.StreamWriter
    task: asyncio.Task[None] | None = field(default_factory=asyncio.current_task)
    ended: bool = False  # evicted, or the server closing: its handler returns quietly

    def end(self) -> None:
        self.ended = True
        self.writer.transport.abort()
        if self.task is not None:
            self.task.cancel()


class StatusServer:
    """Serves `document()` as JSON on the unix socket at `path`, mode 0600 (a `Service` of the
    daemon). A socket that cannot be served is said at warning: the daemon runs on without it.
    `request_timeout` and `write_timeout` are each connection's deadlines (see the module)."""

    def __init__(
        self,
        path: str,
        document: Callable[[], dict[str, Any]],
        *,
        request_timeout: float = REQUEST_TIMEOUT,
        write_timeout: float = WRITE_TIMEOUT,
    ) -> None:
        self.path = path
        self.document = document
        self.request_timeout = request_timeout
        self.write_timeout = write_timeout
        self._server: asyncio.AbstractServer | None = None
        self._identity: FileId | None = None
        # "quiet": its request not read yet; "heard": its answer being taken. None is ever "answering"
        # (never evicted): one that does not take its answer is what would keep `status` out.
        self._open: ConnectionTable[_Connection] = ConnectionTable(
            total=MAX_CONNECTIONS,
            per_peer=MAX_CONNECTIONS,
            hard_total=HARD_MAX_CONNECTIONS,
            fair_turns=FAIR_TURNS,
            fair_time=FAIR_TIME,
            heard_time=SLOW_TIME,
        )
        # The loop's turns in which connections were taken, as `nri_plugin.daemon.probes` counts them.
        self._turn = 0
        self._tick_pending = False
        self._waiting: dict[_Connection, None] = {}  # newcomers with no room yet, oldest first
        self.evicted = 0  # connections closed to make room for newer ones
        self.refused = 0  # newcomers closed for want of room
        self._warned_at: float | None = None
        self._warned_counts = (0, 0)  # evicted, refused at the last warning

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._open)

    async def start(self) -> None:
        try:
            sock = self._bind()
        except OSError as exc:
            log.warning(
                "cannot serve the status socket: `mixed-cpu-nri-plugin status` will say the daemon is not "
                "running",
                socket=self.path,
                error=str(exc),
                fix="give state_dir a shorter path (unix socket paths are limited to 107 bytes), and "
                "make sure nothing else is at that path",
            )
            return
        self._server = await asyncio.start_unix_server(
            self._answer, sock=sock, limit=_MAX_HEAD, backlog=BACKLOG
        )
        log.info("serving the status", socket=self.path)

    def _bind(self) -> socket.socket:
        """A listening socket at `path`, mode 0600 from the moment it has that name, replacing
        whatever socket a previous daemon left (the state dir's lock says no other daemon uses this
        one): `nri_plugin.common.unixsocket.bind_socket`."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._identity = bind_socket(self.path, sock.bind)
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        return sock

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        remove_if_ours(self.path, self._identity)  # ours still: not a newer daemon's
        handlers = []
        for connection in [*self._open, *self._waiting]:
            connection.end()
            self._open.discard(connection)
            if connection.task is not None:
                handlers.append(connection.task)
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request, one answer, then the connection is closed."""
        me = _Connection(writer)
        try:
            if not await self._admitted(me):
                return
            try:
                target: tuple[str, str] | None = await asyncio.wait_for(
                    _read_request(reader), self.request_timeout
                )
                answer = self._response(target)
            except asyncio.TimeoutError:
                answer = _http(408, "Request Timeout", f"no request within {self.request_timeout:g} s\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
                answer = self._response(None)
            self._open.heard(me)  # taking its answer from now: evicted if it is slow at it
            await asyncio.wait_for(_send(writer, answer), self.write_timeout)
        except (OSError, asyncio.TimeoutError):
            pass  # gone, or too slow to take its answer: dropped
        except asyncio.CancelledError:
            if not me.ended:
                raise
        finally:
            self._open.discard(me)
            writer.transport.abort()  # nothing if closed already; else no waiting on a slow peer

    async def _admitted(self, me: _Connection) -> bool:
        """Whether the new connection is taken. One refused (the hard limit reached, and none open
        had its chance yet: a burst) waits for room, asking again every `FAIR_TIME` until the oldest
        open had theirs. `MAX_CONNECTIONS` wait at most: a newcomer beyond them closes the one that
        has waited longest (the newest are the likeliest to be a `status` still there)."""
        if self._admit(me):
            return True
        if len(self._waiting) >= MAX_CONNECTIONS:
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            oldest.end()
            self.refused += 1
            self._warn()
        self._waiting[me] = None
        try:
            for _ in range(round(SLOW_TIME / FAIR_TIME) + FAIR_TURNS):
                await asyncio.sleep(FAIR_TIME)
                if self._admit(me):
                    return True
        finally:
            self._waiting.pop(me, None)
        self.refused += 1
        self._warn()
        return False

    def _admit(self, me: _Connection) -> bool:
        """Count the new connection, closing the one that makes room for it if the limits call for one;
        False when there is no room for it yet (see `ConnectionTable`)."""
        loop = asyncio.get_running_loop()
        if not self._tick_pending:
            self._tick_pending = True
            loop.call_soon(self._next_turn)
        eviction = self._open.admit(_PEER, me, now=loop.time(), turn=self._turn)
        if eviction is None:
            return True
        if eviction.item is me:
            return False
        eviction.item.end()
        self.evicted += 1
        self._warn()
        return True

    def _warn(self) -> None:
        """Say at warning, at most once per `EVICTION_WARNING_PERIOD`, that connections were closed to
        make room (or refused), with how many since the last warning."""
        now = asyncio.get_running_loop().time()
        if self._warned_at is not None and now - self._warned_at < EVICTION_WARNING_PERIOD:
            return
        log.warning(
            "status socket connections are closed to make room: something holds them open without "
            "asking, or without reading the answer; find it (ss -xp | grep status.sock)",
            evicted=self.evicted - self._warned_counts[0],  # since the last such warning
            refused=self.refused - self._warned_counts[1],
            socket=self.path,
        )
        self._warned_at, self._warned_counts = now, (self.evicted, self.refused)

    def _next_turn(self) -> None:
        self._turn += 1
        self._tick_pending = False

    def _response(self, target: tuple[str, str] | None) -> bytes:
        if target is None:
            return _http(400, "Bad Request", "a request is one line: GET /status HTTP/1.0\n")
        method, path = target
        if method != "GET":
            return _http(405, "Method Not Allowed", "only GET /status\n")
        if path.split("?", 1)[0] not in ("/", "/status"):
            return _http(404, "Not Found", "only GET /status\n")
        try:
            body = json.dumps(self.document(), separators=(",", ":")) + "\n"
        except Exception:  # a bug: said, and answered, and the daemon goes on
            log.exception("cannot make the status document")
            return _http(500, "Internal Server Error", "the daemon could not make its status; see its log\n")
        return _http(200, "OK", body, "application/json")


async def _send(writer: asyncio.StreamWriter, answer: bytes) -> None:
    """Write `answer` and close, once the peer has taken all of it."""
    writer.write(answer)
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str]:
    """The method and path of an HTTP request's head (its headers read and ignored). Raises
    ValueError for what is no HTTP request line."""
    line = (await reader.readuntil(b"\n")).decode("ascii", "replace").strip()
    parts = line.split()
    if len(parts) not in (2, 3) or (len(parts) == 3 and not parts[2].startswith("HTTP/")):
        raise ValueError(line)
    if len(parts) == 3:  # HTTP/1.x: headers follow, up to an empty line
        for _ in range(_MAX_HEADER_LINES):
            if not (await reader.readuntil(b"\n")).strip():
                break
    return parts[0], parts[1]


def _http(code: int, reason: str, body: str, content_type: str = "text/plain; charset=utf-8") -> bytes:
    data = body.encode()
    head = (
        f"HTTP/1.0 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(data)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + data
