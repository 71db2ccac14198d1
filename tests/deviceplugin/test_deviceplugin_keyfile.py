"""The node's marker secret on disk: created once with mode 0600, stable, and refused when untrustworthy."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nri_plugin.deviceplugin.keyfile import KEY_FILE_NAME, HostKeyError, load_or_create_host_key
from nri_plugin.deviceplugin.marker import HostKey


def test_created_on_first_start_with_mode_0600(tmp_path: Path) -> None:
    state = tmp_path / "state"
    old = os.umask(0)  # the file must not depend on the umask
    try:
        key = load_or_create_host_key(state)
    finally:
        os.umask(old)
    path = state / KEY_FILE_NAME
    assert key.path == path
    info = path.stat()
    assert stat.S_ISREG(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_size == 32
    assert info.st_uid == os.geteuid()
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert sorted(p.name for p in state.iterdir()) == [KEY_FILE_NAME], "temporary file left behind"


def test_stable_across_restarts(tmp_path: Path) -> None:
    first = load_or_create_host_key(tmp_path)
    before = (tmp_path / KEY_FILE_NAME).read_bytes()
    second = load_or_create_host_key(tmp_path)
    assert (tmp_path / KEY_FILE_NAME).read_bytes() == before
    assert second.verify(first.sign("shared-cpus-3")) == "shared-cpus-3"
    assert first.sign("shared-cpus-3", allocation=9) == second.sign("shared-cpus-3", allocation=9)


def test_fresh_state_dirs_get_different_secrets(tmp_path: Path) -> None:
    one = load_or_create_host_key(tmp_path / "one")
    two = load_or_create_host_key(tmp_path / "two")
    assert two.verify(one.sign("shared-cpus-0")) is None


def test_loses_a_creation_race_gracefully(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process publishes its secret between our look and our link: we use theirs."""
    theirs = os.urandom(32)
    real_link = os.link

    def link_after_rival(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, theirs)
        os.close(fd)
        real_link(src, dst)  # raises FileExistsError, as the real race would

    monkeypatch.setattr(os, "link", link_after_rival)
    key = load_or_create_host_key(tmp_path)
    assert key.verify(HostKey(theirs).sign("shared-cpus-1")) == "shared-cpus-1"
    assert sorted(p.name for p in tmp_path.iterdir()) == [KEY_FILE_NAME]


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o200])
def test_refuses_a_secret_others_can_read(tmp_path: Path, mode: int) -> None:
    load_or_create_host_key(tmp_path)
    path = tmp_path / KEY_FILE_NAME
    path.chmod(mode)
    with pytest.raises(HostKeyError, match=rf"mode {mode:04o}.*chmod 600"):
        load_or_create_host_key(tmp_path)


def test_accepts_a_read_only_secret(tmp_path: Path) -> None:
    first = load_or_create_host_key(tmp_path)
    (tmp_path / KEY_FILE_NAME).chmod(0o400)
    assert load_or_create_host_key(tmp_path).sign("x", allocation=9) == first.sign("x", allocation=9)


@pytest.mark.parametrize("size", [0, 16, 31, 33, 64])
def test_refuses_a_secret_of_the_wrong_size(tmp_path: Path, size: int) -> None:
    path = tmp_path / KEY_FILE_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"k" * size)
    os.close(fd)
    with pytest.raises(HostKeyError, match=rf"{size} bytes, a marker secret is 32; remove it"):
        load_or_create_host_key(tmp_path)
    assert path.read_bytes() == b"k" * size, "a bad secret must never be replaced silently"


def test_refuses_a_secret_owned_by_someone_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    load_or_create_host_key(tmp_path)
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)
    with pytest.raises(HostKeyError, match=r"owned by uid \d+, not by us .*chown"):
        load_or_create_host_key(tmp_path)


def test_refuses_a_symlink(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    load_or_create_host_key(elsewhere)
    (tmp_path / KEY_FILE_NAME).symlink_to(elsewhere / KEY_FILE_NAME)
    with pytest.raises(HostKeyError, match="symbolic link"):
        load_or_create_host_key(tmp_path)


def test_refuses_a_directory_or_fifo(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / KEY_FILE_NAME).mkdir(mode=0o700)
    with pytest.raises(HostKeyError, match="not a regular file"):
        load_or_create_host_key(tmp_path / "d")
    (tmp_path / "f").mkdir()
    os.mkfifo(tmp_path / "f" / KEY_FILE_NAME, 0o600)
    with pytest.raises(HostKeyError, match="not a regular file"):
        load_or_create_host_key(tmp_path / "f")


def test_custom_file_name(tmp_path: Path) -> None:
    key = load_or_create_host_key(tmp_path, name="other.key")
    assert key.path == tmp_path / "other.key"
    assert (tmp_path / "other.key").stat().st_size == 32
