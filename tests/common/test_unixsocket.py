"""`nri_plugin.common.unixsocket` and `nri_plugin.common.text`: real sockets in a temporary directory."""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from nri_plugin.common.text import clip
from nri_plugin.common.unixsocket import bind_socket, file_id, remove_if_ours, socket_path_problem


def _listening(path: Path) -> tuple[socket.socket, tuple[int, int, int]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        identity = bind_socket(path, sock.bind)
    except OSError:
        sock.close()
        raise
    sock.listen(1)
    return sock, identity


def test_the_socket_is_0600_and_answers_at_its_path(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    sock, identity = _listening(path)
    with sock, socket.socket(socket.AF_UNIX) as client:
        client.connect(str(path))
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        assert file_id(path) == identity
        assert sorted(p.name for p in tmp_path.iterdir()) == ["s.sock"]  # no private directory left


def test_the_process_umask_is_never_touched(tmp_path: Path) -> None:
    """A thread creating files all along sees the umask it set, whatever the binds do meanwhile."""
    old = os.umask(0o022)
    try:
        seen: set[int] = set()
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                current = os.umask(0o022)
                os.umask(current)
                seen.add(current)

        watcher = threading.Thread(target=watch)
        watcher.start()
        for n in range(50):
            sock, _ = _listening(tmp_path / f"{n}.sock")
            sock.close()
        stop.set()
        watcher.join()
        assert seen == {0o022}
    finally:
        os.umask(old)


def test_a_stale_socket_is_replaced_and_anything_else_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    stale, stale_id = _listening(path)
    stale.close()
    sock, identity = _listening(path)
    with sock:
        assert identity != stale_id
    other = tmp_path / "file"
    other.write_text("mine")
    with pytest.raises(OSError, match="exists and is not a socket"):
        _listening(other)
    assert other.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "s.sock"]


def test_remove_if_ours_leaves_a_newer_file_alone(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    sock, identity = _listening(path)
    sock.close()
    os.unlink(path)
    path.write_text("someone else's")
    assert remove_if_ours(path, identity) is False
    assert path.read_text() == "someone else's"
    os.unlink(path)
    sock, identity = _listening(path)
    sock.close()
    assert remove_if_ours(path, identity) is True
    assert not path.exists()


def test_a_path_too_long_for_the_temporary_name_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    directory = tmp_path / ("d" * max(1, 100 - len(str(tmp_path))))
    directory.mkdir()
    path = directory / "s"  # short enough itself, but not the temporary path beside it
    assert len(os.fsencode(path)) <= 107
    problem = socket_path_problem(path)
    assert problem is not None
    assert "over 107" in problem
    with pytest.raises(OSError, match="over 107"):
        _listening(path)
    assert list(directory.iterdir()) == []


@pytest.mark.parametrize(
    ("value", "limit", "expected"),
    [
        ("plain words", 512, "plain words"),
        ("line\nforged", 512, "line\\nforged"),
        ("\x1b[31mred", 512, "\\x1b[31mred"),
        ("x" * 20, 5, "xxxxx... (20 characters)"),
        ("a\u2028b", 512, "a\\u2028b"),
    ],
)
def test_clip_caps_and_escapes(value: str, limit: int, expected: str) -> None:
    assert clip(value, limit) == expected
