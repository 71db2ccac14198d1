"""One daemon per node: exclusive locks taken before anything is served, and watched while it runs.

The project ships three ways to run the daemon (the systemd unit, the wrapper a runtime launches,
the DaemonSet). Two of them running at once fight over kubelet's device-plugin socket, register the
same NRI name and both raise pod quotas for the same containers. So the daemon takes two locks,
``flock(LOCK_EX)`` each, first thing, and writes its pid and config path in each file; a second
daemon finds one taken and stops at once (exit status 2) with one line naming the other's pid and
config, and what to do:

* the **state dir's** ``<state_dir>/daemon.lock`` (`lock_state_dir`): two daemons must never share
  the books, whatever else differs;
* the **node's** ``mixed-cpu-nri-plugin.lock`` beside the runtime's NRI socket (`lock_node`): two
  daemons with different state dirs still talk to the same runtime. The socket's directory is the
  one place every way of running the daemon sees as the host's: the DaemonSet mounts it (read-write,
  for this file), the systemd unit and the runtime-launched daemon run on the host. An abstract unix
  socket would be scoped to a network namespace (the DaemonSet's pod has its own), a file under
  ``/run/mixed-cpu-nri-plugin`` would need one more host mount and, in the tests, a shared host
  directory. Where that directory is missing (the runtime makes it when NRI is on) or cannot be
  written (an old manifest mounting it read-only) with no lock file in it yet, the daemon runs with
  its state dir's lock alone and the wiring says so.

A lock is the open file's: the kernel drops it when the process ends, however it ends, so a daemon
killed with SIGKILL never leaves a stale lock behind (what the file says may be stale; the lock never
is). It is kept for the life of the process: taking it again in the same process (tests build
several daemons) returns the lock already held.

A lock file removed under a running daemon (its state dir deleted, say) leaves the lock on an
unlinked file that nobody else can find, so a second daemon would start. `LockWatch` looks every few
seconds whether each path still names the locked file, and takes the lock again on a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import structlog

from nri_plugin.common.smallfile import NotRegularFile, SymbolicLink, TooLarge, open_regular_file, read_capped

__all__ = [
    "LOCK_FILE_NAME",
    "NODE_LOCK_NAME",
    "InstanceLock",
    "InstanceLockError",
    "LockWatch",
    "NoNodeLock",
    "lock_node",
    "lock_state_dir",
]

log = structlog.get_logger("nri_plugin.daemon.instance")

LOCK_FILE_NAME: Final = "daemon.lock"
NODE_LOCK_NAME: Final = "mixed-cpu-nri-plugin.lock"
# The lock file holds a pid and a config path, a line each; more is not ours to read.
_MAX_HOLDER_TEXT: Final = 4096
_STOP_THE_OTHER: Final = (
    "run one daemon per node; stop the other one (the systemd unit mixed-cpu-nri-plugin.service, the "
    "runtime-launched 10-mixed-cpu in /opt/nri/plugins, or the DaemonSet's pod on this node) before "
    "starting this one"
)


class InstanceLockError(Exception):
    """The lock is held by another daemon, or cannot be taken; one line for the operator."""


class NoNodeLock(InstanceLockError):
    """There is nothing to take the node's lock on (`lock_node`); the daemon may run without it.
    `later`: the socket's directory is missing, so the lock may be taken once the runtime makes it."""

    def __init__(self, message: str, *, later: bool = False) -> None:
        super().__init__(message)
        self.later = later


@dataclass(frozen=True)
class InstanceLock:
    """A lock this process holds: its file, the descriptor the lock lives on (never closed while
    held), the locked file's (device, inode), and how to take it again (`LockWatch`)."""

    path: str
    fd: int
    file_id: tuple[int, int]
    retake: Callable[[], InstanceLock]


@dataclass(frozen=True)
class _Holder:
    """What the holder of a lock wrote in its file."""

    pid: int | None
    config: str | None

    def describe(self) -> str:
        who = f"pid {self.pid}" if self.pid is not None else "a process that wrote no pid"
        return who if self.config is None else f"{who}, config {self.config}"


# Per process, by (device, inode) of the lock file: a daemon built twice in one process (tests)
# keeps the one lock it took, instead of conflicting with itself.
_held: dict[tuple[int, int], InstanceLock] = {}


def lock_state_dir(state_dir: str, config_path: str = "") -> InstanceLock:
    """Take the daemon lock in `state_dir` (created 0700 if missing) and write our pid and
    `config_path` in it.

    Raises `InstanceLockError` when another process holds it (the message names its pid and config,
    read from the file) or when the lock file cannot be made or opened.
    """
    path = os.path.join(state_dir, LOCK_FILE_NAME)

    def taken(holder: _Holder) -> str:
        return (
            f"another mixed-cpu-nri-plugin ({holder.describe()}, as written in {path}) already runs with "
            f"state_dir {state_dir}: {_STOP_THE_OTHER}"
        )

    def take() -> InstanceLock:
        fd, info = _open_lock_file(state_dir, path, "point state_dir at a directory only root can write")
        return _lock(fd, info, path, config_path, taken, take)

    return take()


