"""The plugin's identity to the runtime, worked out once: NRI's naming rules, where a plugin finds
its name, index and connection, and the default socket.

A plugin is known to the runtime by an index (two digits: the order among plugins) and a name; the
runtime shows them joined as ``NN-name``. `resolve_identity` takes them, each from the first source
that has it:

1. what the program was told (the daemon's ``--nri-plugin-name``, ``--nri-plugin-index``);
2. the environment a runtime gives a plugin it launches: ``NRI_PLUGIN_NAME``, ``NRI_PLUGIN_IDX``
   (an empty variable is no value);
3. the executable's file name, when it has the ``NN-name`` form (as in ``/opt/nri/plugins``);
4. the program's own defaults (the daemon's config file).

A name of the ``NN-name`` form, from whichever source, is cut there: runtimes on NRI v0.3 and older
put the whole file name in ``NRI_PLUGIN_NAME``, and the ``NN`` then counts as that source's index
when it gives none of its own. ``NRI_PLUGIN_SOCKET`` names the connection a launching runtime hands
over (a file descriptor number, 3 from the runtime). The result says where each part came from, so
an error and the ``config`` command can name it.

The daemon works the identity out here once (`nri_plugin.daemon.wiring`) and hands it to the stub,
the ``config`` command and the logs; the stub reads no environment itself. Imports no I/O module.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

__all__ = [
    "DEFAULT_SOCKET_PATH",
    "INDEX_VARIABLE",
    "NAME_VARIABLE",
    "PLUGIN_INDEX",
    "PLUGIN_NAME",
    "SOCKET_VARIABLE",
    "Identity",
    "IdentityError",
    "resolve_identity",
    "valid_index",
    "valid_name",
]

# Where containerd and CRI-O listen for NRI plugins unless configured otherwise.
DEFAULT_SOCKET_PATH: Final = "/var/run/nri/nri.sock"
# What a runtime sets for a plugin it launches (and nothing else: no PATH either).
NAME_VARIABLE: Final = "NRI_PLUGIN_NAME"
INDEX_VARIABLE: Final = "NRI_PLUGIN_IDX"
SOCKET_VARIABLE: Final = "NRI_PLUGIN_SOCKET"

# Whole-string patterns (use `fullmatch`): exactly two digits; a name of these characters only.
PLUGIN_INDEX: Final = re.compile(r"[0-9]{2}")
PLUGIN_NAME: Final = re.compile(r"[A-Za-z0-9_.+-]+")
# A plugin file's name: the index, a dash, the name (split at the first dash).
_FILE_NAME: Final = re.compile(r"([0-9]{2})-(.+)")

# Where a part came from, when the caller gave it (`Identity` built directly).
GIVEN: Final = "given"


def valid_index(text: str) -> bool:
    return PLUGIN_INDEX.fullmatch(text) is not None


def valid_name(text: str) -> bool:
    return PLUGIN_NAME.fullmatch(text) is not None


class IdentityError(ValueError):
    """A name, index or handed-over connection NRI's rules refuse; the message says where it came
    from and what to use instead."""


@dataclass(frozen=True, kw_only=True)
class Identity:
    """Who the plugin is to the runtime, checked by NRI's rules when made, and the connection a
    launching runtime handed over (`inherited_fd`, None when the plugin dials the socket)."""

    name: str
    index: str
    inherited_fd: int | None = None
    # Where each part came from: "environment (NRI_PLUGIN_IDX)", "executable name (10-x)", the
    # caller's labels for what it was told and for its defaults, or `GIVEN`.
    name_from: str = GIVEN
    index_from: str = GIVEN

    def __post_init__(self) -> None:
        if not valid_index(self.index):
            raise IdentityError(
                f"plugin index {self.index!r} is invalid: use exactly two digits, e.g. 10"
                + _came_from(self.index_from)
            )
        if not valid_name(self.name):
            raise IdentityError(
                f"plugin name {self.name!r} is invalid: use letters, digits and _ . + - only, "
                "e.g. mixed-cpu" + _came_from(self.name_from)
            )

    @property
    def full_name(self) -> str:
        return f"{self.index}-{self.name}"


def _came_from(origin: str) -> str:
    return "" if origin == GIVEN else f" (it came from {origin})"


def resolve_identity(
    *,
    name: str | None = None,
    index: str | None = None,
    environ: Mapping[str, str],
    executable: str = "",
    default_name: str | None = None,
    default_index: str | None = None,
    defaults_from: str = "default",
    given_from: str = "option",
) -> Identity:
    """The identity from, in this order: `name` and `index` (origin `given_from`), `environ`'s NRI
    variables, `executable` (a path; its file name when of the ``NN-name`` form), and the defaults
    (origin `defaults_from`). Raises `IdentityError` when a part is missing or NRI would refuse it."""
    base = executable.rsplit("/", 1)[-1]
    sources = (
        (given_from, name, given_from, index),
        (
            f"environment ({NAME_VARIABLE})",
            environ.get(NAME_VARIABLE),
            f"environment ({INDEX_VARIABLE})",
            environ.get(INDEX_VARIABLE),
        ),
        # Only a file named NN-name: cut below, as a name of that form from any source is.
        (f"executable name ({base})", base if _FILE_NAME.fullmatch(base) else None, "", None),
        (defaults_from, default_name, defaults_from, default_index),
    )
    chosen_name = chosen_index = None
    name_from = index_from = ""
    for name_origin, source_name, index_origin, source_index in sources:
        if source_name and (whole := _FILE_NAME.fullmatch(source_name)):
            source_name = whole[2]  # a file's name (an old runtime's too): cut, its index kept
            if not source_index:
                source_index, index_origin = whole[1], name_origin
        if chosen_name is None and source_name:
            chosen_name, name_from = source_name, name_origin
        if chosen_index is None and source_index:
            chosen_index, index_from = source_index, index_origin
    if chosen_index is None or chosen_name is None:
        missing = "index" if chosen_index is None else "name"
        raise IdentityError(
            f"no plugin {missing}: set {INDEX_VARIABLE if missing == 'index' else NAME_VARIABLE}, or name "
            "the executable NN-name (e.g. 10-mixed-cpu)"
        )
    return Identity(
        name=chosen_name,
        index=chosen_index,
        inherited_fd=_inherited_fd(environ),
        name_from=name_from,
        index_from=index_from,
    )


def _inherited_fd(environ: Mapping[str, str]) -> int | None:
    value = environ.get(SOCKET_VARIABLE)
    if not value:  # as for the other two: an empty variable is no value
        return None
    if not (value.isascii() and value.isdigit()):
        raise IdentityError(
            f"{SOCKET_VARIABLE}={value!r} is not a file descriptor number; the runtime sets it (to 3) when "
            "it starts the plugin itself, so unset it when starting the plugin any other way"
        )
    return int(value)
