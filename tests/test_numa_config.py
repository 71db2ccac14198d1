"""NUMA-local shared CPUs at the daemon's edge: the ``numa_local_shared_cpus`` key, the topology read
from a fake sysfs (one node, two nodes, CPUs offline, no NUMA at all), the wiring that hands it to the
plugin, and ``check``'s view of the pool by node."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from mixedcpu_support import run_cli, write_daemon_config

from nri_plugin.cgroups import CpusetError, format_cpuset, parse_cpuset
from nri_plugin.daemon.check import Status, check_numa_nodes, run_checks
from nri_plugin.daemon.config import (
    Config,
    ConfigError,
    load_config,
    numa_nodes_from_cpulists,
    parse_config,
    read_numa_nodes,
)
from nri_plugin.daemon.wiring import RunOptions, build_daemon, shared_pool
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin

ALL = frozenset(range(16))


def make_sysfs(root: Path, online: str = "0-15", nodes: dict[str, str] | None = None) -> Path:
    """A fake sysfs: `online` CPUs, and a ``cpulist`` for each node directory named in `nodes`."""
    sysfs = root / "sys"
    cpu = sysfs / "devices" / "system" / "cpu"
    cpu.mkdir(parents=True, exist_ok=True)
    (cpu / "online").write_text(online + "\n")
    for name, cpus in (nodes or {}).items():
        directory = sysfs / "devices" / "system" / "node" / name
        directory.mkdir(parents=True)
        (directory / "cpulist").write_text(cpus + "\n")
    return sysfs


def shown(nodes: dict[int, frozenset[int]]) -> dict[int, str]:
    return {node: format_cpuset(cpus) for node, cpus in nodes.items()}


# -- the key ---------------------------------------------------------------------------------------------


def test_the_key_is_off_by_default_and_a_boolean() -> None:
    assert parse_config({"shared_cpuset": "0"}).numa_local_shared_cpus is False
    assert parse_config({"shared_cpuset": "0", "numa_local_shared_cpus": True}).numa_local_shared_cpus
    with pytest.raises(ConfigError) as info:
        parse_config({"shared_cpuset": "0", "numa_local_shared_cpus": "yes"}, source="c.toml")
    assert str(info.value) == 'c.toml: numa_local_shared_cpus: must be true or false, not "yes"'


def test_the_key_loads_from_the_file(tmp_path: Path) -> None:
    sysfs = make_sysfs(tmp_path)
    path = tmp_path / "config.toml"
    path.write_text(f'shared_cpuset = "0,8"\nsysfs_root = "{sysfs}"\nnuma_local_shared_cpus = true\n')
    assert load_config(path).numa_local_shared_cpus is True


# -- the topology ------------------------------------------------------------------------------------------


def test_the_pure_parser() -> None:
    cpulists = {"node1": "8-15\n", "node0": "0-7\n", "has_cpu": "1\n", "possible": "0-1", "node10": ""}
    assert shown(numa_nodes_from_cpulists(cpulists, ALL)) == {0: "0-7", 1: "8-15", 10: ""}
    assert list(numa_nodes_from_cpulists(cpulists, ALL)) == [0, 1, 10]  # in node order
    assert shown(numa_nodes_from_cpulists(cpulists, frozenset(range(12)))) == {0: "0-7", 1: "8-11", 10: ""}
    with pytest.raises(CpusetError):
        numa_nodes_from_cpulists({"node0": "0-x"}, ALL)


@pytest.mark.parametrize(
    ("online", "nodes", "expected"),
    [
        ("0-15", {"node0": "0-15"}, {0: "0-15"}),
        ("0-15", {"node0": "0-7", "node1": "8-15"}, {0: "0-7", 1: "8-15"}),
        # CPUs offline: only the online ones count, whatever a node's list says.
        ("0-5,8-13", {"node0": "0-7", "node1": "8-15"}, {0: "0-5", 1: "8-13"}),
        # A memory-only node (CXL, HBM) lists no CPU.
        ("0-15", {"node0": "0-7", "node1": "8-15", "node2": ""}, {0: "0-7", 1: "8-15", 2: ""}),
        # A kernel built without NUMA: one node of every online CPU.
        ("0-13", {}, {0: "0-13"}),
    ],
    ids=["one-node", "two-nodes", "cpus-offline", "memory-only-node", "no-numa"],
)
def test_read_numa_nodes(
    tmp_path: Path, online: str, nodes: dict[str, str], expected: dict[int, str]
) -> None:
    sysfs = make_sysfs(tmp_path, online, nodes)
    assert shown(read_numa_nodes(str(sysfs), parse_cpuset(online))) == expected


def test_an_unreadable_topology_is_one_line_naming_sysfs_root(tmp_path: Path) -> None:
    sysfs = make_sysfs(tmp_path, nodes={"node0": "0-x"})
    with pytest.raises(ConfigError) as info:
        read_numa_nodes(str(sysfs), ALL)
    message = str(info.value)
    assert message.startswith(
        f"sysfs_root: cannot read the NUMA nodes' CPUs from {sysfs}/devices/system/node/"
    )
    assert message.endswith(
        "; set sysfs_root to where the host's /sys is mounted, or numa_local_shared_cpus = false"
    )
    (sysfs / "devices" / "system" / "node" / "node0" / "cpulist").unlink()
    with pytest.raises(ConfigError, match=r"node0/cpulist: .*No such file"):
        read_numa_nodes(str(sysfs), ALL)


# -- the wiring -------------------------------------------------------------------------------------------


def test_the_pool_has_nodes_only_with_the_key(tmp_path: Path) -> None:
    sysfs = make_sysfs(tmp_path, "0-15", {"node0": "0-7", "node1": "8-15"})
    off = Config(shared_cpuset=frozenset({0, 8}), sysfs_root=str(sysfs))
    assert shared_pool(off).numa_nodes is None
    on = Config(shared_cpuset=frozenset({0, 8}), sysfs_root=str(sysfs), numa_local_shared_cpus=True)
    pool = shared_pool(on)
    assert pool.cpus == {0, 8}
    assert pool.numa_nodes is not None
    assert shown(dict(pool.numa_nodes)) == {0: "0-7", 1: "8-15"}
    with pytest.raises(TypeError):
        pool.numa_nodes[2] = frozenset()  # type: ignore[index]  # plain data, read-only
    broken = Config(
        shared_cpuset=frozenset({0}),
        sysfs_root=str(tmp_path / "none"),
        numa_local_shared_cpus=True,
        source="c.toml",
    )
    with pytest.raises(ConfigError, match=r"^c\.toml: sysfs_root: cannot read the online CPUs"):
        shared_pool(broken)


@pytest.fixture
def device_plugins() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _numa_daemon_config(tmp_path: Path, device_plugins: Path, nodes: dict[str, str]) -> Path:
    """write_daemon_config's node (shared 0-1 of online 0-3) with the key on and `nodes` in sysfs."""
    config = write_daemon_config(tmp_path, device_plugins)
    config.write_text("numa_local_shared_cpus = true\n" + config.read_text())
    make_sysfs(tmp_path, "0-3", nodes)
    return config


