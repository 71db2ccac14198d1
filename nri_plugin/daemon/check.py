"""``mixed-cpu-nri-plugin check``: is the config right, and is this node ready for the daemon?

Each check returns a `Finding` (OK, WARN or FAIL, what was seen, and for WARN and FAIL how to fix
it); `run_checks` gathers them into a `Report` that renders as text, one line per check. Nothing is
changed on the node: files are read and stat'ed, never written. The one thing done beyond reading
is a connection to the NRI socket, closed at once: a socket file alone does not say whether a
runtime still listens on it (a stopped containerd leaves its socket behind). The runtime may log
that connection as a plugin that never registered.

What is checked:

* the config file loads (the same `ConfigError` line ``run`` would stop with); when it does not,
  the rest is still checked, with its valid keys (or the defaults, without a file or with one that
  is no TOML), and the report says so;
* the shared CPUs are online and leave some CPUs over;
* with ``numa_local_shared_cpus``: the shared CPUs of each NUMA node (a node with none is a warning:
  containers on it get the whole pool);
* the NRI socket exists, is a socket, and a runtime accepts connections on it;
* the cgroup mode (v1, hybrid, v2) and the hierarchies that serve ``cpu`` and ``cpuset``, and that
  a forced ``cgroup_version`` agrees with the mounts;
* kubelet's cgroup driver, from the top cgroup kubelet made: ``kubepods.slice`` (systemd) or
  ``kubepods`` (cgroupfs), compared with the ``cgroupDriver`` of kubelet's config when given;
* under the systemd driver, that systemd answers on ``systemd_bus`` (else a WARN: the pod quotas of
  systemd slices are then written to their cgroup files, which systemd puts back at its next
  ``daemon-reload``); nothing is said when ``systemd_bus`` is "" (the operator's choice);
* the state directory is root's alone (or can be created): it holds the key that signs requests;
* kubelet's device-plugin directory is there and ours to write, when the device plugin is enabled;
* with ``[dra] enabled``: kubelet's plugin-registry and plugins directories are there and ours to
  write, the CDI directory is (or can be made), the node's name is known (``node_name`` or
  ``NODE_NAME``), and there are credentials for the API server (a kubeconfig, or the pod's service
  account); and, when a running daemon's ``status`` names its runtime, that the runtime reads our
  CDI specs (containerd 1.7.12 or later: docs/dra.md, "Which runtimes read our CDI specs");
* kubelet's pod-resources socket: a warning (one line) when it is not there or not asked, since the
  allocation marker alone then proves requests (a copied marker is refused only if another container
  presented its allocation first); nothing when it is there;
* with kubelet's config file (``KubeletConfiguration`` YAML): ``reservedSystemCPUs`` is a cpu list
  kubelet accepts and holds the shared CPUs (else kubelet may hand them out as exclusive CPUs), and
  ``cpuManagerPolicy`` is ``static`` (else no container has exclusive CPUs, and none can ask for
  shared ones). Either failing means the feature cannot work: FAIL, not WARN.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import os
import re
import socket
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import yaml

from nri_plugin import cgroups
from nri_plugin.cgroups import CgroupLayout, CgroupMode, CpusetError
from nri_plugin.cgroups.mode import DEFAULT_MOUNTINFO
from nri_plugin.daemon.config import (
    DEFAULT_CONFIG_PATH,
    Config,
    ConfigError,
    ConfigMissing,
    build_layout,
    check_machine,
    load_config,
    online_cpus,
    parse_config,
    read_document,
    read_numa_nodes,
    state_dir_problem,
)
from nri_plugin.daemon.status import status_socket_path
from nri_plugin.daemon.status_client import StatusError, fetch_status
from nri_plugin.deviceplugin.config import DEFAULT_POD_RESOURCES_SOCKET, DevicePluginConfig
from nri_plugin.deviceplugin.podresources import get_served, socket_state
from nri_plugin.dra.config import DraConfig
from nri_plugin.mixedcpu.policy import shared_by_node
from nri_plugin.systemd import bus as dbus

__all__ = [
    "Finding",
    "Report",
    "Status",
    "check_cdi_runtime",
    "check_cgroup_driver",
    "check_cgroups",
    "check_device_plugin_dir",
    "check_dra",
    "check_kubelet_config",
    "check_nri_socket",
    "check_numa_nodes",
    "check_pod_resources",
    "check_shared_cpus",
    "check_state_dir",
    "check_systemd_bus",
    "drivers_in",
    "run_checks",
]

SYSTEMD_TOP: Final = "kubepods.slice"
CGROUPFS_TOP: Final = "kubepods"
KUBELET_CONFIG_HINT: Final = "kubelet's --config file, often /var/lib/kubelet/config.yaml"
_TOPIC_WIDTH: Final = 22
# Where a pod's service account credentials are mounted (what an in-cluster client reads).
SERVICE_ACCOUNT_TOKEN: Final = "/var/run/secrets/kubernetes.io/serviceaccount/token"
_BUS_DAEMON: Final = "org.freedesktop.DBus"
_BUS_DAEMON_PATH: Final = "/org/freedesktop/DBus"
# The first containerd that reads the CDI specs our DRA driver writes (cdiVersion 0.6.0, device
# annotations): 1.7.0-1.7.11 vendor a CDI library that knows specs up to 0.5.0 and refuses them.
CONTAINERD_CDI_FLOOR: Final = (1, 7, 12)
_VERSION: Final = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")
# A runtime answers a connection on its NRI socket at once; this only bounds a wedged one.
CONNECT_TIMEOUT: Final = 2.0
_NRI_FIX: Final = (
    "enable NRI in the runtime and restart it: containerd 1.7 needs "
    '[plugins."io.containerd.nri.v1.nri"] disable = false in /etc/containerd/config.toml (2.x has it '
    "on by default), CRI-O [crio.nri] enable_nri = true in a /etc/crio/crio.conf.d/ drop-in; in a pod, "
    "mount the host's /var/run/nri directory; or set nri_socket to the runtime's socket_path"
)


class Status(enum.Enum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Finding:
    """One check's outcome: `detail` says what was seen, `fix` what to do about a WARN or FAIL."""

    status: Status
    topic: str
    detail: str
    fix: str = ""


