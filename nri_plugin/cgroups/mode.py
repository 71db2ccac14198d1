"""Which cgroup hierarchy serves the `cpu` and `cpuset` controllers, read from mountinfo.

Modes, as systemd names them:

* v1 ("legacy"): only v1 hierarchies, one per controller or co-mounted group
  (``/sys/fs/cgroup/cpu,cpuacct``, ``/sys/fs/cgroup/cpuset``);
* hybrid: v1 controller hierarchies plus a v2 hierarchy (usually ``/sys/fs/cgroup/unified``) that
  holds no controllers we use;
* v2 ("unified"): one v2 hierarchy at the cgroup root.

A controller is served by the v1 hierarchy that lists it in its mount options; failing that, by the
v2 hierarchy (the one at the root, if several). Only mounts at or below `root` count, so a test or
a container that mounts the host's tree elsewhere can point there.

`detect_layout` works on mountinfo text alone. `read_layout` reads the file and also checks that a
v2 hierarchy really offers the controller (its ``cgroup.controllers``), which mountinfo cannot say.

The plugin must see the host's cgroup tree from its root: a v1 mount whose root field is not "/"
(a container's view without its own cgroup namespace) is refused, because the paths runtimes hand
over are relative to the hierarchy's real root. A private cgroup namespace is not detectable here.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass
from typing import Final

from nri_plugin.cgroups._text import quote
from nri_plugin.cgroups.errors import CgroupModeError
from nri_plugin.cgroups.paths import CgroupVersion, Hierarchy

__all__ = [
    "DEFAULT_CGROUP_ROOT",
    "DEFAULT_MOUNTINFO",
    "CgroupLayout",
    "CgroupMode",
    "CgroupMount",
    "detect_layout",
    "parse_mountinfo",
    "read_layout",
]

DEFAULT_MOUNTINFO: Final = "/proc/self/mountinfo"
DEFAULT_CGROUP_ROOT: Final = "/sys/fs/cgroup"

# The controllers we need. Other v1 controllers are recorded too, for messages.
_NEEDED: Final = ("cpu", "cpuset")

# v1 controller names as the kernel prints them in mount options. Everything else in those options
# (rw, noprefix, clone_children, name=systemd, release_agent=...) is not a controller.
_V1_CONTROLLERS: Final = frozenset(
    {
        "blkio", "cpu", "cpuacct", "cpuset", "devices", "freezer", "hugetlb", "memory", "misc",
        "net_cls", "net_prio", "perf_event", "pids", "rdma",
    }
)  # fmt: skip

# mountinfo escapes space, tab, newline and backslash in paths as \ooo (octal).
_OCTAL_ESCAPE: Final = re.compile(r"\\([0-7]{3})")

# A mountinfo line has six fixed fields, optional fields, "-", then fstype, source, super options.
_FIXED_FIELDS: Final = 6


class CgroupMode(enum.Enum):
    V1 = "v1"
    HYBRID = "hybrid"
    V2 = "v2"


@dataclass(frozen=True, slots=True)
class CgroupMount:
    """One cgroup or cgroup2 mount from mountinfo."""

    version: CgroupVersion
    mount_point: str
    # The directory of the hierarchy that is mounted there: "/" unless a sub-tree was bind-mounted.
    root: str
    # v1: the controllers of this hierarchy. v2: empty (mountinfo does not list them).
    controllers: frozenset[str]


@dataclass(frozen=True, slots=True)
class CgroupLayout:
    """The mode and the hierarchies that serve `cpu` (CFS quota) and `cpuset`."""

    mode: CgroupMode
    cpu: Hierarchy
    cpuset: Hierarchy


def _unescape(field: str) -> str:
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m[1], 8)), field)


def _parse_line(line: str, number: int) -> CgroupMount | None:
    fields = line.split(" ")
    try:
        separator = fields.index("-", _FIXED_FIELDS)
        fstype, _source, options = fields[separator + 1 : separator + 4]
    except ValueError:
        raise CgroupModeError(f"mountinfo line {number} is malformed: {quote(line)}") from None
    if fstype == "cgroup2":
        version: CgroupVersion = 2
        controllers: frozenset[str] = frozenset()
    elif fstype == "cgroup":
        version = 1
        controllers = _V1_CONTROLLERS.intersection(options.split(","))
    else:
        return None
    return CgroupMount(version, _unescape(fields[4]), _unescape(fields[3]), controllers)


def parse_mountinfo(text: str) -> tuple[CgroupMount, ...]:
    """The cgroup and cgroup2 mounts listed in ``/proc/<pid>/mountinfo`` text, in order."""
    mounts = (_parse_line(line, n) for n, line in enumerate(text.splitlines(), 1) if line.strip())
    return tuple(m for m in mounts if m is not None)


def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")  # root "/" has its own slash


def _visible_mounts(mounts: tuple[CgroupMount, ...], root: str) -> list[CgroupMount]:
    # A later mount on the same mount point hides an earlier one.
    by_point = {m.mount_point: m for m in mounts if _is_under(m.mount_point, root)}
    return list(by_point.values())


def _mode(v1: list[CgroupMount], v2: list[CgroupMount], root: str) -> CgroupMode:
    if v1 and v2:
        return CgroupMode.HYBRID
    if v1:
        return CgroupMode.V1
    if v2:
        return CgroupMode.V2
    raise CgroupModeError(
        f"no cgroup filesystem is mounted at or below {quote(root)}; mount the host's /sys/fs/cgroup "
        "(read-write) into the plugin's container"
    )


def _v1_hierarchy(controller: str, candidates: list[CgroupMount]) -> Hierarchy:
    for mount in candidates:
        if mount.root == "/":
            return Hierarchy(1, mount.mount_point)
    raise CgroupModeError(
        f"the cgroup v1 {controller} hierarchy is mounted at {quote(candidates[0].mount_point)} from "
        f"{quote(candidates[0].root)}, not from its root; the plugin needs the host's whole tree "
        "(mount the host's /sys/fs/cgroup)"
    )


def _hierarchy(controller: str, v1: list[CgroupMount], v2: list[CgroupMount], root: str) -> Hierarchy:
    candidates = [m for m in v1 if controller in m.controllers]
    if candidates:
        return _v1_hierarchy(controller, candidates)
    if v2:
        at_root = [m for m in v2 if m.mount_point == root]
        return Hierarchy(2, (at_root or v2)[0].mount_point)
    raise CgroupModeError(f"no cgroup hierarchy at or below {quote(root)} serves the {controller} controller")


def detect_layout(mountinfo: str, *, root: str = DEFAULT_CGROUP_ROOT) -> CgroupLayout:
    """Mode and `cpu` / `cpuset` hierarchies from mountinfo text; mounts outside `root` are ignored.

    Raises `CgroupModeError` when a controller is served by no hierarchy.
    """
    root = os.path.normpath(root)
    visible = _visible_mounts(parse_mountinfo(mountinfo), root)
    v1 = [m for m in visible if m.version == 1 and m.controllers]
    v2 = [m for m in visible if m.version == 2]
    mode = _mode(v1, v2, root)
    cpu, cpuset = (_hierarchy(name, v1, v2, root) for name in _NEEDED)
    return CgroupLayout(mode, cpu, cpuset)


def _v2_controllers(mount_point: str) -> frozenset[str]:
    path = os.path.join(mount_point, "cgroup.controllers")
    try:
        with open(path, encoding="ascii") as file:
            return frozenset(file.read().split())
    except (OSError, UnicodeDecodeError) as exc:
        raise CgroupModeError(f"cannot read {path}: {exc}", path=path) from exc


def _check_v2_controller(controller: str, hierarchy: Hierarchy) -> None:
    if hierarchy.version != 2:
        return
    available = _v2_controllers(hierarchy.mount_point)
    if controller not in available:
        raise CgroupModeError(
            f"the cgroup v2 hierarchy at {hierarchy.mount_point} does not offer the {controller} "
            f"controller (cgroup.controllers: {' '.join(sorted(available)) or 'none'}); enable it "
            "in the parent's cgroup.subtree_control or use a host with it",
            path=hierarchy.mount_point,
        )


def read_layout(*, mountinfo_path: str = DEFAULT_MOUNTINFO, root: str = DEFAULT_CGROUP_ROOT) -> CgroupLayout:
    """`detect_layout` on the mountinfo file, then check that v2 hierarchies offer the controllers."""
    try:
        with open(mountinfo_path, encoding="utf-8", errors="surrogateescape") as file:
            text = file.read()
    except OSError as exc:
        raise CgroupModeError(f"cannot read {mountinfo_path}: {exc}", path=mountinfo_path) from exc
    layout = detect_layout(text, root=root)
    _check_v2_controller("cpu", layout.cpu)
    _check_v2_controller("cpuset", layout.cpuset)
    return layout
