"""``mixed-cpu-nri-plugin status``: ask the running daemon who holds the shared CPUs, and print it.

The daemon's status socket (`nri_plugin.daemon.status`) is found from the config, as ``run`` finds
its state dir, or in the default state dir on a node with no config file (`find_socket`). One
request, by the standard library's ``http.client`` over the unix socket: the command runs wherever
the daemon does, inside its distroless image too (``kubectl exec ds/<name> -- mixed-cpu-nri-plugin
status``). A failure is one line with its cause and its fix (`StatusError`).

The whole question (connecting, sending, and reading the whole answer) has one deadline, `TIMEOUT`
seconds: a server that answers a byte at a time fails it as surely as one that says nothing. An
answer larger than `MAX_ANSWER` is refused as such, never cut and misread. What the document says
is printed with its control characters escaped (``\\x1b``), in the table as in JSON, so a name or
message in it cannot move the cursor or retitle the terminal.
"""

from __future__ import annotations

import datetime
import http.client
import json
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any, Final, TextIO

from nri_plugin.daemon.config import (
    DEFAULT_CONFIG_PATH,
    DEFAULT_STATE_DIR,
    ConfigError,
    ConfigMissing,
    load_config,
)
from nri_plugin.daemon.status import status_socket_path
from nri_plugin.mixedcpu.status import SCHEMA

__all__ = [
    "EXIT_CONFIG",
    "EXIT_UNREACHABLE",
    "MAX_ANSWER",
    "TIMEOUT",
    "StatusError",
    "fetch_status",
    "find_socket",
    "printable",
    "render_table",
    "run_status",
]

EXIT_UNREACHABLE: Final = 1
EXIT_CONFIG: Final = 2
# Seconds the daemon has to answer, the whole answer; the largest answer read (a node's worth of pods
# is far less: some 2 KB a pod).
TIMEOUT: Final = 5.0
MAX_ANSWER: Final = 64 << 20
_CHUNK: Final = 1 << 16
_IN_POD: Final = "kubectl exec -n <namespace> ds/<daemonset> -- mixed-cpu-nri-plugin status"
_CLEAR: Final = "\x1b[H\x1b[2J"


class StatusError(Exception):
    """The status cannot be had; the message is one line: the cause and the fix."""


class _DeadlineSocket(socket.socket):
    """A socket whose every call (connect, send, receive) waits at most until `deadline` (monotonic
    time): the timeout a plain socket sets is per call, and a peer sending a byte now and then would
    keep each call short and the whole answer endless."""

    deadline = 0.0

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline has passed")
        self.settimeout(left)

    def connect(self, address: Any) -> None:
        self._arm()
        super().connect(address)

    def sendall(self, data: Any, flags: int = 0) -> None:
        self._arm()
        super().sendall(data, flags)

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        self._arm()
        return super().recv_into(buffer, nbytes, flags)


class _UnixHTTPConnection(http.client.HTTPConnection):
    """``http.client`` over the unix socket at `path`, every call of it before `deadline`."""

    def __init__(self, path: str, deadline: float) -> None:
        super().__init__("localhost")
        self.socket_path = path
        self.deadline = deadline

    def connect(self) -> None:
        sock = _DeadlineSocket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.deadline = self.deadline
        try:
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def fetch_status(path: str, timeout: float = TIMEOUT, *, limit: int = MAX_ANSWER) -> dict[str, Any]:
    """The status document the daemon serves on the unix socket at `path`, the whole of it within
    `timeout` seconds and at most `limit` bytes. Raises `StatusError`."""
    connection = _UnixHTTPConnection(path, time.monotonic() + timeout)
    try:
        connection.request("GET", "/status", headers={"Accept": "application/json"})
        with connection.getresponse() as response:  # an HTTP/1.0 answer owns the socket from here
            code, reason = response.status, response.reason
            body = _read_body(path, response, limit)
    except FileNotFoundError:
        raise StatusError(
            f"no status socket at {path}: the daemon is not running, or runs with another state_dir; start "
            "it (systemctl start mixed-cpu-nri-plugin, or look at its pod), or name its state dir "
            "(--state-dir DIR: the chart's hostPaths.stateDir) or the --config it runs with"
        ) from None
    except ConnectionRefusedError:
        raise StatusError(
            f"nothing answers on {path}: the daemon that made it has stopped; start the daemon again"
        ) from None
    except PermissionError:
        raise StatusError(
            f"permission denied on {path}: only root may ask the daemon; run the command as root (sudo), "
            f"or inside the daemon's pod: {_IN_POD}"
        ) from None
    except TimeoutError:
        raise StatusError(
            f"the daemon did not answer on {path} within {timeout:g} s (the whole answer): it is stuck or "
            "overloaded, or something else serves that socket; look at its log, and its /healthz"
        ) from None
    except ConnectionError:  # reset, or closed before the answer (RemoteDisconnected)
        raise StatusError(
            f"{path} closed the connection without an answer: the daemon is shutting down or overloaded; "
            "ask again, and look at its log"
        ) from None
    except http.client.HTTPException as exc:
        raise StatusError(
            f"{path} answered something that is not HTTP ({printable(str(exc))[:200]}): is it the daemon's "
            "socket? point --config at the daemon's own config"
        ) from None
    except OSError as exc:
        raise StatusError(f"cannot ask the daemon on {path}: {exc.strerror or exc}") from None
    finally:
        connection.close()
    return _document(path, code, reason, body)


