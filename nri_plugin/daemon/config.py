"""The daemon's TOML configuration: loading, validation, and the one error type callers handle.

Default path ``/etc/mixed-cpu-nri/config.toml``. Only ``shared_cpuset`` is required::

    shared_cpuset = "0-1"                  # the node's shared CPU pool (Linux cpu list)

    plugin_name = "mixed-cpu"              # NRI name; --nri-plugin-name, NRI_PLUGIN_NAME, NN-name file win
    plugin_index = "10"                    # two digits; --nri-plugin-index, NRI_PLUGIN_IDX, NN-name file win
    nri_socket = "/var/run/nri/nri.sock"   # --socket wins
    cgroup_root = "/sys/fs/cgroup"         # where the host's cgroup tree is mounted
    cgroup_version = "auto"                # auto (from mountinfo) | v1 (<root>/cpu, <root>/cpuset) | v2
    sysfs_root = "/sys"                    # online CPUs: <sysfs_root>/devices/system/cpu/online
    numa_local_shared_cpus = false         # true: only the shared CPUs on a container's NUMA nodes
    state_dir = "/var/lib/mixed-cpu-nri"   # pod quota bookkeeping and the device plugin's marker key
    log_level = "info"                     # debug | info | warning | error; --log-level wins
    log_format = "auto"                    # auto (JSON when stderr is not a terminal) | console | json
    metrics_address = "127.0.0.1:8891"     # host:port (":8891": every address) of /metrics, /healthz,
                                           # /readyz; "" turns it off
    reconcile_interval = 30                # seconds between the reconciler's checks of the node
    creation_timeout = 300                 # seconds a CRI-O creation may run before a failed one
                                           # gives its share back (CRI-O's container_create_timeout + 60)
    max_synchronize_mib = 32               # the most one Synchronize may bring (1-1024 MiB)
    nri_stall_limit = 60                   # seconds the NRI connection may be stuck (neither serving
                                           # nor waiting to reconnect) before /healthz fails (1-3600)
    systemd_bus = "/run/dbus/system_bus_socket"  # the system bus: pod slices' quotas set through
                                           # systemd (systemd driver); "": always the cgroup files

    [trusted_sources]                      # what proves that a container asked for shared CPUs
    device_plugin_marker = true            # our device plugin's signed allocation marker
    pod_annotation = false                 # cpu-shared.crio.io/<container>: enable (OpenShift admission)

    [device_plugin]                        # see nri_plugin.deviceplugin.config
    enabled = true

    [dra]                                  # see nri_plugin.dra.config (DRA, off by default)
    enabled = false

Every problem is a `ConfigError` whose one-line message names the file, the key, what is wrong and
how to fix it. Unknown keys are errors too, in every table alike, with the nearest known key offered:
a misspelt key must not silently fall back to a default. A missing file is `ConfigMissing`.
`parse_config` checks a parsed document; `load_config` reads the file, parses it and checks it
against the machine (every shared CPU online).
"""

from __future__ import annotations

import difflib
import errno
import functools
import json
import os
import re
import stat
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Final, TypeVar

from nri_plugin import cgroups
from nri_plugin.cgroups import CgroupLayout, CgroupMode, CgroupModeError, CpusetError, Hierarchy
from nri_plugin.cgroups.mode import DEFAULT_CGROUP_ROOT, DEFAULT_MOUNTINFO
from nri_plugin.common.smallfile import NotRegularFile, TooLarge, read_capped
from nri_plugin.deviceplugin.config import DevicePluginConfig, DevicePluginConfigError
from nri_plugin.dra.config import DraConfig, DraConfigError
from nri_plugin.nri.identity import DEFAULT_SOCKET_PATH, Identity, IdentityError, resolve_identity
from nri_plugin.nri.identity import PLUGIN_INDEX as _INDEX
from nri_plugin.nri.identity import PLUGIN_NAME as _NAME
from nri_plugin.systemd.bus import SYSTEM_BUS as DEFAULT_SYSTEMD_BUS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "TRUSTED_SOURCES_TABLE",
    "TRUSTED_SOURCE_KEYS",
    "Config",
    "ConfigError",
    "ConfigMissing",
    "build_layout",
    "load_config",
    "metrics_address_problem",
    "numa_nodes_from_cpulists",
    "online_cpus",
    "parse_config",
    "plugin_identity",
    "read_document",
    "read_numa_nodes",
    "state_dir_problem",
]

