"""The TOML config: every wrong value is one ConfigError line naming the key; the CLI exits 2 on it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from host_guard import isolated
from mixedcpu_support import run_cli

from nri_plugin.cgroups import CgroupMode
from nri_plugin.daemon.config import (
    Config,
    ConfigError,
    ConfigMissing,
    build_layout,
    load_config,
    parse_config,
    state_dir_problem,
)
from nri_plugin.deviceplugin.config import DevicePluginConfig


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """A fake sysfs with CPUs 0-7 online."""
    online = tmp_path / "sys" / "devices" / "system" / "cpu"
    online.mkdir(parents=True)
    (online / "online").write_text("0-7\n")
    return tmp_path / "sys"


def write(tmp_path: Path, text: str, sysfs: Path | None = None) -> Path:
    path = tmp_path / "config.toml"
    header = f'sysfs_root = "{sysfs}"\n' if sysfs is not None else ""
    path.write_text(header + text)
    return path


def test_minimal_config_takes_the_defaults(tmp_path: Path, sysfs: Path) -> None:
    config = load_config(write(tmp_path, 'shared_cpuset = "3,4"\n', sysfs))
    assert config == Config(
        shared_cpuset=frozenset({3, 4}), sysfs_root=str(sysfs), source=str(tmp_path / "config.toml")
    )
    assert config.shared_cpuset_text == "3-4"
    assert (config.plugin_name, config.plugin_index) == ("mixed-cpu", "10")
    assert config.nri_socket == "/var/run/nri/nri.sock"
    assert config.cgroup_root == "/sys/fs/cgroup"
    assert config.state_dir == "/var/lib/mixed-cpu-nri"
    assert config.trust_device_plugin_marker is True
    assert config.trust_pod_annotation is False
    assert (config.log_level, config.log_format) == ("info", "auto")
    assert config.metrics_address == "127.0.0.1:8891"
    assert config.device_plugin == DevicePluginConfig()


def test_nri_stall_limit_is_seconds_in_range() -> None:
    """How long the NRI connection may be stuck before /healthz fails (issue 29): 60 s by default."""
    assert parse_config({"shared_cpuset": "0"}).nri_stall_limit == 60.0
    for good in (1, 5.5, 3600):
        assert parse_config({"shared_cpuset": "0", "nri_stall_limit": good}).nri_stall_limit == good
    for bad in (0, 0.5, 3601, True, "60"):
        with pytest.raises(ConfigError) as info:
            parse_config({"shared_cpuset": "0", "nri_stall_limit": bad})
        assert "nri_stall_limit: " in str(info.value)
        assert "seconds from 1 to 3600" in str(info.value)
        assert "registration timeout" in str(info.value)


def test_every_key(tmp_path: Path, sysfs: Path) -> None:
    config = load_config(
        write(
            tmp_path,
            """
shared_cpuset = "0-1"
plugin_name = "shared-cpus"
plugin_index = "05"
nri_socket = "/run/nri//nri.sock"
cgroup_root = "/host/sys/fs/cgroup/"
cgroup_version = "v2"
state_dir = "/var/lib/x"
log_level = "debug"
log_format = "json"
metrics_address = "[::1]:9100"

[trusted_sources]
device_plugin_marker = false
pod_annotation = true

