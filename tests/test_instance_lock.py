"""One daemon per node (issue #13, item 2 of the breaks): the state directory's lock.

Two real daemon processes with one config: the second exits 2 at once with one line naming the
first one's pid and how to fix it; the first keeps serving. The lock dies with its holder (SIGKILL
included), and a lock file that is a link, a FIFO or a directory is refused, never followed or
waited on.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mixedcpu_support import Daemon, run_cli, start_daemon, write_daemon_config

from nri_plugin.daemon.instance import LOCK_FILE_NAME, InstanceLockError, lock_state_dir
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
            state = short_dir / "state"
            assert lines[0] == (
                f"error: another mixed-cpu-nri-plugin (pid {first.proc.pid}, as written in "
                f"{state / LOCK_FILE_NAME}) already runs with state_dir {state}: run one daemon per node; "
                "stop the other one (the systemd unit mixed-cpu-nri-plugin.service, the runtime-launched "
                "10-mixed-cpu in /opt/nri/plugins, or the DaemonSet's pod on this node) before starting "
                "this one"
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
            lock = short_dir / "state" / LOCK_FILE_NAME
            assert lock.read_text() == f"{second.proc.pid}\n"
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
