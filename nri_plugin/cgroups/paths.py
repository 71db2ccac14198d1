"""Where a pod's and a container's cgroups are, as validated paths below a hierarchy's root.

Inputs are plain strings as runtimes hand them over (NRI `PodSandbox.linux.cgroup_parent` and
`Container.linux.cgroups_path`); nothing here knows NRI. The layouts understood (systemd driver
names use the pod UID with `-` turned into `_`):

* CRI-O, systemd: parent ``kubepods-pod<uid_>.slice`` (short), container
  ``kubepods-pod<uid_>.slice:crio:<id>``;
* containerd, systemd: parent ``/kubepods.slice/kubepods-pod<uid_>.slice`` (expanded), container
  ``kubepods-pod<uid_>.slice:cri-containerd:<id>``;
* CRI-O, cgroupfs: parent ``/kubepods/pod<uid>``, container ``/kubepods/pod<uid>/crio-<id>``;
* containerd, cgroupfs: parent ``/kubepods/pod<uid>``, container ``/kubepods/pod<uid>/<id>``.

A short slice name is expanded as systemd does (`expand_slice`); ``slice:prefix:name`` is the
scope ``<expanded slice>/<prefix>-<name>.scope``. Burstable and BestEffort pods add their QoS
level (``kubepods-burstable-pod<uid_>.slice``, ``/kubepods/burstable/pod<uid>``).

Not covered: containerd under the cgroupfs driver given a ``.slice`` parent makes one flat
directory named ``kubepods-pod<uid>.slice:cri-containerd:<id>`` at the root; that string reads as
the systemd form here and resolves to the scope (which will not exist). Sub-cgroups a runtime adds
below the container (crun's ``container``, CRI-O's ``cgroup-child``) are reached with `child`.

Every path is checked component by component before it is ever joined to a mount point (see
`CgroupPath`), and `files.py` walks it without following symlinks, so no input can name a file
outside the hierarchy it is resolved in.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Final, Literal

from nri_plugin.cgroups._text import quote
from nri_plugin.cgroups.errors import CgroupPathError

__all__ = [
    "NAME_MAX",
    "PATH_MAX",
    "ROOT_SLICE",
    "CgroupDir",
    "CgroupPath",
    "CgroupVersion",
    "Hierarchy",
    "check_name",
    "container_cgroup_path",
    "expand_slice",
    "parse_cgroupfs_path",
    "pod_cgroup_path",
]

CgroupVersion = Literal[1, 2]

# Linux limits: a path component (NAME_MAX) and a whole path (PATH_MAX). systemd's limit for a
# unit name (UNIT_NAME_MAX 256, counting the NUL) comes to the same 255 characters. Checking the
# whole input's length first also keeps a megabyte of runtime-supplied text out of the parsers.
NAME_MAX: Final = 255
PATH_MAX: Final = 4096

# The characters a cgroup path component may hold. Kubernetes, CRI-O and containerd only ever
# produce ASCII letters, digits, `_` (systemd-escaped pod UIDs), `-`, `.` (`.slice`, `.scope`),
# `:` (containerd's flat name under cgroupfs) and `@` (systemd instance units). Anything else —
# `/`, NUL, newlines and other control characters, spaces, backslashes, non-ASCII look-alikes such
# as U+FF0E FULLWIDTH FULL STOP — is refused rather than interpreted.
_COMPONENT: Final = re.compile(r"[A-Za-z0-9_.:@-]+")
# A valid component in one match: 1 to NAME_MAX allowed characters, not dots only (the common case,
# checked at every pod's first creation; `_check_component` says what is wrong with any other).
_VALID_COMPONENT: Final = re.compile(rf"(?!\.+\Z)[A-Za-z0-9_.:@-]{{1,{NAME_MAX}}}")

# The same minus `@` for the systemd unit names we build or expand (slices and scopes). systemd
# itself also takes `@` (template instances) and `\` (escapes), which kubelet never produces.
_UNIT_NAME: Final = re.compile(r"[A-Za-z0-9_.:-]+")

_ALLOWED_TEXT: Final = "letters, digits and _ . : @ -"
_SLICE: Final = ".slice"
_SCOPE: Final = ".scope"

# systemd's name for the root slice; it expands to the root of the hierarchy.
ROOT_SLICE: Final = "-.slice"


class _Reject(Exception):
    """Internal: why an input is refused; the public function turns it into a CgroupPathError."""


def _describe(char: str) -> str:
    code = f"U+{ord(char):04X}"
    if char == "\0":
        return f"a NUL byte ({code})"
    if not char.isprintable():
        return f"control character {code}"
    if not char.isascii():
        return f"non-ASCII character {code} {char!r}"
    return f"character {char!r}"


def _first_bad_char(text: str, allowed: re.Pattern[str]) -> str | None:
    """The first character of `text` that `allowed` (a ``[...]+`` class) does not match, or None.

    One match of the whole text decides the common case, a valid name; only a refused one is
    scanned character by character, to name the culprit."""
    if allowed.fullmatch(text) is not None:
        return None
    return next((c for c in text if allowed.fullmatch(c) is None), None)


def _check_component(part: str) -> None:
    if _VALID_COMPONENT.fullmatch(part) is not None:
        return
    if not part:
        raise _Reject("empty path component (doubled or trailing '/')")
    if len(part) > NAME_MAX:
        raise _Reject(f"path component longer than {NAME_MAX} characters")
    bad = _first_bad_char(part, _COMPONENT)
    if bad is not None:
        raise _Reject(f"component {quote(part)} contains {_describe(bad)}; allowed: {_ALLOWED_TEXT}")
    if part.strip(".") == "":
        raise _Reject(f"component {quote(part)} is not allowed ('.', '..' and dots-only names)")


def check_name(name: str, what: str) -> None:
    """Raise `CgroupPathError` unless `name` is a valid single component (a cgroup file's name, a
    sub-cgroup's name); `what` names it in the message."""
    try:
        _check_component(name)
    except _Reject as exc:
        raise _refused(what, name, str(exc)) from None


_TOO_LONG: Final = f"longer than {PATH_MAX} characters"


def _check_length(text: str) -> None:
    if len(text) > PATH_MAX:
        raise _Reject(_TOO_LONG)


def _refused(what: str, text: str, reason: str) -> CgroupPathError:
    return CgroupPathError(f"invalid {what} {quote(text)}: {reason}", input=text)


@dataclass(frozen=True, slots=True)
class CgroupPath:
    """A cgroup path relative to the root of a hierarchy, validated component by component.

    ``CgroupPath(("kubepods", "pod1"))`` is ``/kubepods/pod1``; ``CgroupPath()`` is the root.
    Each component is non-empty, at most `NAME_MAX` characters, made of ``[A-Za-z0-9_.:@-]`` and
    not `.`, `..` or any other dots-only name, so a `CgroupPath` can never climb out of the
    hierarchy it is joined to.
    """

    parts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            for part in self.parts:
                _check_component(part)
            _check_length(str(self))
        except _Reject as exc:
            raise _refused("cgroup path", str(self), str(exc)) from None

    @classmethod
    def _of_parts(cls, parts: tuple[str, ...]) -> CgroupPath:
        """The path of `parts`, made by a parser below: `_Reject` when too long, so that the
        parser's message names its input (the components, which it checked, are checked again)."""
        if len("/".join(parts)) >= PATH_MAX:  # the path is "/" and that
            raise _Reject(_TOO_LONG)
        return cls(parts)

    def __str__(self) -> str:
        return "/" + "/".join(self.parts)

    @property
    def is_root(self) -> bool:
        return not self.parts

    def child(self, name: str) -> CgroupPath:
        """This path plus one component; `name` is validated like any other component."""
        return CgroupPath((*self.parts, name))

    def is_below(self, other: CgroupPath) -> bool:
        """True when this path is strictly inside `other`."""
        return len(self.parts) > len(other.parts) and self.parts[: len(other.parts)] == other.parts


def _cgroupfs_parts(text: str) -> tuple[str, ...]:
    if len(text) > PATH_MAX:
        raise _Reject(_TOO_LONG)
    if not text.startswith("/"):
        # libcontainer would take a relative path relative to the *runtime's* own cgroup, which we
        # cannot know; runtimes always hand over absolute paths.
        raise _Reject("a cgroupfs path must be absolute (start with '/')")
    if text == "/":
        return ()
    parts = tuple(text[1:].split("/"))
    for part in parts:
        _check_component(part)
    return parts


def parse_cgroupfs_path(text: str) -> CgroupPath:
    """``"/kubepods/burstable/pod<uid>"`` -> `CgroupPath`; ``"/"`` is the root."""
    try:
        return CgroupPath._of_parts(_cgroupfs_parts(text))
    except _Reject as exc:
        raise _refused("cgroupfs path", text, str(exc)) from None


# systemd's rules for a slice unit name, which we enforce before expanding one:
#   * at most 255 characters, from the unit-name alphabet (we take the subset in _UNIT_NAME);
#   * ends in ".slice" with a non-empty name before it;
#   * "-.slice" is the root slice;
#   * otherwise '-' separates nesting levels, so the name part may not start or end with '-' nor
#     contain "--" (each level must be non-empty): "a--b.slice", "-a.slice", "a-.slice" are invalid.
def _check_slice_name(name: str) -> None:
    if len(name) > NAME_MAX:
        raise _Reject(f"slice name longer than {NAME_MAX} characters")
    bad = _first_bad_char(name, _UNIT_NAME)
    if bad is not None:
        raise _Reject(f"slice name {quote(name)} contains {_describe(bad)}")
    stem = name.removesuffix(_SLICE)
    if stem == name or not stem:
        raise _Reject(f"{quote(name)} is not a slice name (expected <name>.slice)")
    if name == ROOT_SLICE:
        return
    if stem.startswith("-") or stem.endswith("-"):
        raise _Reject(f"slice name {quote(name)} starts or ends with '-'")
    if "--" in stem:
        raise _Reject(f"slice name {quote(name)} contains '--'")


def _expanded_parts(name: str) -> tuple[str, ...]:
    _check_slice_name(name)
    if name == ROOT_SLICE:
        return ()
    levels = name.removesuffix(_SLICE).split("-")
    return tuple("-".join(levels[: depth + 1]) + _SLICE for depth in range(len(levels)))


def expand_slice(name: str) -> CgroupPath:
    """Where systemd puts a slice: ``"kubepods-burstable-pod1.slice"`` ->
    ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice``;
    ``"-.slice"`` -> the root. Raises `CgroupPathError` for names systemd would refuse."""
    try:
        return CgroupPath._of_parts(_expanded_parts(name))
    except _Reject as exc:
        raise _refused("slice name", name, str(exc)) from None


def _slice_parts(text: str) -> tuple[str, ...]:
    """A short slice name, expanded; or an already expanded ``/a.slice/a-b.slice``, as given."""
    if "/" not in text:
        return _expanded_parts(text)
    parts = tuple(text.removeprefix("/").split("/"))
    for part in parts:
        if not part:
            raise _Reject("empty path component (doubled or trailing '/')")
        _check_slice_name(part)
        if part == ROOT_SLICE:
            raise _Reject(f"{ROOT_SLICE!r} cannot be a level of an expanded slice path")
    return parts


def _pod_parts(text: str) -> tuple[str, ...]:
    if len(text) > PATH_MAX:
        raise _Reject(_TOO_LONG)
    if not text:
        raise _Reject("empty")
    # (the last component ends in ".slice" when the text does: the suffix holds no "/")
    parts = _slice_parts(text) if text.endswith(_SLICE) else _cgroupfs_parts(text)
    if not parts:
        raise _Reject("names the root cgroup, which is never a pod's")
    return parts


def pod_cgroup_path(cgroup_parent: str) -> CgroupPath:
    """The pod's cgroup from its cgroup parent.

    * ``kubepods-burstable-pod<uid_>.slice`` (systemd, short) -> expanded as systemd does;
    * ``/kubepods.slice/kubepods-pod<uid_>.slice`` (systemd, expanded) -> as given, each level
      checked to be a valid slice name;
    * ``/kubepods/burstable/pod<uid>`` (cgroupfs) -> as given; it must be absolute.
    """
    try:
        return CgroupPath._of_parts(_pod_parts(cgroup_parent))
    except _Reject as exc:
        raise _refused("pod cgroup parent", cgroup_parent, str(exc)) from None


def _check_unit_part(value: str, what: str) -> None:
    if not value:
        raise _Reject(f"empty {what}")
    bad = _first_bad_char(value, _UNIT_NAME)
    if bad is not None:
        raise _Reject(f"{what} {quote(value)} contains {_describe(bad)}")


def _scope_parts(text: str) -> tuple[str, ...]:
    slice_name, prefix, name = text.split(":")
    if not slice_name:
        raise _Reject("empty slice in slice:prefix:name")
    _check_unit_part(prefix, "prefix")
    _check_unit_part(name, "name")
    if name.endswith(_SLICE):
        raise _Reject("a name ending in .slice (a nested slice, not a scope) is not supported")
    scope = f"{prefix}-{name}{_SCOPE}"
    if len(scope) > NAME_MAX:
        raise _Reject(f"scope name {quote(scope)} longer than {NAME_MAX} characters")
    return (*_slice_parts(slice_name), scope)


def _container_parts(text: str) -> tuple[str, ...]:
    if len(text) > PATH_MAX:
        raise _Reject(_TOO_LONG)
    if text.startswith("/"):
        parts = _cgroupfs_parts(text)
    elif text.count(":") == 2:
        parts = _scope_parts(text)
    else:
        raise _Reject(
            "expected an absolute cgroupfs path (/kubepods/pod<uid>/<id>) or systemd's slice:prefix:name"
        )
    if not parts:
        raise _Reject("names the root cgroup, which is never a container's")
    return parts


def container_cgroup_path(cgroups_path: str) -> CgroupPath:
    """The container's cgroup from its cgroups path.

    * ``kubepods-pod<uid_>.slice:crio:<id>`` (systemd driver) ->
      ``<expanded slice>/crio-<id>.scope``; any prefix (``cri-containerd``, ...) works the same;
    * ``/kubepods/pod<uid>/crio-<id>`` or ``/kubepods/pod<uid>/<id>`` (cgroupfs) -> as given.
    """
    try:
        return CgroupPath._of_parts(_container_parts(cgroups_path))
    except _Reject as exc:
        raise _refused("container cgroups path", cgroups_path, str(exc)) from None


@dataclass(frozen=True, slots=True)
class Hierarchy:
    """A mounted cgroup hierarchy: on v1 one controller's (or a few co-mounted ones', as in
    ``cpu,cpuacct``), on v2 the unified one. `mount_point` is absolute and normalized."""

    version: CgroupVersion
    mount_point: str

    def __post_init__(self) -> None:
        if self.version not in (1, 2):
            raise ValueError(f"cgroup version must be 1 or 2, not {self.version!r}")
        mount = self.mount_point
        if not os.path.isabs(mount) or os.path.normpath(mount) != mount or "\0" in mount:
            raise ValueError(f"mount point must be an absolute normalized path, not {quote(mount)}")

    def dir(self, path: CgroupPath) -> CgroupDir:
        return CgroupDir(self, path)


@dataclass(frozen=True, slots=True)
class CgroupDir:
    """One cgroup directory: a validated path inside one hierarchy."""

    hierarchy: Hierarchy
    path: CgroupPath

    @property
    def version(self) -> CgroupVersion:
        return self.hierarchy.version

    @property
    def fs_path(self) -> str:
        """The directory's filesystem path (for messages; files.py never opens it by this name)."""
        return os.path.join(self.hierarchy.mount_point, *self.path.parts)

    def child(self, name: str) -> CgroupDir:
        return CgroupDir(self.hierarchy, self.path.child(name))

    def __str__(self) -> str:
        return self.fs_path
