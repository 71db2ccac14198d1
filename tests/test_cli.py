"""The command line: the demo's output, and the daemon's shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

import pytest
from mixedcpu_support import ROOT, daemon_process, run_cli, terminate, write_daemon_config

from nri_plugin import __version__
from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.daemon.cli import EXIT_OUTPUT_CLOSED, main
from nri_plugin.daemon.demo import run_demo
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key
from nri_plugin.deviceplugin.marker import ANNOTATION_KEY
from nri_plugin.nri.simulator import RuntimeSimulator, env_of

GUARD = 20.0


def test_version() -> None:
    """From this checkout run in place (no build recorded a commit): the commit checked out, read
    from its git files (tests/test_buildinfo.py); "unknown" from a tree without git."""
    if (ROOT / ".git").exists():
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        commit = f"{head}, checkout"
    else:
        commit = "unknown"
    result = run_cli("version", timeout=GUARD, check=True)
    assert result.stdout == f"mixed-cpu-nri-plugin {__version__} (commit {commit})\n"


def test_the_version_is_pyprojects() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == __version__


def test_version_names_the_commit_a_build_recorded(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What setup.py writes into a wheel: the module nri_plugin._build_info with COMMIT."""
    recorded = types.ModuleType("nri_plugin._build_info")
    recorded.COMMIT = "0123456789abcdef0123456789abcdef01234567"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nri_plugin._build_info", recorded)
    assert main(["version"]) == 0
    assert capsys.readouterr().out == (
        f"mixed-cpu-nri-plugin {__version__} (commit 0123456789abcdef0123456789abcdef01234567)\n"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--log-level", "loud", "version"], "argument --log-level: invalid choice: 'loud'"),
        (["run", "--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
        ([], "the following arguments are required: COMMAND"),
        (["serve"], "argument COMMAND: invalid choice: 'serve'"),
        (["check", "--kubeconfig", "x"], "unrecognized arguments: --kubeconfig x"),
        (["demo", "--runtime", "docker"], "argument --runtime: invalid choice: 'docker'"),
    ],
    ids=[
        "log-level",
        "log-level-after-command",
        "no-command",
        "unknown-command",
        "unknown-option",
        "runtime",
    ],
)
def test_argument_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    [line] = err.splitlines()
    assert line.startswith(f"error: {message}"), line
    assert line.endswith("--help'"), line  # names the help to read
    assert out == ""


@pytest.mark.parametrize(
    ("command", "words"),
    [
        ([], ["run", "check", "config", "demo", "version", "--log-level"]),
        (["run"], ["--config", "--socket", "--nri-plugin-index", "SIGUSR1", "Exit status"]),
        (["check"], ["--config", "--kubelet-config", "reservedSystemCPUs", "Exit status: 0"]),
        (["config"], ["--config", "TOML", "environment", "Exit status: 0"]),
        (["demo"], ["--runtime", "simulator"]),
        (["version"], ["Print the version"]),
    ],
    ids=["top", "run", "check", "config", "demo", "version"],
)
def test_every_command_has_help(
    capsys: pytest.CaptureFixture[str], command: list[str], words: list[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: mixed-cpu-nri-plugin {' '.join(command)}".rstrip())
    for word in words:
        assert word in out


def test_log_level_after_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version", "--log-level", "debug"]) == 0
    assert capsys.readouterr().out.startswith("mixed-cpu-nri-plugin 0.")
    assert logging.getLogger().level == logging.DEBUG
    assert main(["--log-level", "error", "version"]) == 0
    assert logging.getLogger().level == logging.ERROR


def test_an_unexpected_error_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("the disk\nis on fire")

    monkeypatch.setattr("nri_plugin.daemon.check.run_checks", broken)
    assert main(["check", "--config", str(tmp_path / "c.toml")]) == 1
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        "error: unexpected RuntimeError: the disk is on fire; run again with --log-level debug to log the "
        "traceback, and report it"
    ]
    assert out == ""
    # With debug logging, the traceback is logged too (stderr is no terminal here: a JSON line).
    assert main(["check", "--log-level", "debug", "--config", str(tmp_path / "c.toml")]) == 1
    logged, error = capsys.readouterr().err.splitlines()
    entry = json.loads(logged)
    assert (entry["level"], entry["msg"]) == ("debug", "unexpected error")
    assert "Traceback" in entry["exception"]
    assert 'raise RuntimeError("the disk\\nis on fire")' in entry["exception"]
    assert error.startswith("error: unexpected RuntimeError: the disk is on fire;")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("runtime", "version", "pod_cgroup"),
    [
        ("containerd", "v2.3.4", "/kubepods/pod2222-aaaa"),
        ("cri-o", "v1.36.3", "/kubepods.slice/kubepods-pod2222_aaaa.slice"),
    ],
)
async def test_demo_shows_what_the_plugin_did(runtime: str, version: str, pod_cgroup: str) -> None:
    out = io.StringIO()
    assert await run_demo(out, runtime_name=runtime, runtime_version=version) == 0
    text = out.getvalue()
    assert f"NRI runtime simulator: {runtime} {version}" in text
    assert "node: CPUs 0-7, shared pool 0-1 (from config.toml), cgroup v1 tree in " in text
    assert (
        "plugin 10-mixed-cpu registered, subscribed to STOP_POD_SANDBOX, REMOVE_POD_SANDBOX, "
        "CREATE_CONTAINER, START_CONTAINER, UPDATE_CONTAINER, STOP_CONTAINER, REMOVE_CONTAINER"
    ) in text
    assert "synchronized: 1 pod(s), 1 container(s)" in text
    assert f"pod telco/packet-fwd (Guaranteed), cgroup {pod_cgroup}\n  pod quota 300000 per 100000 us" in text
    # The requesting container: exclusive + shared CPUs, the quota for all of them, both sets in its
    # environment, and its pod's quota raised by two CPUs.
    fwd = text.split("packet-fwd/fwd (asks for shared CPUs: device-plugin marker for shared-cpus-0)")[1]
    assert fwd.startswith(
        "\n  before: cpus=4-5         quota=200000  env: -"
        "\n  after:  cpus=0-1,4-5     quota=400000  env: "
        "OPENSHIFT_SHARED_CPUS=0-1 OPENSHIFT_ISOLATED_CPUS=4-5"
        "\n  pod quota: 300000 -> 500000\n"
    )
    # The sidecar sets OPENSHIFT_SHARED_CPUS itself: no proof, left exactly as it was.
    sidecar = text.split("packet-fwd/sidecar (no request;")[1]
    assert "\n  before: cpus=6           quota=100000  env: OPENSHIFT_SHARED_CPUS=0-7" in sidecar
    assert "\n  after:  cpus=6           quota=100000  env: OPENSHIFT_SHARED_CPUS=0-7" in sidecar
    assert "\n  pod quota: 500000 -> 500000\n" in sidecar
    # A Burstable pod's request fails with the reason and the fix.
    assert (
        "  FAILED: container batch/report/report asks for shared CPUs but its pod is not Guaranteed "
        "(QoS class Burstable), so it has no exclusive CPUs; give every container of the pod CPU and "
        "memory limits equal to its requests"
    ) in text
    # kubelet's exclusive-only update keeps the shared CPUs and the raised quota.
    assert "UpdateContainerResources(fwd, cpus=4-5)\n  applied: cpus=0-1,4-5 quota=400000\n" in text
    # A restart does not grow the pod quota; removal brings it back.
    restart = text.split("fwd restarts:")[1]
    assert "  after:  cpus=0-1,4-5     quota=400000  env: OPENSHIFT_SHARED_CPUS=0-1" in restart
    # Each pod-quota step says what moved it (issue 15, item 16).
    assert (
        "  pod quota: 500000 (running) -> 300000 (fwd-1 stopped: its share given back) -> 500000 "
        "(fwd-2 created: the share again, once) -> 500000 (fwd-1 removed)\n"
    ) in restart
    assert (
        "fwd ends: StopContainer, RemoveContainer fwd-2\n"
        "  pod quota: 500000 (running) -> 300000 (fwd-2 gone: back to the pod's own)\n"
    ) in text
    assert "11 NRI exchanges, 1 failed (the Burstable request); plugin still connected: True" in text


@pytest.mark.asyncio
async def test_demo_shows_numa_local_shared_cpus_on_two_nodes() -> None:
    out = io.StringIO()
    assert await run_demo(out) == 0
    text = out.getvalue()
    assert "NUMA: node0 CPUs 0,2,4,6 (shared 0), node1 CPUs 1,3,5,7 (shared 1)\n" in text
    # The demo says it turns on what is off by default, before any container is shown.
    said = (
        "this demo turns numa_local_shared_cpus on (off by default: then every container gets the whole pool)"
    )
    assert said in text.split("CreateContainer")[0]
    # The forwarder's exclusive CPUs are on both nodes: it gets the shared CPUs of each.
    assert (
        "  NUMA: exclusive CPUs 4-5 on node0 and node1: shared CPUs 0-1, so its pod quota gains 2 CPU(s)\n"
        in text
    )
    # A container on node 1 alone gets node 1's shared CPU: cpuset, quota, env and pod quota.
    worker = text.split("CreateContainer telco/dpdk-node1/worker")[1]
    assert (
        "\n  before: cpus=3,7         quota=200000  env: -"
        "\n  after:  cpus=1,3,7       quota=300000  env: OPENSHIFT_SHARED_CPUS=1 OPENSHIFT_ISOLATED_CPUS=3,7"
        "\n  pod quota: 200000 -> 300000"
        "\n  NUMA: exclusive CPUs 3,7 on node1: shared CPUs 1, so its pod quota gains 1 CPU(s)"
        "\n1 more NRI exchange(s), 0 failed\n"
    ) in worker


@pytest.fixture
def device_plugins() -> Iterator[Path]:
    """kubelet's device-plugin directory for the daemon; no kubelet listens there.

    Outside tmp_path, which can be longer than a unix socket path may be (107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.asyncio
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
async def test_run_shuts_down_cleanly_on_signal(tmp_path: Path, device_plugins: Path, signum: int) -> None:
    socket_path = tmp_path / "nri.sock"
    config = write_daemon_config(tmp_path, device_plugins)
    async with (
        RuntimeSimulator(socket_path) as sim,
        daemon_process(
            "--log-level", "info", "run", "--socket", str(socket_path), "--config", str(config)
        ) as proc,
    ):
        [plugin] = await sim.wait_for_plugins(1, GUARD)
        assert plugin.full_name == "10-mixed-cpu"
        stderr = await terminate(proc, GUARD, signum)
    assert proc.returncode == 0, stderr.decode()
    assert b"signal received, shutting down" in stderr
    assert b"Traceback" not in stderr
    assert any(r.event == "drop" and r.detail == "connection closed" for r in sim.records)


def test_run_with_a_bad_index_is_one_clear_line(tmp_path: Path, device_plugins: Path) -> None:
    result = run_cli(
        "run",
        "--socket",
        str(tmp_path / "x.sock"),
        "--config",
        str(write_daemon_config(tmp_path, device_plugins)),
        "--nri-plugin-index",
        "7",
        timeout=GUARD,
    )
    assert result.returncode == 2  # a config error (issue 15, item 2)
    assert result.stderr.strip().splitlines() == [
        "error: plugin index '7' is invalid: use exactly two digits, e.g. 10 (it came from the command line)"
    ]


@pytest.mark.asyncio
async def test_run_serves_the_policy_from_its_config(tmp_path: Path, device_plugins: Path) -> None:
    """The daemon as deployed: config file, cgroup tree, state dir, marker key, NRI socket."""
    config = write_daemon_config(tmp_path, device_plugins)
    pod_dir = tmp_path / "cgroup" / "cpu" / "kubepods" / "pod1234"
    pod_dir.mkdir(parents=True)
    (pod_dir / "cpu.cfs_quota_us").write_text("200000\n")
    (pod_dir / "cpu.cfs_period_us").write_text("100000\n")
    socket_path = tmp_path / "nri.sock"
    argv = ("run", "--config", str(config), "--socket", str(socket_path), "--nri-plugin-index", "42")
    async with RuntimeSimulator(socket_path) as sim, daemon_process(*argv) as proc:
        [plugin] = await sim.wait_for_plugins(1, GUARD)
        assert plugin.full_name == "42-mixed-cpu"
        key = load_or_create_host_key(tmp_path / "state")  # the daemon made it at start
        pod = api.PodSandbox(id="s1", uid="1234", name="p", namespace="ns")
        pod.linux.cgroup_parent = "/kubepods/pod1234"
        await sim.run_pod_sandbox(pod)
        container = api.Container(id="c1", pod_sandbox_id="s1", name="main")
        container.annotations[ANNOTATION_KEY] = key.sign("shared-cpus-0")
        container.linux.cgroups_path = "/kubepods/pod1234/c1"
        container.linux.resources.cpu.cpus = "2-3"
        container.linux.resources.cpu.quota.value = 200000
        container.linux.resources.cpu.period.value = 100000
        result = await sim.create_container(container)
        assert result.container.linux.resources.cpu.cpus == "0-3"
        assert result.container.linux.resources.cpu.quota.value == 400000
        assert env_of(result.container)["OPENSHIFT_ISOLATED_CPUS"] == "2-3"
        assert (pod_dir / "cpu.cfs_quota_us").read_text() == "400000\n"
        stderr = await terminate(proc, GUARD)
    assert proc.returncode == 0, stderr.decode()
    assert b"shared CPUs given" in stderr
    assert (tmp_path / "state" / "books.sqlite").exists()


@pytest.mark.asyncio
async def test_leftover_tasks_may_finish_after_shutdown_but_not_hold_it_forever() -> None:
    """A task that ends a few loop turns after shutdown (like grpc's per-RPC tasks) ends by itself
    instead of being cancelled by asyncio.run; one that never ends does not hold the exit past the
    bound."""
    from nri_plugin.daemon.app import let_leftover_tasks_finish

    async def few_turns() -> str:
        for _ in range(5):
            await asyncio.sleep(0)
        return "done"

    never = asyncio.Event()
    finishing = asyncio.create_task(few_turns())
    stuck = asyncio.create_task(never.wait())
    await let_leftover_tasks_finish(0.2)
    assert not finishing.cancelled()
    assert finishing.result() == "done"
    assert not stuck.done()
    stuck.cancel()


# -- what operators tripped over (issue 15) ------------------------------------------------------------


def test_version_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("mixed-cpu-nri-plugin 0.")


@pytest.mark.parametrize("runtime", ["cri-o", "crio"])
def test_demo_takes_crio_by_either_name(capsys: pytest.CaptureFixture[str], runtime: str) -> None:
    assert main(["demo", "--runtime", runtime]) == 0
    assert "NRI runtime simulator: cri-o v1.36.3" in capsys.readouterr().out


def test_demo_keep_leaves_its_directory_and_says_where(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--keep"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("kept /")
    kept = Path(last.split()[1].rstrip(":"))
    try:
        assert (kept / "config.toml").is_file()
        assert (kept / "state" / "books.sqlite").is_file()
        assert (kept / "cgroup" / "cpu").is_dir()
    finally:
        shutil.rmtree(kept)


def test_demo_cleans_up_without_keep(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    made: list[str] = []
    real = tempfile.mkdtemp

    def recording(*args: str, **kwargs: str) -> str:
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr("nri_plugin.daemon.demo.tempfile.mkdtemp", recording)
    assert main(["demo"]) == 0
    [tmp] = made
    assert not Path(tmp).exists()
    assert "kept" not in capsys.readouterr().out


@pytest.mark.parametrize("command", [["demo"], ["check", "--config", "/nonexistent.toml"], ["version"]])
def test_output_nobody_reads_ends_quietly_like_sigpipe(command: list[str]) -> None:
    """``demo | head -1``: the reader is gone before the output is; no traceback, no report-it line,
    and the status of a command that SIGPIPE ended (141)."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "nri_plugin.daemon.cli", *command],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            timeout=GUARD,
            check=False,
        )
    finally:
        os.close(writer)
    assert result.stderr == ""
    assert result.returncode == 128 + signal.SIGPIPE == EXIT_OUTPUT_CLOSED


def test_demo_dra_shows_a_prepared_claim_getting_the_shared_cpus(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--dra"]) == 0
    out = capsys.readouterr().out
    assert "GetInfo: type DRAPlugin, name shared-cpus.mixed-cpu.openshift.io" in out
    assert (
        "kubelet: NodePrepareResources -> device shared-cpus-0, CDI id mixed-cpu.openshift.io/shared-cpus="
        in out
    )
    edits = "its container edits: env MIXED_CPU_SHARED_CPUS_ALLOCATION_SHARED_CPUS_0=v2:dra.shared-cpus-0:"
    assert edits in out
    assert "as it is created: cpus=0-1,4-5" in out
    assert "OPENSHIFT_SHARED_CPUS=0-1 OPENSHIFT_ISOLATED_CPUS=4-5" in out
    assert "pod quota: 200000 -> 400000" in out
    assert "shared CPUs granted: yes" in out
    # The copied marker is left alone, and the spec goes at unprepare.
    assert "(left alone: the device is fwd's)" in out
    assert "NodeUnprepareResources -> ok; CDI spec removed: yes" in out


def test_demo_dra_with_keep_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--dra", "--keep"]) == 2
    assert "--keep is for the device-plugin demo" in capsys.readouterr().err
