"""``mixed-cpu-nri-plugin status``: ask the running daemon who holds the shared CPUs, and print it.

The daemon's status socket (`nri_plugin.daemon.status`) is found from the config, as ``run`` finds
its state dir, or in the default state dir on a node with no config file (`find_socket`). One
request, plain blocking socket calls and the standard library only: the command runs wherever the
daemon does, inside its distroless image too (``kubectl exec ds/<name> -- mixed-cpu-nri-plugin
status``). A failure is one line with its cause and its fix (`StatusError`).
"""

from __future__ import annotations

import datetime
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
    "StatusError",
    "fetch_status",
    "find_socket",
    "render_table",
    "run_status",
]

EXIT_UNREACHABLE: Final = 1
EXIT_CONFIG: Final = 2
# Seconds the daemon has to answer; the largest answer read (a node's worth of pods is far less).
TIMEOUT: Final = 5.0
_MAX_ANSWER: Final = 64 << 20
_IN_POD: Final = "kubectl exec -n <namespace> ds/<daemonset> -- mixed-cpu-nri-plugin status"
_CLEAR: Final = "\x1b[H\x1b[2J"


class StatusError(Exception):
    """The status cannot be had; the message is one line: the cause and the fix."""


def fetch_status(path: str, timeout: float = TIMEOUT) -> dict[str, Any]:
    """The status document the daemon serves on the unix socket at `path`. Raises `StatusError`."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(b"GET /status HTTP/1.0\r\n\r\n")
            answer = _read_all(sock)
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
            f"the daemon did not answer on {path} within {timeout:g} s: it is stuck or overloaded; "
            "look at its log, and its /healthz"
        ) from None
    except OSError as exc:
        raise StatusError(f"cannot ask the daemon on {path}: {exc.strerror or exc}") from None
    return _document(path, answer)


def _read_all(sock: socket.socket) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size <= _MAX_ANSWER:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _document(path: str, answer: bytes) -> dict[str, Any]:
    """The JSON document of an HTTP answer, checked to be the version this command reads."""
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].decode("ascii", "replace")
    if status_line.startswith("HTTP/1.0 500"):
        raise StatusError(
            f"the daemon on {path} could not make its status (a bug): its log says why; report it"
        )
    if not status_line.startswith("HTTP/1.0 200"):
        raise StatusError(
            f"{path} answered {status_line or 'nothing'!r}, not a status: is it the daemon's socket? "
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
) -> int:
    """The ``status`` command: print the daemon's status once, or every `watch` seconds until
    interrupted; the exit status (0, `EXIT_UNREACHABLE`, or `EXIT_CONFIG`). The daemon is found as
    `find_socket` says."""
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
            document = fetch_status(path)
        except StatusError as exc:
            print(f"error: {exc}", file=err, flush=True)
            if watch is None:
                return EXIT_UNREACHABLE
        else:
            if output == "json":
                # Watching: one document per line (JSON Lines), for jq and the like.
                print(json.dumps(document, indent=None if watch else 2), file=out)
            else:
                print((_CLEAR if watch and out.isatty() else "") + render_table(document), file=out)
            out.flush()
            if watch is None:
                return 0
        time.sleep(watch)


# -- the table ---------------------------------------------------------------------------------------------


def render_table(document: dict[str, Any]) -> str:
    """The status document as an operator reads it: the daemon's connections (the DRA front door's
    too), the pool, one row per shared container, one per pod quota, the latest heals."""
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
