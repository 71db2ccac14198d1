"""Write a whole file so that a reader, or the next start after a crash, sees the old or the new
content and nothing in between: a temporary file beside it, written and fsynced, then renamed (or
linked, to never overwrite) over the name, and the directory fsynced so the new name survives power
loss too."""

from __future__ import annotations

import contextlib
import os
import secrets


def write_atomically(
    path: str | os.PathLike[str], data: bytes, *, mode: int = 0o600, replace: bool = True, fsync: bool = True
) -> bool:
    """Publish `data` at `path`; True if it was published.

    `replace=False` never overwrites: when `path` already exists (someone else published first) the
    existing file wins and the call returns False. `fsync=False` skips both fsyncs (for benchmarks
    and tests on throw-away directories). Raises OSError; the temporary file never stays behind.
    """
    path = os.fspath(path)
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    published = True
    try:
        try:
            os.fchmod(fd, mode)  # whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                published = False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    if fsync and published:
        fsync_directory(directory or ".")
    return published


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make the names in `directory` durable (a rename is not, until its directory is synced)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