[device_plugin]
enabled = false
""",
            sysfs,
        )
    )
    assert config.plugin_index == "05"
    assert config.nri_socket == "/run/nri/nri.sock"  # normalized
    assert config.cgroup_root == "/host/sys/fs/cgroup"
    assert config.cgroup_version == "v2"
    assert (config.trust_device_plugin_marker, config.trust_pod_annotation) == (False, True)
    assert config.device_plugin.enabled is False
    assert (config.log_level, config.log_format) == ("debug", "json")
    assert config.metrics_address == "[::1]:9100"


WRONG = [
    ("", "shared_cpuset: is required", "e.g. shared_cpuset"),
    ('shared_cpuset = ""', "shared_cpuset: is empty", "list the node's shared CPUs"),
    ('shared_cpuset = "0-x"', 'shared_cpuset: invalid cpu list "0-x"', 'expected e.g. "0-3,8"'),
    ('shared_cpuset = "3-1"', "shared_cpuset: invalid cpu list", "is reversed"),
    ('shared_cpuset = "1,,2"', "shared_cpuset: invalid cpu list", "empty item"),
    ('shared_cpuset = " 1, 2"', "shared_cpuset: invalid cpu list", "whitespace"),
    ("shared_cpuset = 3", "shared_cpuset: is the number 3", 'quote it, shared_cpuset = "3"'),
    (
        'shared_cpuset = "0-1"\nshared_cpus = "2"',
        "shared_cpus: unknown key (a typo?)",
        "known keys: shared_cpuset",
    ),
    (
        'shared_cpuset = "0"\nplugin_index = "7"',
        "plugin_index:",
        'exactly two digits, e.g. plugin_index = "10"',
    ),
    ('shared_cpuset = "0"\nplugin_index = 100', "plugin_index:", "exactly two digits"),
    (
        'shared_cpuset = "0"\nplugin_index = 10',
        "plugin_index: is the number 10",
        'a string of exactly two digits: quote it, plugin_index = "10"',
    ),
    ('shared_cpuset = "0"\nplugin_index = 5', "plugin_index: is the number 5", 'plugin_index = "05"'),
    ('shared_cpuset = "0"\nplugin_index = true', "plugin_index:", "exactly two digits"),
    ('shared_cpuset = "0"\nplugin_name = "mixed cpu"', "plugin_name:", "letters, digits and _ . + - only"),
    ('shared_cpuset = "0"\nstate_dir = "var/lib/x"', "state_dir:", "must be an absolute path"),
    ('shared_cpuset = "0"\nnri_socket = 5', "nri_socket: must be a string", "int"),
    ('shared_cpuset = "0"\ncgroup_root = ""', "cgroup_root:", "absolute path"),
    ('shared_cpuset = "0"\ncgroup_version = "v3"', "cgroup_version:", "not one of auto, v1, v2"),
    ('shared_cpuset = "0"\nlog_level = "loud"', "log_level:", "not one of debug, info, warning, error"),
    ('shared_cpuset = "0"\nlog_format = "xml"', "log_format:", "not one of auto, console, json"),
    ('shared_cpuset = "0"\nmetrics_address = "8891"', "metrics_address:", "is not host:port"),
    ('shared_cpuset = "0"\nmetrics_address = "localhost:"', "metrics_address:", '"" to turn'),
    ('shared_cpuset = "0"\nmetrics_address = "localhost:99999"', "metrics_address:", "is not host:port"),
    ('shared_cpuset = "0"\nmetrics_address = "a b:80"', "metrics_address:", "is not host:port"),
    ('shared_cpuset = "0"\nmetrics_address = 8891', "metrics_address: must be a string", "int"),
    ('shared_cpuset = "0"\ntrusted_sources = 1', "trusted_sources: must be a table", "[trusted_sources]"),
    (
        'shared_cpuset = "0"\n[trusted_sources]\npod_anotation = true',
        "trusted_sources.pod_anotation: unknown key",
        "known keys: device_plugin_marker, pod_annotation",
    ),
    (
        'shared_cpuset = "0"\n[trusted_sources]\npod_annotation = "yes"',
        "trusted_sources.pod_annotation:",
        "must be true or false",
    ),
    (
        'shared_cpuset = "0"\n[trusted_sources]\ndevice_plugin_marker = false',
        "trusted_sources: no request source",
        "pod_annotation = true",
    ),
    (
        'shared_cpuset = "0"\n[device_plugin]\nenabled = false',
        "trusted_sources.pod_annotation: is false while",
        "enable the device plugin",
    ),
    (
        'shared_cpuset = "0"\n[device_plugin]\ncount = 3',
        "device_plugin.count: unknown key (a typo?)",  # as in every other table
        "did you mean device_plugin.device_count?",
    ),
    (
        'shared_cpuset = "0"\n[device_plugin]\ndevice_count = 0',
        "[device_plugin] device_count = 0",
        "between 1",
    ),
]


@pytest.mark.parametrize(
    ("text", "key", "fix"), WRONG, ids=[f"{i}-{w[1].split(':')[0]}" for i, w in enumerate(WRONG)]
)
def test_wrong_values_name_the_key_and_the_fix(
    tmp_path: Path, sysfs: Path, text: str, key: str, fix: str
) -> None:
    path = write(tmp_path, text + "\n", sysfs)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert key in message
    assert fix in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("shared", "problem"),
    [
        ("6-9", "CPUs 8-9 are not online (online: 0-7"),
        ("0-7", "0-7 is every online CPU, which leaves none to be exclusive"),
    ],
)
def test_shared_cpus_must_be_online_and_leave_some_over(
    tmp_path: Path, sysfs: Path, shared: str, problem: str
) -> None:
    with pytest.raises(ConfigError, match="shared_cpuset: ") as info:
        load_config(write(tmp_path, f'shared_cpuset = "{shared}"\n', sysfs))
    assert problem in str(info.value)


def test_unreadable_sysfs_names_sysfs_root(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"sysfs_root: cannot read the online CPUs from .*/nowhere/devices"):
        load_config(write(tmp_path, f'shared_cpuset = "0"\nsysfs_root = "{tmp_path}/nowhere"\n'))


def test_syntax_errors_missing_file_and_encoding(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"not valid TOML: .*line 2.*; fix the syntax there"):
        load_config(write(tmp_path, 'shared_cpuset = "0"\nplugin_name = \n'))
    with pytest.raises(ConfigError, match=r"no such file; create it with at least shared_cpuset"):
        load_config(tmp_path / "absent.toml")
    (tmp_path / "latin1.toml").write_bytes(b'shared_cpuset = "0" # caf\xe9\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(tmp_path / "latin1.toml")
    with pytest.raises(ConfigError, match=r": a directory, not a regular file: .* point --config at"):
        load_config(tmp_path)


def test_a_fifo_or_a_device_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO with no writer would block the open and the read for ever: refused before either, as a
    device is; a link to a regular file (a ConfigMap's) is followed."""
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"config.toml: a FIFO, not a regular file"):
        load_config(fifo)
    with pytest.raises(ConfigError, match=r"^/dev/zero: a character device, not a regular file"):
        load_config("/dev/zero")
    (tmp_path / "data").mkdir()
    real = write(tmp_path / "data", 'shared_cpuset = "0"\n')
    (tmp_path / "link.toml").symlink_to(real)
    assert load_config(tmp_path / "link.toml", check=False).shared_cpuset == frozenset({0})
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (2 << 20))
    with pytest.raises(ConfigError, match="larger than 1048576 bytes"):
        load_config(big)


