"""The daemon object (`nri_plugin.daemon.app`) and its wiring (`nri_plugin.daemon.wiring`).

In this process, with stand-in parts: the start and shutdown order, the flush, the exit statuses, the
first and the second stop signal. In real processes: the same signals ending a real `Daemon` (a
stand-in child, `daemon_child.py`, whose shutdown can be made to hang), and ``run`` itself flushing
the books on the way out and exiting 1 when the runtime cannot be served.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import structlog.testing
from host_guard import refuse_host_paths
from mixedcpu_support import ROOT, daemon_process, run_cli, saved_books, terminate, write_daemon_config
from mixedcpu_support import Daemon as HelperDaemon

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.common.clock import ManualClock
from nri_plugin.daemon import app
from nri_plugin.daemon.app import EXIT_CANNOT_SERVE, EXIT_CONFIG, NRI_ENDED, Daemon, DaemonError
from nri_plugin.daemon.logs import configure_logging
from nri_plugin.daemon.metrics import Metrics
from nri_plugin.daemon.probes import NotReadyWarnings, ProbeError, ProbeServer, readiness
from nri_plugin.daemon.status import StatusServer
from nri_plugin.daemon.wiring import LAUNCHED_ENDED, RunOptions, build_daemon
from nri_plugin.deviceplugin.keyfile import KEY_FILE_NAME, load_or_create_host_key
from nri_plugin.deviceplugin.marker import ANNOTATION_KEY
from nri_plugin.deviceplugin.server import DevicePluginServer
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin
from nri_plugin.nri.simulator import RuntimeSimulator
from nri_plugin.nri.stub import Stub, StubError

GUARD = 20.0  # against hangs only
# SIGHUP too: a hang-up stops the daemon in order, saying so, instead of killing it (issue 15, item 4).
STOP_SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]
STOP_SIGNAL_IDS = ["SIGTERM", "SIGINT", "SIGHUP"]


# -- stand-in parts -------------------------------------------------------------------------------------


class StandInNri:
    """Serves until stopped, or ends by itself (`ends`), or fails (`error`); says what it did in `log`."""

    def __init__(self, log: list[str], *, ends: bool = False, error: Exception | None = None) -> None:
        self.log = log
        self.ends = ends
        self.error = error
        self.running = asyncio.Event()
        self._stopped = asyncio.Event()

    async def run(self) -> None:
        self.log.append("nri run")
        self.running.set()
        if self.error is not None:
            raise self.error
        if not self.ends:
            await self._stopped.wait()
        self.log.append("nri ended")

    def stop(self) -> None:
        self.log.append("nri stop")
        self._stopped.set()


class StandInService:
    """Records its start and close; `refuses` fails the start, `hang` holds the close until set."""

    def __init__(
        self,
        name: str,
        log: list[str],
        *,
        refuses: Exception | None = None,
        hang: asyncio.Event | None = None,
    ) -> None:
        self.name = name
        self.log = log
        self.refuses = refuses
        self.hang = hang
        self.closing = asyncio.Event()

    async def start(self) -> None:
        if self.refuses is not None:
            raise self.refuses
        self.log.append(f"start {self.name}")

    async def close(self) -> None:
        self.log.append(f"close {self.name}")
        self.closing.set()
        if self.hang is not None:
            await self.hang.wait()


class StandInState:
    def __init__(self, log: list[str], error: OSError | None = None) -> None:
        self.log = log
        self.error = error

    def flush(self) -> None:
        if self.error is not None:
            raise self.error
        self.log.append("flush")


# -- the lifecycle, in this process ------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=STOP_SIGNAL_IDS)
async def test_first_signal_stops_everything_in_order_and_flushes(signum: int) -> None:
    log: list[str] = []
    nri = StandInNri(log)
    daemon = Daemon(
        nri,
        services=[StandInService("probes", log), StandInService("device plugin", log)],
        state=StandInState(log),
        drain_seconds=0.0,
    )
    running = asyncio.ensure_future(daemon.main())
    await asyncio.wait_for(nri.running.wait(), GUARD)
    os.kill(os.getpid(), signum)
    assert await asyncio.wait_for(running, GUARD) == 0
    assert log == [
        "start probes",
        "start device plugin",
        "nri run",
        "nri stop",
        "nri ended",
        # Newest first, then the books: nothing can change them once the NRI side has stopped.
        "close device plugin",
        "close probes",
        "flush",
    ]
    assert daemon.stopping


@pytest.mark.asyncio
@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=STOP_SIGNAL_IDS)
async def test_second_signal_during_a_hung_shutdown_exits_at_once(signum: int) -> None:
    log: list[str] = []
    hang = asyncio.Event()
    exits: list[int] = []

    def hard_exit(status: int) -> None:
        exits.append(status)
        hang.set()  # os._exit would never return; this one lets the test end

    nri = StandInNri(log)
    device_plugin = StandInService("device plugin", log, hang=hang)
    daemon = Daemon(
        nri, services=[device_plugin], state=StandInState(log), hard_exit=hard_exit, drain_seconds=0.0
    )
    running = asyncio.ensure_future(daemon.main())
    await asyncio.wait_for(nri.running.wait(), GUARD)
    os.kill(os.getpid(), signum)
    await asyncio.wait_for(device_plugin.closing.wait(), GUARD)  # and there it hangs
    assert exits == []
    os.kill(os.getpid(), signum)
    await asyncio.wait_for(hang.wait(), GUARD)
    assert exits == [128 + signum]
    assert log[:4] == ["start device plugin", "nri run", "nri stop", "nri ended"]
    assert log[4] == "close device plugin"
    await asyncio.wait_for(running, GUARD)


class DeafNri(StandInNri):
    """An NRI side whose stop() does not end its run (as the stub did while its close waited for a
    runtime that stopped reading, issue 29): only cancelling the run ends it."""

    def stop(self) -> None:
        self.log.append("nri stop")


@pytest.mark.asyncio
async def test_the_first_signal_ends_the_daemon_even_if_the_nri_side_does_not_stop() -> None:
    log: list[str] = []
    nri = DeafNri(log)
    daemon = Daemon(
        nri,
        services=[StandInService("probes", log)],
        state=StandInState(log),
        drain_seconds=0.0,
        nri_stop_seconds=0.05,
    )
    assert app.NRI_STOP_SECONDS == 10.0
    running = asyncio.ensure_future(daemon.main())
    await asyncio.wait_for(nri.running.wait(), GUARD)
    with structlog.testing.capture_logs() as logged:
        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(running, GUARD) == 0
    assert log == ["start probes", "nri run", "nri stop", "close probes", "flush"]
    assert {
        "event": "the NRI side did not stop in time; shutting down without it",
        "waited_seconds": 0.05,
        "log_level": "error",
    } in logged


@pytest.mark.asyncio
async def test_the_tests_daemon_helper_reads_lines_of_any_length() -> None:
    """Issue 32: the helper stopped reading stderr after a line over 64 KiB (asyncio's line limit),
    and the daemon then blocked on the full pipe, which looked like an NRI timeout."""
    script = "import sys; sys.stderr.write('x' * 200_000 + '\\n' + 'y' * 70_000 + '\\nend\\nno newline')"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    helper = HelperDaemon(proc, GUARD)
    await helper.wait_log("end")
    assert await asyncio.wait_for(proc.wait(), GUARD) == 0
    assert await helper.stop() == 0
    assert [len(line) for line in helper.lines] == [200_000, 70_000, 3, 10]


@pytest.mark.asyncio
async def test_the_runtime_going_away_for_good_is_status_1_after_a_full_shutdown() -> None:
    log: list[str] = []
    daemon = Daemon(
        StandInNri(log, ends=True),
        services=[StandInService("probes", log)],
        state=StandInState(log),
        drain_seconds=0.0,
    )
    with pytest.raises(DaemonError) as info:
        await daemon.main()
    assert info.value.status == EXIT_CANNOT_SERVE == 1
    assert str(info.value) == (
        "the connection to the runtime ended and reconnecting is off; restart the daemon "
        "(or run it without --no-reconnect)"
    )
    assert log == ["start probes", "nri run", "nri ended", "close probes", "flush"]


def test_run_freezes_the_start_up_heap_before_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    monkeypatch.setattr(app, "freeze_start_up_heap", lambda: log.append("freeze"))
    daemon = Daemon(StandInNri(log, ends=True), state=StandInState(log), drain_seconds=0.0)
    with pytest.raises(DaemonError):
        daemon.run()
    assert log == ["freeze", "nri run", "nri ended", "flush"]


def test_the_frozen_start_up_heap_keeps_no_garbage_and_is_not_walked_again() -> None:
    # In a process of its own: a frozen heap is frozen for good.
    script = """
import gc, weakref
from nri_plugin.daemon.app import freeze_start_up_heap
class Node:
    pass
cycle = Node()
cycle.self = cycle
gone = weakref.ref(cycle)
del cycle
freeze_start_up_heap()
assert gone() is None, "cyclic garbage frozen"
assert gc.get_freeze_count() > 1000, gc.get_freeze_count()
assert len(gc.get_objects(2)) < 100, len(gc.get_objects(2))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=GUARD, check=False
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.asyncio
async def test_a_probe_server_that_cannot_listen_is_status_2_and_the_runtime_never_sees_us() -> None:
    """metrics_address taken, or not this host's: a config error that no restart mends."""
    log: list[str] = []
    taken = ProbeError("cannot serve metrics and probes on 127.0.0.1:1: Address already in use")
    daemon = Daemon(
        StandInNri(log),
        services=[
            StandInService("first", log),
            StandInService("probes", log, refuses=taken),
            StandInService("device plugin", log),
        ],
        state=StandInState(log),
        drain_seconds=0.0,
    )
    with pytest.raises(DaemonError) as info:
        await daemon.main()
    assert (info.value.status, str(info.value)) == (EXIT_CONFIG, str(taken))
    assert log == ["start first", "close first", "flush"]


@pytest.mark.asyncio
async def test_a_stub_that_cannot_serve_is_status_1() -> None:
    log: list[str] = []
    refused = StubError("cannot connect to the NRI socket /x.sock: [Errno 2] No such file or directory")
    daemon = Daemon(
        StandInNri(log, error=refused),
        services=[StandInService("probes", log)],
        state=StandInState(log),
        drain_seconds=0.0,
    )
    with pytest.raises(DaemonError) as info:
        await daemon.main()
    assert (info.value.status, str(info.value)) == (1, str(refused))
    assert log == ["start probes", "nri run", "close probes", "flush"]


@pytest.mark.asyncio
async def test_books_that_cannot_be_saved_are_one_line_and_the_status_stays_0() -> None:
    log: list[str] = []
    stderr = io.StringIO()
    daemon = Daemon(
        StandInNri(log),
        state=StandInState(log, OSError(28, "No space left on device")),
        stderr=stderr,
        drain_seconds=0.0,
    )
    daemon.stop()  # before it runs: it starts, sees the stop, and shuts down
    assert await asyncio.wait_for(daemon.main(), GUARD) == 0
    assert stderr.getvalue() == "error: cannot save the plugin's state: [Errno 28] No space left on device\n"
    assert log == ["nri stop", "nri run", "nri ended"]


# -- the lifecycle, in real processes ----------------------------------------------------------------------


async def _child(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).with_name("daemon_child.py")),
        *args,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


