"""A host's path, found under the directory where the host's ``/`` (or part of it) is mounted.

``enable-nri`` runs in a container that sees the host's files under ``--host-root``. A symbolic link
there points into the host's tree, not the container's: ``/host/etc/containerd/config.toml ->
/etc/containerd/real.toml`` means ``/host/etc/containerd/real.toml``, and a relative link is taken
from its own directory. `resolve_under` follows every link by hand, one component at a time, with
the host root as ``/``; a link that climbs above it (``..`` at the top) or goes round in circles is
refused, never followed out, and a link whose target is missing is told apart from a plain missing
file (the first is an operator's setup gone wrong, the second a runtime running on its defaults).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Final

__all__ = ["HostPath", "HostPathError", "resolve_under"]

# As the kernel's own limit on links followed in one lookup (MAXSYMLINKS).
MAX_LINKS: Final = 40


class HostPathError(Exception):
    """The path cannot be taken safely under the host root; one line saying why and what to do."""


@dataclass(frozen=True)
class HostPath:
    """`real`: the path under the host root with every link followed; `exists`: whether its last
    component is there (every directory above it is, or `resolve_under` raised)."""

    real: str
    exists: bool


def resolve_under(root: str, path: str) -> HostPath:
    """`path` (a host path such as ``/etc/containerd/config.toml``) under `root`, every link followed
    as the host would follow it. Raises `HostPathError` when a link leaves `root`, dangles or loops,
    when a directory on the way is missing, or when a component cannot be read."""
    shown = "/" + path.strip("/")
    # Components still to walk, last first, each with whether a link's target brought it.
    todo = [(part, False) for part in reversed(_parts(path))]
    done: list[str] = []
    links = 0
    while todo:
        part, from_link = todo.pop()
        if part == "..":
            if not done:
                raise HostPathError(
                    f"{shown} under {root}: a symbolic link leads out of the host root; "
                    "point it at a file inside the host's tree"
                )
            done.pop()
            continue
        here = os.path.join(root, *done, part)
        try:
            target = os.readlink(here)
        except FileNotFoundError:
            if from_link or todo:
                raise HostPathError(_missing(shown, root, here, from_link)) from None
            return HostPath(here, exists=False)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: there, and not a link
                raise HostPathError(f"{shown} under {root}: cannot read {here}: {exc.strerror}") from None
            done.append(part)
            continue
        links += 1
        if links > MAX_LINKS:
            raise HostPathError(f"{shown} under {root}: too many symbolic links (a loop?); fix the links")
        if target.startswith("/"):
            done = []
        todo.extend((step, True) for step in reversed(_parts(target)))
    return HostPath(os.path.join(root, *done), exists=True)


def _missing(shown: str, root: str, here: str, from_link: bool) -> str:
    if from_link:
        return (
            f"{shown} under {root}: a symbolic link on the way points at nothing ({here} is missing); "
            "fix or remove the link"
        )
    return f"{shown} under {root}: {here} is missing; is --host-root where the host's / is mounted?"


def _parts(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]
