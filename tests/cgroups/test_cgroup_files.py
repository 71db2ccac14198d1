"""nri_plugin.cgroups.files and cgroups.quota on fake cgroup trees in tmp_path (v1 and v2)."""

from __future__ import annotations

import dataclasses
import enum
import errno
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from fs_support import count_opens, outcome_within

from nri_plugin.cgroups import (
    CgroupDir,
    CgroupError,
    CgroupNotFound,
    CgroupOpener,
    CgroupPath,
    CgroupPathError,
    CgroupPermissionError,
    CgroupValueError,
    CgroupWriteRejected,
    CpuQuota,
    CpusetError,
    Hierarchy,
    OpenCgroup,
    cgroup_exists,
    files,
    format_cpu_max,
    open_cgroup,
    parse_cpu_max,
    read_cpu_quota,
    read_cpuset,
    read_effective_cpuset,
    read_value,
    restore_cpu_quota,
    write_cpu_limit,
    write_cpu_quota,
    write_cpuset,
    write_parent_child_quota,
    write_value,
)
from nri_plugin.cgroups.quota import format_cfs_quota_us, parse_cfs_period_us, parse_cfs_quota_us

POD = CgroupPath(("kubepods", "pod1"))
CTR = POD.child("ctr")


def _fake_tree(mount: Path, version: int, *, quota: str = "", cpus: str = "0-3\n") -> Hierarchy:
    """A hierarchy at `mount` with the files the kernel would show in /, pod and ctr."""
    for directory in (
        mount,
        mount / "kubepods",
        mount / "kubepods" / "pod1",
        mount / "kubepods" / "pod1" / "ctr",
    ):
        directory.mkdir(parents=True, exist_ok=True)
        if version == 1:
            (directory / "cpu.cfs_quota_us").write_text(quota or "-1\n")
            (directory / "cpu.cfs_period_us").write_text("100000\n")
            (directory / "cpuset.effective_cpus").write_text(cpus)
        else:
            (directory / "cpu.max").write_text(quota or "max 100000\n")
            (directory / "cpuset.cpus.effective").write_text(cpus)
        (directory / "cpuset.cpus").write_text(cpus)
    return Hierarchy(1 if version == 1 else 2, str(mount))


@pytest.fixture(params=[1, 2], ids=["v1", "v2"])
def tree(request: pytest.FixtureRequest, tmp_path: Path) -> Hierarchy:
    return _fake_tree(tmp_path / "cgroup", request.param)


def _text(cgroup: CgroupDir, name: str) -> str:
    return Path(cgroup.fs_path, name).read_text()


# --- pure formats -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "quota"),
    [
        ("max 100000\n", CpuQuota(None, 100000)),
        ("200000 100000\n", CpuQuota(200000, 100000)),
        ("max 50000", CpuQuota(None, 50000)),
        ("1000 1000", CpuQuota(1000, 1000)),
        ("400000 1000000\n", CpuQuota(400000, 1000000)),
    ],
)
def test_cpu_max_round_trip(text: str, quota: CpuQuota) -> None:
    assert parse_cpu_max(text) == quota
    assert format_cpu_max(quota) == text.strip()


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "invalid cpu.max"),
        ("max", "invalid cpu.max"),
        ("200000", "invalid cpu.max"),
        ("max 100000 1", "invalid cpu.max"),
        ("200000  100000", "invalid cpu.max"),
        ("abc 100000", "invalid cpu.max quota"),
        ("-1 100000", "invalid cpu.max quota"),
        ("\uff11000 100000", "invalid cpu.max quota"),
        ("200000 max", "invalid cpu.max period"),
        ("500 100000", "invalid CFS quota 500"),
        ("200000 999", "invalid CFS period 999"),
        ("200000 1000001", "invalid CFS period 1000001"),
    ],
)
def test_cpu_max_rejects(text: str, reason: str) -> None:
    with pytest.raises(CgroupValueError, match=reason):
        parse_cpu_max(text)


