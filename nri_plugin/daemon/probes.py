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

Served by the daemon's one HTTP layer (`nri_plugin.common.httpserve`, on h11; its docstring has
the rules): one request per connection (``Connection: close``), GET and HEAD only (405 for other
methods), no request body read, the request head limited to `MAX_HEAD` bytes (431) and
`READ_TIMEOUT` seconds in all (408, however it trickles in), the answer to `WRITE_TIMEOUT`, anything
unparsable answered 400. A client sending garbage costs one short-lived connection, never the server.

Nobody can starve the probes by holding connections open (issue 13): the port listens on the pod IP,
and kubelet restarts a daemon whose ``/healthz`` fails. Refusing connections beyond a limit would let
any pod keep liveness failing with a few dozen idle sockets; instead every new connection is taken,
and when that goes over a limit, an older one is closed (`ConnectionTable`): a peer (one source
address) holding `MAX_PER_PEER` gives up its own oldest; at `MAX_CONNECTIONS` in all, the oldest
connection that has said nothing goes first, then the oldest still sending its head.

Nor by a churn of new connections from many addresses (issue 25): a connection is evicted only
after it has had its chance to be read (`FAIR_TURNS` turns of the loop and `FAIR_TIME` seconds,
`HEARD_TIME` once its request has begun), so kubelet's probe, whose request comes with its
connection, is read before it could go; a request there whole is answered in the callback that
reads it. Until then newcomers are taken beyond the limit, up to `HARD_MAX_CONNECTIONS`. A
connection costs no task, and the kernel queues `BACKLOG` of them between two turns of the loop.
Evictions are logged at warning, at most once per `EVICTION_WARNING_PERIOD`, with their count, and
each is counted by its reason (`ProbeObserver`: ``mixed_cpu_probe_connections_evicted_total``), so
that an alert need not parse logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import structlog
from prometheus_client import CONTENT_TYPE_LATEST

from nri_plugin.common import connections
from nri_plugin.common.clock import LOOP_CLOCK, Clock
from nri_plugin.common.connections import EVICTION_REASONS, ConnectionTable, Eviction
from nri_plugin.common.httpserve import Answer, HttpServer, Limits
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
# Evictions are said at warning at most this often (seconds), with how many there were since.
EVICTION_WARNING_PERIOD = 60.0


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
        limits = Limits(
            request_timeout=READ_TIMEOUT,
            write_timeout=WRITE_TIMEOUT,
            max_head=MAX_HEAD,
            total=MAX_CONNECTIONS,
            per_peer=MAX_PER_PEER,
            hard_total=max(HARD_MAX_CONNECTIONS, MAX_CONNECTIONS),
            fair_turns=FAIR_TURNS,
            fair_time=FAIR_TIME,
            heard_time=HEARD_TIME,
            warning_period=EVICTION_WARNING_PERIOD,
        )
        routes = {"/metrics": self._metrics_answer, "/healthz": self._health, "/readyz": self._ready}
        self.http = HttpServer(routes, limits, dropped=self._evicted, warn=self._warn_of_evictions)

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
        return self.http.connections

    @property
    def evicted(self) -> int:
        """Connections closed so far to make room for newer ones (see the module docstring)."""
        return self.http.evicted

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
        self.http.start(self._listeners)
        log.info("serving metrics and probes", address=" ".join(self.bound), paths=" ".join(self.http.routes))

    async def close(self) -> None:
        self.http.close()
        self._listeners = []

    async def __aenter__(self) -> ProbeServer:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    def _evicted(self, _peer: str, reason: str) -> None:
        if self.observer is not None:
            self.observer.probe_connection_evicted(reason)

    def _warn_of_evictions(self, counts: dict[str, int], peer: str) -> None:
        """Said at most once per `EVICTION_WARNING_PERIOD`, with how many since the last time:
        probes and scrapes still get through, but something holds the port's connections open, which
        an operator wants to know and keep out."""
        log.warning(
            "connections to the metrics and probe port are evicted to make room: something holds "
            "them open; a NetworkPolicy admitting only the scraper keeps others out (docs/deploy.md)",
            evicted=sum(counts.values()),  # since the last such warning
            last_from=peer,
        )

    def _health(self) -> Answer:
        unhealthy = self._liveness() if self._liveness is not None else None
        if unhealthy:
            return Answer(503, f"unhealthy: {unhealthy}\n".encode())
        return Answer(200, b"ok\n")

    def _ready(self) -> Answer:
        missing = self._readiness()
        if missing:
            return Answer(503, f"not ready: {missing}\n".encode())
        return Answer(200, b"ok\n")

    def _metrics_answer(self) -> Answer:
        try:
            return Answer(200, self._metrics(), CONTENT_TYPE_LATEST)
        except Exception as exc:  # a metric's reader failed: say so, keep serving
            log.error("cannot render the metrics", error=str(exc))
            return Answer(500, f"cannot render the metrics: {exc}\n".encode())
