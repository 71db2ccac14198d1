"""Where a CreateContainer round trip's time goes, on each side, and what the steps cost alone.

Usage: python bench/profile_create.py [--calls N] [--top N] [--sync]

1. The plugin's process under cProfile during N round trips (bench/profile_child.py, switched on and
   off around the timed loop by signals), the simulator not profiled.
2. The simulator (this process) under cProfile during N round trips, the plugin not profiled.
   For both: time by layer (asyncio loop, epoll, socket calls, ttrpc, mux, stub, policy, cgroup
   files, protobuf, logging, ...) and the top functions by own time. cProfile inflates Python calls
   (every call pays the profiler's hook), so read shares, not absolute numbers.
3. Steps timed alone, without a profiler (perf_counter over many repetitions): protobuf work, the
   plugin's handler for a container that asks and one that does not, the pod cgroup lookup and quota
   read.

With --sync: the plugin's process under cProfile from its start through a Synchronize of 1,000 pods /
5,000 containers, at a first start and at a restart.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import logging
import os
import pstats
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from workload import HERE, PluginProcess, already_shared, fake_node, realistic_container, realistic_pod

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import read_cpu_quota
from nri_plugin.nri.simulator import RuntimeSimulator

_BUILTIN_LAYERS = (
    ("epoll", "epoll_wait (waiting, and waking up)"),
    ("'send", "socket send"),
    ("'recv", "socket recv"),
    ("posix.", "file syscalls (cgroup files, state file)"),
    ("_upb", "protobuf (C)"),
    ("google.protobuf", "protobuf (C)"),
)
_FILE_LAYERS = (
    ("/nri_plugin/ttrpc/", "ttrpc"),
    ("/nri_plugin/nri/mux.py", "mux"),
    ("/nri_plugin/nri/stub.py", "stub"),
    ("/nri_plugin/mixedcpu/plugin.py", "plugin (handlers)"),
    ("/nri_plugin/mixedcpu/policy.py", "policy"),
    ("/nri_plugin/mixedcpu/quota.py", "pod quotas (reconciler)"),
    ("/nri_plugin/mixedcpu/resync.py", "resync (Synchronize's books)"),
    ("/nri_plugin/mixedcpu/books.py", "books"),
    ("/nri_plugin/mixedcpu/store.py", "store (state file)"),
    ("/nri_plugin/mixedcpu/bookkeeper.py", "store (state file)"),
    ("/nri_plugin/nri/simulator.py", "simulator"),
    ("/nri_plugin/nri/events.py", "events"),
    ("/cgroups/", "cgroups (paths, files)"),
    ("/structlog/", "structlog"),
    ("/google/protobuf/", "protobuf (Python)"),
    ("/asyncio/", "asyncio loop"),
    ("selectors.py", "asyncio loop"),
    ("/json/", "json"),
    ("posixpath", "os.path"),
    ("/enum.py", "enum"),
    ("/bench/", "benchmark loop"),
)


def layer(key: tuple[str, int, str]) -> str:
    filename, _, name = key
    if filename == "~":
        for needle, label in _BUILTIN_LAYERS:
            if needle in name:
                return label
        return "other builtins"
    for needle, label in _FILE_LAYERS:
        if needle in filename:
            return label
    return "other Python"


def report(title: str, stats: pstats.Stats, calls: int, top: int, *, per: str = "round trip") -> None:
    """Profiled time by layer and the top functions, per call (µs) or, for one Synchronize, in ms."""
    raw: dict[tuple[str, int, str], Any] = stats.stats  # type: ignore[attr-defined]
    by_layer: dict[str, float] = defaultdict(float)
    for key, (_cc, _nc, own, _cum, _callers) in raw.items():
        by_layer[layer(key)] += own
    total = sum(by_layer.values())
    unit, scale = ("µs", 1e6 / calls) if calls > 1 else ("ms", 1e3)
    print(f"\n## {title}: {total * scale:.0f} {unit} of profiled time per {per}\n")
    print(f"| layer | {unit} per {per} (profiled) | share |")
    print("|---|---|---|")
    for name, seconds in sorted(by_layer.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {seconds * scale:.1f} | {seconds / total:.0%} |")
    print(f"\nTop {top} functions by own time:\n")
    print(f"| function | calls per {per} | own {unit} per {per} |")
    print("|---|---|---|")
    ranked = sorted(raw.items(), key=lambda kv: -kv[1][2])[:top]
    for (filename, line, name), (_cc, nc, own, _cum, _callers) in ranked:
        where = name if filename == "~" else f"{_short(filename)}:{line} {name}"
        print(f"| `{where}` | {nc / calls:.2f} | {own * scale:.1f} |")


def _short(filename: str) -> str:
    for marker in ("/nri_plugin/", "/cgroups/", "/site-packages/", "/lib/python3"):
        if marker in filename:
            return marker.strip("/") + "/" + filename.split(marker, 1)[1]
    return os.path.basename(filename)


async def round_trips(calls: int, *, profile_plugin: bool, profile_simulator: bool) -> pstats.Stats:
    with tempfile.TemporaryDirectory(prefix="nri-profile-") as tmp:
        node = Path(tmp)
        out = str(node / "plugin.prof")
        cgroup_root, state_dir = fake_node(node, 1)
        env = (
            {"BENCH_CHILD": str(HERE / "profile_child.py"), "BENCH_PROFILE_OUT": out}
            if profile_plugin
            else {}
        )
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
                profiler = cProfile.Profile()
                if profile_plugin:
                    os.kill(plugin.pid, signal.SIGUSR1)
                    await asyncio.sleep(0.2)
                if profile_simulator:
                    profiler.enable()
                for container in containers[200:]:
                    await sim.create_container(container)
                    del sim.containers[container.id]
                if profile_simulator:
                    profiler.disable()
                    return pstats.Stats(profiler)
                os.kill(plugin.pid, signal.SIGUSR2)
                return pstats.Stats(await _written(out))
            finally:
                plugin.stop()


async def _written(path: str) -> str:
    """Wait (5 s at most) for the profiled child to have written its stats to `path`."""
    file = Path(path)
    for _ in range(100):
        await asyncio.sleep(0.05)
        if file.exists() and file.stat().st_size > 0:  # noqa: ASYNC240 (a stat; fine in a benchmark)
            await asyncio.sleep(0.1)
            break
    return path


async def synchronize(restart: bool) -> tuple[pstats.Stats, float]:
    """The plugin's process under cProfile from its start through one Synchronize of 1,000 pods /
    5,000 realistic containers (4 MiB messages): a first start, or a restart over what it left."""
    with tempfile.TemporaryDirectory(prefix="nri-profile-") as tmp:
        node = Path(tmp)
        cgroup_root, state_dir = fake_node(node, 1000)
        seconds = 0.0
        for profiled in (False, True) if restart else (True,):
            out = str(node / "plugin.prof")
            env = {"BENCH_CHILD": str(HERE / "profile_child.py"), "BENCH_PROFILE_OUT": out}
            env["BENCH_PROFILE_START"] = "1" if profiled else "0"
            sim = RuntimeSimulator(str(node / "nri.sock"), request_timeout=10.0)
            for n in range(1000):
                pod = realistic_pod(n)
                sim.add_pod(pod)
                for c in range(5):
                    container = realistic_container(pod, n * 5 + c)
                    sim.add_container(already_shared(container) if profiled and restart else container)
            async with sim:
                plugin = PluginProcess(sim.socket_path, cgroup_root, state_dir, **env)
                try:
                    await sim.wait_for_plugins(1, timeout=60)
                    seconds = sim.sync_seconds[-1]
                    if profiled:
                        os.kill(plugin.pid, signal.SIGUSR2)
                        return pstats.Stats(await _written(out)), seconds
                finally:
                    plugin.stop()
    raise AssertionError("unreachable")


def per_call(fn: Callable[[], object], repeat: int = 20000) -> float:
    """Median over 5 runs of the mean µs per call."""
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeat):
            fn()
        runs.append((time.perf_counter() - started) / repeat * 1e6)
    return statistics.median(runs)


def steps() -> None:
    from plugin_child import bench_plugin

    pod = realistic_pod(0)
    containers = [realistic_container(pod, n) for n in range(5)]  # app-0 asks, app-1..4 do not
    request = api.CreateContainerRequest(pod=pod, container=containers[0])
    data = request.SerializeToString()
    rows = [
        (
            f"parse a CreateContainerRequest ({len(data)} bytes)",
            per_call(lambda: api.CreateContainerRequest.FromString(data)),
        ),
        (
            "build a CreateContainerRequest (copies pod and container)",
            per_call(lambda: api.CreateContainerRequest(pod=pod, container=containers[0])),
        ),
        ("serialize it", per_call(request.SerializeToString)),
    ]
    with tempfile.TemporaryDirectory(prefix="nri-profile-") as tmp:
        plugin = bench_plugin(*fake_node(Path(tmp), 1))
        pod_dir = plugin.quotas.pod_dir(pod.linux.cgroup_parent)
        quota_file = os.path.join(pod_dir.fs_path, "cpu.cfs_quota_us")
        period_file = os.path.join(pod_dir.fs_path, "cpu.cfs_period_us")

        def plain_read() -> None:
            for path in (quota_file, period_file):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                os.read(fd, 64)
                os.close(fd)

        rows += [
            (
                "pod cgroup lookup (`PodQuotas.pod_dir`: parse and check cgroup_parent)",
                per_call(lambda: plugin.quotas.pod_dir(pod.linux.cgroup_parent)),
            ),
            (
                "`read_cpu_quota` (2 files, each opened component by component)",
                per_call(lambda: read_cpu_quota(pod_dir)),
            ),
            ("the same 2 files with a plain open/read/close each", per_call(plain_read)),
        ]

        async def handler_costs() -> None:
            def create(container: api.Container) -> None:
                coro = plugin.create_container(pod, container)
                try:
                    coro.send(None)
                except StopIteration:
                    return
                raise AssertionError("the handler suspended")

            create(containers[0])  # the first one raises the pod quota (a write and a state save)
            rows.append(
                (
                    "handler, container that asks (pod quota read, no write)",
                    per_call(lambda: create(containers[0]), 5000),
                )
            )
            rows.append(
                ("handler, container that does not ask", per_call(lambda: create(containers[1]), 5000))
            )

        asyncio.run(handler_costs())
    print("\n## Steps timed alone (no profiler)\n")
    print("| step | µs per call |")
    print("|---|---|")
    for label, us in rows:
        print(f"| {label} | {us:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument(
        "--sync", action="store_true", help="profile the plugin through a Synchronize instead"
    )
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    if args.sync:
        for restart in (False, True):
            stats, seconds = asyncio.run(synchronize(restart))
            what = "plugin restart" if restart else "first start"
            title = f"Plugin process through Synchronize ({what}; {seconds * 1e3:.0f} ms under the profiler)"
            report(title, stats, 1, args.top, per="Synchronize")
        return
    plugin_stats = asyncio.run(round_trips(args.calls, profile_plugin=True, profile_simulator=False))
    report("Plugin process", plugin_stats, args.calls, args.top)
    sim_stats = asyncio.run(round_trips(args.calls, profile_plugin=False, profile_simulator=True))
    report("Simulator", sim_stats, args.calls, args.top)
    steps()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