DEFAULT_CONFIG_PATH: Final = "/etc/mixed-cpu-nri/config.toml"
DEFAULT_STATE_DIR: Final = "/var/lib/mixed-cpu-nri"
DEFAULT_NRI_SOCKET: Final = DEFAULT_SOCKET_PATH
LOG_LEVELS: Final = ("debug", "info", "warning", "error")
LOG_FORMATS: Final = ("auto", "console", "json")
DEFAULT_METRICS_ADDRESS: Final = "127.0.0.1:8891"
# A Synchronize of 5,000 realistic containers is 7.3 MB; 32 MiB keeps the daemon far under the
# DaemonSet's 256 Mi memory limit (nri_plugin.nri.stub).
DEFAULT_MAX_SYNCHRONIZE_MIB: Final = 32
MAX_SYNCHRONIZE_MIB: Final = 1024
CGROUP_VERSIONS: Final = ("auto", "v1", "v2")
DEFAULT_RECONCILE_INTERVAL: Final = 30.0
RECONCILE_INTERVAL_RANGE: Final = (1.0, 3600.0)
DEFAULT_CREATION_TIMEOUT: Final = 300.0  # = nri_plugin.mixedcpu.heal.CREATION_TIMEOUT (tested)
CREATION_TIMEOUT_RANGE: Final = (1.0, 86400.0)
# How long the stub may spend neither serving the runtime nor waiting between reconnect attempts
# before /healthz fails (`nri_plugin.daemon.probes.liveness`): far above what an attempt takes (the
# registration timeout is 5 s; a lost connection's hang-up at most the mux's 2 s close bound).
DEFAULT_NRI_STALL_LIMIT: Final = 60.0
NRI_STALL_LIMIT_RANGE: Final = (1.0, 3600.0)
ONLINE_CPUS_FILE: Final = "devices/system/cpu/online"
NUMA_NODES_DIR: Final = "devices/system/node"
_NUMA_NODE: Final = re.compile(r"node([0-9]+)")

_BARE_KEY: Final = re.compile(r"[A-Za-z0-9_-]+")
# Larger than any real config; a bigger file is refused rather than read in part.
MAX_CONFIG_SIZE: Final = 1 << 20
_SOURCES_TABLE: Final = "trusted_sources"
_DEVICE_PLUGIN_TABLE: Final = "device_plugin"
_DRA_TABLE: Final = "dra"
_EXAMPLE: Final = 'e.g. shared_cpuset = "0-1"'


class ConfigError(Exception):
    """The configuration cannot be used. The message is one line: file, key, problem, fix."""


class ConfigMissing(ConfigError):
    """There is no config file at the path: `check` then goes on with the defaults."""


def _show(value: object) -> str:
    """A value as the user would write it in TOML, cut short and with no raw control characters."""
    text = json.dumps(value) if isinstance(value, (str, bool, int, float)) else repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


@dataclass(frozen=True, kw_only=True)
class Config:
    """A validated configuration. Paths are absolute and normalized."""

    shared_cpuset: frozenset[int]
    plugin_name: str = "mixed-cpu"
    plugin_index: str = "10"
    nri_socket: str = DEFAULT_NRI_SOCKET
    cgroup_root: str = DEFAULT_CGROUP_ROOT
    cgroup_version: str = "auto"
    sysfs_root: str = "/sys"
    numa_local_shared_cpus: bool = False
    state_dir: str = DEFAULT_STATE_DIR
    trust_device_plugin_marker: bool = True
    trust_pod_annotation: bool = False
    log_level: str = "info"
    log_format: str = "auto"
    metrics_address: str = DEFAULT_METRICS_ADDRESS
    reconcile_interval: float = DEFAULT_RECONCILE_INTERVAL
    creation_timeout: float = DEFAULT_CREATION_TIMEOUT
    max_synchronize_mib: int = DEFAULT_MAX_SYNCHRONIZE_MIB
    nri_stall_limit: float = DEFAULT_NRI_STALL_LIMIT
    systemd_bus: str = DEFAULT_SYSTEMD_BUS
    device_plugin: DevicePluginConfig = field(default_factory=DevicePluginConfig)
    dra: DraConfig = field(default_factory=DraConfig)
    source: str = "<config>"

    @property
    def shared_cpuset_text(self) -> str:
        return cgroups.format_cpuset(self.shared_cpuset)