def test_v1_formats() -> None:
    assert parse_cfs_quota_us("-1\n") is None
    assert parse_cfs_quota_us("250000\n") == 250000
    assert parse_cfs_period_us("100000\n") == 100000
    assert format_cfs_quota_us(None) == "-1"
    assert format_cfs_quota_us(250000) == "250000"
    for bad in ("", "-2", "1e6", "max", " 1 2"):
        with pytest.raises(CgroupValueError, match=r"cpu\.cfs_quota_us value"):
            parse_cfs_quota_us(bad)
    with pytest.raises(CgroupValueError):
        format_cfs_quota_us(999)


@pytest.mark.parametrize(
    ("quota", "period"),
    [(0, 100000), (999, 100000), (-1, 100000), (True, 100000), (None, 999), (None, 2_000_000)],
)
def test_cpu_quota_validates(quota: int | None, period: int) -> None:
    with pytest.raises(CgroupValueError, match="invalid CFS"):
        CpuQuota(quota, period)


def test_cpu_quota_helpers() -> None:
    quota = CpuQuota(None, 50000)
    assert quota.unlimited
    assert quota.with_quota(200000) == CpuQuota(200000, 50000)
    assert not quota.with_quota(200000).unlimited


class _Micros(enum.IntEnum):
    PERIOD = 100_000
    QUOTA = 250_000


def test_cpu_quota_takes_int_subclasses_and_refuses_bools_past_the_inline_checks() -> None:
    """`CpuQuota` and `with_quota` test a plain int inline; anything else takes the full check,
    which accepts an int subclass (not bool) and refuses the rest."""
    quota = CpuQuota(_Micros.QUOTA, _Micros.PERIOD)
    assert quota == CpuQuota(250_000, 100_000)
    assert quota.with_quota(_Micros.QUOTA) == quota
    for bad in (True, 1000.0, "2000", 999):
        with pytest.raises(CgroupValueError, match="invalid CFS quota"):
            quota.with_quota(bad)  # type: ignore[arg-type]
    with pytest.raises(CgroupValueError, match="invalid CFS period"):
        CpuQuota(None, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        quota.quota = 5000  # type: ignore[misc]
    assert repr(CpuQuota(None, 100_000)) == "CpuQuota(quota=None, period=100000)"
    assert hash(quota.with_quota(250_000)) == hash(CpuQuota(250_000, 100_000))


# --- quota files ------------------------------------------------------------------------------


def test_v1_quota_read_write(tmp_path: Path) -> None:
    hierarchy = _fake_tree(tmp_path, 1)
    ctr = hierarchy.dir(CTR)
    assert read_cpu_quota(ctr) == CpuQuota(None, 100000)
    assert write_cpu_quota(ctr, 200000) == CpuQuota(200000, 100000)
    assert _text(ctr, "cpu.cfs_quota_us") == "200000\n"
    assert _text(ctr, "cpu.cfs_period_us") == "100000\n"
    assert read_cpu_quota(ctr) == CpuQuota(200000, 100000)
    assert write_cpu_quota(ctr, None) == CpuQuota(None, 100000)
    assert _text(ctr, "cpu.cfs_quota_us") == "-1\n"


def test_v2_quota_write_keeps_the_period(tmp_path: Path) -> None:
    hierarchy = _fake_tree(tmp_path, 2, quota="max 50000\n")
    ctr = hierarchy.dir(CTR)
    assert read_cpu_quota(ctr) == CpuQuota(None, 50000)
    assert write_cpu_quota(ctr, 200000) == CpuQuota(200000, 50000)
    assert _text(ctr, "cpu.max") == "200000 50000\n"
    assert write_cpu_quota(ctr, None) == CpuQuota(None, 50000)
    assert _text(ctr, "cpu.max") == "max 50000\n"


@pytest.mark.parametrize("held", [False, True], ids=["dir", "open"])
def test_write_cpu_limit_writes_the_limit_as_it_is(tmp_path: Path, held: bool) -> None:
    """v1: the quota file alone (the period is the caller's, as just read); v2: quota and period.
    A longer value left in a fake tree's file is cut, through a held file too."""
    v1 = _fake_tree(tmp_path / "v1", 1, quota="1234567\n").dir(POD)
    v2 = _fake_tree(tmp_path / "v2", 2, quota="max 50000\n").dir(POD)
    opener = CgroupOpener()  # its cgroups hold their limit file from the first use on
    with opener.open(v1) as opened_v1, opener.open(v2) as opened_v2:
        write_cpu_limit(opened_v1 if held else v1, CpuQuota(200000, 100000))
        assert _text(v1, "cpu.cfs_quota_us") == "200000\n"
        assert _text(v1, "cpu.cfs_period_us") == "100000\n"
        write_cpu_limit(opened_v1 if held else v1, CpuQuota(None, 100000))
        assert _text(v1, "cpu.cfs_quota_us") == "-1\n"
        write_cpu_limit(opened_v2 if held else v2, CpuQuota(200000, 50000))
        assert _text(v2, "cpu.max") == "200000 50000\n"
        write_cpu_limit(opened_v2 if held else v2, CpuQuota(None, 50000))
        assert _text(v2, "cpu.max") == "max 50000\n"
    opener.close()


def test_v2_restore_writes_quota_and_period_without_reading(tmp_path: Path) -> None:
    pod = _fake_tree(tmp_path, 2, quota="300000 50000\n").dir(POD)
    restore_cpu_quota(pod, CpuQuota(200000, 100000))
    assert _text(pod, "cpu.max") == "200000 100000\n"
    restore_cpu_quota(pod, CpuQuota(None, 100000))
    assert _text(pod, "cpu.max") == "max 100000\n"
    # A write cut short left garbage: the limit cannot be read, yet it can be put back.
    Path(pod.fs_path, "cpu.max").write_text("30")
    restore_cpu_quota(pod, CpuQuota(400000, 100000))
    assert read_cpu_quota(pod) == CpuQuota(400000, 100000)


@pytest.mark.parametrize("held", [False, True], ids=["dir", "open"])
def test_v1_restore_writes_the_period_only_when_it_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: bool
) -> None:
    pod = _fake_tree(tmp_path, 1, quota="300000\n").dir(POD)
    writes: list[tuple[str, str]] = []
    real = files.write_value

    def recording(cgroup: CgroupDir, name: str, value: str) -> None:
        writes.append((name, value))
        real(cgroup, name, value)

    monkeypatch.setattr(files, "write_value", recording)
    with open_cgroup(pod) as opened:
        target = opened if held else pod
        restore_cpu_quota(target, CpuQuota(200000, 100000))
        assert writes == [("cpu.cfs_quota_us", "200000")]  # same period: the quota file only
        writes.clear()
        restore_cpu_quota(target, CpuQuota(None, 50000))
        assert writes == [("cpu.cfs_period_us", "50000"), ("cpu.cfs_quota_us", "-1")]
    assert read_cpu_quota(pod) == CpuQuota(None, 50000)


