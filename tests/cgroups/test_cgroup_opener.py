"""nri_plugin.cgroups.CgroupOpener (pod cgroups opened below held parents) and the CFS limit file an opened
cgroup holds from its read to its write, on fake trees."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
from fs_support import count_opens

from nri_plugin.cgroups import (
    CgroupNotFound,
    CgroupOpener,
    CgroupPath,
    CgroupPathError,
    CgroupPermissionError,
    CpuQuota,
    Hierarchy,
    files,
    read_cpu_quota,
    read_value,
    write_cpu_quota,
)

PODS = CgroupPath(("kubepods",))


def _pod(mount: Path, name: str, version: int = 1, quota: str = "") -> None:
    directory = mount / "kubepods" / name
    directory.mkdir(parents=True, exist_ok=True)
    if version == 1:
        (directory / "cpu.cfs_quota_us").write_text(quota or "200000\n")
        (directory / "cpu.cfs_period_us").write_text("100000\n")
    else:
        (directory / "cpu.max").write_text(quota or "200000 100000\n")


@pytest.fixture(params=[1, 2], ids=["v1", "v2"])
def version(request: pytest.FixtureRequest) -> int:
    return int(request.param)


def _hierarchy(mount: Path, version: int, *pods: str) -> Hierarchy:
    for name in pods:
        _pod(mount, name, version)
    return Hierarchy(1 if version == 1 else 2, str(mount))


def _limit_file(version: int) -> str:
    return "cpu.cfs_quota_us" if version == 1 else "cpu.max"


def test_a_pod_is_one_openat_below_its_held_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int
) -> None:
    hierarchy = _hierarchy(tmp_path, version, "pod1", "pod2")
    opener = CgroupOpener()
    opened = count_opens(monkeypatch)
    with opener.open(hierarchy.dir(PODS.child("pod1"))) as pod:
        assert read_cpu_quota(pod) == CpuQuota(200000, 100000)
    assert opened[:3] == [str(tmp_path), "kubepods", "pod1"]  # the parent walked to once
    opened.clear()
    with opener.open(hierarchy.dir(PODS.child("pod2"))) as pod:
        assert opened == ["pod2"]
        assert os.path.samestat(os.fstat(pod.fileno()), os.stat(tmp_path / "kubepods" / "pod2"))
    opener.close()


def test_the_limit_is_read_and_written_through_one_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int
) -> None:
    hierarchy = _hierarchy(tmp_path, version, "pod1")
    opener = CgroupOpener()
    with opener.open(hierarchy.dir(PODS.child("pod1"))) as pod:
        opened = count_opens(monkeypatch)
        current = read_cpu_quota(pod)
        assert write_cpu_quota(pod, 1_000_000, current=current) == CpuQuota(1_000_000, 100000)
        write_cpu_quota(pod, 2000, current=current)  # shorter: nothing of the longer one is left
        assert read_cpu_quota(pod) == CpuQuota(2000, 100000)
    reads = ["cpu.cfs_quota_us", "cpu.cfs_period_us"] if version == 1 else ["cpu.max"]
    assert opened == [*reads, *reads[1:]]  # the limit file opened once, the period read again
    expected = "2000\n" if version == 1 else "2000 100000\n"
    assert (tmp_path / "kubepods" / "pod1" / _limit_file(version)).read_text() == expected
    opener.close()


def test_a_removed_parent_made_anew_is_found(tmp_path: Path, version: int) -> None:
    hierarchy = _hierarchy(tmp_path, version, "pod1")
    opener = CgroupOpener()
    opener.open(hierarchy.dir(PODS.child("pod1"))).close()
    shutil.rmtree(tmp_path / "kubepods")
    with pytest.raises(CgroupNotFound) as info:
        opener.open(hierarchy.dir(PODS.child("pod1")))
    assert info.value.path == str(tmp_path / "kubepods")
    _pod(tmp_path, "pod1", version, "300000\n" if version == 1 else "300000 100000\n")
    with opener.open(hierarchy.dir(PODS.child("pod1"))) as pod:
        assert read_cpu_quota(pod).quota == 300000
    opener.close()


def test_below_a_held_parent_a_missing_pod_or_a_symlink_is_refused(tmp_path: Path) -> None:
    hierarchy = _hierarchy(tmp_path, 1, "pod1")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "cpu.cfs_quota_us").write_text("-1\n")
    opener = CgroupOpener()
    opener.open(hierarchy.dir(PODS.child("pod1"))).close()  # the parent is held from here on
    with pytest.raises(CgroupNotFound) as info:
        opener.open(hierarchy.dir(PODS.child("gone")))
    assert info.value.path == str(tmp_path / "kubepods" / "gone")
    (tmp_path / "kubepods" / "trap").symlink_to(outside)
    with pytest.raises(CgroupPathError, match="symlink"):
        opener.open(hierarchy.dir(PODS.child("trap")))
    (tmp_path / "kubepods" / "pod1" / "cpu.cfs_quota_us").unlink()
    (tmp_path / "kubepods" / "pod1" / "cpu.cfs_quota_us").symlink_to(outside / "cpu.cfs_quota_us")
    with opener.open(hierarchy.dir(PODS.child("pod1"))) as pod, pytest.raises(CgroupPathError):
        read_cpu_quota(pod)
    opener.close()


def test_a_limit_file_that_cannot_be_opened_for_writing_is_still_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hierarchy = _hierarchy(tmp_path, 1, "pod1")
    real_open = os.open

    def read_only(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if path == "cpu.cfs_quota_us" and flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", read_only)
    opener = CgroupOpener()
    with opener.open(hierarchy.dir(PODS.child("pod1"))) as pod:
        current = read_cpu_quota(pod)
        assert current == CpuQuota(200000, 100000)
        with pytest.raises(CgroupPermissionError, match="EROFS"):
            write_cpu_quota(pod, 300000, current=current)
    opener.close()


def test_nothing_is_left_open(tmp_path: Path, version: int) -> None:
    hierarchy = _hierarchy(tmp_path, version, "pod1")
    before = len(os.listdir("/proc/self/fd"))
    opener = CgroupOpener(limit=1)
    for _ in range(3):
        with opener.open(hierarchy.dir(PODS.child("pod1"))) as pod:
            write_cpu_quota(pod, 400000, current=read_cpu_quota(pod))
        with pytest.raises(CgroupNotFound):
            opener.open(hierarchy.dir(PODS.child("gone")))
        opener.open(hierarchy.dir(CgroupPath(("kubepods",)))).close()  # another parent: the cap
    opener.close()
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("size", [4095, 4096, 4097, 9000])
def test_values_around_the_first_read_are_read_whole(tmp_path: Path, size: int) -> None:
    hierarchy = _hierarchy(tmp_path, 1, "pod1")
    text = "7" * (size - 1) + "\n"
    (tmp_path / "kubepods" / "pod1" / "cpuset.cpus").write_text(text)
    (tmp_path / "kubepods" / "pod1" / "cpu.cfs_quota_us").write_text(text)
    pod = hierarchy.dir(PODS.child("pod1"))
    assert read_value(pod, "cpuset.cpus") == text
    with CgroupOpener().open(pod) as held:
        assert read_value(held, "cpu.cfs_quota_us") == text  # the held file, read from its start
        assert read_value(held, "cpu.cfs_quota_us") == text
    assert size < files.MAX_READ
