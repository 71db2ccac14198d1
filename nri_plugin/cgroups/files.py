"""Reading and writing cgroup files: CFS quota (v1 and v2) and `cpuset.cpus`.

Rules kept by every function here:

* a directory is reached from its hierarchy's mount point one component at a time with
  ``O_NOFOLLOW``: a symlink below a mount point is refused (`CgroupPathError`); a real cgroup
  filesystem has none, so one there is a fake tree or an attempt to leave the mount;
* its files are opened relative to that directory's descriptor (``openat``), with ``O_NOFOLLOW``
  too. Every function takes a `CgroupDir` (the directory is walked to and closed again for each
  call) or an `OpenCgroup` (walked to once, then any number of reads and writes through the one
  descriptor: `open_cgroup`, or `CgroupOpener`, which holds the parent directories of the cgroups
  it opens so that each open is one ``openat``); an `OpenCgroup` also holds its CFS limit file
  open, read-write, from the read to the write;
* files are opened as they are, never created (no ``O_CREAT``): a missing file is `CgroupNotFound`;
  and never waited on (``O_NONBLOCK``): what is opened must be a regular file, as every cgroup file
  is, else it is refused (a FIFO or device in a fake or tampered tree would otherwise block the
  caller's event loop, or feed it without end);
* values are written with one ``os.write`` on the open file (a fake tree's regular file, left
  longer than the new value, is then cut to it); no shell, no subprocess;
* errors are typed (see `errors.py`) and name the file, the value and, where it helps, the fix.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Final, TypeAlias, TypeVar

from nri_plugin.cgroups import cpuset
from nri_plugin.cgroups._text import quote
from nri_plugin.cgroups.errors import (
    CgroupError,
    CgroupNotFound,
    CgroupPathError,
    CgroupPermissionError,
    CgroupValueError,
    CgroupWriteRejected,
)
from nri_plugin.cgroups.paths import CgroupDir, CgroupPath, CgroupVersion, Hierarchy, check_name
from nri_plugin.cgroups.quota import (
    CpuQuota,
    format_cfs_quota_us,
    format_cpu_max,
    parse_cfs_period_us,
    parse_cfs_quota_us,
    parse_cpu_max,
)

__all__ = [
    "CFS_PERIOD_US",
    "CFS_QUOTA_US",
    "CPUSET_CPUS",
    "CPU_MAX",
    "MAX_READ",
    "Cgroup",
    "CgroupOpener",
    "OpenCgroup",
    "cgroup_exists",
    "open_cgroup",
    "read_cpu_quota",
    "read_cpuset",
    "read_effective_cpuset",
    "read_value",
    "restore_cpu_quota",
    "set_cpu_limit",
    "write_cpu_limit",
    "write_cpu_quota",
    "write_cpuset",
    "write_parent_child_quota",
    "write_value",
]

CFS_QUOTA_US: Final = "cpu.cfs_quota_us"
CFS_PERIOD_US: Final = "cpu.cfs_period_us"
CPU_MAX: Final = "cpu.max"
CPUSET_CPUS: Final = "cpuset.cpus"
_EFFECTIVE_CPUS: Final = {1: "cpuset.effective_cpus", 2: "cpuset.cpus.effective"}
# The CFS limit files an `OpenCgroup` may hold open read-write, from its read to its write.
_LIMIT_NAMES: Final = frozenset({CFS_QUOTA_US, CPU_MAX})
# Our own file names need no check each time they are opened (a caller's name is checked).
_KNOWN_NAMES: Final = frozenset(
    {CFS_QUOTA_US, CFS_PERIOD_US, CPU_MAX, CPUSET_CPUS, *_EFFECTIVE_CPUS.values()}
)

# cgroup value files are small: the largest we read, a cpu list, stays under 25 KB even for 8192
# CPUs listed one by one ("0,2,4,..."). Reading more than this means a wrong file.
MAX_READ: Final = 64 * 1024
# Most values are a line of a few bytes: read them into a small buffer first.
_FIRST_READ: Final = 4096

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK changes nothing for a regular file (cgroup files are); it keeps a FIFO put in a file's
# place from blocking the open, and O_NOCTTY a terminal device from becoming ours.
_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
# No O_TRUNC: it does nothing on a cgroup filesystem, and on a fake tree's ext4 file it costs ~20
# times the write itself (a journalled truncation to 0 and a flush at close: 145 us against 7 us).
# A fake tree's file is cut after the write instead, when it still holds more than the new value.
_WRITE_FLAGS: Final = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
_READ_WRITE_FLAGS: Final = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY

_NOT_REGULAR: Final = (
    "not a regular file (a FIFO, socket or device where a cgroup file was expected); the cgroup tree "
    "has been tampered with, or cgroup_root points at something else"
)
_PERMISSION_ERRNOS: Final = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
_PERMISSION_HINT: Final = (
    "the plugin needs root (CAP_SYS_ADMIN) and the host's /sys/fs/cgroup mounted read-write"
)

# What the kernel means when it refuses a write, by file and errno (kernel/sched/core.c,
# kernel/cgroup/cpuset.c). EACCES at write time (the open succeeded) is the v1 cpuset's "not a
# subset of the parent", not a permission problem.
_REJECT_HINTS: Final = {
    (CFS_QUOTA_US, errno.EINVAL): (
        "cgroup v1 refuses a quota above the parent's (raise the parent first, lower the child "
        "first), a parent quota below a child's, and quotas under 1000 us"
    ),
    (CFS_PERIOD_US, errno.EINVAL): "the period must be 1000 to 1000000 us and keep children within it",
    (CPU_MAX, errno.EINVAL): (
        'cpu.max takes "max PERIOD" or "QUOTA PERIOD", quota >= 1000 us, period 1000 to 1000000 us'
    ),
    (CPUSET_CPUS, errno.EACCES): (
        "cgroup v1 requires a cgroup's CPUs to be a subset of its parent's: widen the parent first"
    ),
    (CPUSET_CPUS, errno.EBUSY): "a child cgroup uses CPUs outside the new set: narrow the children first",
    (CPUSET_CPUS, errno.EINVAL): "the list names CPUs that are offline or do not exist",
    (CPUSET_CPUS, errno.ERANGE): "the list names CPUs that do not exist on this machine",
    (CPUSET_CPUS, errno.ENOSPC): "the cgroup has tasks and would be left without CPUs",
}
_REJECT_ERRNOS: Final = frozenset(
    {errno.EINVAL, errno.ERANGE, errno.EBUSY, errno.ENOSPC, errno.EACCES, errno.EDEADLK}
)

_T = TypeVar("_T")
_S_ISREG: Final = stat.S_ISREG


def _errno_name(code: int) -> str:
    return errno.errorcode.get(code, str(code))


def _open_error(exc: OSError, path: str, dir_fd: int | None = None, name: str = "") -> CgroupError:
    code = exc.errno or 0
    reason = f"{os.strerror(code)} ({_errno_name(code)})"
    if code == errno.ENOENT:
        return CgroupNotFound(
            f"cannot open {path}: {reason}; the pod or container may be gone, or the controller is "
            "not enabled for this cgroup",
            path=path,
            errno=code,
        )
    if code in _PERMISSION_ERRNOS:
        return CgroupPermissionError(
            f"cannot open {path}: {reason}; {_PERMISSION_HINT}", path=path, errno=code
        )
    if code in (errno.ELOOP, errno.ENOTDIR) and dir_fd is not None and _is_symlink(dir_fd, name):
        return CgroupPathError(
            f"refusing {path}: it is a symlink, and a cgroup filesystem has none (a fake tree, or an "
            "attempt to leave the mount)",
            input=path,
            path=path,
        )
    if code == errno.EISDIR:
        reason = "a directory where a cgroup file was expected"
    elif code == errno.ENXIO:  # O_WRONLY | O_NONBLOCK on a FIFO nobody reads
        reason = _NOT_REGULAR
    return CgroupError(f"cannot open {path}: {reason}", path=path, errno=code)


def _is_symlink(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _file_path(cgroup: Cgroup, name: str) -> str:
    """The file's filesystem path, for messages only: built when one is written."""
    return os.path.join(cgroup.fs_path, name)