def test_invalid_quota_is_refused_before_writing(tree: Hierarchy) -> None:
    ctr = tree.dir(CTR)
    before = read_cpu_quota(ctr)
    with pytest.raises(CgroupValueError, match="invalid CFS quota 10"):
        write_cpu_quota(ctr, 10)
    assert read_cpu_quota(ctr) == before


@pytest.mark.parametrize(
    ("version", "name", "content"),
    [
        (1, "cpu.cfs_quota_us", "lots\n"),
        (1, "cpu.cfs_period_us", "\n"),
        (2, "cpu.max", "max\n"),
        (1, "cpu.cfs_quota_us", "5\n"),
    ],
)
def test_unreadable_quota_names_the_file(tmp_path: Path, version: int, name: str, content: str) -> None:
    hierarchy = _fake_tree(tmp_path, version)
    ctr = hierarchy.dir(CTR)
    Path(ctr.fs_path, name).write_text(content)
    with pytest.raises(CgroupValueError) as info:
        read_cpu_quota(ctr)
    assert ctr.fs_path in str(info.value)


# --- cpuset files -----------------------------------------------------------------------------


def test_cpuset_read_write(tree: Hierarchy) -> None:
    ctr = tree.dir(CTR)
    assert read_cpuset(ctr) == frozenset({0, 1, 2, 3})
    write_cpuset(ctr, {0, 1, 2, 3, 8})
    assert _text(ctr, "cpuset.cpus") == "0-3,8\n"
    assert read_cpuset(ctr) == frozenset({0, 1, 2, 3, 8})
    write_cpuset(ctr, set())
    assert _text(ctr, "cpuset.cpus") == "\n"  # an empty value is still a real write
    assert read_cpuset(ctr) == frozenset()
    assert read_effective_cpuset(ctr) == frozenset({0, 1, 2, 3})


