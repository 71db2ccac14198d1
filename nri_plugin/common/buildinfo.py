"""Which build this is: the package's version and the commit it was built from.

A wheel or an sdist made by the project's build (setup.py) carries the module ``nri_plugin._build_info``,
whose ``COMMIT`` is the commit of the checkout it was built from (``git rev-parse HEAD``, with
``+dirty`` when tracked files differed from it; ``MIXED_CPU_NRI_BUILD_COMMIT`` in the environment
wins, for a build from a tree without git). A wheel built from an sdist keeps the sdist's. A source
checkout run in place (an editable install) has no such module: its commit is "unknown", as is a
build's that could not tell.
"""

from __future__ import annotations

import importlib
from typing import Final

from nri_plugin import __version__

__all__ = ["PROGRAM", "UNKNOWN", "build_commit", "version_line"]

PROGRAM: Final = "mixed-cpu-nri-plugin"
UNKNOWN: Final = "unknown"


def build_commit() -> str:
    """The commit this copy was built from, or "unknown"."""
    try:
        module = importlib.import_module("nri_plugin._build_info")
    except ImportError:
        return UNKNOWN
    commit = getattr(module, "COMMIT", None)
    return commit if isinstance(commit, str) and commit else UNKNOWN


def version_line() -> str:
    """``mixed-cpu-nri-plugin <version> (commit <commit>)``: what ``version`` prints."""
    return f"{PROGRAM} {__version__} (commit {build_commit()})"
