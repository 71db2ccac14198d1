"""For tests against the real kernel's cgroup v1 hierarchies: skip, with the reason, where there are
none; scratch subtrees always removed; cgroups made as kubelet and the runtime make them."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator

import pytest

from nri_plugin.cgroups import (
    CgroupDir,
    CgroupLayout,
    CgroupModeError,
    CgroupPath,
    Hierarchy,
    read_cpuset,
    read_layout,
    read_value,
    write_value,
)


def require_v1_layout(*, min_cpus: int = 1) -> CgroupLayout:
    """The host's layout when tests may create cgroups in its v1 `cpu` and `cpuset` hierarchies."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create cgroups")
    try:
        layout = read_layout()
    except CgroupModeError as exc:
        pytest.skip(f"no usable cgroup mounts: {exc}")
    if layout.cpu.version != 1 or layout.cpuset.version != 1:
        pytest.skip(f"cpu and cpuset are not both cgroup v1 hierarchies here ({layout})")
    if len(read_cpuset(layout.cpuset.dir(CgroupPath()))) < min_cpus:
        pytest.skip(f"needs at least {min_cpus} CPUs in the root cpuset")
    return layout


@contextlib.contextmanager
def scratch_subtree(layout: CgroupLayout, prefix: str) -> Iterator[str]:
    """The name of a scratch subtree ``<mount>/<prefix>-<pid>-<random>`` of both v1 hierarchies (made
    by the caller), every cgroup in it removed afterwards, deepest first; asserts none is left."""
    top = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        yield top
    finally:
        for hierarchy in (layout.cpu, layout.cpuset):
            base = os.path.join(hierarchy.mount_point, top)
            if os.path.isdir(base):  # cgroup dirs hold no removable files: rmdir is enough
                for dirpath, _dirs, _files in sorted(os.walk(base), key=lambda e: -e[0].count("/")):
                    with contextlib.suppress(OSError):
                        os.rmdir(dirpath)
        left = [
            h.mount_point for h in (layout.cpu, layout.cpuset) if os.path.exists(f"{h.mount_point}/{top}")
        ]
        assert not left, f"scratch cgroups left behind in {left}"


def inherit_cpuset(cgroup: CgroupDir) -> None:
    """A new v1 cpuset starts empty (without clone_children) and takes no task until filled: copy
    its parent's."""
    parent = CgroupDir(cgroup.hierarchy, CgroupPath(cgroup.path.parts[:-1]))
    for name in ("cpuset.mems", "cpuset.cpus"):
        write_value(cgroup, name, read_value(parent, name).strip())


def make_cgroups(layout: CgroupLayout, hierarchy: Hierarchy, path: CgroupPath) -> None:
    """`path` and its missing parents in `hierarchy` (one of `layout`'s), each new cpuset filled from
    its parent's, as kubelet makes a pod cgroup."""
    for depth in range(1, len(path.parts) + 1):
        cgroup = hierarchy.dir(CgroupPath(path.parts[:depth]))
        if not os.path.isdir(cgroup.fs_path):
            os.mkdir(cgroup.fs_path)
            if hierarchy is layout.cpuset:
                inherit_cpuset(cgroup)
