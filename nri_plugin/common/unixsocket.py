"""Serving a unix socket at a fixed path: mode 0600 from its first instant, no process-wide umask.

The daemon serves three sockets whose path others find by name: the device plugin's (kubelet dials
it), the DRA plugin's two (kubelet's plugin watcher and kubelet) and the status socket (root's
``status`` command). Each must be root's alone from the moment it has its name, must replace a
socket an earlier run left there but nothing else, and must be recognised later as ours (a socket
someone removed and another process re-created is not).

`bind_socket` does it without touching ``os.umask``, which is process-wide: a worker thread writing
a file while another thread had the umask narrowed would get the wrong mode. The socket is bound
inside a fresh private directory (``mkdtemp``: mode 0700, beside the final path, so on the same file
system), its mode set to 0600 there where nobody else can reach it, and only then renamed to its
path, atomically replacing a stale socket. The server side may bind however it likes (a gRPC
server binds its own socket; the status server binds a plain one): it is handed the temporary path.

`file_id` names a socket file by (device, inode, ctime); the rename changes the ctime, so the id is
taken after it, and a file re-created at the same path has another id. `remove_if_ours` removes the
socket at close only while it is still the one we made.

Standard library only: the socket's users know gRPC, asyncio or sockets; this knows paths.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable
from typing import Final

__all__ = [
    "MAX_SOCKET_PATH",
    "SOCKET_MODE",
    "FileId",
    "bind_socket",
    "file_id",
    "remove_if_ours",
    "socket_path_problem",
]

# sun_path holds 108 bytes with the terminating NUL.
MAX_SOCKET_PATH: Final = 107
SOCKET_MODE: Final = 0o600
# The private directory's name: a dot (kubelet's plugin watcher ignores hidden entries) and
# mkdtemp's eight random characters; the socket inside it is one character.
_TEMP_PREFIX: Final = "."
_TEMP_NAME_LENGTH: Final = len(_TEMP_PREFIX) + 8
_INNER_NAME: Final = "s"

FileId = tuple[int, int, int]


def file_id(path: str | os.PathLike[str]) -> FileId | None:
    """(device, inode, ctime) of `path` itself, None if nothing is there (or it cannot be looked at)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_ctime_ns)


def socket_path_problem(path: str | os.PathLike[str]) -> str | None:
    """Why a socket cannot be served at `path` for its length (the path, or the temporary path it is
    bound at first, over `MAX_SOCKET_PATH` bytes); None when it can."""
    encoded = os.fsencode(path)
    temporary = len(os.fsencode(os.path.dirname(path))) + 2 + _TEMP_NAME_LENGTH + len(_INNER_NAME)
    longest = max(len(encoded), temporary)
    if longest <= MAX_SOCKET_PATH:
        return None
    return (
        f"socket path {os.fsdecode(encoded)} needs {longest} bytes (with the temporary name it is bound "
        f"at first), over {MAX_SOCKET_PATH}, the unix socket limit"
    )


def bind_socket(path: str | os.PathLike[str], bind: Callable[[str], object]) -> FileId:
    """Bind a socket with `bind` (given the temporary path) and put it at `path`, mode 0600, replacing
    a socket left there; return its `file_id`. Raises `OSError` when `path` is too long, exists and
    is not a socket, or the directory cannot be written; whatever `bind` raises passes through. The
    caller makes the directory of `path`."""
    where = os.fspath(path)
    problem = socket_path_problem(where)
    if problem is not None:
        raise OSError(problem)
    _refuse_non_socket(where)
    private = tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=os.path.dirname(where) or ".")
    temporary = os.path.join(private, _INNER_NAME)
    try:
        bind(temporary)
        os.chmod(temporary, SOCKET_MODE)
        _refuse_non_socket(where)  # checked again: rename would replace anything
        os.rename(temporary, where)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        os.rmdir(private)
    identity = file_id(where)
    if identity is None:
        raise OSError(f"{where} vanished right after it was made; is something removing it?")
    return identity


def remove_if_ours(path: str | os.PathLike[str], identity: FileId | None) -> bool:
    """Remove the socket at `path` if it is still the one `identity` names; True if removed."""
    if identity is None or file_id(path) != identity:
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _refuse_non_socket(path: str) -> None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise OSError(f"{path} exists and is not a socket; remove it, or serve the socket elsewhere")