def _ok(topic: str, detail: str) -> Finding:
    return Finding(Status.OK, topic, detail)


def _warn(topic: str, detail: str, fix: str) -> Finding:
    return Finding(Status.WARN, topic, detail, fix)


def _fail(topic: str, detail: str, fix: str = "") -> Finding:
    return Finding(Status.FAIL, topic, detail, fix)


@dataclass(frozen=True)
class Report:
    config_path: str
    findings: tuple[Finding, ...]
    # Said in the heading: e.g. that the node was checked with the defaults.
    note: str = ""

    def count(self, status: Status) -> int:
        return sum(1 for f in self.findings if f.status is status)

    @property
    def exit_code(self) -> int:
        """0 when nothing failed (warnings alone included), else 1."""
        return 1 if self.count(Status.FAIL) else 0

    def render(self) -> str:
        """The report as text: a heading, one line per check (a fix below it), a summary line."""
        lines = [f"mixed-cpu-nri-plugin check of {self.config_path}{self.note}"]
        for finding in self.findings:
            lines.append(f"{finding.status.value:<5} {finding.topic:<{_TOPIC_WIDTH}} {finding.detail}")
            if finding.fix:
                lines.append(f"{'':<5} {'':<{_TOPIC_WIDTH}} fix: {finding.fix}")
        ok, warn, fail = (self.count(s) for s in Status)
        verdict = "not ready: fix each FAIL above" if fail else "ready"
        lines.append(f"{ok} OK, {warn} WARN, {fail} FAIL: {verdict}")
        return "\n".join(lines)


# -- one check each --------------------------------------------------------------------------------


def check_shared_cpus(config: Config) -> Finding:
    topic = "shared CPUs"
    if not config.shared_cpuset:
        return _unset_shared_cpus(topic, config)
    try:
        online = check_machine(config)
    except ConfigError as exc:
        return _fail(topic, str(exc))
    left = cgroups.format_cpuset(online - config.shared_cpuset)
    return _ok(topic, f"{config.shared_cpuset_text} online; {left} left for exclusive CPUs")