@pytest.mark.parametrize(
    ("text", "fix"),
    [
        (
            "shared_cpuset = 0-1\n",
            'line 1, column 18); a cpu list is a string in TOML: quote it, shared_cpuset = "0-1"',
        ),
        ('log_level = "info"\nshared_cpuset = 0,2  # two\n', 'quote it, shared_cpuset = "0,2"'),
        (
            'shared_cpuset = "0"\nlog_format = json\n',
            'text is a string in TOML: quote it, log_format = "json"',
        ),
        ('shared_cpuset = "0-1\n', "; fix the syntax there"),
    ],
    ids=["cpu-list", "cpu-list-commented", "word", "other"],
)
def test_an_unquoted_string_is_told_to_be_quoted(tmp_path: Path, text: str, fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'config.toml'}: not valid TOML: ")
    assert message.endswith(fix)
    assert "\n" not in message


def test_an_unreadable_config_says_who_may_read_it(tmp_path: Path) -> None:
    """Run as uid 65534, as a user who forgot sudo: the file is root's, mode 0600."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to make a file only root may read and to become another user")
    with tempfile.TemporaryDirectory() as directory:
        os.chmod(directory, 0o755)
        path = Path(directory) / "config.toml"
        path.write_text('shared_cpuset = "0-1"\n')
        path.chmod(0o600)
        nested = Path(directory) / "closed"
        nested.mkdir(mode=0o700)
        (nested / "config.toml").write_text('shared_cpuset = "0-1"\n')
        file_line, directory_line = as_nobody(str(path)), as_nobody(str(nested / "config.toml"))
    assert file_line == (
        f"{path}: cannot read the config file: Permission denied to uid 65534: mode 0600, owner uid 0, so "
        f"only root may read it; run as root, as the daemon runs, or let uid 65534 read it (chmod o+r {path})"
    )
    assert directory_line == (
        f"{nested / 'config.toml'}: cannot read the config file: Permission denied to uid 65534, which may "
        "not search a directory on its way; run as root, as the daemon runs"
    )


def as_nobody(path: str) -> str:
    """load_config's error for `path`, in a child that became uid 65534 once it had imported it (the
    interpreter's own files may be where that user cannot read them)."""
    code = (
        "import os, sys; from nri_plugin.daemon.config import ConfigError, load_config; "
        "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
        "try:\n    load_config(sys.argv[1], check=False)\nexcept ConfigError as exc:\n    print(exc)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, path], capture_output=True, text=True, timeout=60, check=True
    )
    return result.stdout.strip()


