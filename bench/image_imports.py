"""The plugin's imports as in its image: refuse the development venv's packages the image lacks.

The image (packaging/Dockerfile) installs the plugin's wheel with its ``[dra]`` extra: its
dependencies and theirs (pinned in packaging/image.lock), nothing else. The development venv adds
the test and lint tools, and with them packages a runtime dependency imports when it finds them:
structlog.dev imports rich (and through it pygments, markdown-it) only if it can, ~4 MiB of the
plugin's resident memory; grpc imports grpc_tools (grpcio-tools, the test extra's code generator)
if it can. The benchmark's plugin runs with those refused, so what it measures is the plugin as
deployed; ``BENCH_DEV_PACKAGES=1`` lets them in (to see what they cost).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

# Installed in the development venv (by the test extra's tools), not by ``pip install .``: a
# runtime dependency imports them only when present (`tests/test_bench_image_imports.py` checks
# that no other module outside the image's distributions is imported).
NOT_IN_IMAGE = frozenset(
    {"rich", "pygments", "markdown_it", "mdurl", "colorama", "better_exceptions", "grpc_tools"}
)


class RefuseNotInImage(importlib.abc.MetaPathFinder):
    """A finder first on ``sys.meta_path`` that fails the import of a package the image lacks, as
    a missing one fails (``ModuleNotFoundError``), so an optional import falls back as it would."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] in NOT_IN_IMAGE:
            raise ModuleNotFoundError(f"No module named {fullname!r} (not in the image)", name=fullname)
        return None


def refuse_not_in_image() -> None:
    """Install `RefuseNotInImage` (once), before anything imports structlog."""
    if not any(isinstance(finder, RefuseNotInImage) for finder in sys.meta_path):
        sys.meta_path.insert(0, RefuseNotInImage())
