"""The allocation marker and the host secret behind it."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nri_plugin.deviceplugin.marker import ANNOTATION_KEY, KEY_FILE_NAME, HostKey, HostKeyError

KEY_A = HostKey(bytes(range(32)))
KEY_B = HostKey(bytes(range(1, 33)))
device_id_strategy = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", fullmatch=True)

# ---------------------------------------------------------------------------------------------------
# sign / verify
# ---------------------------------------------------------------------------------------------------


def test_annotation_key_is_a_valid_kubernetes_annotation_key() -> None:
    prefix, name = ANNOTATION_KEY.split("/")
    assert len(prefix) <= 253
    assert len(name) <= 63
    assert prefix == prefix.lower()


def test_sign_then_verify() -> None:
    value = KEY_A.sign("shared-cpus-7")
    assert value.startswith("v1:shared-cpus-7:")
    assert KEY_A.verify(value) == "shared-cpus-7"
    assert KEY_A.verify_annotations({ANNOTATION_KEY: value, "other": "x"}) == "shared-cpus-7"


def test_signing_is_deterministic_per_key_and_id() -> None:
    assert KEY_A.sign("shared-cpus-1") == KEY_A.sign("shared-cpus-1")
    assert KEY_A.sign("shared-cpus-1") != KEY_A.sign("shared-cpus-2")
    assert KEY_A.sign("shared-cpus-1") != KEY_B.sign("shared-cpus-1")


def test_marker_made_with_another_key_is_refused() -> None:
    assert KEY_B.verify(KEY_A.sign("shared-cpus-1")) is None


def test_signature_moved_to_another_device_id_is_refused() -> None:
    mac = KEY_A.sign("shared-cpus-1").rpartition(":")[2]
    assert KEY_A.verify(f"v1:shared-cpus-2:{mac}") is None


def test_forged_mac_is_refused() -> None:
    forged = base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode()
    assert KEY_A.verify(f"v1:shared-cpus-1:{forged}") is None


@pytest.mark.parametrize(
    "value",
    [
        None,
        7,
        b"v1:shared-cpus-1:x",
        "",
        "1",
        "true",
        "shared-cpus-1",
        "v2:shared-cpus-1:" + "A" * 43,
        "v1::" + "A" * 43,
        "v1:shared-cpus-1:" + "A" * 42,
        "v1:shared-cpus-1:" + "A" * 44,
        "v1:shared-cpus-1:" + "A" * 42 + "=",
        "v1:a:b:" + "A" * 43,
    ],
)
def test_malformed_values_are_refused(value: object) -> None:
    assert KEY_A.verify(value) is None


def test_altered_marker_is_refused() -> None:
    value = KEY_A.sign("shared-cpus-1")
    assert KEY_A.verify(value + " ") is None
    assert KEY_A.verify(" " + value) is None
    assert KEY_A.verify(value.upper()) is None
    last = value[-1]
    assert KEY_A.verify(value[:-1] + ("B" if last != "B" else "C")) is None


def test_missing_annotation() -> None:
    assert KEY_A.verify_annotations({}) is None
    assert KEY_A.verify_annotations({"workload.openshift.io/enable-shared-cpus": "1"}) is None


@pytest.mark.parametrize("device_id", ["", "a:b", "-x", "x" * 64, "é", "a b"])
def test_sign_refuses_ids_kubelet_would_not_give(device_id: str) -> None:
    with pytest.raises(ValueError, match="cannot sign device id"):
        KEY_A.sign(device_id)


@given(device_id_strategy)
def test_round_trip_for_every_valid_id(device_id: str) -> None:
    assert KEY_A.verify(KEY_A.sign(device_id)) == device_id
    assert KEY_B.verify(KEY_A.sign(device_id)) is None


@given(st.text(max_size=200))
def test_verify_never_raises_and_never_accepts_noise(value: str) -> None:
    assert KEY_A.verify(value) is None


def test_secret_size_and_repr() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        HostKey(b"short")
    assert "00010203" not in repr(KEY_A)
    assert repr(KEY_A) == "HostKey(path=None)"


# ---------------------------------------------------------------------------------------------------
# The secret file
# ---------------------------------------------------------------------------------------------------


def test_created_on_first_start_with_mode_0600(tmp_path: Path) -> None:
    state = tmp_path / "state"
    old = os.umask(0)  # the file must not depend on the umask
    try:
        key = HostKey.load_or_create(state)
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
    first = HostKey.load_or_create(tmp_path)
    before = (tmp_path / KEY_FILE_NAME).read_bytes()
    second = HostKey.load_or_create(tmp_path)
    assert (tmp_path / KEY_FILE_NAME).read_bytes() == before
    assert second.verify(first.sign("shared-cpus-3")) == "shared-cpus-3"
    assert first.sign("shared-cpus-3") == second.sign("shared-cpus-3")


def test_fresh_state_dirs_get_different_secrets(tmp_path: Path) -> None:
    one = HostKey.load_or_create(tmp_path / "one")
    two = HostKey.load_or_create(tmp_path / "two")
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
    key = HostKey.load_or_create(tmp_path)
    assert key.verify(HostKey(theirs).sign("shared-cpus-1")) == "shared-cpus-1"
    assert sorted(p.name for p in tmp_path.iterdir()) == [KEY_FILE_NAME]


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o200])
def test_refuses_a_secret_others_can_read(tmp_path: Path, mode: int) -> None:
    HostKey.load_or_create(tmp_path)
    path = tmp_path / KEY_FILE_NAME
    path.chmod(mode)
    with pytest.raises(HostKeyError, match=rf"mode {mode:04o}.*chmod 600"):
        HostKey.load_or_create(tmp_path)


def test_accepts_a_read_only_secret(tmp_path: Path) -> None:
    first = HostKey.load_or_create(tmp_path)
    (tmp_path / KEY_FILE_NAME).chmod(0o400)
    assert HostKey.load_or_create(tmp_path).sign("x") == first.sign("x")


@pytest.mark.parametrize("size", [0, 16, 31, 33, 64])
def test_refuses_a_secret_of_the_wrong_size(tmp_path: Path, size: int) -> None:
    path = tmp_path / KEY_FILE_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"k" * size)
    os.close(fd)
    with pytest.raises(HostKeyError, match=rf"{size} bytes, a marker secret is 32; remove it"):
        HostKey.load_or_create(tmp_path)
    assert path.read_bytes() == b"k" * size, "a bad secret must never be replaced silently"


def test_refuses_a_secret_owned_by_someone_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    HostKey.load_or_create(tmp_path)
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)
    with pytest.raises(HostKeyError, match=r"owned by uid \d+, not by us .*chown"):
        HostKey.load_or_create(tmp_path)


def test_refuses_a_symlink(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    HostKey.load_or_create(elsewhere)
    (tmp_path / KEY_FILE_NAME).symlink_to(elsewhere / KEY_FILE_NAME)
    with pytest.raises(HostKeyError, match="symbolic link"):
        HostKey.load_or_create(tmp_path)


def test_refuses_a_directory_or_fifo(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / KEY_FILE_NAME).mkdir(mode=0o700)
    with pytest.raises(HostKeyError, match="not a regular file"):
        HostKey.load_or_create(tmp_path / "d")
    (tmp_path / "f").mkdir()
    os.mkfifo(tmp_path / "f" / KEY_FILE_NAME, 0o600)
    with pytest.raises(HostKeyError, match="not a regular file"):
        HostKey.load_or_create(tmp_path / "f")


def test_custom_file_name(tmp_path: Path) -> None:
    key = HostKey.load_or_create(tmp_path, name="other.key")
    assert key.path == tmp_path / "other.key"
    assert (tmp_path / "other.key").stat().st_size == 32