def test_cpuset_bad_ids_write_nothing(tree: Hierarchy) -> None:
    ctr = tree.dir(CTR)
    with pytest.raises(CpusetError):
        write_cpuset(ctr, {0, -1})
    assert _text(ctr, "cpuset.cpus") == "0-3\n"


def test_cpuset_garbage_in_file_names_the_file(tree: Hierarchy) -> None:
    ctr = tree.dir(CTR)
    Path(ctr.fs_path, "cpuset.cpus").write_text("0-x\n")
    with pytest.raises(CgroupValueError) as info:
        read_cpuset(ctr)
    assert str(info.value).startswith(os.path.join(ctr.fs_path, "cpuset.cpus") + ": invalid cpu list")
    assert isinstance(info.value.__cause__, CpusetError)


# --- file-system errors -----------------------------------------------------------------------


def test_missing_file_is_not_found_and_never_created(tree: Hierarchy) -> None:
    ctr = tree.dir(CTR)
    with pytest.raises(CgroupNotFound) as info:
        read_value(ctr, "cpu.weight")
    assert info.value.path == os.path.join(ctr.fs_path, "cpu.weight")
    assert info.value.errno == errno.ENOENT
    with pytest.raises(CgroupNotFound, match="may be gone"):
        write_value(ctr, "cpu.weight", "100")
    assert not os.path.exists(os.path.join(ctr.fs_path, "cpu.weight"))


def test_missing_directory_is_not_found(tree: Hierarchy) -> None:
    gone = tree.dir(POD.child("gone"))
    assert not cgroup_exists(gone)
    assert cgroup_exists(tree.dir(CTR))
    with pytest.raises(CgroupNotFound) as info:
        write_cpu_quota(gone, 200000)
    assert info.value.path == gone.fs_path
    assert not os.path.exists(gone.fs_path)
    with pytest.raises(CgroupNotFound):
        read_cpuset(CgroupDir(Hierarchy(1, tree.mount_point + "-absent"), CTR))


def test_directory_in_place_of_a_file(tree: Hierarchy) -> None:
    ctr = tree.dir(CTR)
    Path(ctr.fs_path, "cpuset.cpus").unlink()
    Path(ctr.fs_path, "cpuset.cpus").mkdir()
    with pytest.raises(CgroupError, match="a directory where a cgroup file was expected") as read_info:
        read_cpuset(ctr)
    with pytest.raises(CgroupError, match="a directory where a cgroup file was expected") as write_info:
        write_cpuset(ctr, {0})
    for info in (read_info, write_info):
        assert type(info.value) is CgroupError
        assert info.value.errno == errno.EISDIR


@pytest.mark.parametrize("kind", ["fifo", "fifo-with-writer", "socket"])
def test_a_fifo_or_socket_in_place_of_a_quota_file_never_blocks(tree: Hierarchy, kind: str) -> None:
    """A FIFO in place of a quota file blocked the daemon's event loop (issue #13): now every open is
    non-blocking and anything but a regular file is refused at once."""
    pod = tree.dir(POD)
    name = "cpu.cfs_quota_us" if tree.version == 1 else "cpu.max"
    path = Path(pod.fs_path, name)
    path.unlink()
    held: list[int] = []
    sock: socket.socket | None = None
    if kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
    else:
        os.mkfifo(path)
        if kind == "fifo-with-writer":  # a writer that never writes: a plain read would wait for ever
            held.append(os.open(path, os.O_RDWR | os.O_NONBLOCK))

    def release() -> None:
        held.append(os.open(path, os.O_RDWR | os.O_NONBLOCK))

    try:
        for work in (lambda: read_cpu_quota(pod), lambda: write_cpu_quota(pod, 200_000)):
            error = outcome_within(2.0, work, release)
            assert isinstance(error, CgroupError), error
            assert "not a regular file" in str(error) or "No such device" in str(error), error
            assert str(path) in str(error)
    finally:
        for fd in held:
            os.close(fd)
        if sock is not None:
            sock.close()


def test_file_in_place_of_a_directory(tree: Hierarchy) -> None:
    with pytest.raises(CgroupError, match="Not a directory") as info:
        read_cpuset(tree.dir(CTR.child("cpuset.cpus").child("x")))
    assert info.value.errno == errno.ENOTDIR


