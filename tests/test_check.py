"""``mixed-cpu-nri-plugin check``: a readable report of the config and the node, exit 0 or 1.

Each test builds a node in a temporary directory: a fake sysfs (CPUs 0-7 online), a cgroup tree,
a real unix socket for the runtime's NRI socket and for kubelet's device-plugin socket, and kubelet
config files; then runs the command as the console script does (`nri_plugin.daemon.cli.main`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from dbus_support import fake_systemd, private_bus

from nri_plugin.cgroups import CgroupLayout, CgroupMode, Hierarchy
from nri_plugin.daemon.check import (
    Status,
    check_cdi_runtime,
    check_cgroup_driver,
    check_device_plugin_dir,
    check_dra,
    drivers_in,
    run_checks,
)
from nri_plugin.daemon.cli import main
from nri_plugin.deviceplugin.config import DevicePluginConfig
from nri_plugin.dra.config import DraConfig


@dataclass
class Node:
    """The paths of a fake node; `config` is written by `write_config`."""

    root: Path
    sockets: list[socket.socket]
    # No bus by default: the host's systemd is none of these tests' business (see the systemd tests).
    systemd_bus: str = ""

    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    @property
    def nri_socket(self) -> Path:
        return self.root / "nri" / "nri.sock"

    @property
    def cgroup(self) -> Path:
        return self.root / "cgroup"

    @property
    def plugin_dir(self) -> Path:
        return self.root / "dp"

    @property
    def pod_resources(self) -> Path:
        return self.root / "pr" / "kubelet.sock"

    def listen(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        server.listen()
        self.sockets.append(server)

    def write_config(self, extra: str = "", *, shared: str = "0-1", cgroup_version: str = "v2") -> Path:
        self.config.write_text(
            f'shared_cpuset = "{shared}"\n'
            f'sysfs_root = "{self.root}/sys"\n'
            f'nri_socket = "{self.nri_socket}"\n'
            f'cgroup_root = "{self.cgroup}"\n'
            f'cgroup_version = "{cgroup_version}"\n'
            f'state_dir = "{self.root}/state"\n'
            f'systemd_bus = "{self.systemd_bus}"\n'
            f"{extra}"
            f'[device_plugin]\nplugin_dir = "{self.plugin_dir}"\n'
            f'pod_resources_socket = "{self.pod_resources}"\n'
        )
        return self.config

    def kubelet_config(self, text: str) -> Path:
        path = self.root / "kubelet.yaml"
        path.write_text(text)
        return path


@pytest.fixture
def node() -> Iterator[Node]:
    """A node ready for the daemon: NRI on, kubelet running with the systemd driver, cgroup v2.

    Under /tmp, not tmp_path: a unix socket path must fit in 107 bytes."""
    root = Path(tempfile.mkdtemp(prefix="chk-", dir="/tmp"))
    made = Node(root, [])
    online = root / "sys" / "devices" / "system" / "cpu"
    online.mkdir(parents=True)
    (online / "online").write_text("0-7\n")
    (made.cgroup / "kubepods.slice").mkdir(parents=True)
    made.listen(made.nri_socket)
    made.listen(made.plugin_dir / "kubelet.sock")
    made.listen(made.pod_resources)
    made.write_config()
    yield made
    for server in made.sockets:
        server.close()
    shutil.rmtree(root, ignore_errors=True)


def check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    """Run ``check`` through the CLI: its exit status and the report's lines on stdout."""
    status = main(["check", *args])
    out, err = capsys.readouterr()
    assert err == ""
    return status, out.splitlines()


def line_of(lines: list[str], topic: str) -> str:
    [line] = [line for line in lines if line[6:].startswith(topic)]
    return line


def fix_of(lines: list[str], topic: str) -> str:
    following = lines[lines.index(line_of(lines, topic)) + 1]
    assert following.lstrip().startswith("fix: "), following
    return following.lstrip()[len("fix: ") :]


KUBELET_OK = """\
kind: KubeletConfiguration
cgroupDriver: systemd
cpuManagerPolicy: static
reservedSystemCPUs: "0-1,7"
"""


