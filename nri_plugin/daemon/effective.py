"""``mixed-cpu-nri-plugin config``: the effective configuration, every key, as TOML.

Every key of the config file is printed with the value the daemon would use and, in a comment,
where that value comes from::

    shared_cpuset = "0-1"                # file
    plugin_index = "10"                  # default
    plugin_name = "mine"                 # environment (NRI_PLUGIN_NAME)

``file`` is a key the file sets, ``default`` one it leaves out; ``environment`` (NRI_PLUGIN_NAME,
NRI_PLUGIN_IDX) and ``executable name`` (an ``NN-name`` file) are where the daemon takes its name
and index before the file, worked out as for `run` by `nri_plugin.daemon.config.plugin_identity`.
The text is a config file `run --config` takes back, and gives the same configuration. The file is
only read: whether it suits this node (the CPUs online, the sockets there) is `check`'s job.

The TOML is written here, not by a TOML writer library: tomli-w writes no comments, and the origin
comments are the point; docs/design.md says how the writer is checked.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import PurePosixPath
from typing import Any, Final

from nri_plugin import cgroups
from nri_plugin.daemon.config import (
    FROM_CONFIG,
    TRUSTED_SOURCE_KEYS,
    TRUSTED_SOURCES_TABLE,
    Config,
    parse_config,
    plugin_identity,
    read_document,
)
from nri_plugin.deviceplugin.config import TABLE as DEVICE_PLUGIN_TABLE
from nri_plugin.dra.config import TABLE as DRA_TABLE
from nri_plugin.nri.identity import SOCKET_VARIABLE, Identity

__all__ = ["Setting", "config_command", "default_settings", "effective_settings", "render"]

FILE: Final = "file"
DEFAULT: Final = "default"
# The origin of a key that has no default (shared_cpuset): `config --defaults` prints it commented out.
REQUIRED: Final = "required, no default"
_REQUIRED_KEY: Final = "shared_cpuset"
# What the `Config` holds that no key sets.
_NOT_KEYS: Final = frozenset({"source", "device_plugin", "dra", *TRUSTED_SOURCE_KEYS.values()})
# TOML's escapes for the control characters that have a short one; the rest are written \\uXXXX.
_SHORT_ESCAPES: Final = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


@dataclass(frozen=True)
class Setting:
    """One key: its table ("" for the top level), its name, its value as TOML holds it (a string,
    boolean, integer or float), and where the value comes from."""

    table: str
    key: str
    value: str | bool | int | float
    origin: str


def effective_settings(
    path: str, environ: Mapping[str, str], *, executable: str = ""
) -> tuple[Config, list[Setting]]:
    """The configuration `run --config path` would use with `environ`, started as `executable`, and
    every key of it in the order the file's tables take. Raises `ConfigError` (`ConfigMissing`
    without a file) as `run` would, an environment variable it would refuse included."""
    return _settings(read_document(path), path, environ, executable)


def default_settings(environ: Mapping[str, str], *, executable: str = "") -> list[Setting]:
    """Every key at its default (the environment's or the executable name's, for the name and
    index), as `config --defaults` prints them: ``shared_cpuset``, which has none, is `REQUIRED`."""
    # A stand-in for the one required key lets the rest be built; its line then says it has none.
    settings = _settings({_REQUIRED_KEY: "0"}, "(the defaults)", environ, executable)[1]
    return [
        dataclasses.replace(s, value="", origin=REQUIRED) if (s.table, s.key) == ("", _REQUIRED_KEY) else s
        for s in settings
    ]


def _settings(
    document: Mapping[str, Any], path: str, environ: Mapping[str, str], executable: str
) -> tuple[Config, list[Setting]]:
    config = parse_config(document, source=path)
    identity = plugin_identity(config, environ, executable=executable)
    settings: list[Setting] = []
    for name in (f.name for f in fields(Config) if f.name not in _NOT_KEYS):
        settings.append(_top_level(name, getattr(config, name), document, identity))
    sources = document.get(TRUSTED_SOURCES_TABLE, {})
    for key, name in TRUSTED_SOURCE_KEYS.items():
        settings.append(Setting(TRUSTED_SOURCES_TABLE, key, getattr(config, name), _origin(key, sources)))
    for table_name, table_config in ((DEVICE_PLUGIN_TABLE, config.device_plugin), (DRA_TABLE, config.dra)):
        table = document.get(table_name, {})
        for field in fields(table_config):
            value = _toml_value(getattr(table_config, field.name))
            settings.append(Setting(table_name, field.name, value, _origin(field.name, table)))
    identity_keys = {"plugin_name": identity.name, "plugin_index": identity.index}
    return parse_config({**document, **identity_keys}, source=path), settings


def _top_level(name: str, value: object, document: Mapping[str, Any], identity: Identity) -> Setting:
    # The name and index as `run` takes them: from the config only when nothing before it has them.
    taken = {"plugin_name": identity.name_from, "plugin_index": identity.index_from}.get(name, FROM_CONFIG)
    if taken != FROM_CONFIG:
        return Setting("", name, identity.name if name == "plugin_name" else identity.index, taken)
    origin = _origin(name, document)
    if name == "nri_socket" and identity.inherited_fd is not None:
        origin += (
            f"; not used while {SOCKET_VARIABLE}={identity.inherited_fd} hands over the runtime's connection"
        )
    return Setting("", name, _toml_value(value), origin)


def _origin(key: str, table: object) -> str:
    return FILE if isinstance(table, Mapping) and key in table else DEFAULT


def _toml_value(value: object) -> str | bool | int | float:
    """A `Config` value as the config file writes it."""
    if isinstance(value, frozenset):
        return cgroups.format_cpuset(value)
    if isinstance(value, PurePosixPath):
        return str(value)
    if value is None:  # pod_resources_socket: not asked
        return ""
    if isinstance(value, (str, bool, int, float)):
        return value
    raise TypeError(f"no TOML form for {type(value).__name__} {value!r}")


def render(path: str | None, settings: list[Setting]) -> str:
    """The settings as a TOML config file, each value's origin in a comment beside it; `path` None:
    the defaults (`default_settings`), a required key commented out, for the user to set."""
    if path is None:
        lines = [
            "# The defaults: every key, with where its value comes from (no config file read).",
            f"# {_REQUIRED_KEY} has no default and `run` requires it: set it (uncomment its line) in the",
            "# config file; `mixed-cpu-nri-plugin run --config FILE` then takes this text back.",
            "",
        ]
    else:
        lines = [
            f"# The effective configuration of {_comment(path)}: every key, with where its value comes from.",
            "# `mixed-cpu-nri-plugin run --config FILE` takes this text back as it is.",
            "",
        ]
    width = max(len(_assignment(s)) for s in settings) + 2
    table = ""
    for setting in settings:
        if setting.table != table:
            table = setting.table
            lines.extend(("", f"[{table}]"))
        if setting.origin == REQUIRED:
            example = '# shared_cpuset = "0-1"'
            lines.append(f"{example:<{width}}# {REQUIRED}: the node's shared CPUs (a Linux cpu list)")
        else:
            lines.append(f"{_assignment(setting):<{width}}# {_comment(setting.origin)}")
    return "\n".join(lines) + "\n"


def _assignment(setting: Setting) -> str:
    return f"{setting.key} = {_toml(setting.value)}"


def _toml(value: str | bool | int | float) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    escaped = []
    for char in value:
        if char in ('"', "\\"):
            escaped.append("\\" + char)
        elif char in _SHORT_ESCAPES:
            escaped.append(_SHORT_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\u{ord(char):04X}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


def _comment(text: str) -> str:
    """`text` fit for a TOML comment: one line, no control characters (which TOML refuses there)."""
    return "".join(char if char.isprintable() else "?" for char in text)


def config_command(
    path: str | None, environ: Mapping[str, str] | None = None, *, executable: str = ""
) -> str:
    """What ``config --config path`` prints, started as `executable`; `path` None: ``config
    --defaults``. Raises `ConfigError`."""
    environ = os.environ if environ is None else environ
    if path is None:
        return render(None, default_settings(environ, executable=executable))
    return render(path, effective_settings(path, environ, executable=executable)[1])
