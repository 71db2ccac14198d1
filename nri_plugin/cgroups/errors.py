"""Errors of the cgroups package. Every one is a `CgroupError`; each message names the input or
file involved and, where the operator can do something about it, says what."""

from __future__ import annotations

__all__ = [
    "CgroupError",
    "CgroupModeError",
    "CgroupNotFound",
    "CgroupPathError",
    "CgroupPermissionError",
    "CgroupValueError",
    "CgroupWriteRejected",
]


class CgroupError(Exception):
    """Base of every error raised by this package.

    Raised as such for unexpected filesystem states (a directory where a cgroup file should be,
    a short write, an errno with no better class). `path` is the file or directory concerned when
    there is one, `errno` the OS error number when one caused it.
    """

    def __init__(self, message: str, *, path: str | None = None, errno: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno


class CgroupPathError(CgroupError, ValueError):
    """A cgroup parent, cgroups path, slice name or path component that we refuse.

    Raised before any filesystem access for malformed input (`..`, control characters, names
    systemd would not accept, ...) and while walking a tree for a symlink below a mount. `input` is
    the offending text as given.
    """

    def __init__(self, message: str, *, input: str, path: str | None = None) -> None:
        super().__init__(message, path=path)
        self.input = input


class CgroupModeError(CgroupError):
    """The cgroup mounts do not offer what we need (no `cpu` or `cpuset` controller, ...)."""


class CgroupNotFound(CgroupError):
    """A cgroup directory or file does not exist (ENOENT): the pod or container is gone, or the
    controller is not enabled there. Files are never created."""


class CgroupPermissionError(CgroupError):
    """Opening or writing a cgroup file was refused by permissions (EACCES, EPERM, EROFS)."""


class CgroupWriteRejected(CgroupError):
    """The kernel refused a value written to a cgroup file (EINVAL, ERANGE, EBUSY, ...).

    `value` is the text that was written.
    """

    def __init__(self, message: str, *, path: str, value: str, errno: int) -> None:
        super().__init__(message, path=path, errno=errno)
        self.value = value


class CgroupValueError(CgroupError, ValueError):
    """A cgroup file holds, or a caller passed, a value we cannot interpret (`cpu.max` that is not
    "max 100000" or "200000 100000", a quota below the kernel's minimum, ...)."""
