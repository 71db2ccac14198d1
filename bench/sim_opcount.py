"""The runtime simulator's share of an asking CreateContainer round trip: its Python bytecodes, by
file and by function, and its CPU time.

Usage: python bench/sim_opcount.py [--calls N] [--warm N] [--cpu-calls N] [--top N]

The plugin (bench/plugin_child.py: the stub and the real mixed-CPU plugin on a fake cgroup v1 node)
runs as this process's child, as in `run_all.py`'s fill; this process is the runtime: the simulator's
`create_container` of each pod's first container, which asks for shared CPUs (the request built and
sent, the reply received, the adjustment checked, merged and applied, the creation recorded), with
the asyncio loop, the multiplexer and the ttrpc client under it. After `--warm` creations untraced,
`--calls` are traced with ``sys.settrace`` and per-opcode events (`opcount.OpcodeCounter`): a count
that the machine's load does not move, since the plugin's work happens in the other process. Then
`--cpu-calls` more, untraced, give the CPU time per round trip of this process (process_time) and of
the plugin's (schedstat), and the wall time: those move with the load.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path

import structlog
from opcount import OpcodeCounter, print_tables
from workload import PluginProcess, fake_node, realistic_container, realistic_pod

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.nri.simulator import RuntimeSimulator


class Reading:
    """What one run gives: the traced bytecodes and the CPU times per round trip (µs)."""

    def __init__(self, counter: OpcodeCounter, own_us: float, plugin_us: float, wall_us: float) -> None:
        self.counter = counter
        self.own_us = own_us
        self.plugin_us = plugin_us
        self.wall_us = wall_us


def measure(calls: int, warm: int, cpu_calls: int, pods: int = 0) -> Reading:
    """`pods` pods are run first (at least one per creation): two runs with the same `pods` differ
    only by the creations, whose instructions their difference under cachegrind then gives."""
    with tempfile.TemporaryDirectory(prefix="sim-opcount-") as tmp:
        return asyncio.run(_measure(Path(tmp), calls, warm, cpu_calls, max(pods, warm + calls + cpu_calls)))


async def _measure(node: Path, calls: int, warm: int, cpu_calls: int, pods: int) -> Reading:
    cgroup_root, state_dir = fake_node(node, pods)
    async with RuntimeSimulator(str(node / "nri.sock")) as sim:
        plugin = PluginProcess(sim.socket_path, cgroup_root, state_dir)
        try:
            await sim.wait_for_plugins(1, timeout=30)
            containers = []
            for n in range(pods):
                pod = realistic_pod(n)
                await sim.run_pod_sandbox(pod)
                containers.append(realistic_container(pod, n * 5, state=api.CONTAINER_UNKNOWN))
            for container in containers[:warm]:
                await sim.create_container(container)
            counter = OpcodeCounter()
            with counter:
                for container in containers[warm : warm + calls]:
                    await sim.create_container(container)
            timed = containers[warm + calls : warm + calls + cpu_calls]
            walls = []
            plugin_cpu, own_cpu = plugin.cpu_ns(), time.process_time_ns()
            for container in timed:
                started = time.perf_counter()
                await sim.create_container(container)
                walls.append(time.perf_counter() - started)
            plugin_cpu, own_cpu = plugin.cpu_ns() - plugin_cpu, time.process_time_ns() - own_cpu
        finally:
            plugin.stop()
    created = warm + calls + cpu_calls
    asked = sum(1 for r in sim.records if r.event == "CreateContainer" and r.outcome == "ok")
    assert asked == created, "every creation reached the plugin and was answered"
    shared = sum(1 for c in sim.containers.values() if "OPENSHIFT_SHARED_CPUS=0-1" in c.env)
    assert shared == created, "every container was given the shared CPUs"
    runs = max(1, len(timed))
    median = statistics.median(walls) * 1e6 if walls else 0.0
    return Reading(counter, own_cpu / runs / 1e3, plugin_cpu / runs / 1e3, median)


def report(reading: Reading, calls: int, top: int) -> None:
    calls = max(calls, 1)
    total = reading.counter.total()
    print(f"simulator-side bytecodes per asking CreateContainer round trip: {total / calls:,.0f}")
    print(
        f"CPU per round trip: simulator {reading.own_us:.0f} µs, plugin {reading.plugin_us:.0f} µs; "
        f"wall p50 {reading.wall_us:.0f} µs\n"
    )
    print_tables(reading.counter, calls, top, per="round trip")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="round trips traced (20)")
    parser.add_argument("--warm", type=int, default=50, help="untraced round trips before them (50)")
    parser.add_argument("--cpu-calls", type=int, default=300, help="round trips timed after them (300)")
    parser.add_argument("--pods", type=int, default=0, help="pods run first (default: one per creation)")
    parser.add_argument("--top", type=int, default=40, help="functions listed (40)")
    args = parser.parse_args(argv)
    # The simulator's lines (a plugin configured, disconnected) are not the benchmark's output.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    report(measure(args.calls, args.warm, args.cpu_calls, args.pods), args.calls, args.top)


if __name__ == "__main__":
    main()