# Top-level keys and the checker for each (tables are handled apart).
_PATH_KEYS: Final = ("nri_socket", "cgroup_root", "sysfs_root", "state_dir")
_TOP_KEYS: Final = (
    "shared_cpuset",
    "plugin_name",
    "plugin_index",
    *_PATH_KEYS,
    "numa_local_shared_cpus",
    "cgroup_version",
    "log_level",
    "log_format",
    "metrics_address",
    "reconcile_interval",
    "creation_timeout",
    "max_synchronize_mib",
    "nri_stall_limit",
    "systemd_bus",
    _SOURCES_TABLE,
    _DEVICE_PLUGIN_TABLE,
    _DRA_TABLE,
)
_SOURCE_KEYS: Final = {
    "device_plugin_marker": "trust_device_plugin_marker",
    "pod_annotation": "trust_pod_annotation",
}
# The [trusted_sources] table, its keys and the `Config` field each one sets (`config` prints them).
TRUSTED_SOURCES_TABLE: Final = _SOURCES_TABLE
TRUSTED_SOURCE_KEYS: Final = _SOURCE_KEYS


class _Checker:
    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.source}: {key}: {problem}")

    def string(self, key: str, value: object) -> str:
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, not {type(value).__name__} {_show(value)}")
        return value

    def boolean(self, key: str, value: object) -> bool:
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, not {_show(value)}")
        return value

    def choice(self, key: str, value: object, choices: tuple[str, ...]) -> str:
        text = self.string(key, value)
        if text not in choices:
            raise self.error(key, f"{_show(text)} is not one of {', '.join(choices)}")
        return text

    def path(self, key: str, value: object) -> str:
        text = self.string(key, value)
        if not text or "\0" in text or not text.startswith("/"):
            raise self.error(key, f"{_show(text)} must be an absolute path (starting with '/')")
        return os.path.normpath(text)

    def unknown(
        self, table: Mapping[str, Any], known: tuple[str, ...] | Mapping[str, str], where: str
    ) -> None:
        """Every table's unknown keys are refused alike: the first one, the known key nearest to it
        when one is close, and the known keys."""
        extra = sorted(set(table) - set(known))
        if extra:
            # A key outside TOML's bare-key alphabet is shown quoted and escaped: a newline or a
            # right-to-left override in it must not break or disguise the one-line message.
            key = extra[0] if _BARE_KEY.fullmatch(extra[0]) else _show(extra[0])
            nearest = _nearest_key(extra[0], tuple(known))
            guess = f" did you mean {where}{nearest}?" if nearest else ""
            raise self.error(f"{where}{key}", f"unknown key (a typo?):{guess} known keys: {', '.join(known)}")


