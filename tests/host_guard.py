"""Tests never touch the host: a daemon a test starts names its own NRI socket, state dir, kubelet
dirs, cgroup tree and bus, and no default metrics port.

`host_paths` reads the configuration a ``run`` command line would use (the file after ``--config``,
``--socket`` winning over its ``nri_socket``) and lists every place in it that is the host's: under
/var, /run, /etc or /sys/fs/cgroup, or the default metrics port. `refuse_host_paths` fails the test
with that list. The helpers that start daemons (`mixedcpu_support.start_daemon`, ``run_cli`` and the
tests that spawn ``nri_plugin.daemon.cli`` by hand) call it before the daemon starts, so a test that
forgets a path fails here, on any machine, rather than only on a node where a real daemon holds
/var/run/nri/mixed-cpu-nri-plugin.lock (.ci/run holds that lock and the port during the suite).

A file that does not parse or check is let through: the daemon refuses it before it touches anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from nri_plugin.daemon.config import DEFAULT_METRICS_ADDRESS, ConfigError, load_config

# The host's places: the runtime's NRI directory, kubelet's directories, the state dir, the system
# bus, the CDI spec directories, the host's cgroup tree.
HOST_ROOTS = ("/var/", "/run/", "/etc/", "/sys/fs/cgroup")
DEFAULT_METRICS_PORT = DEFAULT_METRICS_ADDRESS.rsplit(":", 1)[1]


def _option(argv: Sequence[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


LOOPBACK_OR_ANY = ("", "127.0.0.1", "localhost", "0.0.0.0", "::", "[::]", "::1", "[::1]")


def host_paths(argv: Sequence[str], *, kernel_cgroups: bool = False) -> list[str]:
    """What of the host a ``run`` command line would use; [] when it names its own of everything.
    `kernel_cgroups`: the real-kernel tier, which says so, may use the host's cgroup tree."""
    if "run" not in argv:
        return []
    path = _option(argv, "--config")
    if path is None:
        return ["--config: none given, so /etc/mixed-cpu-nri/config.toml"]
    try:
        config = load_config(path, check=False)  # the daemon's own reading: size cap, nesting, keys
    except (OSError, ConfigError):
        return []
    places = {
        "nri_socket": _option(argv, "--socket") or config.nri_socket,
        "state_dir": config.state_dir,
        "cgroup_root": "" if kernel_cgroups else config.cgroup_root,
        "systemd_bus": config.systemd_bus,
    }
    if config.device_plugin.enabled:
        places["device_plugin.plugin_dir"] = str(config.device_plugin.plugin_dir)
        if config.device_plugin.pod_resources_socket is not None:
            places["device_plugin.pod_resources_socket"] = str(config.device_plugin.pod_resources_socket)
    if config.dra.enabled:
        places["dra.registry_dir"] = str(config.dra.registry_dir)
        places["dra.plugins_dir"] = str(config.dra.plugins_dir)
        places["dra.cdi_dir"] = str(config.dra.cdi_dir)
    found = [f"{key} = {value}" for key, value in places.items() if value and value.startswith(HOST_ROOTS)]
    host, _, port = config.metrics_address.rpartition(":")
    if config.metrics_address and port == DEFAULT_METRICS_PORT and host in LOOPBACK_OR_ANY:
        found.append(f"metrics_address = {config.metrics_address} (the default port)")
    return found


def refuse_host_paths(argv: Sequence[str], *, kernel_cgroups: bool = False) -> None:
    """Fail the calling test if `argv` would start a daemon on any of the host's places."""
    found = host_paths(argv, kernel_cgroups=kernel_cgroups)
    if found:
        raise AssertionError(
            "a test daemon would use the host's: " + "; ".join(found) + " (name a path under tmp_path, "
            'metrics_address = "127.0.0.1:0" or "", systemd_bus = "")'
        )


def isolated(text: str, root: Path) -> str:
    """The config `text` with the host's places it leaves at their defaults moved under `root`: the
    NRI socket, the state dir, the cgroup tree, kubelet's device-plugin directory and PodResources
    socket; no metrics and no system bus. Keys `text` sets are kept as they are."""
    top = {
        "nri_socket": f'"{root}/nri.sock"',
        "state_dir": f'"{root}/state"',
        "cgroup_root": f'"{root}/cgroup"',
        "metrics_address": '""',
        "systemd_bus": '""',
    }
    head = "".join(f"{key} = {value}\n" for key, value in top.items() if not _sets(text, key))
    if "[device_plugin]" in text:
        return head + text
    return (
        head + text + f'[device_plugin]\nplugin_dir = "{root}/device-plugins"\n'
        f'pod_resources_socket = "{root}/pod-resources.sock"\n'
    )


def _sets(text: str, key: str) -> bool:
    return any(line.split("=", 1)[0].strip() == key for line in text.splitlines() if "=" in line)
