"""One daemon per node: an exclusive lock on the state directory, taken before anything is served.

The project ships three ways to run the daemon (the systemd unit, the wrapper a runtime launches,
the DaemonSet), all reading one config and one state directory. Two of them running at once fight
over kubelet's device-plugin socket and both raise pod quotas for the same containers. So the daemon
takes ``flock(LOCK_EX)`` on ``<state_dir>/daemon.lock`` first thing, and writes its pid in the file;
a second one finds the lock taken and stops at once (exit status 2) with one line naming the pid
written there and what to do.

The lock is the open file's: the kernel drops it when the process ends, however it ends, so a
daemon killed with SIGKILL never leaves a stale lock behind (the pid in the file may be stale; the
lock never is). It is kept for the life of the process: `lock_state_dir` called again in the same
process (tests build several daemons) returns the lock it already holds.
"""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass
from typing import Final

from nri_plugin.common.smallfile import NotRegularFile, SymbolicLink, TooLarge, open_regular_file, read_capped

__all__ = ["LOCK_FILE_NAME", "InstanceLock", "InstanceLockError", "lock_state_dir"]

LOCK_FILE_NAME: Final = "daemon.lock"
# The lock file holds a pid and a newline; more is not ours to read.
_MAX_PID_TEXT: Final = 32


class InstanceLockError(Exception):
    """The state directory is locked by another daemon, or cannot be locked; one line for the operator."""


@dataclass(frozen=True)
class InstanceLock:
    """The lock this process holds: its file and the descriptor the lock lives on (never closed)."""

    path: str
    fd: int


# Per process, by (device, inode) of the lock file: a daemon built twice in one process (tests)
# keeps the one lock it took, instead of conflicting with itself.
_held: dict[tuple[int, int], InstanceLock] = {}


def lock_state_dir(state_dir: str) -> InstanceLock:
    """Take the node's daemon lock in `state_dir` (created 0700 if missing) and write our pid in it.

    Raises `InstanceLockError` when another process holds it (the message names its pid, read from
    the file) or when the lock file cannot be made or opened.
    """
    path = os.path.join(state_dir, LOCK_FILE_NAME)
    fd, info = _open_lock_file(state_dir, path)
    held = _held.get((info.st_dev, info.st_ino))
    if held is not None:
        os.close(fd)
        return held
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise InstanceLockError(_taken_message(state_dir, path, holder)) from None
    _write_pid(fd)
    lock = InstanceLock(path, fd)
    _held[(info.st_dev, info.st_ino)] = lock
    return lock


def _open_lock_file(state_dir: str, path: str) -> tuple[int, os.stat_result]:
    """The lock file (created 0600 if missing) and its `os.fstat`, opened as every small file of the
    state dir is (`nri_plugin.common.smallfile`: no link followed, no wait on a FIFO, a regular file
    only); read-only when the state dir is mounted so."""
    try:
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        try:
            return open_regular_file(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES):
                raise
            return open_regular_file(path, os.O_RDONLY)  # flock works on a read-only descriptor too
    except SymbolicLink:
        raise InstanceLockError(
            f"{path}: is a symbolic link; remove it (the daemon creates its lock file itself)"
        ) from None
    except NotRegularFile:
        raise InstanceLockError(
            f"{path}: not a regular file, so the daemon cannot take its one-per-node lock; remove it "
            "(the daemon creates it)"
        ) from None
    except OSError as exc:
        raise InstanceLockError(
            f"{path}: cannot open the daemon's lock file: {exc.strerror or exc}; point state_dir at a "
            "directory only root can write"
        ) from None


def _holder(fd: int) -> int | None:
    """The pid the lock's holder wrote in the file, if it wrote one."""
    try:
        text = read_capped(fd, _MAX_PID_TEXT).decode("ascii").strip()
    except (OSError, UnicodeDecodeError, TooLarge):
        return None
    return int(text) if text.isdigit() else None


def _write_pid(fd: int) -> None:
    """Our pid in the file, for the next one to name (skipped on a read-only state dir)."""
    data = f"{os.getpid()}\n".encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except OSError:
        pass  # read-only: the lock holds all the same, only the message will lack the pid


def _taken_message(state_dir: str, path: str, pid: int | None) -> str:
    who = f"pid {pid}" if pid is not None else "a process that wrote no pid"
    return (
        f"another mixed-cpu-nri-plugin ({who}, as written in {path}) already runs with state_dir "
        f"{state_dir}: run one daemon per node; stop the other one (the systemd unit "
        "mixed-cpu-nri-plugin.service, the runtime-launched 10-mixed-cpu in /opt/nri/plugins, or the "
        "DaemonSet's pod on this node) before starting this one"
    )
