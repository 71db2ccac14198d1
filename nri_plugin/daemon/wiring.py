"""The daemon's wiring: every part built from the config, each in one function, and put together by
`build_daemon` in the order they depend on each other.

1. the config, read and checked, then logging as it says, then the cgroup layout; then the node's
   one-daemon lock in state_dir (`nri_plugin.daemon.instance`), before any file there is read;
   then the state dir's format (`nri_plugin.daemon.stateformat`: one a newer daemon wrote is refused);
2. the metrics, first of the parts: each part that reports to them is built with them as its
   observer (none is given one afterwards);
3. the node's marker key, kubelet's PodResources client (the record that proves a marker's
   holder), the pod quota writer (through systemd for pods that are systemd slices, when the config
   names a bus), then the mixed-CPU plugin (which checks markers with the key and the record);
4. the NRI stub serving that plugin;
5. the kubelet device plugin (which signs markers with the same key), and with ``[dra] enabled`` the
   DRA front door (its CDI specs carry markers signed with the same key);
6. the probe server, and the gauges bound to the parts they read at scrape time; the status socket;
7. the not-ready warnings, which read what ``/readyz`` reads, metrics or not.

A config problem is a `DaemonError` with exit status 2, one line the command line prints. Whatever
is configured counts, wherever it comes from: the config file, the options (``--nri-plugin-index``)
and the environment (``NRI_PLUGIN_IDX``, ``NRI_PLUGIN_SOCKET``) are all checked here, before any part
is built, so a systemd unit that does not restart on status 2 does not restart-loop on them either.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

import structlog

from nri_plugin.cgroups import CgroupLayout, format_cpuset
from nri_plugin.common.buildinfo import version_line
from nri_plugin.daemon.app import EXIT_CONFIG, NRI_ENDED, Daemon, DaemonError, Service
from nri_plugin.daemon.config import (
    DEFAULT_CONFIG_PATH,
    Config,
    ConfigError,
    build_layout,
    load_config,
    online_cpus,
    plugin_identity,
    read_numa_nodes,
    state_dir_problem,
)
from nri_plugin.daemon.instance import (
    InstanceLock,
    InstanceLockError,
    LockWatch,
    NoNodeLock,
    lock_node,
    lock_state_dir,
)
from nri_plugin.daemon.logs import configure_logging
from nri_plugin.daemon.metrics import Metrics
from nri_plugin.daemon.probes import NotReadyWarnings, ProbeError, ProbeServer, liveness, readiness
from nri_plugin.daemon.stateformat import STATE_FORMAT, StateFormatError, settle_state_format
from nri_plugin.daemon.status import StatusParts, StatusServer, status_document, status_socket_path
from nri_plugin.deviceplugin.keyfile import HostKeyError, load_or_create_host_key
from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.deviceplugin.podresources import DraDevices, PodResourcesClient
from nri_plugin.deviceplugin.server import DevicePluginServer
from nri_plugin.dra import slices
from nri_plugin.dra.kubeletplugin import DraPluginError
from nri_plugin.mixedcpu.allocations import AllocationRecord
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin, TrustedSources
from nri_plugin.mixedcpu.policy import SharedPool, shared_by_node
from nri_plugin.mixedcpu.quota import PodQuotaWriter
from nri_plugin.mixedcpu.store import StateStore
from nri_plugin.nri.identity import SOCKET_VARIABLE, Identity
from nri_plugin.nri.stub import Stub, StubError
from nri_plugin.systemd.podquota import SystemdPodQuotaWriter

if TYPE_CHECKING:
    from nri_plugin.dra.frontdoor import DraFrontDoor

__all__ = [
    "LAUNCHED_ENDED",
    "RunOptions",
    "bind_gauges",
    "build_allocation_record",
    "build_daemon",
    "build_device_plugin",
    "build_dra",
    "build_metrics",
    "build_plugin",
    "build_probes",
    "build_quota_writer",
    "build_status_server",
    "build_stub",
    "load_marker_key",
    "load_settings",
    "shared_pool",
    "take_instance_locks",
]

log = structlog.get_logger("nri_plugin.daemon.wiring")

# The end of a daemon the runtime started itself: its connection was the runtime's to give, and
# the runtime starts it again when it starts again.
LAUNCHED_ENDED = (
    "the runtime closed the connection it started the plugin with (NRI_PLUGIN_SOCKET); a plugin "
    "the runtime launches does not reconnect: the runtime starts it again when it starts again"
)


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """What ``run``'s command line adds to the config file; each one given wins over the config."""

    config_path: str = DEFAULT_CONFIG_PATH
    socket: str | None = None
    plugin_name: str | None = None
    plugin_index: str | None = None
    reconnect: bool = True
    log_level: str | None = None
    # The node-wide lock, and a watch on the locks while it runs: the command line's daemon takes
    # them; a daemon built in a test's own process (several, one after another) does not.
    node_lock: bool = False
    # The path the program was started by (argv[0]): a plugin file's ``NN-name`` names the plugin.
    executable: str = ""