def _read_body(path: str, response: http.client.HTTPResponse, limit: int) -> bytes:
    """The whole body of `response`, refused when over `limit` bytes (a length said beforehand is
    believed: nothing is read of an answer that says it is too large) or shorter than it said."""
    expected = response.length
    if expected is not None and expected > limit:
        raise _oversize(path, limit)
    chunks: list[bytes] = []
    size = 0
    while chunk := response.read(_CHUNK):
        size += len(chunk)
        if size > limit:
            raise _oversize(path, limit)
        chunks.append(chunk)
    if expected is not None and size < expected:
        raise StatusError(
            f"the answer on {path} ended after {size} of its {expected} bytes: the daemon closed the "
            "connection early (shutting down?); ask again"
        )
    return b"".join(chunks)


def _oversize(path: str, limit: int) -> StatusError:
    return StatusError(
        f"{path} answered more than {limit >> 20} MiB, far more than a status document: is it the daemon's "
        "socket? point --config at the daemon's own config; if it is the daemon's, report it"
    )


def _document(path: str, code: int, reason: str, body: bytes) -> dict[str, Any]:
    """The JSON document of an HTTP answer, checked to be the version this command reads."""
    if code == 500:
        raise StatusError(
            f"the daemon on {path} could not make its status (a bug): its log says why; report it"
        )
    if code != 200:
        raise StatusError(
            f"{path} answered {code} {printable(reason)[:200]!r}, not a status: is it the daemon's socket? "
            "point --config at the daemon's own config"
        )
    try:
        document = json.loads(body)
    except ValueError:
        raise StatusError(f"{path} answered something that is not JSON; report it") from None
    schema = document.get("schema") if isinstance(document, dict) else None
    if not isinstance(document, dict) or schema != SCHEMA:
        raise StatusError(
            f"the daemon answered a status of schema {schema!r}, and this command reads {SCHEMA!r}: run the "
            f"command of the daemon's own version, e.g. inside its pod: {_IN_POD}"
        )
    return dict(document)


def socket_from_config(config_path: str) -> str:
    """The status socket of the daemon that runs with the config at `config_path`. Raises
    `ConfigError`."""
    return status_socket_path(load_config(config_path, check=False).state_dir)


def find_socket(
    config_path: str | None = None, *, state_dir: str | None = None, socket_path: str | None = None
) -> str:
    """Where to ask the daemon: the socket given, else the one in the state dir given, else the one
    the config file given names; with none of them, the one the default config names, or, on a
    node with no default config (the DaemonSet's config lives in its pod), the one in the default
    state dir. Raises `ConfigError` for a config file that cannot be read (the default one too:
    a config that is there but wrong is not silently passed over)."""
    if socket_path is not None:
        return socket_path
    if state_dir is not None:
        return status_socket_path(state_dir)
    if config_path is not None:
        try:
            return socket_from_config(config_path)
        except ConfigMissing:
            raise ConfigError(
                f"{config_path}: no such file; pass the --config the daemon runs with"
            ) from None
    try:
        return socket_from_config(DEFAULT_CONFIG_PATH)
    except ConfigMissing:
        return status_socket_path(DEFAULT_STATE_DIR)