def check_numa_nodes(config: Config) -> list[Finding]:
    """The shared CPUs of each NUMA node, when numa_local_shared_cpus is on (else no finding)."""
    if not config.numa_local_shared_cpus:
        return []
    topic = "NUMA nodes"
    try:
        nodes = read_numa_nodes(config.sysfs_root, online_cpus(config.sysfs_root))
    except ConfigError as exc:
        return [_fail(topic, f"{config.source}: {exc}")]
    split = shared_by_node(config.shared_cpuset, nodes)
    show = cgroups.format_cpuset
    detail = "; ".join(
        f"node{node} CPUs {show(nodes[node])}: shared {show(cpus) or 'none'}" for node, cpus in split.items()
    )
    bare = [node for node, cpus in split.items() if not cpus]
    if bare:
        names = ", ".join(f"node{node}" for node in bare)
        return [
            _warn(
                topic,
                detail,
                f"add CPUs of {names} to shared_cpuset and to kubelet's reservedSystemCPUs; until then a "
                f"container whose exclusive CPUs are on {names} gets the whole shared pool, across the "
                "interconnect",
            )
        ]
    return [_ok(topic, detail)]


def _unset_shared_cpus(topic: str, config: Config) -> Finding:
    """No shared_cpuset to check (no config file): what the online CPUs are to choose from."""
    try:
        online = cgroups.format_cpuset(online_cpus(config.sysfs_root))
    except ConfigError as exc:
        return _fail(topic, f"shared_cpuset is not set; {exc}")
    return _warn(
        topic,
        f"shared_cpuset is not set (online CPUs: {online})",
        "set shared_cpuset to a few of the online CPUs, also listed in kubelet's reservedSystemCPUs",
    )


def check_nri_socket(path: str) -> Finding:
    topic = "NRI socket"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return _fail(topic, f"{path} does not exist", _NRI_FIX)
    except OSError as exc:
        return _fail(
            topic, f"cannot look at {path}: {exc.strerror}", _permission_fix("check nri_socket's path")
        )
    if not stat.S_ISSOCK(mode):
        return _fail(
            topic,
            f"{path} is not a socket",
            "set nri_socket to the runtime's NRI socket (containerd's and CRI-O's default is "
            "/var/run/nri/nri.sock)",
        )
    refused = _connect_problem(path)
    if refused is not None:
        return refused
    return _ok(topic, f"{path} is a socket")


def _connect_problem(path: str) -> Finding | None:
    """A FAIL when nothing accepts a connection on the socket at `path`, else None."""
    topic = "NRI socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(CONNECT_TIMEOUT)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return _fail(
                topic,
                f"{path} is a socket, but nothing listens on it (connection refused): a runtime that "
                "stopped, or restarted with NRI off, left it behind",
                f"start the runtime with NRI on; {_NRI_FIX}",
            )
        except PermissionError:
            return _fail(
                topic,
                f"{path} may not be connected to by uid {os.geteuid()}",
                _permission_fix(
                    "a security policy (SELinux, AppArmor) denies it: look at the host's audit log"
                ),
            )
        except (OSError, TimeoutError) as exc:
            reason = os.strerror(exc.errno) if exc.errno else "no answer"
            if exc.errno == errno.EAGAIN:
                reason = "the runtime accepts no more connections for now"
            return _fail(topic, f"cannot connect to {path}: {reason}", "look at the runtime's log")
    return None


def _describe_layout(layout: CgroupLayout) -> str:
    if layout.mode is CgroupMode.V2:
        return f"v2 (unified) at {layout.cpu.mount_point}"
    kind = "v1" if layout.mode is CgroupMode.V1 else "hybrid (v1 controllers beside a v2 tree)"
    return f"{kind}: cpu at {layout.cpu.mount_point}, cpuset at {layout.cpuset.mount_point}"


def check_cgroups(
    config: Config, mountinfo_path: str = DEFAULT_MOUNTINFO
) -> tuple[Finding, CgroupLayout | None]:
    topic = "cgroups"
    try:
        layout = build_layout(config, mountinfo_path=mountinfo_path)
    except ConfigError as exc:
        return _fail(topic, str(exc)), None
    how = (
        f"from {mountinfo_path}"
        if config.cgroup_version == "auto"
        else f'cgroup_version = "{config.cgroup_version}"'
    )
    return _ok(topic, f"{_describe_layout(layout)} ({how})"), layout