def build_daemon(options: RunOptions, *, environ: Mapping[str, str] | None = None) -> Daemon:
    """The daemon as `options` and its config file describe it, ready to `run()`.

    `environ` (default: the process's) supplies NRI_PLUGIN_NAME, NRI_PLUGIN_IDX, NRI_PLUGIN_SOCKET
    and NODE_NAME; it is read here only, and what it says is handed to the parts. Raises `DaemonError`.
    """
    env = os.environ if environ is None else environ
    try:
        config, layout = load_settings(options, node=env.get("NODE_NAME"))
        lock_watch = take_instance_locks(config, options)
        say_state_format = settle_state_dir_format(config)
        identity = plugin_identity(
            config, env, executable=options.executable, name=options.plugin_name, index=options.plugin_index
        )
        metrics = build_metrics(config)
        key = load_marker_key(config)
        record = build_allocation_record(config, key, observer=metrics, environ=env)
        writer = build_quota_writer(config)
        plugin = build_plugin(config, layout, key, allocations=record, observer=metrics, writer=writer)
        if key is not None:
            # New allocations numbered above every one the books hold, whatever the clock did.
            key.raise_floor(plugin.books.newest_allocation())
        stub = build_stub(
            plugin,
            identity,
            options,
            socket_path=_connection(identity, options, config),
            max_sync_bytes=config.max_synchronize_mib << 20,
            observer=metrics,
        )
        plugin.send_updates = stub.update_containers  # grants that wait for a binding's end
        device_plugin = build_device_plugin(config, key, observer=metrics)
        dra = build_dra(config, key, env)
        probes = build_probes(config, metrics, stub, device_plugin, dra)
    except (ConfigError, StubError, ProbeError) as exc:
        raise DaemonError(str(exc), EXIT_CONFIG) from None
    if metrics is not None:
        bind_gauges(metrics, stub, plugin, device_plugin, dra)
    _log_start(config, layout, stub)
    say_state_format()  # once the daemon is built: a start that fails stays one line
    _log_numa(plugin.pool)
    if record is not None:
        record.log_start()
    # Started in this order and closed in the reverse: a port already taken fails the start before
    # kubelet or the runtime ever see us.
    # The bus first: the pod quotas go through systemd from the first event on when it is there.
    services: list[Service] = [part for part in (writer, probes, device_plugin, dra) if part is not None]
    services.append(build_status_server(config, options, plugin, stub, device_plugin, dra))
    if options.node_lock:
        services.append(lock_watch)
    services.append(NotReadyWarnings(readiness(stub, device_plugin, dra)))
    ended = LAUNCHED_ENDED if identity.inherited_fd is not None else NRI_ENDED
    return Daemon(stub, services=services, state=plugin, nri_ended=ended)


def load_settings(options: RunOptions, *, node: str | None = None) -> tuple[Config, CgroupLayout]:
    """The checked config, logging set up as it says (for good; every line naming `node` when
    given), and the cgroup layout. Raises `ConfigError`."""
    config = load_config(options.config_path)
    # For good: each logger is cached at its first use (the level still follows SIGUSR1).
    configure_logging(
        options.log_level or config.log_level, config.log_format, cache_loggers=True, node=node or None
    )
    return config, build_layout(config)


def _connection(identity: Identity, options: RunOptions, config: Config) -> str:
    """Where the stub's connection comes from: the runtime's socket, or the one it handed over."""
    if identity.inherited_fd is not None:
        return f"fd {identity.inherited_fd} from the runtime ({SOCKET_VARIABLE})"
    return options.socket or config.nri_socket