def _nearest_key(key: str, known: tuple[str, ...]) -> str | None:
    """The known key `key` was probably meant to be: a close spelling ("state_dirr"), else the one
    known key that has `key` as a whole word ("count" for device_count)."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return close[0]
    holding = [name for name in known if key in name.split("_")]
    return holding[0] if len(holding) == 1 else None


def _shared_cpuset(check: _Checker, value: object) -> frozenset[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        raise check.error(
            "shared_cpuset",
            f'is the number {value}; a cpu list is a string: quote it, shared_cpuset = "{value}"',
        )
    text = check.string("shared_cpuset", value)
    try:
        cpus = cgroups.parse_cpuset(text)
    except CpusetError as exc:
        raise check.error("shared_cpuset", f"{exc}") from None
    if not cpus:
        raise check.error(
            "shared_cpuset",
            f"is empty; list the node's shared CPUs, {_EXAMPLE} (they must also be in kubelet's "
            "reservedSystemCPUs so they are never handed out exclusively)",
        )
    return cpus


def _plugin_index(check: _Checker, value: object) -> str:
    """Two digits in a string, as NRI has it: the index is text (sorted as text, part of a file name
    "10-name"), and NRI refuses "5" rather than pad it, so a number is refused too."""
    if isinstance(value, str) and _INDEX.fullmatch(value):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 99:
        raise check.error(
            "plugin_index",
            f"is the number {value}; NRI's index is a string of exactly two digits: quote it, "
            f'plugin_index = "{value:02d}"',
        )
    raise check.error(
        "plugin_index", f'{_show(value)} is invalid; use exactly two digits, e.g. plugin_index = "10"'
    )


def _plugin_name(check: _Checker, value: object) -> str:
    text = check.string("plugin_name", value)
    if not _NAME.fullmatch(text):
        raise check.error(
            "plugin_name", f'{_show(text)} is invalid; use letters, digits and _ . + - only, e.g. "mixed-cpu"'
        )
    return text


# Where `plugin_identity` says a name or index left to the config comes from.
FROM_CONFIG: Final = "the config"


def plugin_identity(
    config: Config,
    environ: Mapping[str, str],
    *,
    executable: str = "",
    name: str | None = None,
    index: str | None = None,
) -> Identity:
    """The plugin's name and index, worked out once for `run` and `config` alike by
    `nri_plugin.nri.identity.resolve_identity`: `name` and `index` (``--nri-plugin-name``,
    ``--nri-plugin-index``), then NRI's environment, then `executable` when named ``NN-name``, then
    the config (whose values `parse_config` has checked); and the connection the runtime handed
    over, if any. Raises `ConfigError` for what NRI's rules refuse, naming where it came from."""
    try:
        return resolve_identity(
            name=name,
            index=index,
            environ=environ,
            executable=executable,
            default_name=config.plugin_name,
            default_index=config.plugin_index,
            defaults_from=FROM_CONFIG,
            given_from="the command line",
        )
    except IdentityError as exc:
        raise ConfigError(str(exc)) from None


MAX_PORT: Final = 65535


def split_host_port(text: str) -> tuple[str, int] | None:
    """``"host:port"``, ``"[v6]:port"`` or ``":port"`` → (host, port), or None when `text` is none of
    them. ``":port"`` (Go's way of saying every address) gives the host "", which asyncio takes as
    every address of every family."""
    if metrics_address_problem(text) is not None:
        return None
    host, _, port = text.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


def metrics_address_problem(text: str) -> str | None:
    """What keeps `text` from being a listening address, in words, or None when it is one."""
    host, sep, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if not sep or not port.isdigit():
        return "it has no :port at the end"
    if (bracketed and not host) or any(c.isspace() or c in "/[]" for c in host) or not host.isprintable():
        return f"the host {_show(host)} is not a host name or address"
    if int(port) > MAX_PORT:
        return f"the port {port} is out of range (0 to {MAX_PORT})"
    return None


def _metrics_address(check: _Checker, value: object) -> str:
    """``host:port`` (``[v6]:port`` for IPv6, ``:port`` for every address), or "" for no
    metrics/probe endpoint. Port 0 picks a free port (the daemon logs the one it bound)."""
    text = check.string("metrics_address", value)
    if text == "":
        return text
    problem = metrics_address_problem(text)
    if problem is not None:
        raise check.error(
            "metrics_address",
            f'{_show(text)} is not host:port: {problem}; use e.g. "127.0.0.1:8891" (or "[::1]:8891", or '
            '":8891" for every address), or "" to turn metrics and probes off',
        )
    return text


def _seconds(check: _Checker, key: str, limits: tuple[float, float], hint: str, value: object) -> float:
    """A number of seconds within `limits`; `hint` ends the error."""
    low, high = limits
    if isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high:
        return float(value)
    raise check.error(key, f"{_show(value)} is not a number of seconds from {low:g} to {high:g}; {hint}")


