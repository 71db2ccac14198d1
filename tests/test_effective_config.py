"""``config``: every key of the effective config, with its origin, as TOML that ``run --config`` takes
back and that gives the same configuration."""

from __future__ import annotations

import dataclasses
import math
import struct
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nri_plugin.daemon import effective
from nri_plugin.daemon.cli import main
from nri_plugin.daemon.config import TRUSTED_SOURCE_KEYS, Config, ConfigError, load_config
from nri_plugin.daemon.effective import config_command, effective_settings
from nri_plugin.deviceplugin.config import DevicePluginConfig
from nri_plugin.dra.config import DraConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

# Every value other than its default: a key printed from the wrong field shows.
EVERY_KEY = """\
shared_cpuset = "2,3"
plugin_name = "mine"
plugin_index = "42"
nri_socket = "/run/nri/other.sock"
cgroup_root = "/host/cgroup"
cgroup_version = "v2"
sysfs_root = "/host/sys"
numa_local_shared_cpus = true
state_dir = "/var/lib/other"
log_level = "debug"
log_format = "json"
metrics_address = ":9000"
reconcile_interval = 7.5
max_synchronize_mib = 64
nri_stall_limit = 90.0
systemd_bus = ""

[trusted_sources]
device_plugin_marker = false
pod_annotation = true

[device_plugin]
enabled = false
resource_name = "example.com/shared"
device_count = 12
plugin_dir = "/dp"
endpoint = "x.sock"
pod_resources_socket = ""

[dra]
driver_name = "shared.example.com"
registry_dir = "/reg"
plugins_dir = "/plugins"
cdi_dir = "/cdi"
node_name = "node-7"
publish_resource_slices = false
kubeconfig = "/etc/kubeconfig"
"""