def take_instance_locks(config: Config, options: RunOptions) -> LockWatch:
    """The one-daemon-per-node locks, held until the process ends, and the watch on them: with
    `options.node_lock`, the node's, beside the NRI socket (the config's even when the runtime
    launched us: another daemon would connect there; taken later when the runtime has not made its
    directory yet); then the state dir's. Raises `DaemonError` with exit status 2 when another
    daemon holds one (or it cannot be taken)."""
    socket_path = options.socket or config.nri_socket
    locks: list[InstanceLock] = []
    pending = None
    try:
        if options.node_lock:
            try:
                locks.append(lock_node(socket_path, options.config_path))
            except NoNodeLock as exc:
                if exc.later:
                    pending = functools.partial(lock_node, socket_path, options.config_path)
                else:
                    log.warning(
                        "no node-wide lock: a second daemon with another state_dir would not be refused",
                        problem=str(exc),
                        fix="mount the NRI socket's directory read-write",
                    )
        locks.append(lock_state_dir(config.state_dir, options.config_path))
    except InstanceLockError as exc:
        raise DaemonError(str(exc), EXIT_CONFIG) from None
    return LockWatch(locks, pending=pending)


def settle_state_dir_format(config: Config) -> Callable[[], None]:
    """The state dir's format checked before anything in it is read, and recorded as this version
    writes it (`nri_plugin.daemon.stateformat`): a state dir a newer daemon laid out is refused.
    Returns what to log once the daemon is built (so that a start that fails stays one line): the
    record written, or why it could not be (a state dir that cannot be written fails later, where
    the books or the key say why). Raises `ConfigError` (exit status 2, one line saying what to do)."""
    problem = state_dir_problem(config.state_dir)
    if problem is not None:
        raise _state_dir_error(config, problem)
    try:
        written = settle_state_format(config.state_dir, version_line())
    except StateFormatError as exc:
        raise ConfigError(f"{config.source}: state_dir: {exc}") from None
    except OSError as exc:
        return functools.partial(
            log.warning, "state dir format not recorded", state_dir=config.state_dir, problem=str(exc)
        )
    if not written:
        return lambda: None
    return functools.partial(
        log.info, "state dir format recorded", state_dir=config.state_dir, state_format=STATE_FORMAT
    )


def build_metrics(config: Config) -> Metrics | None:
    """The metrics every part reports to, or None when they are not served (metrics_address "")."""
    return Metrics() if config.metrics_address else None


def load_marker_key(config: Config) -> HostKey | None:
    """The node's marker key in state_dir (created at the first start), or None when device-plugin
    markers are not trusted. Raises `ConfigError` when it cannot be used, or when state_dir is not
    the daemon's alone (anyone who may write there could plant a key of their own)."""
    problem = state_dir_problem(config.state_dir)
    if problem is not None:
        raise _state_dir_error(config, problem)
    if not config.trust_device_plugin_marker:
        return None
    try:
        return load_or_create_host_key(config.state_dir)
    except (HostKeyError, OSError) as exc:
        raise _state_dir_error(config, exc) from None


def build_allocation_record(
    config: Config,
    key: HostKey | None,
    *,
    observer: Metrics | None = None,
    environ: Mapping[str, str] = MappingProxyType({}),
) -> PodResourcesClient | None:
    """kubelet's PodResources client, when our markers are trusted, one of the front doors hands
    them out (the device plugin, or DRA: then the client also counts kubelet's DRA devices of our
    driver) and [device_plugin] pod_resources_socket is set (whether it can be asked is logged once
    the whole daemon is built)."""
    device_plugin = config.device_plugin
    handed_out = device_plugin.enabled or config.dra.enabled
    if key is None or not handed_out or device_plugin.pod_resources_socket is None:
        return None
    dra = config.dra.enabled
    return PodResourcesClient(
        str(device_plugin.pod_resources_socket),
        device_plugin.resource_name,
        # Our driver's devices prove a request only from our pool (the node) and among those published.
        dra=DraDevices(
            config.dra.driver_name,
            dra_node_name(config, environ),
            frozenset(slices.device_names(device_plugin.device_count)),
        )
        if dra
        else None,
        observer=observer,
    )


def build_quota_writer(config: Config) -> SystemdPodQuotaWriter | None:
    """The pod quota writer that sets the quota of pods that are systemd slices through systemd on
    the bus systemd_bus names (a service: it connects at start); None when systemd_bus is ""."""
    return SystemdPodQuotaWriter(config.systemd_bus) if config.systemd_bus else None


