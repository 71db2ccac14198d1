"""The command line: the demo's output, and the daemon's shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nri_plugin.cli import main
from nri_plugin.demo import run_demo
from nri_plugin.simulator import RuntimeSimulator

ROOT = Path(__file__).resolve().parent.parent
GUARD = 20.0


def test_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nri_plugin.cli", "version"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=GUARD,
        check=True,
    )
    assert result.stdout.startswith("mixed-cpu-nri-plugin 0.")


def test_unknown_log_level_is_refused() -> None:
    with pytest.raises(SystemExit, match="unknown log level 'loud'"):
        main(["--log-level", "loud", "version"])


@pytest.mark.asyncio
@pytest.mark.parametrize(("runtime", "version"), [("containerd", "v2.3.4"), ("cri-o", "v1.36.3")])
async def test_demo_shows_what_the_plugin_did(runtime: str, version: str) -> None:
    out = io.StringIO()
    assert await run_demo(out, runtime_name=runtime, runtime_version=version) == 0
    text = out.getvalue()
    assert f"NRI runtime simulator: {runtime} {version}" in text
    assert "plugin 10-mixed-cpu registered, subscribed to CREATE_CONTAINER, UPDATE_CONTAINER" in text
    assert "synchronized: 1 pod(s), 1 container(s)" in text
    # The requesting container gets the shared CPUs and both sets in its environment...
    assert "after:  cpus=0-1,2-3" in text
    assert "OPENSHIFT_SHARED_CPUS=0-1 OPENSHIFT_ISOLATED_CPUS=2-3" in text
    # ...the other one is left alone, and kubelet's update keeps the shared CPUs.
    sidecar = text.split("packet-fwd/sidecar")[1]
    assert "after:  cpus=2-3    quota=200000  env: -" in sidecar
    assert "applied: cpus=0-1,2-3" in text
    assert "0 failed; plugin still connected: True" in text


@pytest.mark.asyncio
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_run_shuts_down_cleanly_on_signal(tmp_path: Path, signum: int) -> None:
    socket_path = tmp_path / "nri.sock"
    async with RuntimeSimulator(socket_path) as sim:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "nri_plugin.cli",
            "--log-level",
            "info",
            "run",
            "--socket",
            str(socket_path),
            "--shared-cpus",
            "0-1",
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            [plugin] = await sim.wait_for_plugins(1, GUARD)
            assert plugin.full_name == "10-mixed-cpu"
            proc.send_signal(signum)
            _, stderr = await asyncio.wait_for(proc.communicate(), GUARD)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0, stderr.decode()
    assert b"signal received, shutting down" in stderr
    assert b"Traceback" not in stderr
    assert any(r.event == "drop" and r.detail == "connection closed" for r in sim.records)


def test_run_with_a_bad_index_is_one_clear_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nri_plugin.cli",
            "run",
            "--socket",
            str(tmp_path / "x.sock"),
            "--shared-cpus",
            "0",
            "--nri-plugin-index",
            "7",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=GUARD,
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: plugin index '7' is invalid: use exactly two digits, "
        "e.g. --nri-plugin-index 10 or NRI_PLUGIN_IDX=10"
    ]
