"""NRI's rules for naming a plugin, and where runtimes listen, written once.

A plugin is known to the runtime by an index (two digits: the order among plugins) and a name; the
runtime shows them joined as ``NN-name``. The stub checks them before connecting and the daemon's
config check applies the same rules, so both take them from here. Imports nothing but `re`.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["DEFAULT_SOCKET_PATH", "PLUGIN_INDEX", "PLUGIN_NAME", "valid_index", "valid_name"]

# Where containerd and CRI-O listen for NRI plugins unless configured otherwise.
DEFAULT_SOCKET_PATH: Final = "/var/run/nri/nri.sock"

# Whole-string patterns (use `fullmatch`): exactly two digits; a name of these characters only.
PLUGIN_INDEX: Final = re.compile(r"[0-9]{2}")
PLUGIN_NAME: Final = re.compile(r"[A-Za-z0-9_.+-]+")


def valid_index(text: str) -> bool:
    return PLUGIN_INDEX.fullmatch(text) is not None


def valid_name(text: str) -> bool:
    return PLUGIN_NAME.fullmatch(text) is not None