def _max_synchronize_mib(check: _Checker, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SYNCHRONIZE_MIB:
        raise check.error(
            "max_synchronize_mib",
            f"{_show(value)} is not a whole number of MiB from 1 to {MAX_SYNCHRONIZE_MIB}; the default, "
            f"{DEFAULT_MAX_SYNCHRONIZE_MIB}, takes Synchronize messages of some 20,000 containers",
        )
    return value


def parse_config(document: Mapping[str, Any], *, source: str = "<config>") -> Config:
    """Check a parsed TOML document and build the `Config`; no file or machine access.

    Keys are checked in a fixed order (the required shared CPUs, the optional top-level keys, the
    tables, then the combinations), so that of several problems the same one is always reported.
    """
    check = _Checker(source)
    check.unknown(document, _TOP_KEYS, "")
    if "shared_cpuset" not in document:
        raise check.error("shared_cpuset", f"is required; set the node's shared CPUs, {_EXAMPLE}")
    config = Config(
        source=source,
        shared_cpuset=_shared_cpuset(check, document["shared_cpuset"]),
        **_optional_values(check, document),
        **_trusted_sources(check, document.get(_SOURCES_TABLE, {})),
        device_plugin=_table(
            check, _DEVICE_PLUGIN_TABLE, document.get(_DEVICE_PLUGIN_TABLE, {}), DevicePluginConfig
        ),
        dra=_table(check, _DRA_TABLE, document.get(_DRA_TABLE, {}), DraConfig),
    )
    _check_requests_provable(check, config)
    return config


def _optional_values(check: _Checker, document: Mapping[str, Any]) -> dict[str, Any]:
    """The optional top-level keys present in `document`, checked, by `Config` field name."""
    parsers: dict[str, Callable[[object], object]] = {
        "plugin_name": functools.partial(_plugin_name, check),
        "plugin_index": functools.partial(_plugin_index, check),
        **{key: functools.partial(check.path, key) for key in _PATH_KEYS},
        "numa_local_shared_cpus": functools.partial(check.boolean, "numa_local_shared_cpus"),
        "cgroup_version": functools.partial(check.choice, "cgroup_version", choices=CGROUP_VERSIONS),
        "log_level": functools.partial(check.choice, "log_level", choices=LOG_LEVELS),
        "log_format": functools.partial(check.choice, "log_format", choices=LOG_FORMATS),
        "metrics_address": functools.partial(_metrics_address, check),
        # Seconds between the reconciler's passes; seconds a CRI-O creation may run before it is
        # taken for failed (nri_plugin.mixedcpu.heal).
        "reconcile_interval": functools.partial(
            _seconds, check, "reconcile_interval", RECONCILE_INTERVAL_RANGE, "e.g. reconcile_interval = 30"
        ),
        "creation_timeout": functools.partial(
            _seconds,
            check,
            "creation_timeout",
            CREATION_TIMEOUT_RANGE,
            "take CRI-O's container_create_timeout (240 unless set) plus 60, e.g. creation_timeout = 300",
        ),
        "max_synchronize_mib": functools.partial(_max_synchronize_mib, check),
        # Seconds the NRI connection may be stuck before /healthz fails (nri_plugin.daemon.probes).
        "nri_stall_limit": functools.partial(
            _seconds,
            check,
            "nri_stall_limit",
            NRI_STALL_LIMIT_RANGE,
            "e.g. nri_stall_limit = 60 (keep it above the runtime's registration timeout, 5 s by default)",
        ),
        "systemd_bus": functools.partial(_systemd_bus, check),
    }
    return {key: parse(document[key]) for key, parse in parsers.items() if key in document}


def _systemd_bus(check: _Checker, value: object) -> str:
    """An absolute path, or "" for no bus at all."""
    if value == "":
        return ""
    return check.path("systemd_bus", value)


def _trusted_sources(check: _Checker, sources: object) -> dict[str, Any]:
    """The ``[trusted_sources]`` table's keys, checked, by `Config` field name."""
    if not isinstance(sources, Mapping):
        raise check.error(_SOURCES_TABLE, f"must be a table ([{_SOURCES_TABLE}]), not {_show(sources)}")
    check.unknown(sources, _SOURCE_KEYS, f"{_SOURCES_TABLE}.")
    return {
        attribute: check.boolean(f"{_SOURCES_TABLE}.{key}", sources[key])
        for key, attribute in _SOURCE_KEYS.items()
        if key in sources
    }


_Table = TypeVar("_Table", DevicePluginConfig, DraConfig)


def _table(check: _Checker, name: str, table: Any, kind: type[_Table]) -> _Table:
    """A table checked by its own config class (``[device_plugin]``, ``[dra]``); its unknown keys
    are refused as every other table's are, the nearest known key offered."""
    if isinstance(table, Mapping):
        check.unknown(table, tuple(f.name for f in fields(kind)), f"{name}.")
    try:
        return kind.from_table(table)
    except (DevicePluginConfigError, DraConfigError) as exc:
        raise ConfigError(f"{check.source}: {exc}") from None


def _check_requests_provable(check: _Checker, config: Config) -> None:
    """Some trusted source must be able to prove a request, or no container ever gets shared CPUs."""
    if not config.trust_device_plugin_marker and not config.trust_pod_annotation:
        raise check.error(
            _SOURCES_TABLE,
            "no request source is trusted, so no container could ever get shared CPUs; set "
            f"{_SOURCES_TABLE}.device_plugin_marker = true (our device plugin) or "
            f"{_SOURCES_TABLE}.pod_annotation = true (OpenShift's admission plugin)",
        )
    if config.dra.enabled and not config.trust_device_plugin_marker:
        raise check.error(
            f"{_SOURCES_TABLE}.device_plugin_marker",
            "is false while [dra] enabled = true: a DRA-prepared container proves its request with "
            "the same signed marker; set device_plugin_marker = true, or [dra] enabled = false",
        )
    if not config.device_plugin.enabled and not config.dra.enabled and not config.trust_pod_annotation:
        raise check.error(
            f"{_SOURCES_TABLE}.pod_annotation",
            "is false while [device_plugin] enabled = false, so nothing can prove a request: "
            "enable the device plugin (or [dra]), or set pod_annotation = true where an admission plugin "
            "adds cpu-shared.crio.io/<container> annotations",
        )


def online_cpus(sysfs_root: str) -> frozenset[int]:
    """The online CPUs listed in ``<sysfs_root>/devices/system/cpu/online``; `ConfigError` if unreadable."""
    path = os.path.join(sysfs_root, ONLINE_CPUS_FILE)
    try:
        with open(path, encoding="ascii") as file:
            text = file.read(65536)
        return cgroups.parse_cpuset(text)
    except (OSError, UnicodeDecodeError, CpusetError) as exc:
        raise ConfigError(
            f"sysfs_root: cannot read the online CPUs from {path}: {exc}; set sysfs_root to where the "
            "host's /sys is mounted"
        ) from None


def numa_nodes_from_cpulists(
    cpulists: Mapping[str, str], online: frozenset[int]
) -> dict[int, frozenset[int]]:
    """NUMA node id -> its online CPUs, from each node directory's name (``node1``) and the text of its
    ``cpulist``; other names are ignored. Raises `CpusetError` for a malformed list."""
    nodes: dict[int, frozenset[int]] = {}
    for name, text in cpulists.items():
        match = _NUMA_NODE.fullmatch(name)
        if match is not None:
            nodes[int(match[1])] = cgroups.parse_cpuset(text.strip()) & online
    return dict(sorted(nodes.items()))


def read_numa_nodes(sysfs_root: str, online: frozenset[int]) -> dict[int, frozenset[int]]:
    """NUMA node id -> its online CPUs, from ``<sysfs_root>/devices/system/node/node*/cpulist``. A kernel
    built without NUMA lists no nodes: then one node 0 holds every online CPU. `ConfigError` when a
    list cannot be read."""
    directory = os.path.join(sysfs_root, NUMA_NODES_DIR)
    try:
        names = [name for name in os.listdir(directory) if _NUMA_NODE.fullmatch(name)]
    except FileNotFoundError:
        names = []
    except OSError as exc:
        raise _numa_error(directory, exc) from None
    nodes: dict[int, frozenset[int]] = {}
    for name in names:
        path = os.path.join(directory, name, "cpulist")
        try:
            with open(path, encoding="ascii") as file:
                nodes.update(numa_nodes_from_cpulists({name: file.read(65536)}, online))
        except (OSError, UnicodeDecodeError, CpusetError) as exc:
            raise _numa_error(path, exc) from None
    return dict(sorted(nodes.items())) or {0: online}


def _numa_error(path: str, exc: Exception) -> ConfigError:
    return ConfigError(
        f"sysfs_root: cannot read the NUMA nodes' CPUs from {path}: {exc}; set sysfs_root to where the "
        "host's /sys is mounted, or numa_local_shared_cpus = false"
    )


def check_machine(config: Config) -> frozenset[int]:
    """Check the configuration against this machine: every shared CPU online, some CPU left over.
    Returns the online CPUs."""
    online = online_cpus(config.sysfs_root)
    offline = config.shared_cpuset - online
    if offline:
        raise ConfigError(
            f"{config.source}: shared_cpuset: CPUs {cgroups.format_cpuset(offline)} are not online "
            f"(online: {cgroups.format_cpuset(online) or 'none'}, from "
            f"{os.path.join(config.sysfs_root, ONLINE_CPUS_FILE)}); list online CPUs only"
        )
    if not online - config.shared_cpuset:
        raise ConfigError(
            f"{config.source}: shared_cpuset: {config.shared_cpuset_text} is every online CPU, which leaves "
            "none to be exclusive; keep the shared pool to a few CPUs"
        )
    return online


def load_config(path: str | os.PathLike[str] = DEFAULT_CONFIG_PATH, *, check: bool = True) -> Config:
    """Read, parse and validate the TOML file at `path` (and check it against the machine)."""
    source = os.fspath(path)
    config = parse_config(read_document(source), source=source)
    if check:
        check_machine(config)
    return config


def read_document(source: str) -> dict[str, Any]:
    """The TOML document in the file at `source`, not yet checked (`parse_config` does that).
    Raises `ConfigMissing` when there is no such file, `ConfigError` when it cannot be read or is
    no TOML."""
    try:
        data = _read_config_file(source)
    except NotRegularFile as exc:
        raise ConfigError(
            f"{source}: a {exc.kind}, not a regular file: no config is read from one; point --config at "
            "the config file"
        ) from None
    except TooLarge:
        raise ConfigError(
            f"{source}: larger than {MAX_CONFIG_SIZE} bytes, which no config is; is it the right file?"
        ) from None
    except FileNotFoundError:
        raise ConfigMissing(
            f"{source}: no such file; create it with at least shared_cpuset set ({_EXAMPLE}), "
            "or pass --config PATH"
        ) from None
    except OSError as exc:
        raise ConfigError(_unreadable(source, exc)) from None
    try:
        text = data.decode("utf-8")
        document = tomllib.loads(text)
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not UTF-8 text; save the config file as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}; {_toml_fix(text, exc)}") from None
    except RecursionError:
        # tomllib parses nested arrays and inline tables recursively.
        raise ConfigError(
            f"{source}: not valid TOML: arrays or inline tables nested too deeply; fix the syntax there"
        ) from None
    return document