def test_a_ready_node_is_all_ok(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    kubelet = node.kubelet_config(KUBELET_OK)
    status, lines = check(capsys, "--config", str(node.config), "--kubelet-config", str(kubelet))
    r = node.root
    assert lines == [
        f"mixed-cpu-nri-plugin check of {node.config}",
        f'OK    config                 {node.config} is valid; shared_cpuset = "0-1"',
        "OK    shared CPUs            0-1 online; 2-7 left for exclusive CPUs",
        f"OK    NRI socket             {r}/nri/nri.sock is a socket",
        f'OK    cgroups                v2 (unified) at {r}/cgroup (cgroup_version = "v2")',
        f"OK    cgroup driver          systemd (kubepods.slice in {r}/cgroup)",
        f"OK    state directory        {r}/state does not exist yet; the daemon will create it",
        f"OK    device-plugin dir      {r}/dp is writable, kubelet listens on {r}/dp/kubelet.sock",
        "OK    kubelet reserved CPUs  reservedSystemCPUs 0-1,7 hold the shared CPUs 0-1",
        "OK    kubelet CPU manager    cpuManagerPolicy is static",
        "9 OK, 0 WARN, 0 FAIL: ready",
    ]
    assert status == 0


def test_the_console_script_prints_the_report(node: Node) -> None:
    script = Path(sys.executable).with_name("mixed-cpu-nri-plugin")
    if not script.exists():
        pytest.skip(f"the console script is not installed next to {sys.executable}")
    os.remove(node.nri_socket)
    result = subprocess.run(
        [str(script), "check", "--config", str(node.config)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr == ""
    assert f"FAIL  NRI socket             {node.nri_socket} does not exist" in result.stdout.splitlines()
    assert result.stdout.splitlines()[-1] == "6 OK, 0 WARN, 1 FAIL: not ready: fix each FAIL above"


# Shared CPUs that kubelet may hand out as exclusive ones, or a file kubelet refuses to start with:
# the feature cannot work, so FAIL (issue 15, item 10).
@pytest.mark.parametrize(
    ("text", "status", "detail", "fix"),
    [
        (
            'reservedSystemCPUs: "0"\ncpuManagerPolicy: static\n',
            "FAIL",
            "reservedSystemCPUs 0 leave out the shared CPUs 1",
            'set reservedSystemCPUs: "0-1" (or a superset) in {path} and restart kubelet',
        ),
        (
            "cpuManagerPolicy: static\n",
            "FAIL",
            "{path} sets no reservedSystemCPUs",
            'set reservedSystemCPUs: "0-1" (or a superset) in {path}',
        ),
        (
            "reservedSystemCPUs: 1\ncpuManagerPolicy: static\n",  # YAML reads a lone CPU as a number
            "FAIL",
            "{path}: reservedSystemCPUs: 1 is a YAML number, which kubelet refuses",
            'set reservedSystemCPUs: "0-1" (or a superset)',
        ),
        (
            "reservedSystemCPUs: 0\ncpuManagerPolicy: static\n",  # a number even when it is right
            "FAIL",
            "{path}: reservedSystemCPUs: 0 is a YAML number, which kubelet refuses (it wants a quoted",
            'set reservedSystemCPUs: "0-1" (or a superset)',
        ),
        (
            'reservedSystemCPUs: "0-1,x"\n',
            "FAIL",
            '{path}: reservedSystemCPUs: invalid cpu list "0-1,x"',
            "fix reservedSystemCPUs in {path}",
        ),
    ],
    ids=["outside", "missing-key", "number", "number-zero", "bad-list"],
)
def test_kubelet_reserved_cpus(
    node: Node, capsys: pytest.CaptureFixture[str], text: str, status: str, detail: str, fix: str
) -> None:
    kubelet = node.kubelet_config(text)
    code, lines = check(capsys, "--config", str(node.config), "--kubelet-config", str(kubelet))
    line = line_of(lines, "kubelet reserved CPUs")
    assert line.startswith(f"{status:<5} ")
    assert detail.format(path=kubelet) in line
    assert fix.format(path=kubelet) in fix_of(lines, "kubelet reserved CPUs")
    assert code == (1 if status == "FAIL" else 0)  # a warning alone still exits 0


def test_kubelet_without_the_static_cpu_manager_fails(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    kubelet = node.kubelet_config('reservedSystemCPUs: "0-1"\n')
    code, lines = check(capsys, "--config", str(node.config), "--kubelet-config", str(kubelet))
    assert line_of(lines, "kubelet CPU manager").startswith(
        "FAIL  kubelet CPU manager    cpuManagerPolicy is none, so no container has exclusive CPUs"
    )
    assert fix_of(lines, "kubelet CPU manager").startswith(f"set cpuManagerPolicy: static in {kubelet}")
    assert lines[-1] == "8 OK, 0 WARN, 1 FAIL: not ready: fix each FAIL above"
    assert code == 1


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        (None, "cannot read {path}: No such file or directory"),
        (
            "reservedSystemCPUs: [0, 1\n",
            "{path} is not valid YAML: expected ',' or ']', but got '<stream end>'",
        ),
        ("- 0-1\n", "{path} is not a KubeletConfiguration (a YAML mapping)"),
        ("kind: Pod\n", "{path} is a Pod, not a KubeletConfiguration"),
    ],
    ids=["missing", "invalid-yaml", "a-list", "another-kind"],
)
def test_unusable_kubelet_config_fails_with_one_line(
    node: Node, capsys: pytest.CaptureFixture[str], text: str | None, detail: str
) -> None:
    kubelet = node.root / "kubelet.yaml"
    if text is not None:
        kubelet.write_text(text)
    code, lines = check(capsys, "--config", str(node.config), "--kubelet-config", str(kubelet))
    line = line_of(lines, "kubelet config")
    assert line.startswith(f"FAIL  kubelet config         {detail.format(path=kubelet)}")
    assert (
        fix_of(lines, "kubelet config") == "pass kubelet's --config file, often /var/lib/kubelet/config.yaml"
    )
    assert code == 1


def test_a_wrong_config_is_said_first_and_the_node_still_checked(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    """The config's valid keys (here the node's paths) are what the node is checked with."""
    _, good = check(capsys, "--config", str(node.config))
    node.config.write_text('state_dirr = "/x"\n' + node.config.read_text())
    code, lines = check(capsys, "--config", str(node.config))
    assert lines[0] == (
        f"mixed-cpu-nri-plugin check of {node.config} (config error: the node checked with its valid "
        "keys, the wrong ones at their defaults)"
    )
    assert lines[1].startswith(
        f"FAIL  config                 {node.config}: state_dirr: unknown key (a typo?)"
    )
    assert lines[2:-1] == good[2:-1]  # every check of the node, as with the config put right
    assert lines[-1].endswith(" 1 FAIL: not ready: fix each FAIL above")
    assert code == 1
    node.config.write_text("shared_cpuset = 0-1\n")  # no TOML: the defaults
    code, lines = check(capsys, "--config", str(node.config))
    assert lines[0].endswith("(config error: the node checked with the defaults)")
    assert lines[1].endswith('quote it, shared_cpuset = "0-1"')
    assert line_of(lines, "NRI socket")[29:].startswith("/var/run/nri/nri.sock ")
    assert code == 1
    missing = node.root / "absent.toml"
    code, lines = check(capsys, "--config", str(missing))
    assert lines[1] == (
        f"FAIL  config                 {missing}: no such file; create it with at least shared_cpuset set "
        '(e.g. shared_cpuset = "0-1"), or pass --config PATH'
    )
    assert code == 1


@pytest.mark.parametrize(
    ("shared", "detail"),
    [
        ("0-1,9", "shared_cpuset: CPUs 9 are not online (online: 0-7"),
        ("0-7", "shared_cpuset: 0-7 is every online CPU, which leaves none to be exclusive"),
    ],
)
def test_shared_cpus_must_be_online_with_some_left(
    node: Node, capsys: pytest.CaptureFixture[str], shared: str, detail: str
) -> None:
    node.write_config(shared=shared)
    code, lines = check(capsys, "--config", str(node.config))
    assert line_of(lines, "shared CPUs").startswith(f"FAIL  shared CPUs            {node.config}: {detail}")
    assert code == 1


def test_nri_socket_missing_or_not_a_socket(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    os.remove(node.nri_socket)
    code, lines = check(capsys, "--config", str(node.config))
    assert line_of(lines, "NRI socket") == f"FAIL  NRI socket             {node.nri_socket} does not exist"
    fix = fix_of(lines, "NRI socket")
    assert '[plugins."io.containerd.nri.v1.nri"] disable = false' in fix
    assert "[crio.nri] enable_nri = true" in fix
    assert code == 1
    node.nri_socket.write_text("")
    code, lines = check(capsys, "--config", str(node.config))
    assert line_of(lines, "NRI socket") == f"FAIL  NRI socket             {node.nri_socket} is not a socket"
    assert code == 1


def _mountinfo(node: Node, text: str) -> Path:
    path = node.root / "mountinfo"
    path.write_text(text.replace("ROOT", str(node.cgroup)))
    return path


@pytest.mark.parametrize(
    ("mountinfo", "controllers", "detail"),
    [
        (
            "30 20 0:26 / ROOT rw - cgroup2 cgroup2 rw,nsdelegate\n",
            "cpuset cpu io memory pids\n",
            "v2 (unified) at ROOT (from MOUNTINFO)",
        ),
        (
            "30 20 0:26 / ROOT/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
            "31 20 0:27 / ROOT/cpuset rw - cgroup cgroup rw,cpuset\n",
            None,
            "v1: cpu at ROOT/cpu,cpuacct, cpuset at ROOT/cpuset (from MOUNTINFO)",
        ),
        (
            "29 20 0:22 / ROOT/unified rw - cgroup2 cgroup2 rw,nsdelegate\n"
            "30 20 0:26 / ROOT/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
            "31 20 0:27 / ROOT/cpuset rw - cgroup cgroup rw,cpuset\n",
            None,
            "hybrid (v1 controllers beside a v2 tree): cpu at ROOT/cpu,cpuacct, cpuset at ROOT/cpuset "
            "(from MOUNTINFO)",
        ),
    ],
    ids=["v2", "v1", "hybrid"],
)
def test_cgroup_mode_detected_from_mountinfo(
    node: Node, capsys: pytest.CaptureFixture[str], mountinfo: str, controllers: str | None, detail: str
) -> None:
    node.write_config(cgroup_version="auto")
    path = _mountinfo(node, mountinfo)
    if controllers is not None:
        (node.cgroup / "cgroup.controllers").write_text(controllers)
    else:
        (node.cgroup / "cpu,cpuacct" / "kubepods").mkdir(parents=True)
    code, lines = check(capsys, "--config", str(node.config), "--mountinfo", str(path))
    expected = detail.replace("ROOT", str(node.cgroup)).replace("MOUNTINFO", str(path))
    assert line_of(lines, "cgroups") == f"OK    cgroups                {expected}"
    driver = "systemd (kubepods.slice" if controllers else "cgroupfs (kubepods"
    assert line_of(lines, "cgroup driver").startswith(f"OK    cgroup driver          {driver}")
    assert code == 0


def test_cgroup_mode_not_detected_fails(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    node.write_config(cgroup_version="auto")
    path = _mountinfo(node, "30 20 0:26 / /elsewhere rw - cgroup2 cgroup2 rw\n")
    code, lines = check(capsys, "--config", str(node.config), "--mountinfo", str(path))
    assert line_of(lines, "cgroups").startswith(
        f"FAIL  cgroups                {node.config}: cgroup_root: no cgroup filesystem is mounted at or "
        f'below "{node.cgroup}"'
    )
    assert not [line for line in lines if "cgroup driver" in line]  # nothing to look in
    assert code == 1


def test_drivers_in_a_hierarchy_root() -> None:
    assert drivers_in(["kubepods.slice", "system.slice", "user.slice"]) == ("systemd",)
    assert drivers_in(["kubepods", "system.slice"]) == ("cgroupfs",)
    assert drivers_in(["kubepods", "kubepods.slice"]) == ("systemd", "cgroupfs")
    assert drivers_in(["kubepods-besteffort.slice", "init.scope"]) == ()


@pytest.mark.parametrize(
    ("tops", "kubelet", "status", "detail"),
    [
        ((), None, Status.WARN, "neither kubepods.slice nor kubepods in ROOT"),
        (("kubepods",), None, Status.OK, "cgroupfs (kubepods in ROOT)"),
        (("kubepods", "kubepods.slice"), None, Status.WARN, "both kubepods.slice (systemd) and kubepods"),
        (("kubepods", "kubepods.slice"), "cgroupfs", Status.OK, "cgroupfs (kubepods in ROOT)"),
        (("kubepods",), "systemd", Status.WARN, "but kubelet's cgroupDriver is systemd"),
    ],
    ids=["none", "cgroupfs", "both", "both-kubelet-says", "disagree"],
)
def test_cgroup_driver(
    tmp_path: Path, tops: tuple[str, ...], kubelet: str | None, status: Status, detail: str
) -> None:
    for top in tops:
        (tmp_path / top).mkdir()
    layout = CgroupLayout(CgroupMode.V2, Hierarchy(2, str(tmp_path)), Hierarchy(2, str(tmp_path)))
    finding = check_cgroup_driver(layout, kubelet)
    assert finding.status is status
    assert detail.replace("ROOT", str(tmp_path)) in finding.detail
    assert bool(finding.fix) == (status is not Status.OK)


def test_state_dir(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    state = node.root / "state"
    state.mkdir()
    _, lines = check(capsys, "--config", str(node.config))
    assert line_of(lines, "state directory") == f"OK    state directory        {state} is writable"
    state.rmdir()
    state.write_text("")
    code, lines = check(capsys, "--config", str(node.config))
    assert line_of(lines, "state directory") == f"FAIL  state directory        {state} is not a directory"
    assert code == 1


def test_device_plugin_dir(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    os.remove(node.plugin_dir / "kubelet.sock")
    code, lines = check(capsys, "--config", str(node.config))
    assert line_of(lines, "device-plugin dir") == (
        f"WARN  device-plugin dir      no kubelet socket {node.plugin_dir}/kubelet.sock"
    )
    assert code == 0
    shutil.rmtree(node.plugin_dir)
    code, lines = check(capsys, "--config", str(node.config))
    assert line_of(lines, "device-plugin dir") == (
        f"FAIL  device-plugin dir      {node.plugin_dir} does not exist"
    )
    assert "mount the host's /var/lib/kubelet/device-plugins" in fix_of(lines, "device-plugin dir")
    assert code == 1
    node.plugin_dir.write_text("")
    _, lines = check(capsys, "--config", str(node.config))
    assert line_of(lines, "device-plugin dir") == (
        f"FAIL  device-plugin dir      {node.plugin_dir} is not a directory"
    )
    node.plugin_dir.unlink()
    # Without the device plugin, kubelet's directory is not needed.
    node.write_config("[trusted_sources]\npod_annotation = true\n")
    with node.config.open("a") as file:
        file.write("enabled = false\n")
    report = run_checks(str(node.config))
    [finding] = [f for f in report.findings if f.topic == "device-plugin dir"]
    assert (finding.status, finding.detail) == (
        Status.OK,
        "not used: [device_plugin] enabled = false; the pod annotation alone proves requests",
    )
    assert report.exit_code == 0
    with_dra = check_device_plugin_dir(DevicePluginConfig(enabled=False), dra=True)
    assert (with_dra.status, with_dra.detail) == (
        Status.OK,
        "not used: [device_plugin] enabled = false; DRA serves the requests",
    )


# -- what operators tripped over (issue 15) ------------------------------------------------------------


def test_without_a_config_file_the_node_is_checked_with_the_defaults(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator's first run: one FAIL for the missing file, and still a report of the node."""
    missing = node.root / "absent.toml"
    code, lines = check(capsys, "--config", str(missing))
    assert lines[0] == (
        f"mixed-cpu-nri-plugin check of {missing} (no such file: the node checked with the defaults)"
    )
    assert lines[1].startswith(f"FAIL  config                 {missing}: no such file;")
    topics = [line[6:28].strip() for line in lines[1:-1] if not line.startswith(" ")]
    assert topics[:4] == ["config", "shared CPUs", "NRI socket", "cgroups"]
    assert topics[-3:] == ["state directory", "device-plugin dir", "pod-resources API"]
    # Not checkable without shared_cpuset, but the online CPUs to choose from are named.
    assert line_of(lines, "shared CPUs").startswith(
        "WARN  shared CPUs            shared_cpuset is not set (online CPUs: "
    )
    assert line_of(lines, "NRI socket")[29:].startswith("/var/run/nri/nri.sock ")  # the default
    assert code == 1


def test_without_a_config_file_kubelet_reserved_cpus_are_offered_as_the_pool(node: Node) -> None:
    kubelet = node.kubelet_config('reservedSystemCPUs: "0-1"\ncpuManagerPolicy: static\n')
    report = run_checks(str(node.root / "absent.toml"), kubelet_config=str(kubelet))
    [reserved] = [f for f in report.findings if f.topic == "kubelet reserved CPUs"]
    assert (reserved.status, reserved.detail) == (
        Status.WARN,
        "reservedSystemCPUs 0-1; shared_cpuset is not set",
    )
    assert reserved.fix == 'choose shared_cpuset among these, e.g. shared_cpuset = "0-1"'


def test_a_stale_nri_socket_nobody_listens_on_fails(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    """A runtime stopped with SIGTERM leaves its socket behind; `run` would see connection refused."""
    [listener] = [s for s in node.sockets if s.getsockname() == str(node.nri_socket)]
    listener.close()  # the file stays, nothing listens
    code, lines = check(capsys, "--config", str(node.config))
    assert line_of(lines, "NRI socket") == (
        f"FAIL  NRI socket             {node.nri_socket} is a socket, but nothing listens on it (connection "
        "refused): a runtime that stopped, or restarted with NRI off, left it behind"
    )
    assert fix_of(lines, "NRI socket").startswith("start the runtime with NRI on; enable NRI in the runtime")
    assert code == 1


def test_a_state_dir_others_may_write_fails(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    state = node.root / "state"
    state.mkdir()
    os.chmod(state, 0o777)
    code, lines = check(capsys, "--config", str(node.config))
    assert line_of(lines, "state directory") == (
        f"FAIL  state directory        {state} is writable by its group and others (mode 0777); "
        f"chmod 0700 {state}"
    )
    assert (
        fix_of(lines, "state directory") == "point state_dir at a directory only root can write (mode 0700)"
    )
    assert code == 1


def test_a_forced_cgroup_version_the_mounts_contradict_fails(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    """cgroup_version = "v2" on a host whose cpu and cpuset controllers are v1 hierarchies."""
    for controller in ("cpu", "cpuset"):
        (node.cgroup / controller).mkdir()
    mountinfo = _mountinfo(
        node,
        "30 20 0:26 / ROOT/cpu rw - cgroup cgroup rw,cpu,cpuacct\n"
        "31 20 0:27 / ROOT/cpuset rw - cgroup cgroup rw,cpuset\n",
    )
    code, lines = check(capsys, "--config", str(node.config), "--mountinfo", str(mountinfo))
    assert line_of(lines, "cgroups").startswith(
        f'FAIL  cgroups                {node.config}: cgroup_version: "v2" is forced, but {mountinfo} shows '
        f"the cpu controller served by a cgroup v1 hierarchy at {node.cgroup}/cpu"
    )
    assert code == 1


def test_kubelets_cgroup_driver_is_compared_with_the_node(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    """The node's pod cgroups were made by the systemd driver (kubepods.slice); kubelet's file says
    cgroupfs. Only a warning: since Kubernetes 1.31 kubelet may take the driver from the runtime
    and ignore the file's."""
    kubelet = node.kubelet_config(KUBELET_OK.replace("cgroupDriver: systemd", "cgroupDriver: cgroupfs"))
    code, lines = check(capsys, "--config", str(node.config), "--kubelet-config", str(kubelet))
    assert line_of(lines, "cgroup driver") == (
        f"WARN  cgroup driver          kubepods.slice in {node.cgroup} was made by the systemd driver, but "
        "kubelet's cgroupDriver is cgroupfs"
    )
    assert code == 0


# -- the systemd bus (issue 12) -------------------------------------------------------------------------


def test_no_systemd_on_the_bus_is_a_warning_under_the_systemd_driver(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    node.systemd_bus = str(node.root / "no-bus")
    node.write_config()
    status, lines = check(capsys, "--config", str(node.config))
    assert line_of(lines, "systemd bus").startswith(
        f"WARN  systemd bus            systemd does not answer on {node.root}/no-bus "
        "(No such file or directory): pod quotas of systemd slices would be written to their cgroup files"
    )
    assert fix_of(lines, "systemd bus").startswith("mount the host's /run/dbus into the daemon's pod")
    assert status == 0, "a warning: the daemon still works, on the files"
    with private_bus() as path:  # a bus, but no systemd on it
        node.systemd_bus = path
        node.write_config()
        _, lines = check(capsys, "--config", str(node.config))
    assert "org.freedesktop.DBus.Error.NameHasNoOwner" in line_of(lines, "systemd bus")


def test_systemd_answering_is_ok_and_cgroupfs_pods_need_no_bus(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    async def check_with_systemd() -> list[str]:
        layout = CgroupLayout(CgroupMode.V2, Hierarchy(2, str(node.cgroup)), Hierarchy(2, str(node.cgroup)))
        async with fake_systemd(layout) as (path, _):
            node.systemd_bus = path
            node.write_config()
            return (await asyncio.to_thread(check, capsys, "--config", str(node.config)))[1]

    lines = asyncio.run(check_with_systemd())
    assert line_of(lines, "systemd bus").startswith("OK    systemd bus            systemd (:")
    assert line_of(lines, "systemd bus").endswith(
        f"answers on {node.systemd_bus}: pod quotas of slices are set through it"
    )
    (node.cgroup / "kubepods.slice").rmdir()
    (node.cgroup / "kubepods").mkdir()
    node.systemd_bus = str(node.root / "no-bus")
    node.write_config()
    _, lines = check(capsys, "--config", str(node.config))
    assert not [line for line in lines if "systemd bus" in line], "cgroupfs pods are no units"


# -- issue #25, break 9: the real cause, not "run as root" to root ---------------------------------

ROOT_DIR = Path(__file__).resolve().parent.parent


def check_under(prefix: list[str], node: Node) -> list[str]:
    """``check`` run under the command `prefix`: its report's lines."""
    result = subprocess.run(
        [*prefix, sys.executable, "-m", "nri_plugin.daemon.cli", "check", "--config", str(node.config)],
        cwd=ROOT_DIR,
        env={**os.environ, "PYTHONPATH": str(ROOT_DIR)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    return result.stdout.splitlines()


def test_root_is_never_told_to_run_check_as_root(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    """The attack: root, whose check could not look at a path, was told to "run check as root"."""
    if os.geteuid() != 0:
        pytest.skip("this is about what root is told")
    os.remove(node.nri_socket)
    os.rmdir(node.nri_socket.parent)
    node.nri_socket.parent.write_text("")  # a file where a directory should be: ENOTDIR, even for root
    status, lines = check(capsys, "--config", str(node.config))
    assert status == 1
    assert line_of(lines, "NRI socket") == (
        f"FAIL  NRI socket             cannot look at {node.nri_socket}: Not a directory"
    )
    assert fix_of(lines, "NRI socket") == "check nri_socket's path"
    assert not [line for line in lines if "as root" in line]


def test_a_read_only_state_dir_is_named_read_only_by_check(node: Node) -> None:
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("no mount namespace here (unshare --mount): a read-only mount needs one")
    state = node.root / "state"
    state.mkdir(mode=0o700)
    read_only_then_exec = (
        "import os, subprocess, sys; "
        "subprocess.run(['mount', '--bind', '-o', 'ro', sys.argv[1], sys.argv[1]], check=True); "
        "os.execv(sys.argv[2], sys.argv[2:])"
    )
    prefix = ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", read_only_then_exec]
    lines = check_under([*prefix, str(state)], node)
    assert line_of(lines, "state directory") == (
        f"FAIL  state directory        {state} is on a read-only file system"
    )
    assert fix_of(lines, "state directory") == "mount it read-write"


def test_check_run_by_another_user_says_you_are_not_root(node: Node) -> None:
    """It may read anything (so that it gets as far as it can), write and connect nothing."""
    nobody = [
        "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
        "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
    ]  # fmt: skip
    lines = check_under(nobody, node)
    assert line_of(lines, "NRI socket") == (
        f"FAIL  NRI socket             {node.nri_socket} may not be connected to by uid 65534"
    )
    assert (
        fix_of(lines, "NRI socket") == "you are not root (uid 65534): run check as root, as the daemon runs"
    )


def test_dra_lines_only_when_dra_is_on(
    node: Node, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, lines = check(capsys, "--config", str(node.config))
    assert not [line for line in lines if "DRA" in line or "CDI" in line]
    for name in ("plugins_registry", "plugins"):
        (node.root / name).mkdir()
    kubeconfig = node.root / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    node.write_config(
        f'[dra]\nenabled = true\nregistry_dir = "{node.root}/plugins_registry"\n'
        f'plugins_dir = "{node.root}/plugins"\ncdi_dir = "{node.root}/cdi"\n'
        f'kubeconfig = "{kubeconfig}"\n'
    )
    monkeypatch.setenv("NODE_NAME", "worker-1")
    code, lines = check(capsys, "--config", str(node.config))
    assert line_of(lines, "DRA plugin registry") == (
        f"OK    DRA plugin registry    {node.root}/plugins_registry is writable"
    )
    assert line_of(lines, "DRA plugins dir").startswith("OK ")
    assert line_of(lines, "CDI dir").endswith("does not exist yet; the daemon will create it")
    assert line_of(lines, "node name").endswith("'worker-1' (pool and ResourceSlice are named after it)")
    assert line_of(lines, "API credentials").endswith(f"kubeconfig {kubeconfig}")
    assert code == 0
    (node.root / "plugins_registry").rmdir()
    monkeypatch.delenv("NODE_NAME")
    code, lines = check(capsys, "--config", str(node.config))
    assert line_of(lines, "DRA plugin registry").startswith("FAIL")
    assert "mount the host's /var/lib/kubelet/plugins_registry" in fix_of(lines, "DRA plugin registry")
    assert line_of(lines, "node name").endswith("neither [dra] node_name nor NODE_NAME is set")
    assert "spec.nodeName" in fix_of(lines, "node name")
    assert code == 1


def test_dra_credentials_in_a_pod_or_not(tmp_path: Path) -> None:
    dra = DraConfig(enabled=True, node_name="n1")
    token = tmp_path / "token"
    in_pod = {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    [*_, found] = check_dra(dra, in_pod, token_path=str(token))
    assert found.status is Status.FAIL
    assert "no service account token" in found.detail
    token.write_text("t")
    [*_, found] = check_dra(dra, in_pod, token_path=str(token))
    assert found.status is Status.OK
    [*_, found] = check_dra(dra, {}, token_path=str(token))
    assert found.status is Status.FAIL
    assert "KUBERNETES_SERVICE_HOST" in found.detail
    assert check_dra(DraConfig(), in_pod) == []


@pytest.mark.parametrize(
    ("name", "version", "status"),
    [
        ("containerd", "v1.7.0", Status.FAIL),
        ("containerd", "v1.7.11", Status.FAIL),
        ("containerd", "1.7.12", Status.OK),
        ("containerd", "v2.1.4", Status.OK),
        ("containerd", "main-abcdef", Status.WARN),
        ("cri-o", "1.34.1", Status.OK),
    ],
)
def test_the_runtimes_cdi_floor(name: str, version: str, status: Status) -> None:
    """containerd before 1.7.12 refuses our cdiVersion 0.6.0 specs (docs/dra.md)."""
    found = check_cdi_runtime(DraConfig(enabled=True), {"name": name, "version": version})
    assert found is not None
    assert found.status is status
    if status is Status.FAIL:
        assert "upgrade containerd to 1.7.12 or later" in found.fix
    assert check_cdi_runtime(DraConfig(), {"name": name, "version": version}) is None
    assert check_cdi_runtime(DraConfig(enabled=True), {"name": None, "version": None}) is None


def test_check_asks_the_running_daemon_which_runtime_it_serves(
    node: Node, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a daemon running (its status socket in the state dir), check names its runtime's CDI
    floor; with none, it says nothing of it."""
    import threading

    from nri_plugin.daemon.status import StatusServer, status_socket_path
    from nri_plugin.mixedcpu.status import SCHEMA

    node.write_config(f'[dra]\nenabled = true\nnode_name = "n1"\ncdi_dir = "{node.root}/cdi"\n')
    _, lines = check(capsys, "--config", str(node.config))
    assert not [line for line in lines if line[6:].startswith("CDI in the runtime")]
    (node.root / "state").mkdir(mode=0o700, exist_ok=True)
    serving, stop = threading.Event(), threading.Event()

    def serve() -> None:
        async def run() -> None:
            document = {"schema": SCHEMA, "runtime": {"name": "containerd", "version": "v1.7.11"}}
            server = StatusServer(status_socket_path(str(node.root / "state")), lambda: document)
            await server.start()
            serving.set()
            await asyncio.to_thread(stop.wait)
            await server.close()

        asyncio.run(run())

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        assert serving.wait(30)
        _, lines = check(capsys, "--config", str(node.config))
    finally:
        stop.set()
        thread.join()
    assert line_of(lines, "CDI in the runtime").startswith("FAIL  CDI in the runtime     containerd v1.7.11")
