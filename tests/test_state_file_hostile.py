"""A hostile state file at start (issue #13, break 6): a FIFO hung the daemon before it served anything,
a link to /dev/zero or a 1 GiB file exhausted its memory, a directory gave a daemon that reported ready
and refused every shared creation.

Now the books are an SQLite database, and a path that is not a regular file (a link, a FIFO, a device,
a directory; its ``-wal`` too), or a file that is not a database, is damaged, or holds another schema or
a row of the wrong type, is set aside (renamed ``books.sqlite.refused-*``, one warning) and the books
rebuilt from Synchronize: the daemon starts at once, and its next save works.
Only a file that cannot even be set aside stops the start, with exit status 2 and one line. A FIFO
in place of a pod's quota file is refused at once instead of blocking the event loop.
"""

from __future__ import annotations

import os
import resource
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog
from mixedcpu_support import marker, run_cli, saved_books, write_daemon_config
from redteam_support import GUARD, daemon_node, is_shared, rss_kib, short_directory

from nri_plugin.daemon.instance import LOCK_FILE_NAME
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key
from nri_plugin.mixedcpu.books import Books, PodRecord
from nri_plugin.mixedcpu.store import STATE_FILE_NAME, StateFileError, StateStore
from nri_plugin.nri.simulator import PluginFailed


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _fifo_with_a_silent_writer(path: Path) -> None:
    os.mkfifo(path)
    # Held open for the test process' life (a plain read would wait for its data for ever).
    _fifo_with_a_silent_writer.held = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # type: ignore[attr-defined]


def _link_to_dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _one_gib(path: Path) -> None:
    with open(path, "wb") as file:
        file.truncate(1 << 30)  # sparse: 1 GiB to read, no disk used


