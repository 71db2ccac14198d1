"""cgroups against the real kernel's cgroup v1 `cpu` and `cpuset` hierarchies.

Runs only as root on a host whose `cpu` and `cpuset` controllers are v1 hierarchies; skipped
otherwise. Each test works in a scratch tree ``<mount>/mixed-cpu-test-<pid>-<random>/pod/ctr``
that the fixture removes afterwards, children first, whatever the outcome.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from kernel_support import require_v1_layout

from nri_plugin.cgroups import (
    CgroupDir,
    CgroupPath,
    CgroupWriteRejected,
    CpuQuota,
    Hierarchy,
    read_cpu_quota,
    read_cpuset,
    read_value,
    write_cpu_quota,
    write_cpuset,
    write_parent_child_quota,
    write_value,
)


@dataclass(frozen=True)
class Scratch:
    top: CgroupDir
    pod: CgroupDir
    ctr: CgroupDir


def _scratch(hierarchy: Hierarchy) -> Iterator[Scratch]:
    name = f"mixed-cpu-test-{os.getpid()}-{secrets.token_hex(4)}"
    top = hierarchy.dir(CgroupPath((name,)))
    scratch = Scratch(top, top.child("pod"), top.child("pod").child("ctr"))
    made: list[str] = []
    try:
        for cgroup in (scratch.top, scratch.pod, scratch.ctr):
            os.mkdir(cgroup.fs_path)
            made.append(cgroup.fs_path)
        yield scratch
    finally:
        for path in reversed(made):
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(path)


@pytest.fixture
def cpu_tree() -> Iterator[Scratch]:
    yield from _scratch(require_v1_layout().cpu)


@pytest.fixture
def cpuset_tree() -> Iterator[Scratch]:
    layout = require_v1_layout()
    root = layout.cpuset.dir(CgroupPath())
    if len(read_cpuset(root)) < 2:
        pytest.skip("needs at least two CPUs in the root cpuset")
    for scratch in _scratch(layout.cpuset):
        # A new v1 cpuset starts with empty cpus and mems (unless clone_children is set) and
        # cannot be used until both are filled in, parent first.
        parent = root
        for cgroup in (scratch.top, scratch.pod, scratch.ctr):
            for name in ("cpuset.mems", "cpuset.cpus"):
                write_value(cgroup, name, read_value(parent, name).strip())
            parent = cgroup
        yield scratch


def _quotas(tree: Scratch) -> tuple[int | None, int | None]:
    return read_cpu_quota(tree.pod).quota, read_cpu_quota(tree.ctr).quota


def test_scratch_tree_starts_unlimited(cpu_tree: Scratch) -> None:
    assert read_cpu_quota(cpu_tree.pod) == CpuQuota(None, read_cpu_quota(cpu_tree.pod).period)
    assert _quotas(cpu_tree) == (None, None)


def test_raise_parent_first_succeeds(cpu_tree: Scratch) -> None:
    write_parent_child_quota(cpu_tree.pod, cpu_tree.ctr, parent_quota=100_000, child_quota=100_000)
    assert _quotas(cpu_tree) == (100_000, 100_000)
    write_parent_child_quota(cpu_tree.pod, cpu_tree.ctr, parent_quota=200_000, child_quota=200_000)
    assert _quotas(cpu_tree) == (200_000, 200_000)


def test_raise_child_first_is_rejected_by_the_kernel(cpu_tree: Scratch) -> None:
    write_parent_child_quota(cpu_tree.pod, cpu_tree.ctr, parent_quota=100_000, child_quota=100_000)
    with pytest.raises(CgroupWriteRejected) as info:
        write_cpu_quota(cpu_tree.ctr, 200_000)
    assert info.value.errno == errno.EINVAL
    assert info.value.value == "200000"
    assert info.value.path == os.path.join(cpu_tree.ctr.fs_path, "cpu.cfs_quota_us")
    assert "raise the parent first" in str(info.value)
    assert _quotas(cpu_tree) == (100_000, 100_000)


def test_lower_child_first_succeeds(cpu_tree: Scratch) -> None:
    write_parent_child_quota(cpu_tree.pod, cpu_tree.ctr, parent_quota=200_000, child_quota=200_000)
    write_parent_child_quota(cpu_tree.pod, cpu_tree.ctr, parent_quota=100_000, child_quota=100_000)
    assert _quotas(cpu_tree) == (100_000, 100_000)


def test_lower_parent_first_is_rejected_by_the_kernel(cpu_tree: Scratch) -> None:
    write_parent_child_quota(cpu_tree.pod, cpu_tree.ctr, parent_quota=200_000, child_quota=200_000)
    with pytest.raises(CgroupWriteRejected) as info:
        write_cpu_quota(cpu_tree.pod, 100_000)
    assert info.value.errno == errno.EINVAL
    assert _quotas(cpu_tree) == (200_000, 200_000)


def test_unlimited_and_back(cpu_tree: Scratch) -> None:
    write_parent_child_quota(cpu_tree.pod, cpu_tree.ctr, parent_quota=100_000, child_quota=100_000)
    write_parent_child_quota(cpu_tree.pod, cpu_tree.ctr, parent_quota=None, child_quota=300_000)
    assert _quotas(cpu_tree) == (None, 300_000)
    write_parent_child_quota(cpu_tree.pod, cpu_tree.ctr, parent_quota=150_000, child_quota=None)
    assert _quotas(cpu_tree) == (150_000, None)  # an unlimited child under a limited parent is allowed


def test_quota_below_kernel_minimum_never_reaches_the_kernel(cpu_tree: Scratch) -> None:
    with pytest.raises(ValueError, match="invalid CFS quota 999"):
        write_cpu_quota(cpu_tree.ctr, 999)
    assert _quotas(cpu_tree) == (None, None)


def test_cpuset_widening_needs_the_parent_first(cpuset_tree: Scratch) -> None:
    first, second = sorted(read_cpuset(cpuset_tree.top))[:2]
    write_cpuset(cpuset_tree.ctr, {first})
    write_cpuset(cpuset_tree.pod, {first})
    with pytest.raises(CgroupWriteRejected) as info:
        write_cpuset(cpuset_tree.ctr, {first, second})
    assert info.value.errno == errno.EACCES
    assert "subset of its parent's" in str(info.value)
    assert read_cpuset(cpuset_tree.ctr) == {first}

    write_cpuset(cpuset_tree.pod, {first, second})
    write_cpuset(cpuset_tree.ctr, {first, second})
    assert read_cpuset(cpuset_tree.ctr) == {first, second}


def test_cpuset_outside_parent_is_rejected(cpuset_tree: Scratch) -> None:
    first, second = sorted(read_cpuset(cpuset_tree.top))[:2]
    write_cpuset(cpuset_tree.ctr, {first})
    write_cpuset(cpuset_tree.pod, {first})
    with pytest.raises(CgroupWriteRejected) as info:
        write_cpuset(cpuset_tree.ctr, {second})
    assert info.value.value == str(second)
    assert read_cpuset(cpuset_tree.ctr) == {first}


def test_cpuset_narrowing_parent_under_a_wider_child_is_rejected(cpuset_tree: Scratch) -> None:
    first, second = sorted(read_cpuset(cpuset_tree.top))[:2]
    write_cpuset(cpuset_tree.pod, {first, second})
    write_cpuset(cpuset_tree.ctr, {first, second})
    with pytest.raises(CgroupWriteRejected) as info:
        write_cpuset(cpuset_tree.pod, {first})
    assert info.value.errno == errno.EBUSY
    assert "narrow the children first" in str(info.value)


def test_cpuset_naming_cpus_that_do_not_exist_is_rejected(cpuset_tree: Scratch) -> None:
    with pytest.raises(CgroupWriteRejected) as info:
        write_cpuset(cpuset_tree.ctr, {8191})
    assert info.value.errno in (errno.EINVAL, errno.ERANGE)