def drivers_in(names: Iterable[str]) -> tuple[str, ...]:
    """The cgroup drivers whose kubelet top cgroup is among `names` (the entries of a hierarchy's
    root): ``systemd`` for ``kubepods.slice``, ``cgroupfs`` for ``kubepods``."""
    present = set(names)
    return tuple(
        driver for driver, top in (("systemd", SYSTEMD_TOP), ("cgroupfs", CGROUPFS_TOP)) if top in present
    )


def _drivers(layout: CgroupLayout, kubelet_driver: str | None) -> tuple[str, ...]:
    """kubelet's cgroup driver when its config says, else those whose top cgroup is there."""
    if kubelet_driver is not None:
        return (kubelet_driver,)
    try:
        return drivers_in(os.listdir(layout.cpu.mount_point))
    except OSError:
        return ()


def check_cgroup_driver(layout: CgroupLayout, kubelet_driver: str | None = None) -> Finding:
    """Which driver made the pod cgroups the cpu hierarchy holds; `kubelet_driver` is kubelet's
    ``cgroupDriver`` setting, when its config was read."""
    topic = "cgroup driver"
    where = layout.cpu.mount_point
    try:
        found = drivers_in(os.listdir(where))
    except OSError as exc:
        return _fail(topic, f"cannot list {where}: {exc.strerror}", _permission_fix("check cgroup_root"))
    if not found:
        return _warn(
            topic,
            f"neither {SYSTEMD_TOP} nor {CGROUPFS_TOP} in {where}",
            "start kubelet on this node (it makes them), or point cgroup_root at the host's cgroup tree",
        )
    if len(found) > 1 and kubelet_driver not in found:
        return _warn(
            topic,
            f"both {SYSTEMD_TOP} (systemd) and {CGROUPFS_TOP} (cgroupfs) in {where}",
            "one is left over from a change of driver; pass --kubelet-config to tell which kubelet uses",
        )
    driver = kubelet_driver if kubelet_driver in found else found[0]
    top = SYSTEMD_TOP if driver == "systemd" else CGROUPFS_TOP
    if kubelet_driver is not None and kubelet_driver != driver:
        return _warn(
            topic,
            f"{top} in {where} was made by the {driver} driver, but kubelet's cgroupDriver is "
            f"{kubelet_driver}",
            "the runtime's and kubelet's cgroup drivers must agree (containerd SystemdCgroup, CRI-O "
            "cgroup_manager); fix the one that differs and restart it",
        )
    return _ok(topic, f"{driver} ({top} in {where})")


def check_systemd_bus(config: Config, drivers: Iterable[str]) -> Finding | None:
    """Under the systemd driver (in `drivers`), does systemd answer on ``systemd_bus``? None when no
    pod is a systemd unit or ``systemd_bus`` is off ("")."""
    topic = "systemd bus"
    path = config.systemd_bus
    if not path or "systemd" not in drivers:
        return None
    try:
        owner = dbus.call(
            path,
            _BUS_DAEMON,
            _BUS_DAEMON_PATH,
            _BUS_DAEMON,
            "GetNameOwner",
            dbus.SYSTEMD,
            timeout=CONNECT_TIMEOUT,
        )
    except (OSError, dbus.BusError) as exc:
        problem = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return _warn(
            topic,
            f"systemd does not answer on {path} ({problem}): pod quotas of systemd slices would be "
            "written to their cgroup files, which systemd puts back at its next daemon-reload",
            "mount the host's /run/dbus into the daemon's pod (the chart and manifests do), or set "
            "systemd_bus",
        )
    return _ok(topic, f"systemd ({owner}) answers on {path}: pod quotas of slices are set through it")


def _permission_fix(as_root: str) -> str:
    """The fix for what uid `os.geteuid()` may not do: to run as root when we are not (the daemon
    runs as root); `as_root` when we are, since becoming root would change nothing."""
    uid = os.geteuid()
    if uid != 0:
        return f"you are not root (uid {uid}): run check as root, as the daemon runs"
    return as_root


def _not_writable(topic: str, path: str, fix: str) -> Finding:
    """The FAIL for a directory we may not write: its read-only file system when that is the cause
    (root may not write there either), else the uid and `fix`."""
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return _fail(topic, f"{path} is on a read-only file system", "mount it read-write")
    return _fail(topic, f"{path} is not writable by uid {os.geteuid()}", fix)


