"""Open and read the small files the daemon keeps on disk without trusting what is at their path.

The state file and its journals, the marker secret and the daemon's lock file live in a directory an
operator, a bad hostPath or a test may have filled: at the path there may be a link to /dev/zero, a
FIFO with or without a writer, a 1 GiB file, a directory. One way to open such a file and one way to
read it, so that none of them can hang the daemon or fill its memory, and each caller only says, in
its own words, what to do with a file it refuses:

* opened with ``O_NOFOLLOW`` (a symbolic link is refused, never followed), ``O_NONBLOCK`` (opening a
  FIFO does not wait for a writer; it is then refused as not a regular file), ``O_NOCTTY`` (a
  terminal does not become ours) and ``O_CLOEXEC``;
* the open descriptor, not the path (which may change meanwhile), must be a regular file;
* at most `limit` bytes: a larger file is refused before anything is read, and one that grows while
  it is read once `limit` + 1 bytes have come.

A refusal is a `RefusedFile`, not an `OSError`, so a caller that handles the I/O errors of a file it
could read (a failing disk) cannot mistake one for the other. A missing file is `FileNotFoundError`,
as from `os.open`.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from typing import Final

__all__ = [
    "OPEN_FLAGS",
    "NotRegularFile",
    "RefusedFile",
    "SymbolicLink",
    "TooLarge",
    "open_regular_file",
    "read_capped",
    "read_small_file",
]

# Added to the access mode of every open here.
OPEN_FLAGS: Final = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

_KINDS: Final = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
)


class RefusedFile(Exception):
    """The file is not one the daemon could have written; the subclass says why, the caller words
    the message (it knows which file it is and what the operator should do)."""


class SymbolicLink(RefusedFile):
    """The path is a symbolic link (never followed)."""

    def __init__(self) -> None:
        super().__init__("a symbolic link")


class NotRegularFile(RefusedFile):
    """The path is a directory, FIFO, socket or device."""

    def __init__(self, mode: int) -> None:
        self.mode = mode
        super().__init__(f"a {self.kind}, not a regular file")

    @property
    def kind(self) -> str:
        """What it is instead: ``directory``, ``FIFO``, ``socket``, ... ."""
        return next((name for test, name in _KINDS if test(self.mode)), "special file")


class TooLarge(RefusedFile):
    """More than `limit` bytes: `size` as the file said it was, or, when it `grew` while it was
    read, the bytes read by then (`limit` + 1)."""

    def __init__(self, size: int, limit: int, *, grew: bool) -> None:
        self.size, self.limit, self.grew = size, limit, grew
        super().__init__(f"{size} bytes, over the limit of {limit}")


def open_regular_file(
    path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o600
) -> tuple[int, os.stat_result]:
    """Open `path` with `flags` (plus `OPEN_FLAGS`; `mode` for an ``O_CREAT``), and return the
    descriptor with its `os.fstat`. Raises `SymbolicLink` or `NotRegularFile` (nothing left open),
    or the `OSError` of the open."""
    try:
        fd = os.open(path, flags | OPEN_FLAGS, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SymbolicLink() from None
        raise
    try:
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotRegularFile(info.st_mode)
    return fd, info


def read_capped(fd: int, limit: int) -> bytes:
    """All of the open regular file `fd`, from its start whatever its offset; `TooLarge` once more
    than `limit` bytes have come (so no more than `limit` + 1 are ever held)."""
    chunks: list[bytes] = []
    size = 0
    while size <= limit and (chunk := os.pread(fd, limit + 1 - size, size)):
        chunks.append(chunk)
        size += len(chunk)
    if size > limit:
        raise TooLarge(size, limit, grew=True)
    return b"".join(chunks)


def read_small_file(
    path: str | os.PathLike[str], limit: int, *, vet: Callable[[os.stat_result], None] | None = None
) -> bytes:
    """The whole content of the regular file `path`, of at most `limit` bytes. `vet`, if given, sees
    its `os.fstat` before anything is read, to refuse it for reasons of its own (owner, mode) with an
    exception of its own. Raises `RefusedFile`, `FileNotFoundError`, or the `OSError` of the open or
    the read."""
    fd, info = open_regular_file(path)
    try:
        if vet is not None:
            vet(info)
        if info.st_size > limit:
            raise TooLarge(info.st_size, limit, grew=False)
        return read_capped(fd, limit)
    finally:
        os.close(fd)