def _fail_open_of(monkeypatch: pytest.MonkeyPatch, name: str, code: int) -> None:
    real_open = os.open

    def failing_open(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if path == name:
            raise OSError(code, os.strerror(code), path)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", failing_open)


@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM, errno.EROFS])
@pytest.mark.parametrize("failing", ["pod1", "cpu.cfs_quota_us"])
def test_permission_errors_on_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, failing: str
) -> None:
    ctr = _fake_tree(tmp_path, 1).dir(CTR)
    _fail_open_of(monkeypatch, failing, code)
    attempts: list[Callable[[], object]] = [lambda: read_cpu_quota(ctr), lambda: write_cpu_quota(ctr, 200000)]
    for attempt in attempts:
        with pytest.raises(CgroupPermissionError) as info:
            attempt()
        assert info.value.errno == code
        assert info.value.path is not None
        assert info.value.path.endswith(failing)
        assert "needs root" in str(info.value)
    assert _text(ctr, "cpu.cfs_quota_us") == "-1\n"


def _fail_write(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def failing_write(fd: int, data: bytes) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "write", failing_write)


@pytest.mark.parametrize(
    ("code", "name", "value", "hint"),
    [
        (errno.EINVAL, "cpu.cfs_quota_us", "200000", "raise the parent first"),
        (errno.ERANGE, "cpu.cfs_quota_us", "200000", "the kernel refused the value"),
        (errno.EINVAL, "cpuset.cpus", "0-9", "offline or do not exist"),
        (errno.EACCES, "cpuset.cpus", "0-9", "subset of its parent's"),
        (errno.EBUSY, "cpuset.cpus", "0", "narrow the children first"),
    ],
)
def test_rejected_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, name: str, value: str, hint: str
) -> None:
    ctr = _fake_tree(tmp_path, 1).dir(CTR)
    _fail_write(monkeypatch, code)
    with pytest.raises(CgroupWriteRejected) as info:
        write_value(ctr, name, value)
    path = os.path.join(ctr.fs_path, name)
    assert str(info.value).startswith(f'writing "{value}" to {path} was rejected: ')
    assert errno.errorcode[code] in str(info.value)
    assert hint in str(info.value)
    assert (info.value.path, info.value.value, info.value.errno) == (path, value, code)


def test_v2_cpu_max_rejection_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctr = _fake_tree(tmp_path, 2).dir(CTR)
    _fail_write(monkeypatch, errno.EINVAL)
    with pytest.raises(
        CgroupWriteRejected, match=r'writing "200000 100000" to .*cpu.max was rejected.*QUOTA PERIOD'
    ):
        write_cpu_quota(ctr, 200000)


@pytest.mark.parametrize(("code", "kind"), [(errno.EPERM, CgroupPermissionError), (errno.EIO, CgroupError)])
def test_other_write_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, kind: type[CgroupError]
) -> None:
    ctr = _fake_tree(tmp_path, 1).dir(CTR)
    _fail_write(monkeypatch, code)
    with pytest.raises(kind) as info:
        write_cpu_quota(ctr, 200000)
    assert type(info.value) is kind
    assert info.value.errno == code


def test_short_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctr = _fake_tree(tmp_path, 1).dir(CTR)
    monkeypatch.setattr(os, "write", lambda fd, data: 1)
    with pytest.raises(CgroupError, match="short write"):
        write_cpu_quota(ctr, 200000)


@pytest.mark.parametrize("value", ["1\n2", "1\x00", "\u0661", "1 \r"])
def test_write_value_refuses_odd_text(tree: Hierarchy, value: str) -> None:
    ctr = tree.dir(CTR)
    with pytest.raises(CgroupValueError, match="not printable ASCII"):
        write_value(ctr, "cpuset.cpus", value)
    assert _text(ctr, "cpuset.cpus") == "0-3\n"


def test_a_shorter_value_leaves_nothing_of_the_longer_one(tree: Hierarchy) -> None:
    ctr = tree.dir(CTR)
    write_value(ctr, "cpuset.cpus", "0-2,4,6-7,9")
    write_value(ctr, "cpuset.cpus", "1")  # a fake tree's file is cut to the new value
    assert _text(ctr, "cpuset.cpus") == "1\n"
    write_value(ctr, "cpuset.cpus", "2-3")
    assert _text(ctr, "cpuset.cpus") == "2-3\n"