async def _expect_line(proc: asyncio.subprocess.Process, text: str) -> None:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), GUARD)
    assert line.decode().strip() == text, line


@pytest.mark.asyncio
@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=STOP_SIGNAL_IDS)
async def test_a_real_process_stops_on_the_first_signal_with_status_0(signum: int) -> None:
    proc = await _child()
    try:
        await _expect_line(proc, "started")
        proc.send_signal(signum)
        out, err = await asyncio.wait_for(proc.communicate(), GUARD)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    assert out.decode().split() == ["closing", "flushed"]
    [entry] = [json.loads(line) for line in err.decode().splitlines()]
    assert (entry["msg"], entry["signal"]) == ("signal received, shutting down", signal.Signals(signum).name)


@pytest.mark.asyncio
@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=STOP_SIGNAL_IDS)
async def test_a_real_process_exits_at_once_on_the_second_signal(signum: int) -> None:
    proc = await _child("hang")
    try:
        await _expect_line(proc, "started")
        proc.send_signal(signum)
        await _expect_line(proc, "closing")  # and it hangs there
        proc.send_signal(signum)
        out, err = await asyncio.wait_for(proc.communicate(), GUARD)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 128 + signum, err.decode()
    assert out == b"", "no flush after the second signal"
    messages = [json.loads(line)["msg"] for line in err.decode().splitlines()]
    assert messages == ["signal received, shutting down", "second signal received, exiting at once"]


