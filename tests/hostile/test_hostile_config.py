"""Config files with every kind of wrong value: a `Config` or one clear `ConfigError` line, never a crash.

tests/test_config.py names the key and the fix for each known mistake. Here hypothesis writes whole
TOML documents (known keys with values of every TOML type, unknown and unicode keys, nested arrays
and tables), plus arbitrary text and bytes, and `load_config` must return a `Config` or raise a
`ConfigError` whose message is one printable line (no newline, no bidi override) naming the file.
A few files of each kind also go through ``mixed-cpu-nri-plugin run --config F``: exit status 2,
exactly one line on stderr.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from host_guard import refuse_host_paths
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mixedcpu_support import ROOT

from nri_plugin.daemon.config import MAX_CONFIG_SIZE, Config, ConfigError, load_config

SETTINGS = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
TOP_KEYS = (
    "shared_cpuset",
    "plugin_name",
    "plugin_index",
    "nri_socket",
    "cgroup_root",
    "sysfs_root",
    "state_dir",
    "cgroup_version",
    "log_level",
    "log_format",
    "metrics_address",
)
SOURCE_KEYS = ("device_plugin_marker", "pod_annotation")
DEVICE_PLUGIN_KEYS = ("enabled", "resource_name", "device_count", "plugin_dir", "endpoint")
GOOD = {
    "shared_cpuset": "0-1",
    "plugin_name": "mixed-cpu",
    "plugin_index": "10",
    "nri_socket": "/run/nri/nri.sock",
    "cgroup_root": "/sys/fs/cgroup",
    "sysfs_root": "/sys",
    "state_dir": "/var/lib/mixed-cpu-nri",
    "cgroup_version": "auto",
    "log_level": "info",
    "log_format": "json",
    "metrics_address": "127.0.0.1:8891",
    "device_plugin_marker": True,
    "pod_annotation": False,
    "enabled": True,
    "resource_name": "workload.openshift.io/enable-shared-cpus",
    "device_count": 256,
    "plugin_dir": "/var/lib/kubelet/device-plugins",
    "endpoint": "mixed-cpu-nri-plugin.sock",
}

# -- a small TOML writer (the documents are built as Python values, then written out) ---------------------

_BARE = re.compile(r"[A-Za-z0-9_-]+")


def _string(text: str) -> str:
    # A TOML basic string: JSON's escapes are TOML's, once DEL (not escaped by JSON) is.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _key(key: str) -> str:
    return key if _BARE.fullmatch(key) else _string(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def toml(document: dict[str, Any]) -> str:
    lines = [f"{_key(k)} = {_value(v)}" for k, v in document.items() if not isinstance(v, dict)]
    for name, table in document.items():
        if isinstance(table, dict):
            lines.append(f"[{_key(name)}]")
            lines += [f"{_key(k)} = {_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


# -- documents ---------------------------------------------------------------------------------------------

text = st.text(st.characters(exclude_categories=["Cs"]), max_size=20)
scalars = st.one_of(
    text,
    st.sampled_from(["", "0-1", "0-999999999", "-1", "v1", "v3", "auto", "/", "//x/../y", "a\0b", "\u202e"]),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, -1, 99, 100, 2**31, 2**63 - 1]),
    st.floats(),
    st.booleans(),
    st.datetimes(timezones=st.none() | st.just(datetime.timezone.utc)),
    st.dates(),
    st.times(),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)),
    max_leaves=6,
)
keys = st.one_of(
    text.filter(bool), st.sampled_from(["Shared_cpuset", "shared-cpuset", "shared_cpuset ", "a\nb"])
)


def _table(names: tuple[str, ...]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {},
        optional={name: st.one_of(st.just(GOOD[name]), values) for name in names},
    ).flatmap(lambda table: st.dictionaries(keys, values, max_size=1).map(lambda extra: {**table, **extra}))


documents = st.fixed_dictionaries(
    # Mostly a good shared_cpuset (required, and checked first), so that the other keys are reached.
    {"shared_cpuset": st.one_of(st.just("0-1"), st.just("2"), st.just("0-1,3"), values)},
    optional={
        **{name: st.one_of(st.just(GOOD[name]), values) for name in TOP_KEYS[1:]},
        "trusted_sources": st.one_of(_table(SOURCE_KEYS), values),
        "device_plugin": st.one_of(_table(DEVICE_PLUGIN_KEYS), values),
    },
).flatmap(lambda doc: st.dictionaries(keys, values, max_size=1).map(lambda extra: {**extra, **doc}))


def _outcome(path: Path) -> Config | ConfigError:
    try:
        return load_config(path, check=False)
    except ConfigError as exc:
        message = str(exc)
        assert message.startswith(f"{path}: "), message
        assert message.isprintable(), message  # one line, no control or bidi characters
        return exc


@SETTINGS
@given(documents)
def test_any_toml_document_gives_a_config_or_one_error_line(
    tmp_path_factory: Any, document: dict[str, Any]
) -> None:
    path = tmp_path_factory.mktemp("config") / "config.toml"
    path.write_text(toml(document), encoding="utf-8")
    _outcome(path)


@SETTINGS
@given(
    st.one_of(st.binary(max_size=400), text.map(str.encode), documents.map(lambda d: toml(d).encode()[:-5]))
)
def test_any_bytes_give_a_config_or_one_error_line(tmp_path_factory: Any, data: bytes) -> None:
    path = tmp_path_factory.mktemp("config") / "config.toml"
    path.write_bytes(data)
    _outcome(path)


# -- what the fuzzing found --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recursion_limit", "message"),
    [
        (1000, "nested too deeply"),  # the interpreter's default: tomllib runs out of frames
        (100_000, "unknown key"),  # raised (hypothesis raises it while it runs): parsed, then refused
    ],
)
def test_deeply_nested_arrays_are_a_config_error_not_a_crash(
    tmp_path: Path, recursion_limit: int, message: str
) -> None:
    path = tmp_path / "config.toml"
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(recursion_limit)  # the outcome depends on it: pinned, not inherited
    try:
        for nested in ("[" * 5000 + "]" * 5000, "{a = " * 5000 + "1" + "}" * 5000):
            path.write_text(f'shared_cpuset = "0-1"\nx = {nested}\n')
            with pytest.raises(ConfigError, match=message):
                load_config(path, check=False)
    finally:
        sys.setrecursionlimit(before)


@pytest.mark.parametrize("key", ["a\nb", "a\rb", "\u202eevil", "x\0y", "caf\u00e9", "\u0430dmin"])
def test_unknown_keys_are_shown_escaped_on_one_line(tmp_path: Path, key: str) -> None:
    path = tmp_path / "config.toml"
    for document in (
        {"shared_cpuset": "0-1", key: 1},
        {"shared_cpuset": "0-1", "trusted_sources": {key: 1}},
        {"shared_cpuset": "0-1", "device_plugin": {key: 1}},
    ):
        path.write_text(toml(document), encoding="utf-8")
        with pytest.raises(ConfigError, match="unknown key") as caught:
            load_config(path, check=False)
        assert str(caught.value).isprintable(), str(caught.value)


def test_a_file_over_the_size_limit_is_refused_not_cut_short(tmp_path: Path) -> None:
    # A valid document whose last setting lies past the first MiB: reading only that much would
    # silently drop the setting.
    padding = ("#" + "x" * 99 + "\n") * (MAX_CONFIG_SIZE // 100)
    path = tmp_path / "config.toml"
    path.write_text('shared_cpuset = "0-1"\n' + padding + "[trusted_sources]\npod_annotation = true\n")
    with pytest.raises(ConfigError, match=f"larger than {MAX_CONFIG_SIZE} bytes"):
        load_config(path, check=False)
    path.write_text('shared_cpuset = "0-1"\n' + padding[: MAX_CONFIG_SIZE - 100])
    assert load_config(path, check=False).shared_cpuset == {0, 1}


# -- the command ---------------------------------------------------------------------------------------------

BAD_FILES: dict[str, bytes] = {
    "binary": bytes(range(256)) * 4,
    "not-utf8": b'shared_cpuset = "\xff\xfe"\n',
    "nul": b'shared_cpuset = "0-1"\0\n',
    "huge": b'shared_cpuset = "0-1"\n' + b"#" * (MAX_CONFIG_SIZE + 10) + b"\n",
    "deep": b"x = " + b"[" * 20000 + b"]" * 20000 + b"\n",
    "wrong-type": b"shared_cpuset = 1\n",
    "out-of-range": b'shared_cpuset = "0-999999999"\n',
    "negative-count": b'shared_cpuset = "0-1"\n[device_plugin]\ndevice_count = -1\n',
    "unknown-key": 'shared_cpuset = "0-1"\n"\u202elevel_gol" = "debug"\n'.encode(),
    "newline-key": b'shared_cpuset = "0-1"\n"a\\nerror: forged line" = 1\n',
    "bad-index": b'shared_cpuset = "0-1"\nplugin_index = 1e3\n',
    "table-as-value": b"shared_cpuset = { a = 1 }\n",
    "empty": b"",
}


def test_run_exits_2_with_one_clear_line_for_each_kind_of_bad_file(tmp_path: Path) -> None:
    async def run(name: str, data: bytes) -> tuple[str, int, bytes]:
        path = tmp_path / f"{name}.toml"
        path.write_bytes(data)
        refuse_host_paths(("run", "--config", str(path)))
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "nri_plugin.daemon.cli",
            "run",
            "--config",
            str(path),
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            _, err = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode is not None
        return name, proc.returncode, err

    async def all_files() -> list[tuple[str, int, bytes]]:
        return await asyncio.gather(*(run(name, data) for name, data in BAD_FILES.items()))

    for name, status, err in asyncio.run(all_files()):
        lines = err.decode().splitlines()
        assert (status, len(lines)) == (2, 1), (name, status, err)
        assert lines[0].startswith(f"error: {tmp_path / name}.toml: "), (name, lines)
        assert lines[0].isprintable(), (name, lines)
