"""The daemon's status: the whole document (`status_document`) and the socket it is served on
(`StatusServer`), for ``mixed-cpu-nri-plugin status`` (`nri_plugin.daemon.status_client`).

The socket is ``status.sock`` in the state dir (`status_socket_path`): a unix socket of mode 0600
in a directory only root may write, so only root on the node (or in the daemon's own container) can
ask; never the metrics port, which listens on the pod network. It answers one request per
connection, ``GET /status``, with the JSON document (docs/status.md; its JSON Schema is
docs/status.schema.json), over the daemon's one HTTP layer (`nri_plugin.common.httpserve`, HTTP/1.1
on h11, HTTP/1.0 requests too), so ``curl --unix-socket <state_dir>/status.sock
http://localhost/status`` reads it too. The document is made on the event loop when asked: nothing
is kept up to date for it between questions, and asking costs one quota read per pod in the books,
and with the DRA front door one listing of the CDI spec directory (its prepared claims are counted
from the file names there).

Idle or slow clients cannot keep ``status`` out (issue 32). Each connection has `REQUEST_TIMEOUT`
seconds to send its request (408 after) and `WRITE_TIMEOUT` to take the whole answer (dropped
after). A newcomer is always taken: at `MAX_CONNECTIONS` open, the oldest connection that has not
sent a byte yet is closed to make room, else the oldest still sending its request or taking its
answer; either only once it had its chance (the rules and `ConnectionTable` of
`nri_plugin.common.connections`: a few turns of the loop, and `FAIR_TIME` seconds for one that said
nothing, `SLOW_TIME` for one sending or taking). While none had it, newcomers are taken beyond
`MAX_CONNECTIONS`, up to `HARD_MAX_CONNECTIONS`; past that, up to `MAX_CONNECTIONS` of them wait for
room (asking every `FAIR_TIME`). ``status`` sends its request with its connection and reads its
answer at once, so it is neither the one to go nor kept waiting long. Evictions are said at
warning, at most once per `EVICTION_WARNING_PERIOD`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import structlog

from nri_plugin import __version__
from nri_plugin.cgroups import CgroupError, CgroupNotFound, read_cpu_quota
from nri_plugin.common.httpserve import NO_ROOM, Answer, HttpServer, Limits
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
# A request's head (its line and headers) is at most this long: a status request is a few lines.
MAX_HEAD: Final = 4096
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
        self._identity: FileId | None = None
        self._serving = False
        # Every connection is a local one: one peer, as far as the limits go. One taking its answer
        # may be evicted (`evict_slow_readers`): one that does not read is what would keep `status` out.
        limits = Limits(
            request_timeout=request_timeout,
            write_timeout=write_timeout,
            max_head=MAX_HEAD,
            total=MAX_CONNECTIONS,
            per_peer=MAX_CONNECTIONS,
            hard_total=HARD_MAX_CONNECTIONS,
            fair_time=FAIR_TIME,
            heard_time=SLOW_TIME,
            waiting=MAX_CONNECTIONS,
            evict_slow_readers=True,
            warning_period=EVICTION_WARNING_PERIOD,
        )
        routes = {"/status": self._answer, "/": self._answer}
        self.http = HttpServer(routes, limits, methods=("GET",), warn=self._warn)

    @property
    def connections(self) -> int:
        """Connections open now."""
        return self.http.connections

    @property
    def evicted(self) -> int:
        """Connections closed to make room for newer ones."""
        return self.http.evicted

    @property
    def refused(self) -> int:
        """Newcomers closed for want of room."""
        return self.http.refused

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
        self.http.start([sock])
        self._serving = True
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
        if not self._serving:
            return
        self._serving = False
        remove_if_ours(self.path, self._identity)  # ours still: not a newer daemon's
        self.http.close()

    def _warn(self, counts: dict[str, int], _peer: str) -> None:
        """Said at most once per `EVICTION_WARNING_PERIOD`, with the counts since the last time."""
        log.warning(
            "status socket connections are closed to make room: something holds them open without "
            "asking, or without reading the answer; find it (ss -xp | grep status.sock)",
            evicted=sum(count for reason, count in counts.items() if reason != NO_ROOM),
            refused=counts.get(NO_ROOM, 0),
            socket=self.path,
        )

    def _answer(self) -> Answer:
        try:
            body = json.dumps(self.document(), separators=(",", ":")) + "\n"
        except Exception:  # a bug: said, and answered, and the daemon goes on
            log.exception("cannot make the status document")
            return Answer(500, b"the daemon could not make its status; see its log\n")
        return Answer(200, body.encode(), "application/json")