def test_read_is_bounded(tree: Hierarchy) -> None:
    ctr = tree.dir(CTR)
    Path(ctr.fs_path, "cpuset.cpus").write_text("0," * (files.MAX_READ // 2) + "1")
    with pytest.raises(CgroupError, match="more than 65536 bytes"):
        read_cpuset(ctr)


def test_non_ascii_content(tree: Hierarchy) -> None:
    ctr = tree.dir(CTR)
    Path(ctr.fs_path, "cpuset.cpus").write_bytes(b"0-3\xff\n")
    with pytest.raises(CgroupValueError, match="non-ASCII"):
        read_cpuset(ctr)


# --- an open cgroup: one walk, several files ---------------------------------------------------


def test_an_open_cgroup_reads_and_writes_like_its_directory(tree: Hierarchy) -> None:
    ctr = tree.dir(CTR)
    with open_cgroup(ctr) as held:
        assert (held.path, held.hierarchy, held.version, held.fs_path, str(held)) == (
            ctr.path,
            ctr.hierarchy,
            ctr.version,
            ctr.fs_path,
            ctr.fs_path,
        )
        assert read_cpu_quota(held) == read_cpu_quota(ctr) == CpuQuota(None, 100000)
        assert write_cpu_quota(held, 250000) == CpuQuota(250000, 100000)
        assert read_cpu_quota(ctr) == CpuQuota(250000, 100000)
        write_cpuset(held, {1, 2})
        assert read_cpuset(ctr) == {1, 2}
        assert read_value(held, "cpuset.cpus") == "1-2\n"
        with pytest.raises(CgroupNotFound) as info:
            read_value(held, "cpu.weight")
        assert info.value.path == os.path.join(ctr.fs_path, "cpu.weight")
        assert not held.closed
    assert held.closed
    with pytest.raises(ValueError, match="closed"):
        read_cpu_quota(held)
    held.close()  # idempotent


def test_an_open_cgroup_walks_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pod = _fake_tree(tmp_path, 1).dir(POD)
    opened = count_opens(monkeypatch)
    walk = [str(tmp_path), "kubepods", "pod1"]
    read_cpu_quota(pod)  # one walk, then both files
    assert opened == [*walk, "cpu.cfs_quota_us", "cpu.cfs_period_us"]
    opened.clear()
    write_cpu_quota(pod, 300000)  # one walk, the limit read, the quota written
    assert opened == [*walk, "cpu.cfs_quota_us", "cpu.cfs_period_us", "cpu.cfs_quota_us"]
    with open_cgroup(pod) as held:
        opened.clear()
        current = read_cpu_quota(held)
        write_cpu_quota(held, 400000, current=current)  # the limit just read: no second read
        assert read_cpu_quota(held) == CpuQuota(400000, 100000)
    reads = ["cpu.cfs_quota_us", "cpu.cfs_period_us"]
    assert opened == [*reads, "cpu.cfs_quota_us", *reads]


def test_v2_write_with_the_current_limit_keeps_its_period(tmp_path: Path) -> None:
    pod = _fake_tree(tmp_path, 2, quota="max 50000\n").dir(POD)
    with open_cgroup(pod) as held:
        assert write_cpu_quota(held, 100000, current=read_cpu_quota(held)) == CpuQuota(100000, 50000)
    assert _text(pod, "cpu.max") == "100000 50000\n"


def test_an_open_cgroup_outlives_its_directory_without_creating_files(tmp_path: Path) -> None:
    mount = tmp_path / "cgroup"
    (mount / "kubepods" / "pod1").mkdir(parents=True)
    (mount / "kubepods" / "pod1" / "cpu.cfs_quota_us").write_text("-1\n")
    held = open_cgroup(Hierarchy(1, str(mount)).dir(POD))
    try:
        (mount / "kubepods" / "pod1" / "cpu.cfs_quota_us").unlink()
        (mount / "kubepods" / "pod1").rmdir()  # the pod went away meanwhile
        with pytest.raises(CgroupNotFound, match="may be gone"):
            write_value(held, "cpu.cfs_quota_us", "200000")
        assert not (mount / "kubepods" / "pod1").exists()
    finally:
        held.close()


def test_an_open_cgroup_closes_its_descriptor(tmp_path: Path) -> None:
    held = OpenCgroup(_fake_tree(tmp_path, 1).dir(POD))
    fd = held.fileno()
    assert os.path.samestat(os.fstat(fd), os.stat(held.fs_path))
    held.close()
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)


def test_a_failed_walk_leaks_no_descriptor(tmp_path: Path) -> None:
    hierarchy = _fake_tree(tmp_path, 1)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(CgroupNotFound):
            open_cgroup(hierarchy.dir(POD.child("gone")))
        with pytest.raises(CgroupNotFound):
            read_cpu_quota(hierarchy.dir(POD.child("gone")))
    assert len(os.listdir("/proc/self/fd")) == before


# --- parent and child quota order -------------------------------------------------------------


def _record_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    writes: list[tuple[str, str]] = []
    real = files.write_value

    def recording(cgroup: CgroupDir, name: str, value: str) -> None:
        writes.append((str(cgroup.path), value))
        real(cgroup, name, value)

    monkeypatch.setattr(files, "write_value", recording)
    return writes


@pytest.mark.parametrize(
    ("parent_now", "parent_new", "child_new", "first"),
    [
        (100000, 200000, 200000, "parent"),  # raise
        (200000, 100000, 100000, "child"),  # lower
        (None, 200000, 100000, "child"),  # unlimited -> limited is lowering
        (200000, None, None, "parent"),  # limited -> unlimited is raising
        (200000, 200000, 150000, "parent"),  # unchanged parent
        (100000, 300000, 50000, "parent"),
        (300000, 200000, 250000, "child"),
    ],
)
def test_parent_child_order(
    monkeypatch: pytest.MonkeyPatch,
    tree: Hierarchy,
    parent_now: int | None,
    parent_new: int | None,
    child_new: int | None,
    first: str,
) -> None:
    pod, ctr = tree.dir(POD), tree.dir(CTR)
    write_cpu_quota(pod, parent_now)
    writes = _record_writes(monkeypatch)
    write_parent_child_quota(pod, ctr, parent_quota=parent_new, child_quota=child_new)
    assert [path for path, _ in writes] == (
        [str(POD), str(CTR)] if first == "parent" else [str(CTR), str(POD)]
    )
    assert read_cpu_quota(pod).quota == parent_new
    assert read_cpu_quota(ctr).quota == child_new


def test_parent_child_order_reaches_grandchildren(tree: Hierarchy) -> None:
    grandchild = tree.dir(CTR)
    write_parent_child_quota(
        tree.dir(CgroupPath(("kubepods",))), grandchild, parent_quota=400000, child_quota=300000
    )
    assert read_cpu_quota(grandchild).quota == 300000


@pytest.mark.parametrize(
    ("parent", "child"), [(CTR, POD), (POD, POD), (POD, CgroupPath(("kubepods", "pod2")))]
)
def test_parent_child_must_be_nested(tree: Hierarchy, parent: CgroupPath, child: CgroupPath) -> None:
    with pytest.raises(CgroupPathError, match="is not below"):
        write_parent_child_quota(tree.dir(parent), tree.dir(child), parent_quota=None, child_quota=None)


def test_parent_child_must_share_a_hierarchy(tmp_path: Path) -> None:
    first = _fake_tree(tmp_path / "a", 1)
    second = _fake_tree(tmp_path / "b", 1)
    with pytest.raises(CgroupPathError, match="is not below"):
        write_parent_child_quota(first.dir(POD), second.dir(CTR), parent_quota=None, child_quota=None)


@pytest.mark.parametrize(("parent_quota", "child_quota"), [(200000, 500), (500, 200000)])
def test_parent_child_checks_both_before_writing(
    tree: Hierarchy, parent_quota: int, child_quota: int
) -> None:
    pod, ctr = tree.dir(POD), tree.dir(CTR)
    with pytest.raises(CgroupValueError, match="invalid CFS quota 500"):
        write_parent_child_quota(pod, ctr, parent_quota=parent_quota, child_quota=child_quota)
    assert read_cpu_quota(pod).quota is None
    assert read_cpu_quota(ctr).quota is None