def _nearest_existing(path: str) -> str:
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def check_state_dir(path: str) -> Finding:
    topic = "state directory"
    fix = _permission_fix("point state_dir at a directory only root can write")
    if os.path.isdir(path):
        problem = state_dir_problem(path)
        if problem is not None:
            return _fail(topic, problem, "point state_dir at a directory only root can write (mode 0700)")
        if os.access(path, os.W_OK | os.X_OK):
            return _ok(topic, f"{path} is writable")
        return _not_writable(topic, path, fix)
    if os.path.lexists(path):
        return _fail(topic, f"{path} is not a directory", "point state_dir at a directory")
    parent = _nearest_existing(path)
    if os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK):
        return _ok(topic, f"{path} does not exist yet; the daemon will create it")
    return _fail(topic, f"{path} does not exist, and {parent} is not a writable directory", fix)


def check_device_plugin_dir(device_plugin: DevicePluginConfig, *, dra: bool = False) -> Finding:
    """kubelet's device-plugin directory, where the device plugin registers; not needed with it off
    (`dra`: the DRA front door on, which then serves the requests)."""
    topic = "device-plugin dir"
    if not device_plugin.enabled:
        serves = "DRA serves the requests" if dra else "the pod annotation alone proves requests"
        return _ok(topic, f"not used: [device_plugin] enabled = false; {serves}")
    directory = str(device_plugin.plugin_dir)
    if not os.path.isdir(directory):
        exists = "is not a directory" if os.path.lexists(directory) else "does not exist"
        return _fail(
            topic,
            f"{directory} {exists}",
            "set [device_plugin] plugin_dir to kubelet's device-plugin directory (kubelet creates it when "
            "it starts); in a pod, mount the host's /var/lib/kubelet/device-plugins (the directory, not "
            "the socket files)",
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        return _not_writable(topic, directory, _permission_fix("make it writable by root, as kubelet has it"))
    kubelet = str(device_plugin.kubelet_socket)
    try:
        is_socket = stat.S_ISSOCK(os.stat(kubelet).st_mode)
    except OSError:
        is_socket = False
    if not is_socket:
        return _warn(
            topic,
            f"no kubelet socket {kubelet}",
            "start kubelet; the daemon registers with it once the socket appears",
        )
    return _ok(topic, f"{directory} is writable, kubelet listens on {kubelet}")


def check_dra(
    dra: DraConfig, environ: Mapping[str, str], *, token_path: str = SERVICE_ACCOUNT_TOKEN
) -> list[Finding]:
    """The DRA front door's directories, node name and credentials; nothing when it is off."""
    if not dra.enabled:
        return []
    findings = [
        _kubelet_dir("DRA plugin registry", str(dra.registry_dir), "registry_dir", "plugins_registry"),
        _kubelet_dir("DRA plugins dir", str(dra.plugins_dir), "plugins_dir", "plugins"),
    ]
    cdi = str(dra.cdi_dir)
    if os.path.isdir(cdi):
        writable = os.access(cdi, os.W_OK | os.X_OK)
        findings.append(
            _ok("CDI dir", f"{cdi} is writable")
            if writable
            else _not_writable("CDI dir", cdi, _permission_fix("make it writable by root"))
        )
    else:
        parent = _nearest_existing(cdi)
        if os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK):
            findings.append(_ok("CDI dir", f"{cdi} does not exist yet; the daemon will create it"))
        else:
            findings.append(
                _fail(
                    "CDI dir",
                    f"{cdi} does not exist, and {parent} is not a writable directory",
                    "mount the host's /var/run/cdi (a directory the runtime reads CDI specs from), or "
                    "set [dra] cdi_dir",
                )
            )
    node = dra.node_name or environ.get("NODE_NAME", "")
    if node:
        findings.append(_ok("node name", f"{node!r} (pool and ResourceSlice are named after it)"))
    else:
        findings.append(
            _fail(
                "node name",
                "neither [dra] node_name nor NODE_NAME is set",
                "pass NODE_NAME from the pod's spec.nodeName (the chart does), or set [dra] node_name",
            )
        )
    findings.append(_api_credentials(dra, environ, token_path))
    return findings