def test_parse_config_alone_needs_no_machine() -> None:
    config = parse_config({"shared_cpuset": "100-101"}, source="inline")
    assert config.shared_cpuset == {100, 101}
    assert config.source == "inline"


def test_layout_forced_or_detected(tmp_path: Path) -> None:
    base = {"shared_cpuset": "0"}
    (tmp_path / "cpu").mkdir()
    with pytest.raises(
        ConfigError, match=r"cgroup_root: .*/cpuset is not a directory, but cgroup_version = \"v1\""
    ):
        build_layout(parse_config({**base, "cgroup_root": str(tmp_path), "cgroup_version": "v1"}))
    (tmp_path / "cpuset").mkdir()
    v1 = build_layout(parse_config({**base, "cgroup_root": str(tmp_path), "cgroup_version": "v1"}))
    assert (v1.mode, v1.cpu.mount_point, v1.cpuset.mount_point) == (
        CgroupMode.V1,
        str(tmp_path / "cpu"),
        str(tmp_path / "cpuset"),
    )
    v2 = build_layout(parse_config({**base, "cgroup_root": str(tmp_path), "cgroup_version": "v2"}))
    assert (v2.mode, v2.cpu.version, v2.cpu.mount_point) == (CgroupMode.V2, 2, str(tmp_path))
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        f"30 20 0:26 / {tmp_path}/cpu rw - cgroup cgroup rw,cpu,cpuacct\n"
        f"31 20 0:27 / {tmp_path}/cpuset rw - cgroup cgroup rw,cpuset\n"
    )
    detected = build_layout(
        parse_config({**base, "cgroup_root": str(tmp_path)}), mountinfo_path=str(mountinfo)
    )
    assert detected.mode is CgroupMode.V1
    assert detected.cpuset.mount_point == str(tmp_path / "cpuset")
    mountinfo.write_text("")
    with pytest.raises(ConfigError, match=r"cgroup_root: no cgroup filesystem is mounted"):
        build_layout(parse_config({**base, "cgroup_root": str(tmp_path)}), mountinfo_path=str(mountinfo))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, "no such file; create it with at least"),
        ('shared_cpuset = "0-x"\n', 'shared_cpuset: invalid cpu list "0-x"'),
        ('shared_cpuset = "0"\nstate_dirr = "/x"\n', "state_dirr: unknown key (a typo?)"),
        (
            'shared_cpuset = "0"\ncgroup_version = "v1"\ncgroup_root = "/nonexistent"\n',
            "cgroup_root: /nonexistent/cpu",
        ),
    ],
    ids=["missing-file", "bad-cpuset", "unknown-key", "missing-cgroup-root"],
)
def test_cli_exits_2_with_one_line(tmp_path: Path, sysfs: Path, text: str | None, expected: str) -> None:
    path = tmp_path / "config.toml"
    if text is not None:
        write(tmp_path, isolated(text, tmp_path), sysfs)
    result = run_cli("run", "--config", str(path), timeout=20)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {path}: ")
    assert expected in lines[0]
    assert result.stdout == ""


def test_cli_unusable_state_dir_exits_2(tmp_path: Path, sysfs: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "device-plugin-hmac.key").write_bytes(b"short")
    os.chmod(state / "device-plugin-hmac.key", 0o600)
    path = write(
        tmp_path,
        isolated(
            f'shared_cpuset = "0"\nstate_dir = "{state}"\ncgroup_version = "v2"\n'
            f'cgroup_root = "{tmp_path}"\n',
            tmp_path,
        ),
        sysfs,
    )
    result = run_cli("run", "--config", str(path), timeout=20)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {path}: state_dir: ")
    assert "5 bytes, a marker secret is 32" in line