def write(tmp_path: Path, text: str, name: str = "config.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def keys_of_the_model() -> set[str]:
    """Every key the config model knows, from its fields: a new field is a new key to print."""
    attributes = {f.name for f in dataclasses.fields(Config)} - {"source", "device_plugin", "dra"}
    sources = {f"trusted_sources.{key}" for key in TRUSTED_SOURCE_KEYS}
    top = attributes - set(TRUSTED_SOURCE_KEYS.values())
    device_plugin = {f"device_plugin.{f.name}" for f in dataclasses.fields(DevicePluginConfig)}
    dra = {f"dra.{f.name}" for f in dataclasses.fields(DraConfig)}
    return top | sources | device_plugin | dra


def printed_keys(document: dict[str, object]) -> set[str]:
    keys = set()
    for key, value in document.items():
        if isinstance(value, dict):
            keys |= {f"{key}.{inner}" for inner in value}
        else:
            keys.add(key)
    return keys


def same(config: Config, other: Config) -> bool:
    return dataclasses.replace(config, source="") == dataclasses.replace(other, source="")


@pytest.mark.parametrize("text", ['shared_cpuset = "0-1"\n', EVERY_KEY], ids=["defaults", "every-key"])
def test_every_key_is_printed_and_read_back_the_same(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    output = config_command(path, environ={})
    document = tomllib.loads(output)
    assert printed_keys(document) == keys_of_the_model()
    effective = load_config(path, check=False)
    # The printed file, given to run's loader, is the same configuration.
    again = load_config(write(tmp_path, output, "printed.toml"), check=False)
    assert same(again, effective)


def test_each_value_says_where_it_comes_from(tmp_path: Path) -> None:
    path = write(tmp_path, 'shared_cpuset = "0-1"\n\n[device_plugin]\ndevice_count = 3\n')
    lines = config_command(path, environ={}).splitlines()
    origins = {line.split(" = ")[0]: line.rsplit("# ", 1)[1] for line in lines if " = " in line}
    assert origins.pop("shared_cpuset") == "file"
    assert origins.pop("device_count") == "file"
    assert set(origins.values()) == {"default"}, origins
    assert lines[:3] == [*lines[:2], ""]  # the heading, set apart
    assert lines[3].startswith('shared_cpuset = "0-1"  ')
    assert "[device_plugin]" in lines
    assert any(line.startswith("reconcile_interval = 30.0 ") for line in lines)
    pod_resources = 'pod_resources_socket = "/var/lib/kubelet/pod-resources/kubelet.sock" '
    assert any(line.startswith(pod_resources) for line in lines)


def test_the_environment_wins_over_the_file_as_for_run(tmp_path: Path) -> None:
    path = write(tmp_path, 'shared_cpuset = "0-1"\nplugin_index = "20"\n')
    environ = {"NRI_PLUGIN_IDX": "30", "NRI_PLUGIN_NAME": "", "NRI_PLUGIN_SOCKET": "3"}
    config, settings = effective_settings(path, environ)
    assert (config.plugin_index, config.plugin_name) == ("30", "mixed-cpu")
    output = config_command(path, environ=environ)
    assert 'plugin_index = "30"' in output
    assert output.count("# environment (NRI_PLUGIN_IDX)") == 1
    [socket_line] = [line for line in output.splitlines() if line.startswith("nri_socket")]
    assert "not used while NRI_PLUGIN_SOCKET=3" in socket_line
    again = load_config(write(tmp_path, output, "printed.toml"), check=False)
    assert same(again, config)
    assert [s.origin for s in settings if s.key == "plugin_name"] == ["default"]


def test_the_name_and_index_are_those_run_would_register(tmp_path: Path) -> None:
    """`config` and `run` share one identity: an old runtime's whole file name in NRI_PLUGIN_NAME is
    shown cut, as `run` registers it, and an NN-name executable counts before the file."""
    path = write(tmp_path, 'shared_cpuset = "0-1"\nplugin_index = "20"\nplugin_name = "cfg"\n')
    config, _ = effective_settings(path, {"NRI_PLUGIN_NAME": "05-mixed-cpu"})
    assert (config.plugin_index, config.plugin_name) == ("05", "mixed-cpu")
    output = config_command(path, environ={"NRI_PLUGIN_NAME": "05-mixed-cpu"})
    assert 'plugin_name = "mixed-cpu"' in output
    assert 'plugin_index = "05"' in output
    assert output.count("# environment (NRI_PLUGIN_NAME)") == 2
    launched = config_command(path, environ={}, executable="/opt/nri/plugins/30-file-name")
    assert 'plugin_name = "file-name"' in launched
    assert output.count("# environment (NRI_PLUGIN_NAME)") == 2
    assert launched.count("# executable name (30-file-name)") == 2
    plain = config_command(path, environ={}, executable="/usr/bin/mixed-cpu-nri-plugin")
    assert 'plugin_name = "cfg"' in plain
    assert 'plugin_index = "20"' in plain
    with pytest.raises(ConfigError, match=r"plugin index '7' is invalid.*NRI_PLUGIN_IDX"):
        config_command(path, environ={"NRI_PLUGIN_IDX": "7"})


def test_strings_are_escaped_as_toml_wants(tmp_path: Path) -> None:
    path = write(tmp_path, 'shared_cpuset = "0"\nstate_dir = "/var/lib/a \\"b\\" \\\\ c\\u007f\\t"\n')
    output = config_command(path, environ={})
    again = load_config(write(tmp_path, output, "printed.toml"), check=False)
    assert again.state_dir == '/var/lib/a "b" \\ c\x7f\t'


def test_the_command_prints_it_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, 'shared_cpuset = "0-1"\n')
    assert main(["config", "--config", path]) == 0
    out, err = capsys.readouterr()
    assert tomllib.loads(out)["shared_cpuset"] == "0-1"
    assert err == ""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "no such file"),
        ('shared_cpuset = "0-1"\nstate_dirr = "/x"\n', "did you mean state_dir?"),
    ],
    ids=["missing", "typo"],
)
def test_a_config_run_refuses_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None, message: str
) -> None:
    path = write(tmp_path, text) if text is not None else str(tmp_path / "none.toml")
    assert main(["config", "--config", path]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    [line] = err.splitlines()
    assert line.startswith(f"error: {path}: ")
    assert message in line
    if text is None:
        assert line.endswith("; 'mixed-cpu-nri-plugin config --defaults' prints every key's default")


def test_the_defaults_need_no_file_and_become_a_config_once_shared_cpuset_is_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`config --defaults` reads nothing (the host of a DaemonSet has no config file): every key at
    its default, shared_cpuset (required) commented out; uncommented, the text is a config that
    loads as a file with shared_cpuset alone does."""
    assert main(["config", "--defaults"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    [required] = [line for line in lines if "shared_cpuset" in line and "required" in line]
    assert required.startswith('# shared_cpuset = "0-1"  ')
    assert required.endswith("# required, no default: the node's shared CPUs (a Linux cpu list)")
    document = tomllib.loads(out)
    assert "shared_cpuset" not in document
    assert printed_keys({**document, "shared_cpuset": "0-1"}) == keys_of_the_model()
    origins = {line.rsplit("# ", 1)[1] for line in lines if " = " in line and not line.startswith("#")}
    assert origins == {"default"}
    taken_back = load_config(
        write(tmp_path, out.replace(required, 'shared_cpuset = "0-1"'), "d.toml"), check=False
    )
    alone = load_config(write(tmp_path, 'shared_cpuset = "0-1"\n'), check=False)
    assert same(taken_back, alone)
    environ_first = config_command(None, environ={"NRI_PLUGIN_NAME": "other"})
    assert 'plugin_name = "other"' in environ_first
    assert "# environment (NRI_PLUGIN_NAME)" in environ_first
    with pytest.raises(SystemExit) as refused:
        main(["config", "--defaults", "--config", str(tmp_path / "x.toml")])
    assert refused.value.code == 2


# -- the writer, for every value TOML holds -------------------------------------------------------------
#
# The text is written by hand (docs/design.md says why: the origin comment beside each key), so each
# value type is checked against the standard library's TOML reader over generated values.

_VALUES = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),  # TOML's integers are 64-bit
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(),
)
# Any text but the one origin printed as a commented-out example (`config --defaults`' shared_cpuset).
_ORIGINS = st.text().filter(lambda origin: origin != effective.REQUIRED)
_NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,15}", fullmatch=True)  # the config's keys and tables are bare


def _same(read: object, written: str | bool | int | float) -> bool:
    """Equal, and of the same type; floats to the bit (-0.0), a nan as a nan (TOML has one)."""
    if isinstance(written, float):
        if math.isnan(written):
            return isinstance(read, float) and math.isnan(read)
        return isinstance(read, float) and struct.pack("<d", read) == struct.pack("<d", written)
    return type(read) is type(written) and read == written


@given(_VALUES)
@settings(max_examples=500)
def test_every_value_reads_back_as_written(value: str | bool | int | float) -> None:
    text = effective._assignment(effective.Setting("", "key", value, "file"))
    assert _same(tomllib.loads(text)["key"], value), text


@given(
    st.dictionaries(
        st.just("") | _NAMES,
        st.dictionaries(_NAMES, st.tuples(_VALUES, _ORIGINS), min_size=1, max_size=4),
        min_size=1,
        max_size=4,
    ),
    st.text(),
)
@settings(max_examples=100)
def test_a_rendered_config_reads_back_whatever_its_values_origins_and_path(
    tables: dict[str, dict[str, tuple[str | bool | int | float, str]]], path: str
) -> None:
    # Top-level keys first, as the daemon's settings come; a table named as a top-level key is not
    # something the config has.
    top = tables.get("", {})
    tables = {name: keys for name, keys in tables.items() if name not in top}
    order = sorted(tables, key=lambda name: name != "")
    given_settings = [
        effective.Setting(name, key, value, origin)
        for name in order
        for key, (value, origin) in tables[name].items()
    ]
    document = tomllib.loads(effective.render(path, given_settings))
    for setting in given_settings:
        table = document[setting.table] if setting.table else document
        assert _same(table[setting.key], setting.value), setting
    assert sum(len(keys) for keys in tables.values()) == len(given_settings)