def check_cdi_runtime(dra: DraConfig, runtime: Mapping[str, Any] | None) -> Finding | None:
    """Whether the runtime (`runtime`: the ``runtime`` object of a running daemon's status) reads the
    CDI specs of our DRA driver; None when DRA is off or the runtime's name and version are not known."""
    if not dra.enabled or not runtime:
        return None
    name, version = runtime.get("name"), runtime.get("version")
    if not isinstance(name, str) or not isinstance(version, str):
        return None
    topic = "CDI in the runtime"
    if name != "containerd":
        return _ok(topic, f"{name} {version} (CRI-O releases with DRA v1 read cdiVersion 0.6.0 specs)")
    match = _VERSION.match(version)
    if match is None:
        return _warn(
            topic,
            f"containerd version {version!r} is not one this check can read",
            "make sure it is 1.7.12 or later: older ones refuse the DRA driver's CDI specs",
        )
    if tuple(int(part) for part in match.groups()) >= CONTAINERD_CDI_FLOOR:
        return _ok(topic, f"containerd {version} reads the DRA driver's CDI specs (1.7.12 or later)")
    return _fail(
        topic,
        f"containerd {version} refuses the DRA driver's CDI specs: its CDI library knows specs up to "
        '0.5.0 and ours are 0.6.0 (containers of prepared claims fail with "unresolvable CDI devices")',
        "upgrade containerd to 1.7.12 or later, or leave [dra] off on this node",
    )


def _runtime_seen(state_dir: str) -> Mapping[str, Any] | None:
    """The runtime a daemon running with `state_dir` is connected to (its status), None if none answers."""
    try:
        runtime = fetch_status(status_socket_path(state_dir))["runtime"]
    except (StatusError, KeyError, TypeError):
        return None
    return runtime if isinstance(runtime, dict) else None