def _check_regular(fd: int, cgroup: Cgroup, name: str) -> int:
    """Refuse (closing `fd`) anything but a regular file: a cgroup file always is one. Returns its
    size: 0 for a cgroup filesystem's file, whatever it holds (a fake tree's file has its own)."""
    try:
        status = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise _io_error(exc, _file_path(cgroup, name), "inspect") from exc
    if _S_ISREG(status.st_mode):
        return status.st_size
    os.close(fd)
    mode = status.st_mode
    where = _file_path(cgroup, name)
    if stat.S_ISDIR(mode):
        error = OSError(errno.EISDIR, os.strerror(errno.EISDIR))
        raise _io_error(error, where, "use")
    raise CgroupError(f"cannot use {where}: {_NOT_REGULAR}", path=where)


def _open_dir(cgroup: CgroupDir) -> int:
    """A descriptor for the cgroup's directory, reached without following any symlink below the
    mount point. The mount point itself may be a symlink (``/sys/fs/cgroup/cpu`` ->
    ``cpu,cpuacct``): it comes from the host's mount table, not from a runtime."""
    mount = cgroup.hierarchy.mount_point
    try:
        fd = os.open(mount, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise _open_error(exc, mount) from exc
    parts = cgroup.path.parts
    try:
        for depth, part in enumerate(parts):
            try:
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise _open_error(exc, os.path.join(mount, *parts[: depth + 1]), fd, part) from exc
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


class OpenCgroup:
    """A cgroup directory held open: walked to once (without following symlinks, as every access
    here), then each file read or written through the one descriptor with ``openat``.

    Pass it wherever a `CgroupDir` is taken. Close it (`close`, or use it as a context manager);
    it refers to the directory it was opened on even if that is removed, when its files are gone
    (`CgroupNotFound`), or replaced by a new one of the same name.

    `hold_limit` (what `CgroupOpener` asks for): its CFS limit file (v1 ``cpu.cfs_quota_us``, v2
    ``cpu.max``) is opened read-write at its first read and held until `close`, so that the write
    after the read needs no second open. `fd`: the directory already opened (by `CgroupOpener`).
    """

    __slots__ = ("_fd", "_hold_limit", "_limit", "cgroup", "version")

    def __init__(self, cgroup: CgroupDir, *, hold_limit: bool = False, fd: int | None = None) -> None:
        self._fd = -1
        self._limit: _HeldFile | None = None
        self._hold_limit = hold_limit
        self.cgroup = cgroup
        self.version: CgroupVersion = cgroup.hierarchy.version
        self._fd = _open_dir(cgroup) if fd is None else fd

    @property
    def hierarchy(self) -> Hierarchy:
        return self.cgroup.hierarchy

    @property
    def path(self) -> CgroupPath:
        return self.cgroup.path

    @property
    def fs_path(self) -> str:
        """The directory's filesystem path (for messages)."""
        return self.cgroup.fs_path

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def fileno(self) -> int:
        if self._fd < 0:
            raise ValueError(f"{self.cgroup} was closed")
        return self._fd

    def close(self) -> None:
        """Close the descriptor, and the limit file's if held (idempotent)."""
        limit = self._limit
        if limit is not None:
            self._limit = None
            os.close(limit.fd)
        fd = self._fd
        if fd >= 0:
            self._fd = -1
            os.close(fd)

    def _held(self, name: str) -> _HeldFile | None:
        """The file `name` held open read-write, if it is the limit file this cgroup holds (opened
        now at its first use); None for any other file, or when it cannot be opened for writing (a
        read-only file or mount: opened as each access needs, to fail as that access would)."""
        limit = self._limit
        if limit is not None and limit.name == name:
            return limit
        if not self._hold_limit or name not in _LIMIT_NAMES:
            return None
        dir_fd = self._fd
        if dir_fd < 0:
            dir_fd = self.fileno()  # raises: closed
        try:
            fd = os.open(name, _READ_WRITE_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno in _PERMISSION_ERRNOS:
                return None
            raise _open_error(exc, _file_path(self, name), dir_fd, name) from exc
        size = _check_regular(fd, self, name)
        if limit is not None:
            os.close(limit.fd)
        self._limit = limit = _HeldFile(name, fd, size)
        return limit

    def __enter__(self) -> OpenCgroup:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        if self._fd >= 0 or self._limit is not None:  # not closed yet
            self.close()

    def __str__(self) -> str:
        return self.cgroup.fs_path

    def __repr__(self) -> str:
        return f"OpenCgroup({self.cgroup!r}, fd={self._fd})"


class _HeldFile:
    """A cgroup file an `OpenCgroup` holds open read-write: its name, its descriptor, and the
    largest size it has had for us (0 on a cgroup filesystem, whose files always show 0)."""

    __slots__ = ("fd", "name", "size")

    def __init__(self, name: str, fd: int, size: int) -> None:
        self.name = name
        self.fd = fd
        self.size = size


Cgroup: TypeAlias = "CgroupDir | OpenCgroup"


def open_cgroup(cgroup: CgroupDir) -> OpenCgroup:
    """The cgroup's directory held open for several reads and writes (see `OpenCgroup`); raises
    `CgroupNotFound` when it does not exist, `CgroupPathError` for a symlink on the way."""
    return OpenCgroup(cgroup)


class CgroupOpener:
    """Opens cgroups with one ``openat`` each, below their parent directories, held open here.

    Each parent is walked to once (from its mount point, without following symlinks, as every walk
    here) and its descriptor kept: a node's pod cgroups sit below a handful of parents (``kubepods``,
    its QoS levels, or their slices), so opening a pod's cgroup is then one ``openat`` of its last
    component with ``O_NOFOLLOW``, which cannot leave the parent. A parent removed since it was
    walked to (its pods then fail with ENOENT below it) is walked to afresh once, so a recreated
    one is found. The cgroups it opens hold their CFS limit file (`OpenCgroup`'s `hold_limit`).
    At most `limit` parents are held; `close` closes them all.
    """

    def __init__(self, limit: int = 64) -> None:
        self._limit = limit
        # (mount point, parent's parts) -> the parent's descriptor. Keyed by the mount point, not the
        # `Hierarchy` (whose hash is computed at each call): one mount point is one hierarchy.
        self._parents: dict[tuple[str, tuple[str, ...]], int] = {}
        self._finalizer = weakref.finalize(self, _close_all, self._parents)

    def open(self, cgroup: CgroupDir) -> OpenCgroup:
        """`cgroup` held open; raises as `open_cgroup` does."""
        parts = cgroup.path.parts
        if not parts:
            return OpenCgroup(cgroup, hold_limit=True)
        key = (cgroup.hierarchy.mount_point, parts[:-1])
        name = parts[-1]
        held = self._parents.get(key)
        if held is not None:
            try:
                return OpenCgroup(cgroup, hold_limit=True, fd=os.open(name, _DIR_FLAGS, dir_fd=held))
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise _open_error(exc, cgroup.fs_path, held, name) from exc
            # Gone, or its parent is (removed since, perhaps made anew): walk to the parent again.
            os.close(self._parents.pop(key))
        parent = _open_dir(CgroupDir(cgroup.hierarchy, CgroupPath(parts[:-1])))
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            error = _open_error(exc, cgroup.fs_path, parent, name)
            os.close(parent)
            raise error from exc
        if len(self._parents) >= self._limit:
            _close_all(self._parents)
        self._parents[key] = parent
        return OpenCgroup(cgroup, hold_limit=True, fd=fd)

    def close(self) -> None:
        """Close every parent held (the opener may still be used: they are walked to again)."""
        _close_all(self._parents)


def _close_all(parents: dict[tuple[str, tuple[str, ...]], int]) -> None:
    for fd in parents.values():
        os.close(fd)
    parents.clear()


def _open_file(cgroup: Cgroup, name: str, flags: int) -> tuple[int, int]:
    """The file opened with `flags`, and its size (see `_check_regular`)."""
    if name not in _KNOWN_NAMES:
        check_name(name, "cgroup file name")
    if isinstance(cgroup, OpenCgroup):
        dir_fd, walked = cgroup.fileno(), False
    else:
        dir_fd, walked = _open_dir(cgroup), True  # walked to for this file only
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        raise _open_error(exc, _file_path(cgroup, name), dir_fd, name) from exc
    finally:
        if walked:
            os.close(dir_fd)
    return fd, _check_regular(fd, cgroup, name)


def _io_error(exc: OSError, path: str, action: str) -> CgroupError:
    code = exc.errno or 0
    reason = f"{os.strerror(code)} ({_errno_name(code)})"
    if code == errno.EISDIR:
        reason = "a directory where a cgroup file was expected"
    return CgroupError(f"cannot {action} {path}: {reason}", path=path, errno=code)


def _read_all(fd: int, *, from_start: bool = False) -> bytes | None:
    """The file's bytes (read at offset 0 on, leaving the file's offset alone, when `from_start`: a
    held file); None when it holds more than `MAX_READ`. A read that returns less than asked is the
    end: a regular file's reads are short only there, and the kernel fills a cgroup file's read
    with the whole value."""
    first = os.pread(fd, _FIRST_READ, 0) if from_start else os.read(fd, _FIRST_READ)
    if len(first) < _FIRST_READ:  # the whole value, as nearly always
        return first
    chunks = [first]
    size = _FIRST_READ
    want = MAX_READ + 1 - size
    while True:
        chunk = os.pread(fd, want, size) if from_start else os.read(fd, want)
        chunks.append(chunk)
        size += len(chunk)
        if len(chunk) < want or size > MAX_READ:
            break
        want = MAX_READ + 1 - size
    return None if size > MAX_READ else b"".join(chunks)


def read_value(cgroup: Cgroup, name: str) -> str:
    """The text of the cgroup file `name` in `cgroup`, as the kernel gives it (newline included)."""
    held = cgroup._held(name) if name in _LIMIT_NAMES and isinstance(cgroup, OpenCgroup) else None
    try:
        if held is not None:
            data = _read_all(held.fd, from_start=True)
        else:
            fd, _ = _open_file(cgroup, name, _READ_FLAGS)
            try:
                data = _read_all(fd)
            finally:
                os.close(fd)
    except OSError as exc:
        raise _io_error(exc, _file_path(cgroup, name), "read") from exc
    if data is None:
        path = _file_path(cgroup, name)
        raise CgroupError(f"{path} holds more than {MAX_READ} bytes; not a cgroup value file", path=path)
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        path = _file_path(cgroup, name)
        raise CgroupValueError(f"{path} holds non-ASCII bytes: {quote(repr(data))}", path=path) from None


def _reject_error(exc: OSError, path: str, name: str, data: bytes) -> CgroupError:
    code = exc.errno or 0
    reason = f"{os.strerror(code)} ({_errno_name(code)})"
    value = data.decode("ascii").removesuffix("\n")
    if code in _REJECT_ERRNOS:
        hint = _REJECT_HINTS.get((name, code), "the kernel refused the value")
        return CgroupWriteRejected(
            f"writing {quote(value)} to {path} was rejected: {reason}; {hint}",
            path=path,
            value=value,
            errno=code,
        )
    if code in _PERMISSION_ERRNOS:
        return CgroupPermissionError(
            f"writing {quote(value)} to {path} was refused: {reason}; {_PERMISSION_HINT}",
            path=path,
            errno=code,
        )
    return CgroupError(f"writing {quote(value)} to {path} failed: {reason}", path=path, errno=code)


def write_value(cgroup: Cgroup, name: str, value: str) -> None:
    """Write `value` to the existing cgroup file `name` in `cgroup` with a single ``write``.

    A newline is appended, as ``echo`` would: the kernel strips it, and it makes an empty value a
    real write (a zero-byte write never reaches the kernel's handler).
    """
    if not value.isascii() or not value.isprintable():
        path = _file_path(cgroup, name)
        raise CgroupValueError(f"refusing to write {quote(value)} to {path}: not printable ASCII", path=path)
    data = (value + "\n").encode("ascii")
    held = cgroup._held(name) if name in _LIMIT_NAMES and isinstance(cgroup, OpenCgroup) else None
    if held is not None:
        written = _write_held(held, data, cgroup)
    else:
        fd, size = _open_file(cgroup, name, _WRITE_FLAGS)
        try:
            written = _write(fd, data, cgroup, name)
            if size:
                _cut(fd, written, cgroup, name)
        finally:
            os.close(fd)
    if written != len(data):
        path = _file_path(cgroup, name)
        raise CgroupError(
            f"short write of {quote(value)} to {path}: {written} of {len(data)} bytes", path=path
        )


def _write(fd: int, data: bytes, cgroup: Cgroup, name: str) -> int:
    try:
        return os.write(fd, data)
    except OSError as exc:
        raise _reject_error(exc, _file_path(cgroup, name), name, data) from exc


def _write_held(held: _HeldFile, data: bytes, cgroup: Cgroup) -> int:
    """Write through a held file, whose offset is 0 (it is read with ``pread``) and put back to 0."""
    written = _write(held.fd, data, cgroup, held.name)
    if held.size:
        _cut(held.fd, written, cgroup, held.name)
        try:
            os.lseek(held.fd, 0, os.SEEK_SET)
        except OSError as exc:
            raise _io_error(exc, _file_path(cgroup, held.name), "rewind") from exc
    if written > held.size:  # (an empty fake file written twice is cut at the second write)
        held.size = written
    return written


def _cut(fd: int, written: int, cgroup: Cgroup, name: str) -> None:
    """A file that had a size when opened is a fake tree's (a cgroup file's size is 0): cut it to
    the value just written, so nothing of a longer one is left after it."""
    try:
        if os.fstat(fd).st_size > written:
            os.ftruncate(fd, written)
    except OSError as exc:
        raise _io_error(exc, _file_path(cgroup, name), "truncate") from exc


def _parsed(cgroup: Cgroup, name: str, parse: Callable[[str], _T]) -> _T:
    text = read_value(cgroup, name)
    try:
        return parse(text)
    except (CgroupValueError, cpuset.CpusetError) as exc:
        path = _file_path(cgroup, name)
        raise CgroupValueError(f"{path}: {exc}", path=path) from exc


def cgroup_exists(cgroup: CgroupDir) -> bool:
    """True when the cgroup's directory exists (reached without following symlinks)."""
    try:
        os.close(_open_dir(cgroup))
    except CgroupNotFound:
        return False
    return True


def read_cpu_quota(cgroup: Cgroup, *, period: int | None = None) -> CpuQuota:
    """The CFS limit: v1 ``cpu.cfs_quota_us`` + ``cpu.cfs_period_us``, v2 ``cpu.max``.

    `period` (v1): the period the caller has just read itself, taken as it is: only the quota file
    is read (a read-back right after a quota write, which leaves the period alone)."""
    if cgroup.version == 2:
        return _parsed(cgroup, CPU_MAX, parse_cpu_max)
    if not isinstance(cgroup, OpenCgroup) and period is None:
        with OpenCgroup(cgroup) as opened:  # one walk for both files
            return read_cpu_quota(opened)
    quota = _parsed(cgroup, CFS_QUOTA_US, parse_cfs_quota_us)
    if period is None:
        period = _parsed(cgroup, CFS_PERIOD_US, parse_cfs_period_us)
    try:
        return CpuQuota(quota, period)
    except CgroupValueError as exc:
        raise CgroupValueError(f"{cgroup.fs_path}: {exc}", path=cgroup.fs_path) from exc


def write_cpu_limit(cgroup: Cgroup, limit: CpuQuota) -> None:
    """Write `limit` (a `CpuQuota`: checked when made, not again) to a cgroup whose period it
    already has, as just read: v1 writes ``cpu.cfs_quota_us`` only, v2 ``"QUOTA PERIOD"`` to
    ``cpu.max``. A limit with another period is `restore_cpu_quota`'s."""
    if cgroup.version == 2:
        write_value(cgroup, CPU_MAX, format_cpu_max(limit))
    else:
        quota = limit.quota
        write_value(cgroup, CFS_QUOTA_US, "-1" if quota is None else str(quota))


def write_cpu_quota(cgroup: Cgroup, quota: int | None, *, current: CpuQuota | None = None) -> CpuQuota:
    """Set the CFS quota (microseconds per period, None = unlimited), keeping the current period.

    v1 writes ``cpu.cfs_quota_us`` only. v2 writes ``"QUOTA PERIOD"`` to ``cpu.max`` with the
    period just read, or with `current`'s when the caller has just read the limit itself. Returns
    the limit written. The quota is checked before anything is written.
    """
    if current is None and not isinstance(cgroup, OpenCgroup):
        with OpenCgroup(cgroup) as opened:  # one walk to read and write
            return write_cpu_quota(opened, quota)
    new = (current if current is not None else read_cpu_quota(cgroup)).with_quota(quota)
    write_cpu_limit(cgroup, new)
    return new


def restore_cpu_quota(cgroup: Cgroup, quota: CpuQuota) -> None:
    """Write back a whole limit, period included, as `read_cpu_quota` returned it (to undo a step).

    v2 writes ``"QUOTA PERIOD"`` to ``cpu.max``. v1 writes ``cpu.cfs_period_us`` first when the
    cgroup's period differs (someone else changed it meanwhile), then ``cpu.cfs_quota_us``. Unlike
    `write_cpu_quota`, this reads nothing on v2: a cgroup whose limit cannot even be read (a write
    cut short) can still be put back.
    """
    if cgroup.version == 2:
        write_value(cgroup, CPU_MAX, format_cpu_max(quota))
        return
    with _held(cgroup) as held:  # one walk for the period and the quota
        if _parsed(held, CFS_PERIOD_US, parse_cfs_period_us) != quota.period:
            write_value(held, CFS_PERIOD_US, str(quota.period))
        write_value(held, CFS_QUOTA_US, format_cfs_quota_us(quota.quota))


def set_cpu_limit(cgroup: Cgroup, limit: CpuQuota, *, current: CpuQuota | None) -> None:
    """Make `limit` the cgroup's CFS limit: the quota alone (`write_cpu_limit`) when `current`, just
    read, has the same period; else the whole limit, period included (`restore_cpu_quota`;
    `current` None: unknown, e.g. a write cut short)."""
    if current is not None and current.period == limit.period:
        write_cpu_limit(cgroup, limit)
    else:
        restore_cpu_quota(cgroup, limit)


def write_parent_child_quota(
    parent: Cgroup, child: Cgroup, *, parent_quota: int | None, child_quota: int | None
) -> None:
    """Set a parent's and a descendant's CFS quota in the order the kernel accepts.

    cgroup v1 refuses (EINVAL) a child quota above its parent's at any moment, so when the
    parent's limit goes up (or stays) it is written first, and when it goes down the child is
    written first. On v2 nothing is refused but the same order avoids a moment of throttling.
    Both quotas are checked and both cgroups read before anything is written. When the second
    write fails the first stays: either way the tree is left in a state the kernel accepted.
    """
    if parent.hierarchy != child.hierarchy or not child.path.is_below(parent.path):
        raise CgroupPathError(f"{child} is not below {parent}", input=child.fs_path, path=child.fs_path)
    with _held(parent) as held_parent, _held(child) as held_child:
        current = read_cpu_quota(held_parent)
        new_parent = current.with_quota(parent_quota)
        new_child = read_cpu_quota(held_child).with_quota(child_quota)
        if _as_limit(new_parent.quota) >= _as_limit(current.quota):
            write_cpu_limit(held_parent, new_parent)
            write_cpu_limit(held_child, new_child)
        else:
            write_cpu_limit(held_child, new_child)
            write_cpu_limit(held_parent, new_parent)


@contextlib.contextmanager
def _held(cgroup: Cgroup) -> Iterator[OpenCgroup]:
    """`cgroup` held open for the block: the caller's `OpenCgroup`, or one opened (and closed) here."""
    if isinstance(cgroup, OpenCgroup):
        yield cgroup
        return
    with OpenCgroup(cgroup) as opened:
        yield opened


def _as_limit(quota: int | None) -> float:
    return float("inf") if quota is None else quota


def read_cpuset(cgroup: Cgroup) -> frozenset[int]:
    """The CPUs in ``cpuset.cpus`` (v1 and v2; empty on v2 means "inherit the parent's")."""
    return _parsed(cgroup, CPUSET_CPUS, cpuset.parse)


def read_effective_cpuset(cgroup: Cgroup) -> frozenset[int]:
    """The CPUs the cgroup may really use: v1 ``cpuset.effective_cpus``, v2 ``cpuset.cpus.effective``."""
    return _parsed(cgroup, _EFFECTIVE_CPUS[cgroup.version], cpuset.parse)


def write_cpuset(cgroup: Cgroup, cpus: Iterable[int]) -> None:
    """Write `cpus` to ``cpuset.cpus`` in canonical form (`cpuset.CpusetError` for bad ids, before
    anything is written). On v1 the CPUs must lie within the parent's."""
    write_value(cgroup, CPUSET_CPUS, cpuset.format(cpus))