def _directory(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_text("x")


def _link_to_valid_books(path: Path) -> None:
    target = path.parent.parent / "elsewhere.json"
    StateStore(path.parent.parent, name="elsewhere.json").save(Books())
    path.symlink_to(target)


def _database(path: Path, *statements: str) -> None:
    with sqlite3.connect(path) as db:
        for statement in statements:
            db.execute(statement)
    db.close()


def _ours_with(*statements: str) -> Callable[[Path], None]:
    """Our own database, with `statements` run in it."""

    def make(path: Path) -> None:
        store = StateStore(path.parent)
        store.save(Books({"p": PodRecord(cgroup_parent="/kubepods/podp", baseline=100_000, period=100_000)}))
        store.checkpoint()
        store.close()
        _database(path, *statements)

    return make


def _damaged(path: Path) -> None:
    _ours_with()(path)
    with open(path, "r+b") as file:  # the second page (a table's root) overwritten
        file.seek(4096)
        file.write(b"\xa5" * 4096)


def _not_a_database(path: Path) -> None:
    path.write_bytes(b"{not sqlite at all}\n" * 300)


def _wal_is_a_link(path: Path) -> None:
    _ours_with()(path)
    Path(f"{path}-wal").symlink_to("/dev/zero")


HOSTILE: dict[str, Callable[[Path], None]] = {
    "not-a-database": _not_a_database,
    "damaged": _damaged,
    "another-schema-version": _ours_with("PRAGMA user_version = 7"),
    "someone-elses-tables": lambda path: _database(path, "CREATE TABLE x (y)"),
    "a-row-of-the-wrong-type": _ours_with("UPDATE pods SET baseline = 'lots'"),
    "a-slot-of-no-pod": _ours_with("INSERT INTO slots VALUES ('q', 'c', 'id', 1, '', NULL)"),
    "wal-is-a-link": _wal_is_a_link,
    "fifo": _fifo,
    "fifo-with-writer": _fifo_with_a_silent_writer,
    "link-to-dev-zero": _link_to_dev_zero,
    "one-gib": _one_gib,
    "directory": _directory,
    "link-to-valid-books": _link_to_valid_books,
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_hostile_state_file_is_set_aside_at_once(tmp_path: Path, kind: str) -> None:
    state = tmp_path / "state"
    state.mkdir()
    path = state / STATE_FILE_NAME
    HOSTILE[kind](path)
    store = StateStore(state)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    with structlog.testing.capture_logs() as logs:
        books = store.load()
    assert time.monotonic() - started < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000, "KiB: nothing read whole"
    assert books == Books()
    [warning] = [e for e in logs if e["event"].startswith("state file refused and set aside")]
    assert warning["log_level"] == "warning"
    aside = Path(warning["moved_to"])
    assert aside.parent == state
    assert aside.name.startswith(f"{STATE_FILE_NAME}.refused-")
    assert os.path.lexists(aside)
    assert not os.path.lexists(path) or (path.is_file() and not path.is_symlink()), (
        "a new database, or none yet"
    )
    if kind.startswith("link"):
        assert aside.is_symlink(), "the link itself is moved, its target left alone"
    if kind == "wal-is-a-link":
        assert Path(f"{aside}-wal").is_symlink()
    # The next save works: not a daemon that is ready and cannot keep its books.
    saved = Books({"p": PodRecord(cgroup_parent="/kubepods/podp", baseline=100_000, period=100_000)})
    store.save(saved)
    assert store.load() == saved


def test_a_file_that_cannot_be_set_aside_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = StateStore(tmp_path)
    os.mkfifo(store.path)

    def refuse(*_args: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "rename", refuse)
    with pytest.raises(StateFileError) as info:
        store.load()
    assert str(info.value) == (
        f"{store.path} is {STATE_FILE_NAME} is a FIFO, not a file the plugin writes, and it cannot be set "
        "aside (Read-only file system); "
        "remove it, the plugin rebuilds its books at the next synchronization"
    )


# -- through the daemon --------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["fifo-with-writer", "link-to-dev-zero", "one-gib", "directory", "damaged"])
async def test_the_daemon_starts_serves_and_saves_despite_a_hostile_state_file(kind: str) -> None:
    with short_directory("st-") as root:
        (root / "state").mkdir()
        HOSTILE[kind](root / "state" / STATE_FILE_NAME)
        started = time.monotonic()
        async with daemon_node(root) as node:
            took = time.monotonic() - started
            line = await node.daemon.wait_log("state file refused and set aside")
            assert '"level": "warning"' in line
            peak = rss_kib(node.daemon.proc.pid, "VmHWM")
            print(f"\n{kind}: registered {took:.2f} s after the start, peak RSS {peak / 1024:.1f} MiB")
            assert peak < 120 * 1024
            # Ready and able to keep its books: a proven container gets the shared CPUs.
            pod = node.pod("1111-aaaa", "fwd")
            result = await node.create(pod, "c1", "fwd", annotations=marker(node.key, "shared-cpus-0"))
            assert is_shared(result)
            assert (root / "state" / STATE_FILE_NAME).is_file()
            assert saved_books(root / "state").find("c1") is not None


def test_run_exits_2_with_one_line_when_the_file_cannot_be_set_aside() -> None:
    with short_directory("st-") as root:
        config = write_daemon_config(root, root / "dp")
        state = root / "state"
        state.mkdir()
        os.mkfifo(state / STATE_FILE_NAME)
        load_or_create_host_key(state)  # what a daemon that ran here before left
        (state / LOCK_FILE_NAME).touch()
        # A read-only bind mount would need root; an immutable state dir does the same for root.
        if os.system(f"chattr +i {state} 2>/dev/null") != 0:
            pytest.skip("chattr +i is not available here")
        try:
            result = run_cli("run", "--config", str(config), timeout=GUARD)
        finally:
            os.system(f"chattr -i {state}")
        assert result.returncode == 2, result.stderr
        [line] = result.stderr.splitlines()
        assert line.startswith(
            f"error: {config}: state_dir: {state / STATE_FILE_NAME} is {STATE_FILE_NAME} is a FIFO"
        )
        assert "cannot be set aside" in line


@pytest.mark.asyncio
async def test_a_fifo_in_place_of_a_pod_quota_file_never_blocks_the_daemon() -> None:
    """A FIFO in place of a quota file blocked the daemon's event loop: now the creation is refused at
    once with the file named, and the daemon serves the next request."""
    with short_directory("st-") as root:
        async with daemon_node(root) as node:
            pod = node.pod("1111-aaaa", "fifo")
            quota_file = Path(node.tree.pod_dir(pod).fs_path, "cpu.cfs_quota_us")
            os.unlink(quota_file)
            os.mkfifo(quota_file)
            writer = os.open(quota_file, os.O_RDWR | os.O_NONBLOCK)  # a writer that never writes
            try:
                started = time.monotonic()
                with pytest.raises(PluginFailed) as info:
                    await node.create(pod, "c1", "fwd", annotations=marker(node.key, "shared-cpus-0"))
                assert time.monotonic() - started < 2.0
                assert info.value.code == 9  # FailedPrecondition
                assert f"{quota_file}: not a regular file" in info.value.message
                other = node.pod("2222-bbbb", "other")
                assert is_shared(
                    await node.create(other, "c2", "fwd", annotations=marker(node.key, "shared-cpus-1"))
                )
            finally:
                os.close(writer)
