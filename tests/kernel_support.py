"""For tests against the real kernel's cgroup v1 hierarchies: skip, with the reason, where there are none."""

from __future__ import annotations

import os

import pytest

from cgroups import CgroupLayout, CgroupModeError, CgroupPath, read_cpuset, read_layout


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