def _read_config_file(source: str) -> bytes:
    """The bytes of the config file; `TooLarge` past `MAX_CONFIG_SIZE`. Opened without waiting
    (a FIFO with no writer would block the open, and then the read, for ever) and refused unless it
    is a regular file: a FIFO, a device or a directory is `NotRegularFile`, at once. A symbolic link
    is followed (a ConfigMap's file is one)."""
    fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(info.st_mode)
        return read_capped(fd, MAX_CONFIG_SIZE)
    finally:
        os.close(fd)


def _unreadable(source: str, exc: OSError) -> str:
    """Why the config file cannot be read, and the fix; for a permission denied, who may read it."""
    problem = f"{source}: cannot read the config file: {exc.strerror}"
    if exc.errno not in (errno.EACCES, errno.EPERM):
        return problem
    uid = os.geteuid()
    if uid == 0:
        return f"{problem}, even to root: a security policy (SELinux, AppArmor) denies it; see the audit log"
    fix = "run as root, as the daemon runs"
    try:
        info = os.stat(source)
    except OSError:
        return f"{problem} to uid {uid}, which may not search a directory on its way; {fix}"
    mode = stat.S_IMODE(info.st_mode)
    readers = ["root"]
    if mode & stat.S_IRUSR and info.st_uid != 0:
        readers.append(f"uid {info.st_uid}")
    if mode & stat.S_IRGRP:
        readers.append(f"group {info.st_gid}")
    return (
        f"{problem} to uid {uid}: mode {mode:04o}, owner uid {info.st_uid}, so only {' and '.join(readers)} "
        f"may read it; {fix}, or let uid {uid} read it (chmod o+r {source})"
    )