def build_plugin(
    config: Config,
    layout: CgroupLayout,
    key: HostKey | None,
    *,
    allocations: AllocationRecord | None = None,
    observer: Metrics | None = None,
    writer: PodQuotaWriter | None = None,
) -> MixedCpuPlugin:
    """The mixed-CPU plugin as `config` describes it, its books loaded from state_dir, asking
    `allocations` (kubelet's record) about the markers it is shown, its pod quotas written by
    `writer` (default: the cgroup files); the saved books' numbers checked against the online CPUs.
    Raises `ConfigError` when state_dir or sysfs_root cannot be used."""
    pool = shared_pool(config)
    try:
        online = len(online_cpus(config.sysfs_root))
    except ConfigError as exc:
        raise ConfigError(f"{config.source}: {exc}") from None
    try:
        plugin = MixedCpuPlugin(
            shared=pool,
            layout=layout,
            store=StateStore(config.state_dir, online=online),
            trusted=TrustedSources(key, config.trust_pod_annotation, allocations),
            observer=observer,
            reconcile_interval=config.reconcile_interval,
        )
    except OSError as exc:
        raise _state_dir_error(config, exc) from None
    if writer is not None:
        plugin.quotas.writer = writer
    plugin.healer.creation_timeout = config.creation_timeout
    plugin.creations = observer
    return plugin


def shared_pool(config: Config) -> SharedPool:
    """The shared CPUs as the plugin hands them out: with numa_local_shared_cpus, with the NUMA nodes'
    online CPUs (read from sysfs_root now, passed on as plain data). Raises `ConfigError`."""
    if not config.numa_local_shared_cpus:
        return SharedPool(config.shared_cpuset)
    try:
        nodes = read_numa_nodes(config.sysfs_root, online_cpus(config.sysfs_root))
    except ConfigError as exc:
        raise ConfigError(f"{config.source}: {exc}") from None
    return SharedPool(config.shared_cpuset, MappingProxyType(nodes))


def _state_dir_error(config: Config, problem: object) -> ConfigError:
    return ConfigError(
        f"{config.source}: state_dir: {problem}; point state_dir at a directory only root can write"
    )


def build_stub(
    plugin: MixedCpuPlugin,
    identity: Identity,
    options: RunOptions,
    *,
    socket_path: str,
    max_sync_bytes: int,
    observer: Metrics | None = None,
) -> Stub:
    """The NRI stub serving `plugin` as `identity`, on `socket_path`, refusing a Synchronize larger
    than `max_sync_bytes`. Raises `StubError`."""
    stub = Stub(
        plugin,
        identity=identity,
        # With a connection handed over, the stub never dials and uses the path only in its log
        # lines: there it names the connection it really has (`_connection`).
        socket_path=socket_path,
        reconnect=options.reconnect,
        observer=observer,
    )
    stub.max_sync_bytes = max_sync_bytes
    return stub


def build_device_plugin(
    config: Config, key: HostKey | None, *, observer: Metrics | None = None
) -> DevicePluginServer | None:
    """The kubelet device plugin, when [device_plugin] enables it and markers are trusted (it hands
    out markers signed with `key`); else None."""
    if not config.device_plugin.enabled or key is None:
        return None
    return DevicePluginServer(config.device_plugin, key, observer=observer)


# What the [dra] extra installs (lightkube, and httpx2 under it): a daemon without them runs, DRA off.
DRA_CLIENT_MODULES: Final = frozenset({"lightkube", "httpx2"})


def dra_node_name(config: Config, environ: Mapping[str, str]) -> str:
    """The DRA pool's name: [dra] node_name, else NODE_NAME. Raises `ConfigError` when neither is set."""
    node_name = config.dra.node_name or environ.get("NODE_NAME", "")
    if not node_name:
        raise ConfigError(
            f"{config.source}: [dra] enabled = true needs the node's name: set NODE_NAME from the "
            "pod's spec.nodeName (the chart does), or [dra] node_name"
        )
    return node_name