@pytest.fixture
def device_plugins() -> Iterator[Path]:
    """kubelet's device-plugin directory (short: unix socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.asyncio
async def test_run_saves_the_books_on_the_way_out(tmp_path: Path, device_plugins: Path) -> None:
    """Every change is in the database before the reply (a restarted container's new instance too),
    and the daemon that exits on SIGTERM leaves the WAL folded into the database."""
    config = write_daemon_config(tmp_path, device_plugins)
    pod_dir = tmp_path / "cgroup" / "cpu" / "kubepods" / "pod1234"
    pod_dir.mkdir(parents=True)
    (pod_dir / "cpu.cfs_quota_us").write_text("200000\n")
    (pod_dir / "cpu.cfs_period_us").write_text("100000\n")
    socket_path = tmp_path / "nri.sock"
    state_dir = tmp_path / "state"

    def holders() -> list[str]:
        return [record.id for _, record in saved_books(state_dir).slots()]

    argv = ("--log-level", "info", "run", "--config", str(config), "--socket", str(socket_path))
    async with RuntimeSimulator(socket_path) as sim, daemon_process(*argv) as proc:
        await sim.wait_for_plugins(1, GUARD)
        key = load_or_create_host_key(tmp_path / "state")
        pod = api.PodSandbox(id="s1", uid="1234", name="p", namespace="ns")
        pod.linux.cgroup_parent = "/kubepods/pod1234"
        await sim.run_pod_sandbox(pod)

        def main_container(cid: str) -> api.Container:
            container = api.Container(id=cid, pod_sandbox_id="s1", name="main")
            container.annotations[ANNOTATION_KEY] = key.sign("shared-cpus-0")
            container.linux.cgroups_path = f"/kubepods/pod1234/{cid}"
            container.linux.resources.cpu.cpus = "2-3"
            container.linux.resources.cpu.quota.value = 200000
            container.linux.resources.cpu.period.value = 100000
            return container

        await sim.create_container(main_container("c1"))
        assert holders() == ["c1"]  # a new pod baseline: written before the reply
        await sim.create_container(main_container("c2"))  # c1 restarted: c2 takes its slot
        assert holders() == ["c2"], "the new holder is written before the reply"
        stderr = await terminate(proc, GUARD)
    assert proc.returncode == 0, stderr.decode()
    wal = state_dir / "books.sqlite-wal"
    assert not wal.exists() or wal.stat().st_size == 0, "the WAL folded in at exit"
    assert holders() == ["c2"]


@pytest.mark.asyncio
async def test_run_without_reconnect_exits_1_when_the_runtime_goes_away(
    tmp_path: Path, device_plugins: Path
) -> None:
    config = write_daemon_config(tmp_path, device_plugins)
    socket_path = tmp_path / "nri.sock"
    argv = ("run", "--config", str(config), "--socket", str(socket_path), "--no-reconnect")
    async with daemon_process(*argv) as proc:
        async with RuntimeSimulator(socket_path) as sim:
            await sim.wait_for_plugins(1, GUARD)
        _, stderr = await asyncio.wait_for(proc.communicate(), GUARD)
    text = stderr.decode()
    assert proc.returncode == 1, text
    assert [line for line in text.splitlines() if line.startswith("error:")] == [
        "error: the connection to the runtime ended and reconnecting is off; restart the daemon "
        "(or run it without --no-reconnect)"
    ]
    assert "Traceback" not in text


def test_run_without_reconnect_exits_1_when_there_is_no_runtime(tmp_path: Path, device_plugins: Path) -> None:
    socket_path = tmp_path / "none.sock"
    config = write_daemon_config(tmp_path, device_plugins)
    result = run_cli(
        "run", "--config", str(config), "--socket", str(socket_path), "--no-reconnect", timeout=GUARD
    )
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: cannot connect to the NRI socket {socket_path}: it does not exist; check that the runtime "
        'runs with NRI on (containerd 1.7: [plugins."io.containerd.nri.v1.nri"] disable = false; CRI-O: '
        "[crio.nri] enable_nri = true), that nri_socket (or --socket) is its NRI socket_path, and in a pod "
        "that the host's /var/run/nri directory is mounted"
    ], result.stderr


# -- the wiring --------------------------------------------------------------------------------------------


@pytest.fixture
def quiet_wiring(monkeypatch: pytest.MonkeyPatch) -> None:
    """`build_daemon` configures logging for good (cached loggers): not in the test process."""
    monkeypatch.setattr("nri_plugin.daemon.wiring.configure_logging", lambda *_a, **_k: "json")


def test_every_part_is_built_with_the_metrics_as_its_observer(
    tmp_path: Path, device_plugins: Path, quiet_wiring: None
) -> None:
    config = write_daemon_config(tmp_path, device_plugins)
    daemon = build_daemon(RunOptions(config_path=str(config)), environ={})
    stub, plugin = daemon.nri, daemon.state
    assert isinstance(stub, Stub)
    assert isinstance(plugin, MixedCpuPlugin)
    assert stub.plugin is plugin
    probes, device_plugin, status, warnings = daemon.services
    assert isinstance(status, StatusServer)
    assert status.path == str(tmp_path / "state" / "status.sock")
    assert isinstance(probes, ProbeServer)
    assert isinstance(device_plugin, DevicePluginServer)
    assert isinstance(warnings, NotReadyWarnings)
    metrics = stub.observer
    assert isinstance(metrics, Metrics)
    assert plugin.observer is metrics
    assert device_plugin.observer is metrics
    assert probes.observer is metrics
    # One key: the device plugin signs the markers the plugin checks, made in state_dir at start.
    assert plugin.marker_key is device_plugin.key
    assert device_plugin.key.path == tmp_path / "state" / KEY_FILE_NAME
    # The gauges read their owners: the runtime has not seen us, kubelet neither.
    rendered = metrics.render().decode()
    assert "mixed_cpu_nri_ready 0.0" in rendered
    assert "mixed_cpu_shared_containers 0.0" in rendered


def test_with_metrics_off_nothing_observes_and_no_port_is_served(
    tmp_path: Path, device_plugins: Path, quiet_wiring: None
) -> None:
    config = write_daemon_config(tmp_path, device_plugins, metrics_address="")
    daemon = build_daemon(RunOptions(config_path=str(config)), environ={})
    assert isinstance(daemon.nri, Stub)
    assert isinstance(daemon.state, MixedCpuPlugin)
    assert daemon.nri.observer is None
    assert daemon.state.observer is None
    device_plugin, status, warnings = daemon.services
    assert isinstance(device_plugin, DevicePluginServer)
    assert isinstance(status, StatusServer), "the status does not need the metrics"
    assert device_plugin.observer is None
    assert isinstance(warnings, NotReadyWarnings), "not-ready warnings do not need the metrics"


# A plugin file the runtime would launch (or someone started by that name): NN-name names the plugin.
LAUNCHED_FILE = "/opt/nri/plugins/05-file-name"


@pytest.mark.parametrize(
    ("options", "environ", "full_name", "socket"),
    [
        (RunOptions(), {}, "10-mixed-cpu", "CONFIG"),  # the config's nri_socket
        (RunOptions(executable="/usr/bin/mixed-cpu-nri-plugin"), {}, "10-mixed-cpu", "CONFIG"),
        (RunOptions(executable=LAUNCHED_FILE), {}, "05-file-name", "CONFIG"),
        (
            RunOptions(executable=LAUNCHED_FILE),
            {"NRI_PLUGIN_NAME": "env-name", "NRI_PLUGIN_IDX": "20"},
            "20-env-name",
            "CONFIG",
        ),
        (
            RunOptions(plugin_name="opt", plugin_index="30", socket="/run/x.sock", executable=LAUNCHED_FILE),
            {"NRI_PLUGIN_NAME": "env-name", "NRI_PLUGIN_IDX": "20"},
            "30-opt",
            "/run/x.sock",
        ),
    ],
    ids=["config", "plain-executable", "executable-wins", "environment-wins", "options-win"],
)
def test_the_stub_takes_options_then_environment_then_executable_then_config(
    tmp_path: Path,
    device_plugins: Path,
    quiet_wiring: None,
    options: RunOptions,
    environ: dict[str, str],
    full_name: str,
    socket: str,
) -> None:
    config = write_daemon_config(tmp_path, device_plugins)
    daemon = build_daemon(dataclasses.replace(options, config_path=str(config)), environ=environ)
    assert isinstance(daemon.nri, Stub)
    socket = socket.replace("CONFIG", str(tmp_path / "nri.sock"))
    assert (daemon.nri.identity.full_name, daemon.nri.socket_path) == (full_name, socket)


def test_build_failures_carry_the_documented_status(
    tmp_path: Path, device_plugins: Path, quiet_wiring: None
) -> None:
    config = write_daemon_config(tmp_path, device_plugins)
    with pytest.raises(DaemonError) as info:
        build_daemon(RunOptions(config_path=str(tmp_path / "missing.toml")), environ={})
    assert info.value.status == EXIT_CONFIG == 2
    assert str(info.value).startswith(f"{tmp_path / 'missing.toml'}: no such file;")
    with pytest.raises(DaemonError) as info:
        build_daemon(RunOptions(config_path=str(config), plugin_index="7"), environ={})
    assert info.value.status == EXIT_CONFIG  # wherever the index comes from (issue 15, item 2)
    assert str(info.value).startswith("plugin index '7' is invalid")
    (tmp_path / "state").mkdir(exist_ok=True)
    (tmp_path / "state" / KEY_FILE_NAME).write_bytes(b"short")
    with pytest.raises(DaemonError) as info:
        build_daemon(RunOptions(config_path=str(config)), environ={})
    assert info.value.status == EXIT_CONFIG
    assert str(info.value).startswith(f"{config}: state_dir: ")
    assert str(info.value).endswith("; point state_dir at a directory only root can write")


# -- what operators tripped over (issue 15) ------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "environ", "problem"),
    [
        (RunOptions(), {"NRI_PLUGIN_IDX": "7"}, "plugin index '7' is invalid"),
        (RunOptions(plugin_index="100"), {}, "plugin index '100' is invalid"),
        (RunOptions(plugin_name="bad name"), {}, "plugin name 'bad name' is invalid"),
        (RunOptions(), {"NRI_PLUGIN_NAME": "bad name"}, "plugin name 'bad name' is invalid"),
        (RunOptions(), {"NRI_PLUGIN_SOCKET": "x"}, "NRI_PLUGIN_SOCKET='x' is not a file descriptor number"),
    ],
    ids=["env-index", "option-index", "option-name", "env-name", "env-socket"],
)
def test_identity_mistakes_are_config_errors_wherever_they_come_from(
    tmp_path: Path,
    device_plugins: Path,
    quiet_wiring: None,
    options: RunOptions,
    environ: dict[str, str],
    problem: str,
) -> None:
    """Status 2, so that a systemd unit with RestartPreventExitStatus=2 does not restart-loop."""
    config = write_daemon_config(tmp_path, device_plugins)
    with pytest.raises(DaemonError) as info:
        build_daemon(dataclasses.replace(options, config_path=str(config)), environ=environ)
    assert info.value.status == EXIT_CONFIG
    assert str(info.value).startswith(problem)


def test_an_old_runtimes_whole_file_name_is_still_a_name(
    tmp_path: Path, device_plugins: Path, quiet_wiring: None
) -> None:
    """Runtimes on NRI v0.3 and older pass NRI_PLUGIN_NAME=10-mixed-cpu; the index is cut off."""
    config = write_daemon_config(tmp_path, device_plugins)
    daemon = build_daemon(RunOptions(config_path=str(config)), environ={"NRI_PLUGIN_NAME": "10-mixed-cpu"})
    assert isinstance(daemon.nri, Stub)
    assert daemon.nri.identity.full_name == "10-mixed-cpu"


def test_run_exits_2_for_a_bad_index_in_the_environment(tmp_path: Path, device_plugins: Path) -> None:
    config = write_daemon_config(tmp_path, device_plugins)
    argv = ("run", "--config", str(config))
    refuse_host_paths(argv)
    result = subprocess.run(
        [sys.executable, "-m", "nri_plugin.daemon.cli", *argv],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "NRI_PLUGIN_IDX": "7"},
        capture_output=True,
        text=True,
        timeout=GUARD,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        "error: plugin index '7' is invalid: use exactly two digits, e.g. 10 (it came from environment "
        "(NRI_PLUGIN_IDX))"
    ]


def test_a_runtime_launched_daemon_names_its_connection_and_its_end(
    tmp_path: Path, device_plugins: Path, quiet_wiring: None
) -> None:
    """Started by the runtime on fd 3: the logs name fd 3, not the config's nri_socket, and the end of
    the connection is told as what it is (the runtime will start the plugin again), not as a
    --no-reconnect the operator never gave."""
    config = write_daemon_config(tmp_path, device_plugins)
    environ = {"NRI_PLUGIN_NAME": "mixed-cpu", "NRI_PLUGIN_IDX": "10", "NRI_PLUGIN_SOCKET": "3"}
    daemon = build_daemon(RunOptions(config_path=str(config)), environ=environ)
    assert isinstance(daemon.nri, Stub)
    assert daemon.nri.socket_path == "fd 3 from the runtime (NRI_PLUGIN_SOCKET)"
    # The connection named in the environment given is the one the stub takes, and it never redials.
    assert (daemon.nri.inherited_fd, daemon.nri.reconnect) == (3, False)
    assert daemon.nri_ended == LAUNCHED_ENDED
    assert isinstance(daemon.nri.plugin, MixedCpuPlugin)
    daemon.nri.plugin.store.close()  # (its lock on the database: the next one opens it)
    plain = build_daemon(RunOptions(config_path=str(config)), environ={})
    assert plain.nri_ended == NRI_ENDED


def test_only_the_environment_given_is_read(
    tmp_path: Path, device_plugins: Path, quiet_wiring: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The identity is worked out once, from the environment `build_daemon` is given: the stub does
    not read the process's own afterwards (it used to, for NRI_PLUGIN_SOCKET)."""
    monkeypatch.setenv("NRI_PLUGIN_SOCKET", "3")
    monkeypatch.setenv("NRI_PLUGIN_NAME", "process-name")
    config = write_daemon_config(tmp_path, device_plugins)
    daemon = build_daemon(RunOptions(config_path=str(config)), environ={})
    assert isinstance(daemon.nri, Stub)
    assert daemon.nri.identity.full_name == "10-mixed-cpu"
    assert (daemon.nri.inherited_fd, daemon.nri.reconnect) == (None, True)
    assert daemon.nri_ended == NRI_ENDED


@pytest.mark.asyncio
async def test_the_end_of_the_connection_is_logged_not_only_printed() -> None:
    """The runtime-launched daemon's stderr is its log file: the reason is a log line there too."""
    log: list[str] = []
    daemon = Daemon(StandInNri(log, ends=True), drain_seconds=0.0, nri_ended=LAUNCHED_ENDED)
    with structlog.testing.capture_logs() as logged, pytest.raises(DaemonError) as info:
        await daemon.main()
    assert (info.value.status, str(info.value)) == (EXIT_CANNOT_SERVE, LAUNCHED_ENDED)
    assert {"event": "the connection to the runtime ended; not reconnecting", "why": LAUNCHED_ENDED,
            "log_level": "warning"} in logged  # fmt: skip


@pytest.mark.asyncio
async def test_not_ready_is_said_at_warning_while_it_lasts() -> None:
    """A rolling update waits on /readyz: the log says why it waits, every period, and when it ends."""
    missing: list[str | None] = ["not registered with kubelet yet"]
    clock = ManualClock()
    warnings = NotReadyWarnings(lambda: missing[0], clock=clock, period=30.0)
    with structlog.testing.capture_logs() as logged:
        await warnings.start()
        await clock.advance(29.0)
        assert logged == [], "a normal start is ready well within a period"
        await clock.advance(1.0)
        await clock.advance(30.0)
        missing[0] = None
        await clock.advance(30.0)
        await clock.advance(30.0)
        await warnings.close()
    assert [(entry["log_level"], entry["event"], entry.get("missing")) for entry in logged] == [
        ("warning", "not ready", "not registered with kubelet yet"),
        ("warning", "not ready", "not registered with kubelet yet"),
        ("info", "ready", None),
    ]
    assert warnings.warnings == 2
    assert clock.pending == 0, "closed: no timer left behind"


def test_readiness_names_a_missing_kubelet_directory(
    tmp_path: Path, device_plugins: Path, quiet_wiring: None
) -> None:
    missing_dir = device_plugins / "absent"
    daemon = build_daemon(RunOptions(config_path=str(write_daemon_config(tmp_path, missing_dir))), environ={})
    stub = daemon.nri
    _, device_plugin, _, _ = daemon.services
    assert isinstance(stub, Stub)
    assert isinstance(device_plugin, DevicePluginServer)
    stub.ready.set()
    assert readiness(stub, device_plugin)() == (
        f"not registered with kubelet yet: its device-plugin directory {missing_dir} does not exist; "
        "mount the host's directory there, or set [device_plugin] plugin_dir"
    )
    missing_dir.mkdir()
    assert readiness(stub, device_plugin)() == "not registered with kubelet yet"


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Leave the process's logging as the test found it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    structlog.reset_defaults()


def test_every_log_line_names_the_node(restore_logging: None) -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream=stream, node="worker-3")
    structlog.get_logger("nri_plugin.test").info("hello", pod="p")
    logging.getLogger("grpc").warning("a stdlib line")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(line["node"], line["msg"]) for line in lines] == [
        ("worker-3", "hello"),
        ("worker-3", "a stdlib line"),
    ]
    assert list(lines[0])[:3] == ["timestamp", "level", "node"]