def lock_node(nri_socket: str, config_path: str = "") -> InstanceLock:
    """Take the node's daemon lock beside `nri_socket` and write our pid and `config_path` in it.

    Raises `InstanceLockError` when another process holds it (the message names its pid and config)
    or when the lock file is not a plain file or cannot be made (not root); `NoNodeLock` when there
    is nothing to lock on: the socket's directory is missing (the runtime makes it; this daemon does
    not), or read-only with no lock file in it yet.
    """
    directory = os.path.dirname(nri_socket) or "."
    path = os.path.join(directory, NODE_LOCK_NAME)
    if not os.path.isdir(directory):
        raise NoNodeLock(
            f"{directory} (the NRI socket's directory) is missing: the runtime makes it", later=True
        )

    def taken(holder: _Holder) -> str:
        return (
            f"another mixed-cpu-nri-plugin ({holder.describe()}, as written in {path}) already serves the "
            f"runtime at {nri_socket}, whatever its state_dir: {_STOP_THE_OTHER}"
        )

    def take() -> InstanceLock:
        fd, info = _open_lock_file(directory, path, f"mount {directory} read-write")
        return _lock(fd, info, path, config_path, taken, take)

    try:
        return take()
    except InstanceLockError as exc:
        cause = exc.__cause__
        if isinstance(cause, OSError) and cause.errno == errno.EROFS:
            raise NoNodeLock(f"{path} cannot be made: {cause.strerror}") from None
        raise


def _lock(
    fd: int,
    info: os.stat_result,
    path: str,
    config_path: str,
    taken: Callable[[_Holder], str],
    retake: Callable[[], InstanceLock],
) -> InstanceLock:
    """`flock` the open lock file `fd` and write who we are in it; `taken(holder)` is the message
    when another process holds it."""
    file_id = (info.st_dev, info.st_ino)
    held = _held.get(file_id)
    if held is not None:
        os.close(fd)
        return held
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise InstanceLockError(taken(holder)) from None
    _write_holder(fd, config_path)
    lock = InstanceLock(path, fd, file_id, retake)
    _held[file_id] = lock
    return lock


def _open_lock_file(directory: str, path: str, fix: str) -> tuple[int, os.stat_result]:
    """The lock file (created 0600 if missing, in `directory`, created 0700 if missing) and its
    `os.fstat`, opened as every small file of the state dir is (`nri_plugin.common.smallfile`: no
    link followed, no wait on a FIFO, a regular file only); read-only when its directory is mounted
    so. An `InstanceLockError` for an `OSError` has it as its ``__cause__``; `fix` ends its message."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        try:
            return open_regular_file(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES):
                raise
            try:
                return open_regular_file(path, os.O_RDONLY)  # flock works on a read-only descriptor too
            except FileNotFoundError:
                raise exc from None  # the first error says why the file could not be made
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
        if exc.errno == errno.EROFS:
            fix = f"{directory} is on a read-only file system: mount it read-write"
        elif exc.errno in (errno.EACCES, errno.EPERM) and os.geteuid() != 0:
            fix = f"you are not root (uid {os.geteuid()}): run the daemon as root"
        raise InstanceLockError(
            f"{path}: cannot open the daemon's lock file: {exc.strerror or exc}; {fix}"
        ) from exc


def _holder(fd: int) -> _Holder:
    """The pid and config the lock's holder wrote in the file, as far as it wrote them."""
    try:
        lines = read_capped(fd, _MAX_HOLDER_TEXT).decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError, TooLarge):
        return _Holder(None, None)
    pid = lines[0].strip() if lines else ""
    config = lines[1].strip() if len(lines) > 1 else ""
    return _Holder(int(pid) if pid.isdigit() else None, config or None)


def _write_holder(fd: int, config_path: str) -> None:
    """Our pid and config in the file, for the next one to name (skipped on a read-only file)."""
    config = os.path.abspath(config_path) if config_path else ""
    data = f"{os.getpid()}\n{config}\n".encode() if config else f"{os.getpid()}\n".encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except OSError:
        pass  # read-only: the lock holds all the same, only the message will lack the pid


def _still_there(lock: InstanceLock) -> bool:
    """Whether `lock.path` still names the file the lock is on."""
    try:
        info = os.stat(lock.path, follow_symlinks=False)
    except OSError:
        return False
    return (info.st_dev, info.st_ino) == lock.file_id


class LockWatch:
    """Every `period` seconds, whether each lock's path still names the locked file; where it does
    not (the file or its directory was removed), the lock is taken again on a new file, so that a
    second daemon is still refused. Says so at warning, or at error when another daemon took the
    new file first (two run on this node then: the line names the other).

    `pending` takes a lock that could not be taken yet (`NoNodeLock.later`: the runtime has not made
    its socket's directory yet); it is tried at each look until it is taken."""

    def __init__(
        self,
        locks: list[InstanceLock],
        *,
        pending: Callable[[], InstanceLock] | None = None,
        period: float = 5.0,
    ) -> None:
        self.locks = list(locks)
        self.pending = pending
        self.period = period
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._watch())

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            self.check()

    def check(self) -> None:
        """One look at every lock (see the class docstring). A lock another daemon took first is
        said once and no longer watched or tried."""
        kept: list[InstanceLock] = []
        for lock in self.locks:
            if _still_there(lock):
                kept.append(lock)
                continue
            try:
                again = lock.retake()
            except InstanceLockError as exc:
                log.error("lock file removed under this daemon; cannot take it again", problem=str(exc))
                continue
            _held.pop(lock.file_id, None)
            os.close(lock.fd)
            kept.append(again)
            log.warning(
                "lock file removed under this daemon; taken again on a new one",
                path=lock.path,
                fix="leave the daemon's state dir and lock files alone while it runs",
            )
        if self.pending is not None:
            try:
                late = self.pending()
            except NoNodeLock as exc:
                if not exc.later:
                    self.pending = None
                    log.warning("no node-wide lock", problem=str(exc))
            except InstanceLockError as exc:
                self.pending = None
                log.error("the node-wide lock is another daemon's", problem=str(exc))
            else:
                self.pending = None
                kept.append(late)
                log.info("node-wide lock taken", path=late.path)
        self.locks = kept
