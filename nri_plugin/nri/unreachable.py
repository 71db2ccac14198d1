"""Why the runtime's NRI socket cannot be connected to, and the warnings that say so while the stub
retries.

`why_unreachable` turns the connect's `OSError` into a cause and what to check: no socket there, a
path that is no socket (a regular file refuses a connection with ECONNREFUSED, as a socket with no
listener does, so the path is looked at), nothing listening, permission denied, or the system's own
words. `ConnectWarnings` logs one warning at the first failure, then at most one a minute (sooner
when the cause changes), each with the count of failed attempts; the attempts in between are debug
lines. A connection that opens starts it over.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from typing import Final

import structlog

from nri_plugin.common.clock import Clock

__all__ = ["WARN_EVERY", "ConnectWarnings", "Unreachable", "why_unreachable"]

# The stub's lines: these are its attempts.
log = structlog.get_logger("nri_plugin.nri.stub")

# The least time between two warnings of the same cause.
WARN_EVERY: Final = 60.0
_SOCKET_SETTING: Final = "nri_socket (or --socket)"
_NRI_ON: Final = (
    'that the runtime runs with NRI on (containerd 1.7: [plugins."io.containerd.nri.v1.nri"] '
    "disable = false; CRI-O: [crio.nri] enable_nri = true)"
)


@dataclass(frozen=True)
class Unreachable:
    """Why a connect failed (`cause`) and what to look at (`check`), in words."""

    cause: str
    check: str


def why_unreachable(path: str, error: OSError) -> Unreachable:
    """The cause of `error`, raised connecting to the unix socket at `path`, and what to check."""
    if error.errno == errno.ENOENT:
        return Unreachable(
            "it does not exist",
            f"{_NRI_ON}, that {_SOCKET_SETTING} is its NRI socket_path, and in a pod that the host's "
            "/var/run/nri directory is mounted",
        )
    if error.errno in (errno.EACCES, errno.EPERM):
        uid = os.geteuid()
        return Unreachable(
            f"permission denied to uid {uid}",
            "the host's audit log: SELinux or AppArmor denies it"
            if uid == 0
            else "that the daemon runs as root, as the runtime's socket wants",
        )
    if error.errno in (errno.ECONNREFUSED, errno.ENOTDIR):
        other = _not_a_socket(path)
        if other is not None:
            return Unreachable(
                f"it is not a socket: {other}",
                f"{_SOCKET_SETTING}: set it to the runtime's NRI socket, /var/run/nri/nri.sock by default",
            )
        return Unreachable(
            "nothing listens on it (connection refused): the runtime stopped, or restarted with "
            "NRI off, and left its socket behind",
            f"{_NRI_ON}, and the runtime's log",
        )
    return Unreachable(error.strerror or str(error), "the runtime's log")


def _not_a_socket(path: str) -> str | None:
    """What is at `path` when it is not a socket ("it is a regular file"), or None for a socket
    (or when it cannot be looked at)."""
    try:
        mode = os.stat(path).st_mode
    except NotADirectoryError:
        return "a part of its path is a file, not a directory"
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    if stat.S_ISDIR(mode):
        return "it is a directory"
    return "it is a regular file" if stat.S_ISREG(mode) else "it is another kind of file"


class ConnectWarnings:
    """The warnings of a run of failed connects: the first at once, then at most one every `every`
    seconds on `clock` unless the cause changes, each with the attempts failed so far."""

    def __init__(self, clock: Clock, every: float = WARN_EVERY) -> None:
        self.clock = clock
        self.every = every
        self.attempts = 0
        self._last: tuple[float, str] | None = None

    def failed(self, path: str, error: OSError, retry_in: float) -> None:
        """Count a failed connect to `path`, and warn of it if it is time to."""
        self.attempts += 1
        why = why_unreachable(path, error)
        now = self.clock.monotonic()
        due = self._last is None or self._last[1] != why.cause or now - self._last[0] >= self.every
        fields = {
            "socket": path,
            "cause": why.cause,
            "attempts": self.attempts,
            "retry_in": round(retry_in, 2),
        }
        if not due:
            log.debug("nri connect failed, retrying", **fields)
            return
        self._last = (now, why.cause)
        log.warning(
            "nri connect failed, retrying",
            **fields,
            check=why.check,
            next_warning=f"in {self.every:g} s unless the cause changes",
        )

    def connected(self) -> None:
        """A connection opened: the next failure is warned of at once, counted from one."""
        self.attempts = 0
        self._last = None