def _kubelet_dir(topic: str, directory: str, key: str, host_dir: str) -> Finding:
    if not os.path.isdir(directory):
        exists = "is not a directory" if os.path.lexists(directory) else "does not exist"
        return _fail(
            topic,
            f"{directory} {exists}",
            f"mount the host's /var/lib/kubelet/{host_dir} directory there, or set [dra] {key}",
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        return _not_writable(topic, directory, _permission_fix("make it writable by root, as kubelet has it"))
    return _ok(topic, f"{directory} is writable")


def _api_credentials(dra: DraConfig, environ: Mapping[str, str], token_path: str) -> Finding:
    topic = "API credentials"
    if dra.kubeconfig:
        if os.access(dra.kubeconfig, os.R_OK):
            return _ok(topic, f"kubeconfig {dra.kubeconfig}")
        return _fail(topic, f"kubeconfig {dra.kubeconfig} cannot be read", "fix [dra] kubeconfig")
    if not environ.get("KUBERNETES_SERVICE_HOST"):
        return _fail(
            topic,
            "not in a pod (no KUBERNETES_SERVICE_HOST) and no [dra] kubeconfig",
            "run in the chart's pod, or set [dra] kubeconfig to a kubeconfig file",
        )
    if not os.access(token_path, os.R_OK):
        return _fail(
            topic,
            f"no service account token at {token_path}",
            "let the pod mount its service account token (automountServiceAccountToken)",
        )
    return _ok(topic, f"the pod's service account ({token_path})")


# -- kubelet's config file -----------------------------------------------------------------------------


def check_pod_resources(config: Config) -> Finding | None:
    """A warning when kubelet's PodResources API cannot prove requests; None when it can (or the
    device plugin's markers are not in use)."""
    device_plugin = config.device_plugin
    if not config.trust_device_plugin_marker or not (device_plugin.enabled or config.dra.enabled):
        return None
    topic = "pod-resources API"
    fallback = "the allocation marker alone proves requests for shared CPUs"
    path = device_plugin.pod_resources_socket
    if path is None:
        return _warn(
            topic,
            f'[device_plugin] pod_resources_socket = "": {fallback}',
            f'set pod_resources_socket to kubelet\'s socket, "{DEFAULT_POD_RESOURCES_SOCKET}"',
        )
    why = socket_state(str(path))
    if why is None:
        refused = get_served(str(path))
        if refused is None:
            return None
        return _warn(
            topic,
            f"kubelet does not serve Get ({refused}): requests for shared CPUs are proven by List, "
            "a whole-node answer per lookup",
            "turn on kubelet's KubeletPodResourcesGet feature gate (on by default from Kubernetes 1.34)",
        )
    return _warn(
        topic,
        f"{why}: {fallback}",
        "mount kubelet's pod-resources directory (the directory, not the socket) and point "
        "[device_plugin] pod_resources_socket at the socket in it",
    )


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        return f"{exc.problem or exc.context} at line {exc.problem_mark.line + 1}"
    return " ".join(str(exc).split())


def _load_kubelet_config(path: str) -> Mapping[str, Any] | Finding:
    topic = "kubelet config"
    fix = f"pass {KUBELET_CONFIG_HINT}"
    try:
        with open(path, encoding="utf-8") as file:
            document = yaml.safe_load(file)
    except OSError as exc:
        return _fail(topic, f"cannot read {path}: {exc.strerror}", fix)
    except UnicodeDecodeError:
        return _fail(topic, f"{path} is not UTF-8 text", fix)
    except yaml.YAMLError as exc:
        return _fail(topic, f"{path} is not valid YAML: {_yaml_problem(exc)}", fix)
    if not isinstance(document, Mapping):
        return _fail(topic, f"{path} is not a KubeletConfiguration (a YAML mapping)", fix)
    kind = document.get("kind", "KubeletConfiguration")
    if kind != "KubeletConfiguration":
        return _fail(topic, f"{path} is a {kind}, not a KubeletConfiguration", fix)
    return document


def _reserved_cpus(path: str, document: Mapping[str, Any], shared: frozenset[int]) -> Finding:
    """reservedSystemCPUs must hold the shared CPUs, or kubelet may give them out as exclusive CPUs:
    the feature cannot work, so anything else FAILs."""
    topic = "kubelet reserved CPUs"
    value = document.get("reservedSystemCPUs")
    if value is None or value == "":
        return _fail(
            topic,
            f"{path} sets no reservedSystemCPUs",
            _reserve(path, frozenset(), shared) + " (unless kubelet gets them with --reserved-cpus)",
        )
    if isinstance(value, int) and not isinstance(value, bool):
        # YAML reads a lone CPU as a number; kubelet wants a string and refuses to start.
        return _fail(
            topic,
            f"{path}: reservedSystemCPUs: {value} is a YAML number, which kubelet refuses (it wants a "
            "quoted cpu list)",
            _reserve(path, frozenset({value}) if value >= 0 else frozenset(), shared),
        )
    try:
        if not isinstance(value, str):
            raise CpusetError(f"{value!r} is not a cpu list")
        reserved = cgroups.parse_cpuset(value)
    except CpusetError as exc:
        return _fail(topic, f"{path}: reservedSystemCPUs: {exc}", f"fix reservedSystemCPUs in {path}")
    outside = shared - reserved
    if outside:
        return _fail(
            topic,
            f"reservedSystemCPUs {cgroups.format_cpuset(reserved)} leave out the shared CPUs "
            f"{cgroups.format_cpuset(outside)}",
            _reserve(path, reserved, shared),
        )
    if not shared:
        return _warn(
            topic,
            f"reservedSystemCPUs {cgroups.format_cpuset(reserved)}; shared_cpuset is not set",
            f'choose shared_cpuset among these, e.g. shared_cpuset = "{cgroups.format_cpuset(reserved)}"',
        )
    return _ok(
        topic,
        f"reservedSystemCPUs {cgroups.format_cpuset(reserved)} hold the shared CPUs "
        f"{cgroups.format_cpuset(shared)}",
    )


def _reserve(path: str, reserved: frozenset[int], shared: frozenset[int]) -> str:
    wanted = cgroups.format_cpuset(reserved | shared) or "<the shared CPUs>"
    return (
        f'set reservedSystemCPUs: "{wanted}" (or a superset) in {path} and restart kubelet, '
        "so it never gives the shared CPUs to a container as exclusive CPUs"
    )


def _cpu_manager(path: str, document: Mapping[str, Any]) -> Finding:
    topic = "kubelet CPU manager"
    policy = document.get("cpuManagerPolicy") or "none"
    if policy != "static":
        return _fail(
            topic,
            f"cpuManagerPolicy is {policy}, so no container has exclusive CPUs to add shared ones to",
            f"set cpuManagerPolicy: static in {path} (kubelet then needs its cpu_manager_state removed "
            "and a restart; a --cpu-manager-policy flag on kubelet's command line wins over the file)",
        )
    return _ok(topic, "cpuManagerPolicy is static")


def check_kubelet_config(path: str, shared: frozenset[int]) -> tuple[list[Finding], str | None]:
    """The reserved-CPU and CPU-manager findings from kubelet's config file, and its cgroupDriver
    (None when the file does not say or cannot be read)."""
    document = _load_kubelet_config(path)
    if isinstance(document, Finding):
        return [document], None
    driver = document.get("cgroupDriver")
    return [_reserved_cpus(path, document, shared), _cpu_manager(path, document)], (
        driver if isinstance(driver, str) else None
    )


# -- all of them ---------------------------------------------------------------------------------------


def run_checks(
    config_path: str = DEFAULT_CONFIG_PATH,
    *,
    kubelet_config: str | None = None,
    mountinfo_path: str = DEFAULT_MOUNTINFO,
    environ: Mapping[str, str] | None = None,
) -> Report:
    """Every check, in the order a newcomer would fix them. A config that does not load is the first
    FAIL, and the node is still checked: with the config's valid keys (the wrong ones at their
    defaults), or with the defaults when there is no config file (an operator's first run) or it is
    no TOML at all. The heading says which."""
    note = ""
    try:
        config = load_config(config_path, check=False)
        first = _ok("config", f'{config.source} is valid; shared_cpuset = "{config.shared_cpuset_text}"')
    except ConfigMissing as exc:
        config = Config(shared_cpuset=frozenset(), source=config_path)
        first, note = _fail("config", str(exc)), " (no such file: the node checked with the defaults)"
    except ConfigError as exc:
        config, note = _valid_part(config_path)
        first = _fail("config", str(exc))
    findings = _node_findings(config, kubelet_config, mountinfo_path)
    findings.extend(check_dra(config.dra, os.environ if environ is None else environ))
    if config.dra.enabled:
        cdi = check_cdi_runtime(config.dra, _runtime_seen(config.state_dir))
        if cdi is not None:
            findings.append(cdi)
    return Report(config.source, (first, *findings), note)


def _valid_part(path: str) -> tuple[Config, str]:
    """The config of the keys of the file at `path` that are valid (each top-level key or table
    whole, tried one at a time in the file's order), the others at their defaults; and the note for
    the heading. The defaults alone when the file is no TOML."""
    try:
        document = read_document(path)
    except ConfigError:
        return Config(
            shared_cpuset=frozenset(), source=path
        ), " (config error: the node checked with the defaults)"
    # shared_cpuset is required: a stand-in while the other keys are tried, dropped unless valid.
    kept: dict[str, Any] = {"shared_cpuset": "0"}
    has_shared = False
    for key, value in document.items():
        try:
            parse_config({**kept, key: value}, source=path)
        except ConfigError:
            continue
        kept[key] = value
        has_shared = has_shared or key == "shared_cpuset"
    config = parse_config(kept, source=path)
    if not has_shared:
        config = dataclasses.replace(config, shared_cpuset=frozenset())
    return config, " (config error: the node checked with its valid keys, the wrong ones at their defaults)"


def _node_findings(config: Config, kubelet_config: str | None, mountinfo_path: str) -> list[Finding]:
    findings = [check_shared_cpus(config), *check_numa_nodes(config), check_nri_socket(config.nri_socket)]
    cgroup_finding, layout = check_cgroups(config, mountinfo_path)
    findings.append(cgroup_finding)
    kubelet_findings: list[Finding] = []
    kubelet_driver = None
    if kubelet_config is not None:
        kubelet_findings, kubelet_driver = check_kubelet_config(kubelet_config, config.shared_cpuset)
    if layout is not None:
        findings.append(check_cgroup_driver(layout, kubelet_driver))
        bus = check_systemd_bus(config, _drivers(layout, kubelet_driver))
        if bus is not None:
            findings.append(bus)
    findings.append(check_state_dir(config.state_dir))
    findings.append(check_device_plugin_dir(config.device_plugin, dra=config.dra.enabled))
    pod_resources = check_pod_resources(config)
    if pod_resources is not None:
        findings.append(pod_resources)
    findings.extend(kubelet_findings)
    return findings