# -- what operators tripped over (issue 15) ------------------------------------------------------------


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (
            {"shared_cpuset": "0", "state_dirr": "/x"},
            "state_dirr: unknown key (a typo?): did you mean state_dir? known keys: shared_cpuset, ",
        ),
        (
            {"shared_cpuset": "0", "trusted_sources": {"pod_anotation": True}},
            "trusted_sources.pod_anotation: unknown key (a typo?): did you mean "
            "trusted_sources.pod_annotation? known keys: device_plugin_marker, pod_annotation",
        ),
        (
            {"shared_cpuset": "0", "device_plugin": {"dir": "/x"}},
            "device_plugin.dir: unknown key (a typo?): did you mean device_plugin.plugin_dir? known keys: "
            "enabled, resource_name, device_count, plugin_dir, endpoint",
        ),
        (
            {"shared_cpuset": "0", "colour": "blue"},
            "colour: unknown key (a typo?): known keys: shared_cpuset, ",  # nothing near: no guess
        ),
    ],
    ids=["top-level", "trusted_sources", "device_plugin", "no-guess"],
)
def test_unknown_keys_read_alike_in_every_table_and_name_the_nearest(
    document: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(document, source="c.toml")
    assert str(info.value).startswith(f"c.toml: {message}")


def test_a_go_style_address_listens_everywhere_and_a_bad_port_says_so() -> None:
    assert parse_config({"shared_cpuset": "0", "metrics_address": ":8891"}).metrics_address == ":8891"
    for text, problem in (
        ("localhost:99999", "the port 99999 is out of range (0 to 65535)"),
        ("8891", "it has no :port at the end"),
        ("[]:8891", 'the host "" is not a host name or address'),
    ):
        with pytest.raises(ConfigError) as info:
            parse_config({"shared_cpuset": "0", "metrics_address": text})
        assert f"is not host:port: {problem};" in str(info.value)


def test_a_missing_file_is_its_own_error() -> None:
    with pytest.raises(ConfigMissing):
        load_config("/nonexistent/mixed-cpu/config.toml")


def _tree(tmp_path: Path) -> Path:
    for controller in ("cpu", "cpuset"):
        (tmp_path / controller).mkdir()
    return tmp_path


V1_MOUNTS = (
    "30 20 0:26 / ROOT/cpu rw - cgroup cgroup rw,cpu,cpuacct\n"
    "31 20 0:27 / ROOT/cpuset rw - cgroup cgroup rw,cpuset\n"
)
V2_MOUNT = "30 20 0:26 / ROOT rw - cgroup2 cgroup2 rw,nsdelegate\n"


@pytest.mark.parametrize(
    ("forced", "mounts", "served", "actual"),
    [
        ("v2", V1_MOUNTS, "cpu controller served by a cgroup v1 hierarchy at ROOT/cpu;", "v1"),
        ("v1", V2_MOUNT, "cpu controller served by a cgroup v2 hierarchy at ROOT;", "v2"),
    ],
    ids=["v2-on-a-v1-host", "v1-on-a-v2-host"],
)
def test_a_forced_version_the_mounts_contradict_is_refused(
    tmp_path: Path, forced: str, mounts: str, served: str, actual: str
) -> None:
    root = _tree(tmp_path)
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(mounts.replace("ROOT", str(root)))
    config = parse_config({"shared_cpuset": "0", "cgroup_root": str(root), "cgroup_version": forced})
    with pytest.raises(ConfigError) as info:
        build_layout(config, mountinfo_path=str(mountinfo))
    message = str(info.value)
    assert f'cgroup_version: "{forced}" is forced, but {mountinfo} shows the ' in message
    assert served.replace("ROOT", str(root)) in message
    assert message.endswith(f'set cgroup_version = "auto" (or "{actual}")')


def test_a_forced_version_the_mounts_agree_with_or_do_not_show_is_taken(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(V1_MOUNTS.replace("ROOT", str(root)))
    forced_v1 = parse_config({"shared_cpuset": "0", "cgroup_root": str(root), "cgroup_version": "v1"})
    assert build_layout(forced_v1, mountinfo_path=str(mountinfo)).mode is CgroupMode.V1
    mountinfo.write_text(V1_MOUNTS.replace("ROOT", "/elsewhere"))  # what forcing is for
    forced_v2 = parse_config({"shared_cpuset": "0", "cgroup_root": str(root), "cgroup_version": "v2"})
    assert build_layout(forced_v2, mountinfo_path=str(mountinfo)).mode is CgroupMode.V2
    assert build_layout(forced_v2, mountinfo_path=str(tmp_path / "unreadable")).mode is CgroupMode.V2


def test_the_state_dir_must_be_the_daemons_alone(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert state_dir_problem(str(state)) is None  # made by the daemon, 0700
    state.mkdir(mode=0o700)
    assert state_dir_problem(str(state)) is None
    os.chmod(state, 0o777)
    assert state_dir_problem(str(state)) == (
        f"{state} is writable by its group and others (mode 0777); chmod 0700 {state}"
    )
    os.chmod(state, 0o1773)
    assert state_dir_problem(str(state)) == (
        f"{state} is writable by its group and others (mode 1773); chmod 0700 {state}"
    )
    os.chmod(state, 0o730)
    assert (
        state_dir_problem(str(state)) == f"{state} is writable by its group (mode 0730); chmod 0700 {state}"
    )
    os.chmod(state, 0o700)
    (tmp_path / "file").write_text("")
    assert state_dir_problem(str(tmp_path / "file")) == f"{tmp_path / 'file'} is not a directory"
    if os.geteuid() == 0:
        os.chown(state, 12345, -1)
        assert state_dir_problem(str(state)) == (
            f"{state} belongs to uid 12345, not to uid 0 that runs the daemon"
        )


def test_run_refuses_a_state_dir_others_may_write_with_status_2(tmp_path: Path, sysfs: Path) -> None:
    """The key that proves requests would be written where anyone could replace it."""
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o777)
    path = write(
        tmp_path,
        isolated(
            f'shared_cpuset = "0"\nstate_dir = "{state}"\ncgroup_version = "v2"\n'
            f'cgroup_root = "{tmp_path}"\n',
            tmp_path,
        ),
        sysfs,
    )
    result = run_cli("run", "--config", str(path), timeout=20)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {path}: state_dir: {state} is writable by its group and others (mode 0777); chmod 0700 "
        f"{state}; point state_dir at a directory only root can write"
    ]
    assert not (state / "device-plugin-hmac.key").exists(), "nothing written there"


def test_a_relative_plugin_dir_is_shown_as_written_not_as_a_python_object() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"shared_cpuset": "0", "device_plugin": {"plugin_dir": "relative"}}, source="c.toml")
    assert str(info.value).startswith("c.toml: [device_plugin] plugin_dir = 'relative': must be an absolute")
    assert "PurePosixPath" not in str(info.value)