_TOML_LINE: Final = re.compile(r"at line ([0-9]+)")
# key = value, the value unquoted (not a string, array or table), up to a comment.
_BARE_VALUE: Final = re.compile(r"\s*([A-Za-z0-9_-]+)\s*=\s*([^\s\"'\[{#][^#]*?)\s*(#.*)?")


def _toml_fix(text: str, exc: tomllib.TOMLDecodeError) -> str:
    """The fix for a TOML syntax error: to quote an unquoted string (a cpu list 0-1, a word) on the
    line the error names, else to fix the syntax there."""
    line_number = _TOML_LINE.search(str(exc))
    lines = text.splitlines()
    if line_number is None or not 0 < int(line_number[1]) <= len(lines):
        return "fix the syntax there"
    match = _BARE_VALUE.fullmatch(lines[int(line_number[1]) - 1])
    if match is None:
        return "fix the syntax there"
    key, value = match[1], match[2]
    try:
        tomllib.loads(f"value = {value}")
    except tomllib.TOMLDecodeError:
        what = "a cpu list" if key == "shared_cpuset" else "text"
        return f"{what} is a string in TOML: quote it, {key} = {_show(value)}"
    return "fix the syntax there"


def build_layout(config: Config, *, mountinfo_path: str = DEFAULT_MOUNTINFO) -> CgroupLayout:
    """The cgroup layout the plugin works in: detected from mountinfo, or forced by cgroup_version.

    A forced version must not contradict the mounts: when mountinfo shows cgroup hierarchies under
    cgroup_root serving cpu or cpuset in the other version, the config is refused (a v2 layout on
    a v1 host would write files that do not exist there, or worse, ones that mean something else).
    """
    if config.cgroup_version == "auto":
        try:
            return cgroups.read_layout(mountinfo_path=mountinfo_path, root=config.cgroup_root)
        except CgroupModeError as exc:
            raise ConfigError(
                f'{config.source}: cgroup_root: {exc}; or set cgroup_version = "v1" or "v2" to skip detection'
            ) from None
    layout = _forced_layout(config)
    _check_forced_version(config, layout, mountinfo_path)
    return layout