def test_the_daemon_hands_the_plugin_the_topology_and_says_so(
    tmp_path: Path, device_plugins: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("nri_plugin.daemon.wiring.configure_logging", lambda *_a, **_k: "json")
    config = _numa_daemon_config(tmp_path, device_plugins, {"node0": "0-1", "node1": "2-3"})
    with structlog.testing.capture_logs() as logs:
        daemon = build_daemon(RunOptions(config_path=str(config)), environ={})
    plugin = daemon.state
    assert isinstance(plugin, MixedCpuPlugin)
    assert plugin.pool.numa_nodes is not None
    assert shown(dict(plugin.pool.numa_nodes)) == {0: "0-1", 1: "2-3"}
    [split] = [e for e in logs if e["event"].startswith("shared CPUs are NUMA-local")]
    assert split["shared_by_numa_node"] == {"0": "0-1", "1": "none"}
    [bare] = [e for e in logs if e["event"].startswith("a NUMA node has no shared CPU")]
    assert (bare["log_level"], bare["numa_node"], bare["node_cpus"]) == ("warning", 1, "2-3")


def test_run_with_an_unreadable_topology_exits_2_with_one_line(tmp_path: Path, device_plugins: Path) -> None:
    config = _numa_daemon_config(tmp_path, device_plugins, {"node0": "0-1", "node1": "2-"})
    result = run_cli("run", "--config", str(config), timeout=20)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {config}: sysfs_root: cannot read the NUMA nodes' CPUs from ")
    assert "node1/cpulist" in line


# -- check ---------------------------------------------------------------------------------------------------


def _config(sysfs: Path, shared: str, *, on: bool = True) -> Config:
    return Config(
        shared_cpuset=parse_cpuset(shared), sysfs_root=str(sysfs), numa_local_shared_cpus=on, source="c.toml"
    )


def test_check_shows_the_pool_by_node(tmp_path: Path) -> None:
    sysfs = make_sysfs(tmp_path, "0-15", {"node0": "0-7", "node1": "8-15", "node2": ""})
    [finding] = check_numa_nodes(_config(sysfs, "0,8"))
    assert finding.status is Status.OK
    assert (finding.topic, finding.detail) == (
        "NUMA nodes",
        "node0 CPUs 0-7: shared 0; node1 CPUs 8-15: shared 8",
    )
    # With the key off, nothing to say: every container gets the whole pool.
    assert check_numa_nodes(_config(sysfs, "0,8", on=False)) == []


def test_check_warns_of_a_node_without_shared_cpus(tmp_path: Path) -> None:
    sysfs = make_sysfs(tmp_path, "0-15", {"node0": "0-7", "node1": "8-15"})
    [finding] = check_numa_nodes(_config(sysfs, "0-1"))
    assert finding.status is Status.WARN
    assert finding.detail == "node0 CPUs 0-7: shared 0-1; node1 CPUs 8-15: shared none"
    assert finding.fix.startswith("add CPUs of node1 to shared_cpuset and to kubelet's reservedSystemCPUs;")
    assert "gets the whole shared pool" in finding.fix


def test_check_fails_when_the_daemon_could_not_read_the_topology(tmp_path: Path) -> None:
    sysfs = make_sysfs(tmp_path, "0-15", {"node0": "zero"})
    [finding] = check_numa_nodes(_config(sysfs, "0-1"))
    assert finding.status is Status.FAIL
    assert finding.detail.startswith("c.toml: sysfs_root: cannot read the NUMA nodes' CPUs from ")


def test_the_report_shows_the_numa_line_after_the_shared_cpus(tmp_path: Path) -> None:
    sysfs = make_sysfs(tmp_path, "0-15", {"node0": "0-7", "node1": "8-15"})
    path = tmp_path / "config.toml"
    path.write_text(f'shared_cpuset = "0-1"\nsysfs_root = "{sysfs}"\nnuma_local_shared_cpus = true\n')
    report = run_checks(str(path))
    topics = [f.topic for f in report.findings]
    assert topics[1:3] == ["shared CPUs", "NUMA nodes"]
    lines = report.render().splitlines()
    assert lines[3] == "WARN  NUMA nodes             node0 CPUs 0-7: shared 0-1; node1 CPUs 8-15: shared none"
    assert lines[4].lstrip().startswith("fix: add CPUs of node1 to shared_cpuset")
