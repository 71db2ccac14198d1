"""The one reader of small files whose path may hold anything (nri_plugin.common.smallfile): a link is
refused, not followed; a FIFO, socket, device or directory is refused without waiting; a file over
the limit is refused before it is read, or as soon as it has grown past it; nothing is left open."""

from __future__ import annotations

import errno
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from fs_support import outcome_within

from nri_plugin.common.smallfile import (
    NotRegularFile,
    RefusedFile,
    SymbolicLink,
    TooLarge,
    open_regular_file,
    read_capped,
    read_small_file,
)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def _nothing_left_open() -> Iterator[None]:
    before = _open_fds()
    yield
    assert _open_fds() <= before


def test_a_regular_file_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"12345\n")
    assert read_small_file(path, 6) == b"12345\n"
    assert read_small_file(str(path), 100) == b"12345\n"
    path.write_bytes(b"")
    assert read_small_file(path, 0) == b""


def test_vet_sees_the_open_files_status_before_anything_is_read(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"secret")
    path.chmod(0o644)
    seen: list[os.stat_result] = []
    assert read_small_file(path, 10, vet=seen.append) == b"secret"
    assert [(stat.S_IMODE(s.st_mode), s.st_size) for s in seen] == [(0o644, 6)]

    class NotOurs(Exception):
        pass

    def refuse(info: os.stat_result) -> None:
        raise NotOurs(info.st_size)

    with pytest.raises(NotOurs):
        read_small_file(path, 10, vet=refuse)


@pytest.mark.parametrize("target", ["valid", "/dev/zero", "missing"])
def test_a_symbolic_link_is_refused_never_followed(tmp_path: Path, target: str) -> None:
    valid = tmp_path / "valid"
    valid.write_bytes(b"fine")
    link = tmp_path / "link"
    link.symlink_to(valid if target == "valid" else target)
    with pytest.raises(SymbolicLink) as info:
        read_small_file(link, 100)
    assert str(info.value) == "a symbolic link"
    assert not isinstance(info.value, OSError), "not to be taken for an I/O error"
    with pytest.raises(SymbolicLink):  # nor created through, when the open would create
        open_regular_file(link, os.O_RDWR | os.O_CREAT)
    assert valid.read_bytes() == b"fine"


@pytest.mark.parametrize("writer", [False, True], ids=["fifo", "fifo-with-silent-writer"])
def test_a_fifo_is_refused_without_waiting(tmp_path: Path, writer: bool) -> None:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    held = [os.open(path, os.O_RDWR | os.O_NONBLOCK)] if writer else []

    def release() -> None:  # a writer that lets a blocked open, then read, go on
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        os.write(fd, b"x")
        held.append(fd)

    try:
        refused = outcome_within(10.0, lambda: read_small_file(path, 100), release)
    finally:
        for fd in held:
            os.close(fd)
    assert isinstance(refused, NotRegularFile), refused
    assert (refused.kind, str(refused)) == ("FIFO", "a FIFO, not a regular file")


def test_directories_and_devices_are_refused_and_a_socket_cannot_be_opened(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    kinds = {}
    for path in (tmp_path / "dir", Path("/dev/null")):
        with pytest.raises(NotRegularFile) as info:
            read_small_file(path, 100)
        kinds[path.name] = info.value.kind
    assert kinds == {"dir": "directory", "null": "character device"}
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "sock"))
        with pytest.raises(OSError, match="No such device") as opened:
            read_small_file(tmp_path / "sock", 100)
    assert opened.value.errno == errno.ENXIO


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "big"
    path.write_bytes(b"x" * 11)
    assert read_small_file(path, 11) == b"x" * 11
    with pytest.raises(TooLarge) as info:
        read_small_file(path, 10)
    assert (info.value.size, info.value.limit, info.value.grew) == (11, 10, False)
    with open(path, "wb") as file:
        file.truncate(1 << 40)  # sparse: a terabyte that must never be read
    with pytest.raises(TooLarge) as info:
        read_small_file(path, 10)
    assert info.value.size == 1 << 40
    assert isinstance(info.value, RefusedFile)


def test_a_file_that_grows_while_read_is_refused_past_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "growing"
    path.write_bytes(b"small")

    def grow(_info: os.stat_result) -> None:  # after the size was checked, before the read
        with open(path, "ab") as file:
            file.write(b"y" * 1000)

    with pytest.raises(TooLarge) as info:
        read_small_file(path, 10, vet=grow)
    assert (info.value.size, info.value.limit, info.value.grew) == (11, 10, True)


def test_a_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_small_file(tmp_path / "none", 10)


def test_read_capped_reads_from_the_start_whatever_the_offset(tmp_path: Path) -> None:
    fd, info = open_regular_file(tmp_path / "lock", os.O_RDWR | os.O_CREAT)
    try:
        assert stat.S_ISREG(info.st_mode)
        assert stat.S_IMODE(info.st_mode) & 0o077 == 0, "created 0600"
        os.write(fd, b"4242\n")  # the offset is now at the end
        assert read_capped(fd, 32) == b"4242\n"
        with pytest.raises(TooLarge) as too_large:
            read_capped(fd, 3)
        assert (too_large.value.size, too_large.value.grew) == (4, True)
    finally:
        os.close(fd)