def _forced_layout(config: Config) -> CgroupLayout:
    root = config.cgroup_root
    if config.cgroup_version == "v1":
        cpu, cpuset = Hierarchy(1, os.path.join(root, "cpu")), Hierarchy(1, os.path.join(root, "cpuset"))
        layout = CgroupLayout(CgroupMode.V1, cpu, cpuset)
    else:
        layout = CgroupLayout(CgroupMode.V2, Hierarchy(2, root), Hierarchy(2, root))
    for hierarchy in (layout.cpu, layout.cpuset):
        if not os.path.isdir(hierarchy.mount_point):
            raise ConfigError(
                f"{config.source}: cgroup_root: {hierarchy.mount_point} is not a directory, but "
                f'cgroup_version = "{config.cgroup_version}" expects one; fix cgroup_root, or set '
                'cgroup_version = "auto" to detect the mounts'
            )
    return layout


def _check_forced_version(config: Config, layout: CgroupLayout, mountinfo_path: str) -> None:
    """Refuse a forced version that the mounts under cgroup_root contradict. Mounts that cannot be
    read, or none under cgroup_root (a tree mounted where mountinfo does not show it: what forcing
    is for), leave the forced version as it is."""
    try:
        with open(mountinfo_path, encoding="utf-8", errors="surrogateescape") as file:
            mounted = cgroups.detect_layout(file.read(), root=config.cgroup_root)
    except (OSError, CgroupModeError):
        return
    forced = layout.cpu.version
    for name, hierarchy in (("cpu", mounted.cpu), ("cpuset", mounted.cpuset)):
        if hierarchy.version != forced:
            actual = f"v{hierarchy.version}"
            raise ConfigError(
                f'{config.source}: cgroup_version: "{config.cgroup_version}" is forced, but {mountinfo_path} '
                f"shows the {name} controller served by a cgroup {actual} hierarchy at "
                f'{hierarchy.mount_point}; set cgroup_version = "auto" (or "{actual}")'
            )


def state_dir_problem(path: str) -> str | None:
    """Why `path` is no place for the daemon's books and signing key, or None.

    Anyone who can write the state directory can replace the key that proves requests, or the
    books that say which pod quotas were raised. So it must belong to this user (root, in
    production) and be writable by nobody else. A directory that does not exist yet is fine: the
    daemon creates it, mode 0700.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot look at {path}: {exc.strerror}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    if info.st_uid != os.geteuid():
        return f"{path} belongs to uid {info.st_uid}, not to uid {os.geteuid()} that runs the daemon"
    writers = [
        who for who, bit in (("its group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if info.st_mode & bit
    ]
    if writers:
        return (
            f"{path} is writable by {' and '.join(writers)} (mode {stat.S_IMODE(info.st_mode):04o}); "
            f"chmod 0700 {path}"
        )
    return None
