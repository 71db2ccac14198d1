"""One daemon per node (issue #13, item 2 of the breaks; issue #25, break 6): the node's lock beside
the NRI socket and the state directory's lock.

Two real daemon processes with one config, or with two configs and two state dirs: the second exits
2 at once with one line naming the first one's pid, its config and how to fix it; the first keeps
serving. A state dir removed under a running daemon is locked again, so a second one is still
refused. The lock dies with its holder (SIGKILL
included), and a lock file that is a link, a FIFO or a directory is refused, never followed or
waited on.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from host_guard import refuse_host_paths
from mixedcpu_support import ROOT, Daemon, run_cli, start_daemon, write_daemon_config
from structlog.testing import capture_logs

from nri_plugin.daemon.instance import (
    LOCK_FILE_NAME,
    NODE_LOCK_NAME,
    InstanceLockError,
    LockWatch,
    NoNodeLock,
    lock_node,
    lock_state_dir,
)
from nri_plugin.nri.simulator import RuntimeSimulator

GUARD = 20.0


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="lock-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.asyncio
async def test_a_second_daemon_exits_2_at_once_naming_the_first(short_dir: Path) -> None:
    config = write_daemon_config(short_dir, short_dir / "dp")
    socket_path = short_dir / "nri.sock"
    async with RuntimeSimulator(socket_path) as sim:
        first = Daemon(
            await start_daemon("run", "--config", str(config), "--socket", str(socket_path)), GUARD
        )
        try:
            await sim.wait_for_plugins(1, GUARD)
            started = time.monotonic()
            second = run_cli("run", "--config", str(config), "--socket", str(socket_path), timeout=GUARD)
            took = time.monotonic() - started
            print(f"\nsecond instance: exit {second.returncode} after {took:.2f} s: {second.stderr.strip()}")
            assert second.returncode == 2
            lines = second.stderr.splitlines()
            assert len(lines) == 1, second.stderr
            assert lines[0] == (
                f"error: another mixed-cpu-nri-plugin (pid {first.proc.pid}, config {config}, as written in "
                f"{short_dir / NODE_LOCK_NAME}) already serves the runtime at {socket_path}, whatever its "
                "state_dir: run one daemon per node; stop the other one (the systemd unit "
                "mixed-cpu-nri-plugin.service, the runtime-launched 10-mixed-cpu in /opt/nri/plugins, or the "
                "DaemonSet's pod on this node) before starting this one"
            )
            assert second.stdout == ""
            # It stopped before anything else: it never reached the runtime.
            assert len(sim.plugins) == 1
            assert first.proc.returncode is None, "the first daemon goes on serving"
        finally:
            status = await first.stop()
            print(f"first daemon's stderr (exit {status}):\n{first.stderr}")  # shown if the test fails
    assert status == 0, first.stderr


@pytest.mark.asyncio
async def test_the_lock_dies_with_its_holder_even_killed(short_dir: Path) -> None:
    config = write_daemon_config(short_dir, short_dir / "dp")
    socket_path = short_dir / "nri.sock"
    async with RuntimeSimulator(socket_path) as sim:
        first = Daemon(
            await start_daemon("run", "--config", str(config), "--socket", str(socket_path)), GUARD
        )
        try:
            await sim.wait_for_plugins(1, GUARD)
        finally:
            await first.kill()  # (the test's point, and its cleanup if the wait failed)
            print(f"first daemon's stderr:\n{first.stderr}")  # shown if the test fails
        second = Daemon(
            await start_daemon("run", "--config", str(config), "--socket", str(socket_path)), GUARD
        )
        try:
            await second.wait_log("registered with the runtime")
            for lock in (short_dir / "state" / LOCK_FILE_NAME, short_dir / NODE_LOCK_NAME):
                assert lock.read_text() == f"{second.proc.pid}\n{config}\n"
        finally:
            status = await second.stop()
            print(f"second daemon's stderr (exit {status}):\n{second.stderr}")  # shown if the test fails
    assert status == 0, second.stderr


def test_the_same_process_keeps_the_one_lock_it_holds(tmp_path: Path) -> None:
    first = lock_state_dir(str(tmp_path / "state"))
    assert lock_state_dir(str(tmp_path / "state")) is first
    assert (tmp_path / "state" / LOCK_FILE_NAME).read_text() == f"{os.getpid()}\n"
    assert os.stat(tmp_path / "state").st_mode & 0o777 == 0o700


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_a_lock_file_that_is_not_a_plain_file_is_refused(tmp_path: Path, kind: str) -> None:
    state = tmp_path / "state"
    state.mkdir()
    path = state / LOCK_FILE_NAME
    if kind == "symlink":
        (tmp_path / "elsewhere").write_text("")
        path.symlink_to(tmp_path / "elsewhere")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    started = time.monotonic()
    with pytest.raises(InstanceLockError) as info:
        lock_state_dir(str(state))
    assert time.monotonic() - started < 1, "never waits on a FIFO"
    assert str(info.value).startswith(f"{path}: ")
    assert "remove it" in str(info.value) or "cannot open" in str(info.value)
    if kind == "symlink":
        assert (tmp_path / "elsewhere").read_text() == "", "the link's target is never written"


def test_run_refuses_a_linked_lock_file_with_one_line(short_dir: Path) -> None:
    config = write_daemon_config(short_dir, short_dir / "dp")
    (short_dir / "state").mkdir()
    (short_dir / "state" / LOCK_FILE_NAME).symlink_to("/dev/null")
    result = run_cli("run", "--config", str(config), timeout=GUARD)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: {short_dir / 'state' / LOCK_FILE_NAME}: is a symbolic link; remove it (the daemon creates "
        "its lock file itself)"
    ]


# -- issue #25, break 6: the one-per-node rule was per state dir -----------------------------------


@pytest.mark.asyncio
async def test_two_daemons_with_different_state_dirs_the_second_is_refused_naming_the_first(
    short_dir: Path,
) -> None:
    """The attack: a second config with its own state dir, on the same runtime, raised the pod quota
    a second time and fought over the device-plugin socket. Now it stops before any of that."""
    socket_path = short_dir / "nri.sock"
    first_config = write_daemon_config(short_dir / "a", short_dir / "dpa")
    second_config = write_daemon_config(short_dir / "b", short_dir / "dpb")
    async with RuntimeSimulator(socket_path) as sim:
        first = Daemon(
            await start_daemon("run", "--config", str(first_config), "--socket", str(socket_path)), GUARD
        )
        try:
            await asyncio.wait_for(sim.wait_for_plugins(1, GUARD), GUARD)
            second = run_cli(
                "run", "--config", str(second_config), "--socket", str(socket_path), timeout=GUARD
            )
            print(f"\nsecond daemon, its own state dir: exit {second.returncode}: {second.stderr.strip()}")
            assert second.returncode == 2
            [line] = second.stderr.splitlines()
            assert line.startswith(
                f"error: another mixed-cpu-nri-plugin (pid {first.proc.pid}, config {first_config}, as "
                f"written in {short_dir / NODE_LOCK_NAME}) already serves the runtime at {socket_path}, "
                "whatever its state_dir: run one daemon per node; "
            )
            assert not (short_dir / "b" / "state").exists(), "stopped before its state dir was touched"
            assert not (short_dir / "dpb").exists() or not any((short_dir / "dpb").iterdir())
            assert len(sim.plugins) == 1, "never reached the runtime"
            assert first.proc.returncode is None
        finally:
            assert await first.stop() == 0, first.stderr


@pytest.mark.asyncio
async def test_a_state_dir_removed_under_a_running_daemon_is_locked_again(short_dir: Path) -> None:
    """The attack: the state dir deleted under a running daemon left its lock on an unlinked file,
    and a second daemon with that state dir (on another socket: the node's lock is not in the way)
    started. Now the first takes the lock again on a new file, and the second is refused."""
    config = write_daemon_config(short_dir, short_dir / "dp")
    state = short_dir / "state"
    socket_path = short_dir / "nri.sock"
    (short_dir / "other").mkdir()
    async with RuntimeSimulator(socket_path) as sim:
        first = Daemon(
            await start_daemon("run", "--config", str(config), "--socket", str(socket_path)), GUARD
        )
        try:
            await asyncio.wait_for(sim.wait_for_plugins(1, GUARD), GUARD)
            shutil.rmtree(state)
            await first.wait_log("lock file removed under this daemon; taken again on a new one")
            assert (state / LOCK_FILE_NAME).read_text() == f"{first.proc.pid}\n{config}\n"
            other_socket = short_dir / "other" / "nri.sock"
            second = run_cli("run", "--config", str(config), "--socket", str(other_socket), timeout=GUARD)
            assert second.returncode == 2, second.stderr
            [line] = second.stderr.splitlines()
            assert line.startswith(
                f"error: another mixed-cpu-nri-plugin (pid {first.proc.pid}, config {config}, as written in "
                f"{state / LOCK_FILE_NAME}) already runs with state_dir {state}: run one daemon per node; "
            )
            assert first.proc.returncode is None
        finally:
            assert await first.stop() == 0, first.stderr


def test_a_removed_lock_file_taken_by_another_is_said_once(tmp_path: Path) -> None:
    """The watch on an unlinked lock whose new file another process already locked: one error line
    naming it, then that lock is no longer watched (the process keeps what it holds)."""
    first = lock_state_dir(str(tmp_path / "state"), "/etc/first.toml")
    watch = LockWatch([first])
    watch.check()
    assert watch.locks == [first], "still there: nothing to do"
    os.unlink(first.path)
    (tmp_path / "state" / LOCK_FILE_NAME).write_text("4242\n/etc/other.toml\n")
    with open(first.path) as other, capture_logs() as logs:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: another holder
        watch.check()
        watch.check()
    assert watch.locks == []
    assert [entry["event"] for entry in logs] == ["lock file removed under this daemon; cannot take it again"]
    assert "(pid 4242, config /etc/other.toml, as written in " in logs[0]["problem"]


def test_no_socket_directory_is_no_node_lock(tmp_path: Path) -> None:
    with pytest.raises(NoNodeLock) as info:
        lock_node(str(tmp_path / "absent" / "nri.sock"))
    assert (
        str(info.value)
        == f"{tmp_path / 'absent'} (the NRI socket's directory) is missing: the runtime makes it"
    )
    assert not (tmp_path / "absent").exists(), "the runtime's directory is the runtime's to make"


def test_a_node_lock_whose_directory_comes_later_is_taken_then(tmp_path: Path) -> None:
    """A daemon started before the runtime made its socket's directory takes the node's lock once
    the directory is there, at the watch's next look."""
    socket_path = tmp_path / "nri" / "nri.sock"
    watch = LockWatch([], pending=lambda: lock_node(str(socket_path), "/etc/x.toml"))
    watch.check()
    assert (watch.locks, watch.pending is not None) == ([], True), "nothing to lock on yet"
    (tmp_path / "nri").mkdir()
    watch.check()
    [lock] = watch.locks
    assert watch.pending is None
    assert lock.path == str(tmp_path / "nri" / NODE_LOCK_NAME)
    assert Path(lock.path).read_text() == f"{os.getpid()}\n/etc/x.toml\n"


# -- issue #25, break 9: errors that name the real cause -------------------------------------------

# Mount argv[1] read-only over itself (in the new mount namespace unshare made), then exec argv[2:].
READ_ONLY_THEN_EXEC = (
    "import os, subprocess, sys; "
    "subprocess.run(['mount', '--bind', '-o', 'ro', sys.argv[1], sys.argv[1]], check=True); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def run_daemon_under(prefix: list[str], config: Path) -> subprocess.CompletedProcess[str]:
    argv = ("run", "--config", str(config))
    refuse_host_paths(argv)
    return subprocess.run(
        [*prefix, sys.executable, "-m", "nri_plugin.daemon.cli", *argv],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=GUARD,
        check=False,
    )


def test_a_read_only_state_dir_is_reported_read_only_not_missing(short_dir: Path) -> None:
    """The attack: the state dir mounted read-only; the lock file was retried read-only, and the
    daemon said 'No such file or directory'."""
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("no mount namespace here (unshare --mount): a read-only mount needs one")
    config = write_daemon_config(short_dir, short_dir / "dp")
    state = short_dir / "state"
    state.mkdir(mode=0o700)
    prefix = ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", READ_ONLY_THEN_EXEC]
    result = run_daemon_under([*prefix, str(state)], config)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert line == (
        f"error: {state / LOCK_FILE_NAME}: cannot open the daemon's lock file: Read-only file system; "
        f"{state} is on a read-only file system: mount it read-write"
    )
    assert not list(state.iterdir())


def test_a_daemon_run_by_another_user_is_told_it_is_not_root(short_dir: Path) -> None:
    """The attack: a user that is not root ran the daemon; nothing said so. It may read (the
    capability to read any file, so that it gets as far as it can), nothing more."""
    config = write_daemon_config(short_dir, short_dir / "dp")
    nobody = [
        "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
        "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
    ]  # fmt: skip
    result = run_daemon_under(nobody, config)
    assert result.returncode == 2, result.stderr
    warning, error = result.stderr.splitlines()
    assert json.loads(warning) | {"timestamp": None} == {
        "timestamp": None,
        "level": "warning",
        "logger": "nri_plugin.daemon.cli",
        "msg": "you are not root",
        "uid": 65534,
        "why": "the daemon writes cgroup files, kubelet's device-plugin directory and its state dir",
        "fix": f"run it as root; see what uid 65534 lacks with: mixed-cpu-nri-plugin check --config {config}",
    }
    assert error == (
        f"error: {short_dir / NODE_LOCK_NAME}: cannot open the daemon's lock file: Permission denied; you "
        "are not root (uid 65534): run the daemon as root"
    )