def build_dra(config: Config, key: HostKey | None, environ: Mapping[str, str]) -> DraFrontDoor | None:
    """The DRA front door, when [dra] enables it (the config made sure markers are trusted then);
    else None. Its node is [dra] node_name, else NODE_NAME. Raises `ConfigError`."""
    if not config.dra.enabled or key is None:
        return None
    node_name = dra_node_name(config, environ)
    try:
        from nri_plugin.dra.frontdoor import DraFrontDoor  # lightkube and httpx2: only when DRA is on
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in DRA_CLIENT_MODULES:
            raise
        raise ConfigError(
            f"{config.source}: [dra] enabled = true needs the DRA client libraries, which this "
            f"installation lacks (no module {exc.name}): pip install 'mixed-cpu-nri-plugin[dra]' "
            "(the image has them), or set [dra] enabled = false"
        ) from None
    try:
        return DraFrontDoor(
            config.dra, key, node_name=node_name, device_count=config.device_plugin.device_count
        )
    except (ValueError, DraPluginError) as exc:
        raise ConfigError(f"{config.source}: [dra] {exc}") from None


def build_probes(
    config: Config,
    metrics: Metrics | None,
    stub: Stub,
    device_plugin: DevicePluginServer | None,
    dra: DraFrontDoor | None = None,
) -> ProbeServer | None:
    """``/metrics``, ``/healthz`` (failing once the NRI connection is stuck for nri_stall_limit
    seconds) and ``/readyz`` on metrics_address (None when that is ""). Raises `ProbeError`."""
    if metrics is None:
        return None
    return ProbeServer(
        config.metrics_address,
        metrics=metrics.render,
        readiness=readiness(stub, device_plugin, dra),
        liveness=liveness(stub, config.nri_stall_limit),
        observer=metrics,
    )


def build_status_server(
    config: Config,
    options: RunOptions,
    plugin: MixedCpuPlugin,
    stub: Stub,
    device_plugin: DevicePluginServer | None,
    dra: DraFrontDoor | None = None,
) -> StatusServer:
    """The status socket in state_dir, for ``mixed-cpu-nri-plugin status``."""
    parts = StatusParts(plugin, stub, device_plugin, options.config_path, config.state_dir, dra)
    return StatusServer(status_socket_path(config.state_dir), functools.partial(status_document, parts))


def bind_gauges(
    metrics: Metrics,
    stub: Stub,
    plugin: MixedCpuPlugin,
    device_plugin: DevicePluginServer | None,
    dra: DraFrontDoor | None = None,
) -> None:
    """Point the gauges read at scrape time at the parts that know their values."""
    metrics.track(nri_ready=stub.ready.is_set, shared_containers=lambda: plugin.shared_containers)
    if device_plugin is not None:
        metrics.track(kubelet_registered=lambda: device_plugin.registered)
    if dra is not None:
        metrics.track(
            dra_registered=lambda: dra.registered, dra_resource_slices_published=lambda: bool(dra.published)
        )
    record = plugin.allocations
    metrics.features(
        device_plugin=device_plugin is not None,
        pod_resources=isinstance(record, PodResourcesClient),
        dra=dra is not None,
        dra_publishing=dra is not None and dra.publisher is not None,
    )
    if isinstance(record, PodResourcesClient):
        metrics.track(
            pod_resources_reachable=lambda: record.answering,
            pod_resources_degraded=lambda: record.degraded,
        )


def _log_start(config: Config, layout: CgroupLayout, stub: Stub) -> None:
    trusted = (
        ("device-plugin-marker", config.trust_device_plugin_marker),
        ("pod-annotation", config.trust_pod_annotation),
    )
    log.info(
        "starting",
        config=config.source,
        plugin=stub.identity.full_name,
        socket=stub.socket_path,
        shared_cpuset=config.shared_cpuset_text,
        cgroup_mode=layout.mode.value,
        cpu_hierarchy=layout.cpu.mount_point,
        trusted_sources=[name for name, on in trusted if on],
    )


def _log_numa(pool: SharedPool) -> None:
    """With NUMA-local shared CPUs: the pool by node, and a warning for each node that has none."""
    if pool.numa_nodes is None:
        return
    split = shared_by_node(pool.cpus, pool.numa_nodes)
    log.info(
        "shared CPUs are NUMA-local: each container gets those on the nodes of its exclusive CPUs",
        shared_by_numa_node={str(node): format_cpuset(cpus) or "none" for node, cpus in split.items()},
    )
    for node, cpus in split.items():
        if not cpus:
            log.warning(
                "a NUMA node has no shared CPU: containers whose exclusive CPUs are all on it get the whole "
                "shared pool; add some of its CPUs to shared_cpuset (and to kubelet's reservedSystemCPUs)",
                numa_node=node,
                node_cpus=format_cpuset(pool.numa_nodes[node]),
            )
