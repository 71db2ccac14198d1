"""What proposed changes would save per CreateContainer round trip: measured, not guessed.

Usage: python bench/experiments.py [--calls N] [--rounds N] [--only NAME,...] [--sync | --asking]

Each variant runs the round-trip benchmark of run_all.py (the simulator here, the plugin in a child
process) with one change: the plugin's event loop (uvloop), a glibc tunable, production logging, or a
change to the core code patched in by bench/experiment_child.py. The variants run interleaved, round
after round, and the table shows medians over the rounds, so that the machine's noise hits them all
alike. With --asking the round trips are asking creations, each the first or second container of a
new pod (run_all.py's fill), and the pods are all made before the timed creations.

The ``spinners`` variant runs one busy loop per CPU at the lowest priority (nice 19) during its
round trips: they yield to the plugin and the simulator at once, but keep the (virtual) CPUs from
going idle between requests. On a KVM guest an idle vCPU halts, and a process woken on it finds cold
caches: the same work then costs it far more CPU (``asking_create.py --idle-us``), a cost of the
machine, not of the code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import structlog
from workload import (
    HERE,
    PluginProcess,
    already_shared,
    fake_node,
    percentile,
    realistic_container,
    realistic_pod,
)

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.nri.simulator import RuntimeSimulator

PATCHED = str(HERE / "experiment_child.py")
VARIANTS: dict[str, tuple[str, dict[str, str], bool]] = {
    # name: (what, the plugin's environment, simulator on uvloop)
    "baseline": ("as run_all.py measures it", {}, False),
    "uvloop": ("the plugin on uvloop", {"BENCH_UVLOOP": "1"}, False),
    "mmap-threshold": (
        "the plugin with GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1048576",
        {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"},
        False,
    ),
    "recv64k": (
        "the plugin's socket reads 64 KiB at most (no mmap per read)",
        {"BENCH_PATCH": "recv64k"},
        False,
    ),
    "podcache": ("pod cgroup lookup memoized", {"BENCH_PATCH": "podcache"}, False),
    "plainread": ("pod quota read with one open() per file", {"BENCH_PATCH": "plainread"}, False),
    "logcache": ("structlog cache_logger_on_first_use", {"BENCH_PATCH": "logcache"}, False),
    "fastcheck": ("cgroup path components checked by one regex match", {"BENCH_PATCH": "fastcheck"}, False),
    "all-plugin": (
        "recv64k + podcache + plainread + logcache + fastcheck, on uvloop",
        {"BENCH_PATCH": "recv64k,podcache,plainread,logcache,fastcheck", "BENCH_UVLOOP": "1"},
        False,
    ),
    "info-logs": ("production logging: info level, JSON, to /dev/null", {"BENCH_LOG": "info"}, False),
    "sim-uvloop": ("the simulator on uvloop (the runtime side cheaper)", {}, True),
    "gc-off": ("no garbage collection, in the plugin or the simulator", {"BENCH_GC": "off"}, False),
    "both-uvloop": ("both on uvloop", {"BENCH_UVLOOP": "1"}, True),
    "no-metrics": ("the plugin without the daemon's metrics observer", {"BENCH_METRICS": "off"}, False),
    "spinners": ("nice-19 busy loops keep the CPUs from going idle", {"BENCH_SPINNERS": "1"}, False),
}


ASKING = ("app-0", "app-1")  # the fill's asking containers, two per pod


async def one_run(calls: int, env: dict[str, str], asking: bool = False) -> tuple[float, float, float, float]:
    if "BENCH_PATCH" in env:
        env = {**env, "BENCH_CHILD": PATCHED}
    if asking:
        return await asking_run(calls, env)
    with tempfile.TemporaryDirectory(prefix="nri-exp-") as tmp:
        node = Path(tmp)
        cgroup_root, state_dir = fake_node(node, 1)
        async with RuntimeSimulator(str(node / "nri.sock")) as sim:
            plugin = PluginProcess(sim.socket_path, cgroup_root, state_dir, **env)
            try:
                await sim.wait_for_plugins(1, timeout=30)
                pod = realistic_pod(0)
                await sim.run_pod_sandbox(pod)
                containers = [
                    realistic_container(pod, n, state=api.CONTAINER_UNKNOWN) for n in range(calls + 200)
                ]
                for container in containers[:200]:
                    await sim.create_container(container)
                    del sim.containers[container.id]
                samples = []
                plugin_cpu, own_cpu = plugin.cpu_ns(), time.process_time_ns()
                for container in containers[200:]:
                    started = time.perf_counter()
                    await sim.create_container(container)
                    samples.append(time.perf_counter() - started)
                    del sim.containers[container.id]
                plugin_cpu, own_cpu = plugin.cpu_ns() - plugin_cpu, time.process_time_ns() - own_cpu
            finally:
                plugin.stop()
    us = [s * 1e6 for s in samples]
    return statistics.median(us), percentile(us, 0.99), plugin_cpu / calls / 1e3, own_cpu / calls / 1e3


async def asking_run(calls: int, env: dict[str, str]) -> tuple[float, float, float, float]:
    """`calls` asking creations into an empty node, two per new pod (the pods made first, untimed)."""
    pods = (calls + len(ASKING) - 1) // len(ASKING)
    with tempfile.TemporaryDirectory(prefix="nri-exp-") as tmp:
        node = Path(tmp)
        cgroup_root, state_dir = fake_node(node, pods)
        async with RuntimeSimulator(str(node / "nri.sock")) as sim:
            plugin = PluginProcess(sim.socket_path, cgroup_root, state_dir, **env)
            try:
                await sim.wait_for_plugins(1, timeout=30)
                containers = []
                for p in range(pods):
                    pod = realistic_pod(p, asking=ASKING)
                    await sim.run_pod_sandbox(pod)
                    containers += [
                        realistic_container(pod, p * 5 + c, state=api.CONTAINER_UNKNOWN)
                        for c in range(len(ASKING))
                    ]
                samples = []
                plugin_cpu, own_cpu = plugin.cpu_ns(), time.process_time_ns()
                for container in containers[:calls]:
                    started = time.perf_counter()
                    await sim.create_container(container)
                    samples.append(time.perf_counter() - started)
                plugin_cpu, own_cpu = plugin.cpu_ns() - plugin_cpu, time.process_time_ns() - own_cpu
            finally:
                plugin.stop()
    us = [s * 1e6 for s in samples]
    return statistics.median(us), percentile(us, 0.99), plugin_cpu / calls / 1e3, own_cpu / calls / 1e3


SYNC_VARIANTS: dict[str, dict[str, str]] = {
    "baseline": {},
    "fastcheck": {"BENCH_PATCH": "fastcheck"},
    "trim": {"BENCH_PATCH": "trim"},
    "uvloop": {"BENCH_UVLOOP": "1"},
}


async def sync_run(env: dict[str, str]) -> list[float]:
    """First start, then restart, over 1,000 pods / 5,000 realistic containers (4 MiB messages):
    for each, the Synchronize's duration (ms), the plugin's RSS right after it and 0.5 s later (MiB)."""
    if "BENCH_PATCH" in env:
        env = {**env, "BENCH_CHILD": PATCHED}
    found: list[float] = []
    with tempfile.TemporaryDirectory(prefix="nri-exp-") as tmp:
        node = Path(tmp)
        cgroup_root, state_dir = fake_node(node, 1000)
        for restart in (False, True):
            sim = RuntimeSimulator(str(node / "nri.sock"), request_timeout=10.0)
            for n in range(1000):
                pod = realistic_pod(n)
                sim.add_pod(pod)
                for c in range(5):
                    container = realistic_container(pod, n * 5 + c)
                    sim.add_container(already_shared(container) if restart else container)
            async with sim:
                plugin = PluginProcess(sim.socket_path, cgroup_root, state_dir, **env)
                try:
                    await sim.wait_for_plugins(1, timeout=60)
                    right_after = plugin.rss_mib()
                    await asyncio.sleep(0.5)
                    found += [sim.sync_seconds[-1] * 1e3, right_after, plugin.rss_mib()]
                finally:
                    plugin.stop()
    return found


def sync_experiments(rounds: int) -> None:
    results: dict[str, list[list[float]]] = {name: [] for name in SYNC_VARIANTS}
    for _ in range(rounds):
        for name, env in SYNC_VARIANTS.items():
            results[name].append(asyncio.run(sync_run(env)))
    print(
        "Synchronize of 1,000 pods / 5,000 realistic containers, 4 MiB messages; "
        f"medians of {rounds} rounds.\n"
    )
    print("| variant | first start | RSS after, +0.5 s | restart | RSS after, +0.5 s |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        m = [statistics.median(r[i] for r in runs) for i in range(6)]
        print(
            f"| {name} | {m[0]:.0f} ms | {m[1]:.1f} MiB, {m[2]:.1f} MiB | {m[3]:.0f} ms "
            f"| {m[4]:.1f} MiB, {m[5]:.1f} MiB |"
        )


@contextlib.contextmanager
def spinners(wanted: bool) -> Iterator[None]:
    """One lowest-priority busy loop per CPU while the block runs (when `wanted`)."""
    procs = []
    if wanted:
        spin = ["nice", "-n", "19", sys.executable, "-c", "while True: pass"]
        procs = [subprocess.Popen(spin) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def run_variant(
    calls: int, env: dict[str, str], sim_uvloop: bool, asking: bool
) -> tuple[float, float, float, float]:
    collecting = env.get("BENCH_GC") != "off"  # off: in the simulator too
    if not collecting:
        gc.disable()
    try:
        with spinners(env.get("BENCH_SPINNERS") == "1"):
            if sim_uvloop:
                import uvloop

                result: tuple[float, float, float, float] = uvloop.run(one_run(calls, env, asking))
                return result
            return asyncio.run(one_run(calls, env, asking))
    finally:
        if not collecting:
            gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated variant names (baseline is always run)")
    parser.add_argument("--sync", action="store_true", help="Synchronize variants instead of round trips")
    parser.add_argument("--asking", action="store_true", help="asking creations, two per new pod")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    if args.sync:
        sync_experiments(args.rounds)
        return
    names = list(VARIANTS)
    if args.only:
        names = ["baseline", *(n for n in args.only.split(",") if n in VARIANTS and n != "baseline")]
    results: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            _, env, sim_uvloop = VARIANTS[name]
            results[name].append(run_variant(args.calls, env, sim_uvloop, args.asking))
    base = [statistics.median(r[i] for r in results["baseline"]) for i in range(4)]
    print(f"{args.rounds} rounds of {args.calls} round trips per variant; medians over the rounds.\n")
    print("| variant | p50 | Δ p50 | p99 | plugin CPU / call | Δ plugin CPU | simulator CPU / call |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        what = VARIANTS[name][0]
        p50, p99, plugin_cpu, sim_cpu = (statistics.median(r[i] for r in results[name]) for i in range(4))
        print(
            f"| {name}: {what} | {p50:.0f} µs | {p50 - base[0]:+.0f} µs | {p99:.0f} µs | {plugin_cpu:.0f} µs "
            f"| {plugin_cpu - base[2]:+.0f} µs | {sim_cpu:.0f} µs |"
        )


if __name__ == "__main__":
    main()