def test_the_dra_table_is_read_and_its_mistakes_are_named() -> None:
    config = parse_config(
        {"shared_cpuset": "0-1", "dra": {"enabled": True, "node_name": "worker-1", "cdi_dir": "/etc/cdi"}}
    )
    assert config.dra.enabled
    assert config.dra.node_name == "worker-1"
    assert str(config.dra.cdi_dir) == "/etc/cdi"
    assert str(config.dra.registration_socket) == (
        "/var/lib/kubelet/plugins_registry/shared-cpus.mixed-cpu.openshift.io-reg.sock"
    )
    assert str(config.dra.service_socket) == (
        "/var/lib/kubelet/plugins/shared-cpus.mixed-cpu.openshift.io/dra.sock"
    )
    assert parse_config({"shared_cpuset": "0-1"}).dra.enabled is False
    for table, words in (
        ({"enabeld": True}, "enabled"),
        ({"driver_name": "Shared_CPUs"}, "lowercase DNS subdomain"),
        ({"cdi_dir": "var/run/cdi"}, "absolute path"),
        ({"enabled": "yes"}, "true or false"),
        ({"plugins_dir": "/" + "p" * 120}, "longer than the 107 bytes"),
    ):
        with pytest.raises(ConfigError, match="dra") as raised:
            parse_config({"shared_cpuset": "0-1", "dra": table})
        assert words in str(raised.value)


def test_dra_needs_the_marker_trusted_and_stands_in_for_the_device_plugin() -> None:
    with pytest.raises(ConfigError, match=r"device_plugin_marker.*\[dra\] enabled = true"):
        parse_config(
            {
                "shared_cpuset": "0-1",
                "trusted_sources": {"device_plugin_marker": False, "pod_annotation": True},
                "dra": {"enabled": True},
            }
        )
    # DRA alone (no device plugin) can prove requests: accepted.
    config = parse_config(
        {"shared_cpuset": "0-1", "device_plugin": {"enabled": False}, "dra": {"enabled": True}}
    )
    assert config.dra.enabled
    assert not config.device_plugin.enabled
