"""Which build this is: the package's version and the commit it was built from.

A wheel or an sdist made by the project's build (setup.py) carries the module ``nri_plugin._build_info``,
whose ``COMMIT`` is the commit of the checkout it was built from (``git rev-parse HEAD``, with
``+dirty`` when tracked files differed from it; ``MIXED_CPU_NRI_BUILD_COMMIT`` in the environment
wins, for a build from a tree without git). A wheel built from an sdist keeps the sdist's.

A source checkout run in place (an editable install) has no such module: the build that made it is
long past, and the checkout moves on. Its commit is read when asked, from the checkout's own git
files (``HEAD``, then the branch's ref, loose or packed; a linked worktree's ``.git`` file and
``commondir`` followed), with no ``git`` process, and said as ``<commit>, checkout``: what is checked
out, whose files may have been changed since. Only a directory that is this project's checkout counts
(its pyproject.toml names the project); anything else, or a git layout not understood, says "unknown",
as does a build that could not tell.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Final

from nri_plugin import __version__
from nri_plugin.common.smallfile import RefusedFile, read_small_file

__all__ = ["PROGRAM", "UNKNOWN", "build_commit", "checkout_commit", "version_line"]

PROGRAM: Final = "mixed-cpu-nri-plugin"
UNKNOWN: Final = "unknown"

# The checkout this module runs from, if it runs from one: <root>/nri_plugin/common/buildinfo.py.
_ROOT: Final = Path(__file__).resolve().parents[2]
_PROJECT_NAME: Final = re.compile(r'^name\s*=\s*"mixed-cpu-nri-plugin"\s*$', re.MULTILINE)
_OBJECT_ID: Final = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")  # SHA-1, or SHA-256 repositories
_REF: Final = re.compile(r"refs/(?:[A-Za-z0-9_.+-]+/)*[A-Za-z0-9_.+-]+")
_SMALL: Final = 4096  # HEAD, a loose ref, a .git file, commondir: far less
_PYPROJECT: Final = 1 << 20
_PACKED_REFS: Final = 16 << 20


def build_commit() -> str:
    """The commit this copy was built from; for a checkout run in place, ``<commit>, checkout``; or
    "unknown"."""
    try:
        module = importlib.import_module("nri_plugin._build_info")
    except ImportError:
        head = checkout_commit(_ROOT)
        return UNKNOWN if head is None else f"{head}, checkout"
    commit = getattr(module, "COMMIT", None)
    return commit if isinstance(commit, str) and commit else UNKNOWN


def version_line() -> str:
    """``mixed-cpu-nri-plugin <version> (commit <commit>)``: what ``version`` prints."""
    return f"{PROGRAM} {__version__} (commit {build_commit()})"


def checkout_commit(root: Path) -> str | None:
    """The commit checked out in `root`, if `root` is a git checkout of this project; else None."""
    try:
        if not _PROJECT_NAME.search(_read(root / "pyproject.toml", _PYPROJECT)):
            return None
        git_dir = _git_dir(root)
        if git_dir is None:
            return None
        head = _read(git_dir / "HEAD").strip()
        if _OBJECT_ID.fullmatch(head):  # a detached HEAD
            return head
        ref = head.removeprefix("ref:").strip()
        if not head.startswith("ref:") or not _REF.fullmatch(ref) or ".." in ref:
            return None
        return _resolve(git_dir, ref)
    except (OSError, RefusedFile, UnicodeDecodeError):
        return None


def _read(path: Path, limit: int = _SMALL) -> str:
    return read_small_file(path, limit).decode()


def _git_dir(root: Path) -> Path | None:
    """`root`'s git directory: ``.git`` itself, or where a ``.git`` file (a linked worktree, a
    submodule) points."""
    dot_git = root / ".git"
    if dot_git.is_dir():
        return dot_git
    if not dot_git.is_file():
        return None
    text = _read(dot_git).strip()
    if not text.startswith("gitdir:"):
        return None
    return root / text.removeprefix("gitdir:").strip()  # relative to root, or absolute


def _resolve(git_dir: Path, ref: str) -> str | None:
    """The object a branch (or other ref) names: its loose file in the worktree's git directory or
    the repository's common one, else its line in the common one's packed-refs."""
    common = git_dir
    if (git_dir / "commondir").is_file():  # a linked worktree: branches live in the main git dir
        common = git_dir / _read(git_dir / "commondir").strip()
    for base in dict.fromkeys((git_dir, common)):
        try:
            loose = _read(base / ref).strip()
        except FileNotFoundError:
            continue
        return loose if _OBJECT_ID.fullmatch(loose) else None
    try:
        packed = _read(common / "packed-refs", _PACKED_REFS)
    except FileNotFoundError:
        return None
    for line in packed.splitlines():
        object_id, _, name = line.partition(" ")
        if name == ref and _OBJECT_ID.fullmatch(object_id):
            return object_id
    return None
