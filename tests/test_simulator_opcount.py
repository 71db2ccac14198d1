"""bench/sim_opcount.py, the simulator's share of an asking round trip, runs and names its layers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_simulator_opcode_count_names_the_layers_of_a_round_trip() -> None:
    options = ["--calls", "2", "--warm", "1", "--cpu-calls", "2", "--top", "5"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sim_opcount.py"), *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()[:2]
    assert first.startswith("simulator-side bytecodes per asking CreateContainer round trip: "), done.stdout
    assert int(first.split(": ")[1].replace(",", "")) > 0, first
    assert second.startswith("CPU per round trip: simulator "), done.stdout
    # The runtime's own code and the transport under it show up by file.
    for path in ("nri_plugin/nri/simulator.py", "nri_plugin/ttrpc/protocol.py", "nri_plugin/nri/mux.py"):
        assert f"| {path} | " in done.stdout, done.stdout