def run_status(
    config_path: str | None = None,
    *,
    state_dir: str | None = None,
    socket: str | None = None,
    output: str = "table",
    watch: float | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    timeout: float = TIMEOUT,
) -> int:
    """The ``status`` command: print the daemon's status once, or every `watch` seconds until
    interrupted; the exit status (0, `EXIT_UNREACHABLE`, or `EXIT_CONFIG`). The daemon is found as
    `find_socket` says, and has `timeout` seconds for each whole answer."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        path = find_socket(config_path, state_dir=state_dir, socket_path=socket)
    except ConfigError as exc:
        print(
            f"error: {exc}; or name the daemon's state dir (--state-dir DIR) or socket (--socket PATH)",
            file=err,
        )
        return EXIT_CONFIG
    while True:
        try:
            document = fetch_status(path, timeout)
        except StatusError as exc:
            print(f"error: {exc}", file=err, flush=True)
            if watch is None:
                return EXIT_UNREACHABLE
        else:
            if output == "json":
                # Watching: one document per line (JSON Lines), for jq and the like. ASCII only: every
                # control character (and anything not ASCII) is written as a JSON escape.
                print(json.dumps(document, indent=None if watch else 2, ensure_ascii=True), file=out)
            else:
                print((_CLEAR if watch and out.isatty() else "") + render_table(document), file=out)
            out.flush()
            if watch is None:
                return 0
        time.sleep(watch)


# -- the table ---------------------------------------------------------------------------------------------


def render_table(document: dict[str, Any]) -> str:
    """The status document as an operator reads it: the daemon's connections (the DRA front door's
    too), the pool, one row per shared container, one per pod quota, the latest heals. Every string
    of the document is shown `printable`."""
    document = _printable_strings(document)
    now = _parse_time(document["time"])
    daemon = document["daemon"]
    lines = [f"mixed-cpu-nri-plugin {document['version']}, pid {daemon['pid']}, at {document['time']}"]
    lines += _summary(document, now)
    pool = document["pool"]
    lines.append(f"{'shared pool':<15}{pool['cpus'] or 'none'}: {_count(pool['containers'], 'container')}")
    for node in pool["numa_nodes"]:
        cpus = node["cpus"] or "none (its containers get the whole pool)"
        name = f"  NUMA node {node['node']}"
        lines.append(f"{name:<15}{cpus}: {_count(node['containers'], 'container')}")
    # By namespace, pod and container, as an operator looks for them (the document's order is the
    # books', by pod UID).
    containers = sorted(
        document["containers"],
        key=lambda row: (row["namespace"] or "~", row["pod"] or row["pod_key"], row["container"]),
    )
    lines += ["", f"SHARED CONTAINERS ({len(containers)})"]
    lines += _table(
        ("NAMESPACE", "POD", "CONTAINER", "EXCLUSIVE", "SHARED", "PROOF", "DEVICE", "HELD FOR"),
        [
            (
                row["namespace"] or "?",
                row["pod"] or f"uid {row['pod_key']}",
                row["container"],
                row["exclusive_cpus"] or "-",
                row["shared_cpus"],
                row["proof"] or "? (until Synchronize)",
                row["device"] or "-",
                _age(row["since"], now),
            )
            for row in containers
        ],
    )
    pods = document["pods"]
    lines += ["", f"POD QUOTAS ({len(pods)}, in CPUs: quota / period)"]
    lines += _table(
        ("NAMESPACE", "POD", "NOW", "TARGET", "BASELINE", "STATE"),
        [
            (
                row["namespace"] or "?",
                row["pod"] or f"uid {row['pod_key']}",
                _cpus(row["quota_now_us"], row["period_us"]) if row["read_error"] is None else "?",
                _cpus(row["quota_target_us"], row["period_us"]),
                f"{_cpus(row['quota_baseline_us'], row['period_us'])} ({row['baseline_source']})",
                _pod_state(row),
            )
            for row in pods
        ],
    )
    heals = document["heals"]
    lines += ["", f"LATEST HEALS ({len(heals)})"]
    lines += _table(
        ("AGO", "KIND", "POD", "CONTAINER ID", "WHAT"),
        [
            (_age(h["at"], now), h["kind"], _heal_pod(h), h["container_id"] or "-", h["message"])
            for h in heals
        ],
    )
    return "\n".join(lines)


def printable(text: str) -> str:
    """`text` with what a terminal would act on rather than show (control characters, C1 ones such as
    CSI included, and Unicode's invisible format characters such as a right-to-left override) written
    as Python escapes: ``\\x1b``, ``\\n``, ``\\u202e``."""
    if text.isprintable():
        return text
    return "".join(
        char if char.isprintable() else char.encode("unicode_escape").decode("ascii") for char in text
    )


def _printable_strings(value: Any) -> Any:
    """`value` (a JSON document) with every string in it `printable`."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {key: _printable_strings(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_printable_strings(item) for item in value]
    return value


def _summary(document: dict[str, Any], now: datetime.datetime | None) -> list[str]:
    runtime = document["runtime"]
    if runtime["name"]:
        who = f"{runtime['name']} {runtime['version'] or ''}".strip()
        nri = f" (NRI {runtime['nri_version']})" if runtime["nri_version"] else ""
        connected = runtime["connected_since"]
        since = f", connected {_age(connected, now)} ago" if connected else ""
        text = f"{who}{nri}: {runtime['state']}{since}"
    else:
        text = f"{runtime['state']}: no runtime has configured the plugin yet"
    device = document["device_plugin"]
    if not device["enabled"]:
        plugin = "off"
    else:
        registrations = _count(device["registrations"], "registration")
        plugin = f"{device['state']} ({device['resource_name']}; {registrations})"
    resources = document["pod_resources"]
    dra = document.get("dra") or {}
    if not resources["configured"] and not device["enabled"] and not dra.get("enabled"):
        record = "not asked: neither the device plugin nor DRA hands out devices to ask kubelet about"
    elif not resources["configured"]:
        record = "not asked: pod_resources_socket is empty, or the allocation marker is not trusted"
    elif resources["reachable"]:
        record = f"reachable: kubelet's record proves requests ({resources['socket']})"
    else:
        record = f"NOT reachable: the marker binding alone proves requests ({resources['socket']})"
    return [
        f"{'runtime':<15}{text}",
        f"{'device plugin':<15}{plugin}",
        f"{'pod resources':<15}{record}",
        *_dra(document.get("dra")),
    ]


def _dra(dra: dict[str, Any] | None) -> list[str]:
    """The DRA front door's lines: none for a daemon older than the ``dra`` section."""
    if dra is None:
        return []
    if not dra["enabled"]:
        return [f"{'DRA':<15}off"]
    kubelet, published, claims = dra["kubelet"], dra["resource_slices"], dra["prepared_claims"]
    registrations = _count(kubelet["registrations"], "registration")
    if kubelet["registered"]:
        registration = f"registered ({registrations})"
    elif kubelet["last_error"]:
        registration = f"REFUSED ({registrations}): {kubelet['last_error']}"
    else:
        registration = f"NOT registered ({registrations}): waiting for kubelet's plugin watcher"
    if not published["published_here"]:
        slices = "not published by this daemon (publish_resource_slices = false)"
    elif published["published"]:
        devices = _count(published["devices"], "device")
        slices = f"published: generation {published['generation']}, {devices}"
        if published["restores"]:
            slices += f", restored {_count(published['restores'], 'time')}"
    elif published["failures"]:
        failures = _count(published["failures"], "failed attempt")
        slices = f"NOT published ({failures}, retrying): {published['last_error']}"
    else:
        slices = "publishing"
    if claims["count"] is None:
        prepared = f"? ({claims['read_error']})"
    else:
        prepared = f"{claims['count']}{' or more' if claims['capped'] else ''} prepared"
    return [
        f"{'DRA':<15}{dra['driver']} on node {dra['node']}",
        f"{'  kubelet':<15}{registration}",
        f"{'  slices':<15}{slices}",
        f"{'  claims':<15}{prepared}",
    ]


def _heal_pod(heal: dict[str, Any]) -> str:
    """The heal's pod by namespace/name when the daemon knew them, else by UID."""
    if heal.get("namespace") and heal.get("pod"):
        return f"{heal['namespace']}/{heal['pod']}"
    return f"uid {heal['pod_key']}" if heal["pod_key"] else "-"


def _pod_state(row: dict[str, Any]) -> str:
    if row["read_error"] is not None:
        return f"unreadable: {row['read_error']}"
    if row["lowering_retry_pending"]:
        return "lowering retried (the kernel refused it yet)"
    return "at target" if row["at_target"] else "off target (the reconciler brings it back)"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    if not rows:
        return ["(none)"]
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=False)]
    return [
        "  ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in (headers, *rows)
    ]


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _cpus(quota: int | None, period: int) -> str:
    """A CFS quota in CPUs, rounded to two decimals."""
    return "unlimited" if quota is None else f"{quota / period:.2f}".rstrip("0").rstrip(".")


def _parse_time(text: str | None) -> datetime.datetime | None:
    if text is None:
        return None
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)


def _age(text: str | None, now: datetime.datetime | None) -> str:
    """How long ago `text` was, before `now`, in the two largest units: ``3m12s``, ``2d4h``."""
    then = _parse_time(text)
    if then is None or now is None:
        return "?"
    seconds = max(int((now - then).total_seconds()), 0)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes}m"
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"
