"""All NRI benchmarks in one run; prints a markdown table with each number next to its target.

Usage: python bench/run_all.py [--quick] [--repeat N] [--calls N] [--sync-only]

The runtime simulator (nri_plugin/nri/simulator.py) runs in this process; the plugin, the stub with the real
mixed-CPU policy, runs in a child process (bench/plugin_child.py) on a fake cgroup v1 node, so each side
has its own interpreter as on a node, with a unix socket between them. Each round starts a fresh plugin
and measures, in order:

* start → registered + synchronized: from spawning the plugin's process to the end of its (empty)
  Synchronize, interpreter start-up and imports included;
* idle RSS (VmRSS of the plugin's process, after a second of idling);
* a burst of 200 container creations issued at once (40 new pods, 5 containers each, one in five asks
  for shared CPUs, so 40 pod quotas are raised and 40 state-file saves happen), twice:
  - through the simulator's `create_container`, which, like containerd/nri's `Adaptation`, holds one
    lock across a whole event: the 200 calls queue and reach the plugin one at a time. Latency is
    counted from the burst's start to each creation's answer, queueing included;
  - pipelined: 200 CreateContainer requests sent at once on the plugin's connection, none waiting for
    another (the plugin's worst case; no NRI runtime does this today). Each request's 2 s budget starts
    when it is sent, so the max latency is compared with that budget directly;
* RSS after the bursts;
* CreateContainer round trips, one at a time (after 200 unmeasured ones): p50, p99, max, and the CPU
  time each side spent per call (the plugin's from /proc/<pid>/task/*/schedstat);
* RSS after all those creations;
* Synchronize of 1,000 pods / 5,000 containers (one container in five asks for shared CPUs) to a freshly
  started plugin: a first start (the asking containers not shared yet: updates to send, pod quotas to
  raise), then restarts over the node it left (books on disk, containers already shared) with lean
  objects in one message and realistic ones (labels, annotations, mounts, env; they do not fit in one
  4 MiB ttrpc message) at the 4 MiB limit and in 1 MiB messages; after the last, the burst of 200
  through the runtime's lock again, onto a plugin whose books hold those 1,000 pods. Each is timed
  from its first message sent to the plugin's last reply, the messages built beforehand (the
  simulator's building is shown beside it, with the plugin's CPU time); then the plugin's peak RSS
  during a Synchronize (VmHWM), and the largest RSS right after one and half a second later;
* the fill: 1,000 pods run, then their 2,000 asking containers created one after the other (each the
  first or second of its pod) into an empty node: the asking round trip's p50 and p99, the CPU time
  each side spent per creation, the first creations against the last, the bytes written to the
  state directory;
* the floor under those round trips: a bare request and reply between two asyncio processes
  (bench/echo_floor.py);
* the plugin's own processing per CreateContainer in this process, bytes in to bytes out, with no
  socket or peer;
* the reconciler's whole pass over books holding 1,000 shared pods with nothing to heal, in this
  process (bench/heal_pass.py; it also runs on the real kernel's cgroup v1 tree with --kernel).

The plugin's process imports what it would in its image (``pip install .``): the development venv's
packages a dependency picks up only when present (rich and pygments for structlog.dev, ~4 MiB of
RSS) are refused (bench/image_imports.py); with BENCH_DEV_PACKAGES=1 in the environment they are
let in, to see the venv's figures.

With --repeat N (default 3) each row shows the median of the N rounds and, in brackets, their range
(a count shows its worst round); "met?" judges the median. A burst "meets" its target when all are
answered and the max is at most 0.2 s, a tenth of the 2 s budget. --quick runs a small smoke version
(300 round trips, 200 pods, one round) in a few seconds. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from asking_create import answered, kernel_available, plugin_behind_trunk
from asking_create import fake_tree_cost as asking_fake_tree_cost
from asking_create import kernel_cost as asking_kernel_cost
from echo_floor import measure as echo_measure
from google.protobuf.internal import api_implementation
from heal_pass import on_fake_tree
from workload import (
    CONTAINERS_PER_POD,
    PluginProcess,
    already_shared,
    fake_node,
    lean_container,
    lean_pod,
    percentile,
    realistic_container,
    realistic_pod,
)

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.nri import mux
from nri_plugin.nri.simulator import RuntimeSimulator
from nri_plugin.nri.stub import PLUGIN_SERVICE
from nri_plugin.ttrpc.protocol import ClientSession

MB = 1_000_000 / (1 << 20)  # one MB in MiB
RSS_TARGET = "≤ 50 MB (47.7 MiB)"
BURST_MAX_OK_MS = 200.0  # "well under the 2 s budget": a tenth of it


def rss_ok(mib: float) -> bool:
    return mib <= 50 * MB


def _show(value: float, unit: str) -> str:
    if unit == "µs":
        return f"{value:.0f} µs"
    if unit == "ms":
        return f"{value:.1f} ms" if value < 10 else f"{value:.0f} ms"
    if unit.startswith("/"):  # a count out of a total: "200/200"
        return f"{value:.0f}{unit}"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "B":
        return f"{value:.0f} B"
    return f"{value:.1f} {unit}"


@dataclass
class Measure:
    """One row of the table: one or more named values (parts), a sample of each per round, and how
    to judge them. Each part shows the median of the rounds and, with several rounds, their range;
    a count out of a total (unit "/N") shows its worst round instead."""

    label: str
    units: dict[str, str]  # part name ("" for a row's only value) -> unit: µs, ms, MiB, /N
    target: str
    ok: Callable[[dict[str, float]], bool] | None = None
    section: float = 0  # rows are shown by section, then in the order they were first added
    samples: list[dict[str, float]] = field(default_factory=list)

    def values(self) -> dict[str, float]:
        found = {}
        for name, unit in self.units.items():
            column = [sample[name] for sample in self.samples]
            found[name] = min(column) if unit.startswith("/") else statistics.median(column)
        return found

    def cells(self) -> tuple[str, str, str, str]:
        values = self.values()
        shown = []
        for name, unit in self.units.items():
            text = _show(values[name], unit)
            column = [sample[name] for sample in self.samples]
            if len(column) > 1 and not unit.startswith("/"):
                text += f" ({_show(min(column), unit).split()[0]}-{_show(max(column), unit)})"
            shown.append(f"{name} {text}" if name else text)
        met = "—" if self.ok is None else ("yes" if self.ok(values) else "**no**")
        return self.label, ", ".join(shown), self.target, met


class Table:
    def __init__(self) -> None:
        self.rows: dict[str, Measure] = {}

    def add(
        self,
        label: str,
        value: float,
        unit: str,
        target: str = "—",
        ok: Callable[[float], bool] | None = None,
        *,
        section: float = 0,
    ) -> None:
        """A row with one value."""
        check = None if ok is None else (lambda values: ok(values[""]))
        self.add_parts(label, {"": (value, unit)}, target, check, section=section)

    def add_parts(
        self,
        label: str,
        parts: dict[str, tuple[float, str]],
        target: str = "—",
        ok: Callable[[dict[str, float]], bool] | None = None,
        *,
        section: float = 0,
    ) -> None:
        """A row with several named values, e.g. ``{"max": (98.0, "ms"), ...}``."""
        units = {name: unit for name, (_, unit) in parts.items()}
        row = self.rows.setdefault(label, Measure(label, units, target, ok, section))
        row.samples.append({name: value for name, (value, _) in parts.items()})

    def markdown(self) -> str:
        lines = ["| measure | result | target | met? |", "|---|---|---|---|"]
        rows = sorted(self.rows.values(), key=lambda row: row.section)  # stable: insertion order kept
        lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
        return "\n".join(lines)


@dataclass(frozen=True)
class Settings:
    calls: int
    burst: int
    sync_pods: int
    idle_seconds: float
    repeat: int
    fill_pods: int
    kernel: bool  # the in-process asking creation on the real kernel's v1 cgroupfs too
    sync_only: bool = False  # the Synchronize rows alone


# -- one round: a plugin serving creations ------------------------------------------------------------


async def creations_round(table: Table, settings: Settings, node: Path) -> None:
    socket_path = str(node / "nri.sock")
    burst_pods = settings.burst // CONTAINERS_PER_POD
    cgroup_root, state_dir = fake_node(node, max(settings.sync_pods, 1 + 2 * burst_pods))
    async with RuntimeSimulator(socket_path) as sim:
        plugin = PluginProcess(socket_path, cgroup_root, state_dir)
        try:
            await sim.wait_for_plugins(1, timeout=30)
            registered = time.perf_counter() - plugin.started
            table.add(
                "start → registered + synchronized", registered * 1e3, "ms", "≤ 1 s", lambda v: v <= 1e3
            )
            await asyncio.sleep(settings.idle_seconds)
            table.add("idle plugin RSS", plugin.rss_mib(), "MiB", RSS_TARGET, rss_ok)
            await burst_through_runtime(table, sim, settings.burst, first_pod=1)
            await burst_pipelined(table, sim, settings.burst, first_pod=1 + burst_pods)
            table.add("plugin RSS after the bursts", plugin.rss_mib(), "MiB", RSS_TARGET, rss_ok, section=1.5)
            await round_trips(table, sim, plugin, settings.calls)
            table.add(
                f"plugin RSS after {settings.calls + 200 + 2 * settings.burst:,} creations",
                plugin.rss_mib(),
                "MiB",
                RSS_TARGET,
                rss_ok,
                section=2.5,
            )
        finally:
            plugin.stop()


async def burst_through_runtime(
    table: Table, sim: RuntimeSimulator, count: int, first_pod: int, how: str = "through the runtime's lock"
) -> None:
    """`count` creations at once through the simulator, which serializes them as containerd/nri does."""
    containers = await _burst_containers(sim, count, first_pod)
    finished: list[float] = []
    answered = 0

    async def create(container: api.Container) -> None:
        nonlocal answered
        await sim.create_container(container)
        finished.append(time.perf_counter())
        answered += 1

    started = time.perf_counter()
    results = await asyncio.gather(*(create(c) for c in containers), return_exceptions=True)
    total = time.perf_counter() - started
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        print(f"burst: {len(errors)} creation(s) failed, first: {errors[0]!r}", file=sys.stderr)
    _burst_rows(table, how, [t - started for t in finished], answered, count, total)


async def burst_pipelined(table: Table, sim: RuntimeSimulator, count: int, first_pod: int) -> None:
    """`count` CreateContainer requests in flight at once on the plugin's connection."""
    containers = await _burst_containers(sim, count, first_pod)
    connection = sim.plugins[0]
    finished: list[float] = []
    answered = 0

    async def create(container: api.Container) -> None:
        nonlocal answered
        request = api.CreateContainerRequest(pod=sim.pods[container.pod_sandbox_id], container=container)
        await connection.client.call(
            PLUGIN_SERVICE,
            "CreateContainer",
            request,
            api.CreateContainerResponse,
            timeout=sim.request_timeout,
        )
        finished.append(time.perf_counter())
        answered += 1

    started = time.perf_counter()
    results = await asyncio.gather(*(create(c) for c in containers), return_exceptions=True)
    total = time.perf_counter() - started
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        print(f"pipelined burst: {len(errors)} request(s) failed, first: {errors[0]!r}", file=sys.stderr)
    _burst_rows(table, "pipelined, all in flight", [t - started for t in finished], answered, count, total)


async def _burst_containers(sim: RuntimeSimulator, count: int, first_pod: int) -> list[api.Container]:
    containers = []
    for i in range(count):
        p = first_pod + i // CONTAINERS_PER_POD
        if i % CONTAINERS_PER_POD == 0:
            await sim.run_pod_sandbox(realistic_pod(p))
        n = p * CONTAINERS_PER_POD + i % CONTAINERS_PER_POD
        containers.append(realistic_container(sim.pods[f"{p:064x}"], n, state=api.CONTAINER_UNKNOWN))
    return containers


def _burst_rows(
    table: Table, how: str, latencies: list[float], answered: int, count: int, total: float
) -> None:
    ms = [s * 1e3 for s in latencies] or [float("inf")]
    table.add_parts(
        f"burst of {count} creations, {how}",
        {
            "answered": (answered, f"/{count}"),
            "max": (max(ms), "ms"),
            "p99": (percentile(ms, 0.99), "ms"),
            "all done in": (total * 1e3, "ms"),
        },
        f"all answered, max ≪ 2 s (≤ {BURST_MAX_OK_MS / 1e3:g} s)",
        lambda v: v["answered"] == count and v["max"] <= BURST_MAX_OK_MS,
        section=1,
    )


async def round_trips(table: Table, sim: RuntimeSimulator, plugin: PluginProcess, calls: int) -> None:
    """CreateContainer round trips one after the other: 200 to warm up, then `calls` timed ones."""
    pod = realistic_pod(0)
    await sim.run_pod_sandbox(pod)
    # Built beforehand so that the simulator's CPU time below is its own. Ids apart from the bursts'.
    containers = [
        realistic_container(pod, 1_000_000 + n, state=api.CONTAINER_UNKNOWN) for n in range(calls + 200)
    ]
    for container in containers[:200]:
        await sim.create_container(container)
        del sim.containers[container.id]
    samples: list[float] = []
    gc.collect()
    plugin_cpu, own_cpu, wall = plugin.cpu_ns(), time.process_time_ns(), time.perf_counter()
    for container in containers[200:]:
        started = time.perf_counter()
        await sim.create_container(container)
        samples.append(time.perf_counter() - started)
        del sim.containers[container.id]
    wall = time.perf_counter() - wall
    plugin_cpu, own_cpu = plugin.cpu_ns() - plugin_cpu, time.process_time_ns() - own_cpu
    us = [s * 1e6 for s in samples]
    table.add(
        f"CreateContainer round trip p50 ({calls:,} calls)",
        statistics.median(us),
        "µs",
        "≤ 150 µs",
        lambda v: v <= 150,
        section=2,
    )
    table.add(
        "CreateContainer round trip p99", percentile(us, 0.99), "µs", "≤ 1 ms", lambda v: v <= 1000, section=2
    )
    table.add(
        "CreateContainer round trip max", max(us) / 1e3, "ms", "< 2 s budget", lambda v: v < 2000, section=2
    )
    table.add_parts(
        "  where a round trip's time goes (means)",
        {
            "wall": (wall / calls * 1e6, "µs"),
            "plugin CPU": (plugin_cpu / calls / 1e3, "µs"),
            "simulator CPU": (own_cpu / calls / 1e3, "µs"),
        },
        section=2,
    )


# -- Synchronize --------------------------------------------------------------------------------------


@dataclass
class _SyncReading:
    """The plugin process around one Synchronize: its CPU time and peak RSS from the first message."""

    plugin: PluginProcess | None = None
    cpu_at_start: int = 0

    def start(self) -> None:
        """The simulator built its messages and is about to send the first (`on_sync_start`)."""
        assert self.plugin is not None
        self.plugin.reset_peak_rss()
        self.cpu_at_start = self.plugin.cpu_ns()


async def synchronize_round(table: Table, settings: Settings, node: Path) -> None:
    """A plugin (re)started on a node with the pods and containers: first a first start, where the
    containers that ask are not shared yet (1 in 5: cpusets and quotas to update, every pod quota
    to raise), then restarts of the plugin over the node as that first one left it (books on disk, pod
    quotas raised, containers already shared), with objects of three sizes and two message limits.

    Each is timed from the first message's serialization and write to the plugin's last reply, its
    messages built beforehand (as a runtime does: a Go runtime builds them in a few ms, this Python
    simulator in tens, which is no cost of the plugin's; that building is its own row). The plugin's
    CPU time (schedstat) and peak RSS (VmHWM, reset as the first message goes out) count from there
    to its reply."""
    pods, containers = settings.sync_pods, settings.sync_pods * CONTAINERS_PER_POD
    what = f"Synchronize {pods:,} pods / {containers:,} containers"
    made_shared = f"first start ({pods:,} containers made shared)"
    variants = (
        (made_shared, realistic_pod, realistic_container, 4 << 20),
        ("plugin restart, lean objects", lean_pod, _shared(lean_container), 4 << 20),
        ("plugin restart", realistic_pod, _shared(realistic_container), 4 << 20),
        ("plugin restart", realistic_pod, _shared(realistic_container), 1 << 20),
    )
    cgroup_root, state_dir = fake_node(node, pods + settings.burst // CONTAINERS_PER_POD)
    peak_rss = largest_rss = settled_rss = 0.0
    for label, make_pod, make_container, limit in variants:
        sim = RuntimeSimulator(str(node / "nri.sock"), max_message_size=limit, request_timeout=10.0)
        for n in range(pods):
            pod = make_pod(n)
            sim.add_pod(pod)
            for c in range(CONTAINERS_PER_POD):
                sim.add_container(make_container(pod, n * CONTAINERS_PER_POD + c))
        size = api.SynchronizeRequest(pods=sim.pods.values(), containers=sim.containers.values()).ByteSize()
        reading = _SyncReading()
        sim.on_sync_start = reading.start
        async with sim:
            plugin = reading.plugin = PluginProcess(sim.socket_path, cgroup_root, state_dir)
            try:
                await sim.wait_for_plugins(1, timeout=60)
                cpu_ms = (plugin.cpu_ns() - reading.cpu_at_start) / 1e6
                peak_rss = max(peak_rss, plugin.peak_rss_mib())
                largest_rss = max(largest_rss, plugin.rss_mib())
                await asyncio.sleep(0.5)  # what the plugin keeps once the Synchronize is over
                settled_rss = max(settled_rss, plugin.rss_mib())
                if limit == 1 << 20:  # the last one: a burst onto a node full of shared pods
                    how = f"through the runtime's lock, onto {pods:,} shared pods (after that Synchronize)"
                    await burst_through_runtime(table, sim, settings.burst, pods, how)
            finally:
                plugin.stop()
        messages = len(sim.sync_chunks)
        plural = "s" if messages > 1 else ""
        table.add_parts(
            f"{what}, {label}: {size / 1e6:.1f} MB in {messages} message{plural} of ≤ {limit >> 20} MiB",
            {
                "": (sim.sync_seconds[-1] * 1e3, "ms"),
                "plugin CPU": (cpu_ms, "ms"),
                "messages built before": (sim.sync_build_seconds[-1] * 1e3, "ms"),
            },
            "≤ 150 ms",
            lambda values: values[""] <= 150,
            section=3,
        )
    table.add(
        f"plugin peak RSS during Synchronize of {containers:,} containers (VmHWM, largest)",
        peak_rss,
        "MiB",
        RSS_TARGET,
        rss_ok,
        section=3.5,
    )
    table.add(
        f"plugin RSS right after Synchronize of {containers:,} containers (largest)",
        largest_rss,
        "MiB",
        RSS_TARGET,
        rss_ok,
        section=3.5,
    )
    table.add(
        f"plugin RSS 0.5 s after Synchronize of {containers:,} containers (largest)",
        settled_rss,
        "MiB",
        RSS_TARGET,
        rss_ok,
        section=3.5,
    )


def _shared(
    make: Callable[[api.PodSandbox, int], api.Container],
) -> Callable[[api.PodSandbox, int], api.Container]:
    return lambda pod, n: already_shared(make(pod, n))


# -- the plugin's own processing, in this process -----------------------------------------------------


async def plugin_processing(table: Table, calls: int, node: Path) -> None:
    """The plugin's work per CreateContainer, bytes in to bytes out, with no socket or peer."""
    from plugin_child import bench_plugin

    trunk, transport = plugin_behind_trunk(bench_plugin(*fake_node(node, 1)))
    pod = realistic_pod(0)
    session = ClientSession()
    frames = []
    for n in range(calls):
        request = api.CreateContainerRequest(pod=pod, container=realistic_container(pod, n))
        _, message = session.send_request(
            PLUGIN_SERVICE, "CreateContainer", request.SerializeToString(), timeout_nano=2_000_000_000
        )
        frames.append(b"".join(mux.encode(mux.PLUGIN_SERVICE_CONN, message)))
    started = time.perf_counter()
    for frame in frames:
        await answered(trunk, transport, frame)
    elapsed = time.perf_counter() - started
    assert transport.written == calls, "every request must be answered"
    table.add(
        "  plugin's own processing per CreateContainer (in-process, no socket)",
        elapsed / calls * 1e6,
        "µs",
        section=2,
    )


# -- a node filling up ---------------------------------------------------------------------------------------

FILL_ASKING = ("app-0", "app-1")  # per pod: two containers that ask
FILL_WINDOW = 200  # creations compared at each end of the fill


async def fill_round(table: Table, settings: Settings, node: Path) -> None:
    """`fill_pods` pods, each with two containers that ask, created one after the other through the
    runtime into an empty node: the round trip of each asking creation, the first ones (an empty
    node) against the last ones (a node holding all the others), where each round trip's CPU time
    goes (the plugin's process, the simulator's), and the bytes the plugin wrote to its state
    directory over the fill. The pods are run first (RunPodSandbox changes nothing in the plugin's
    books: the node fills with the creations), so that the CPU times are the creations' alone."""
    pods = settings.fill_pods
    cgroup_root, state_dir = fake_node(node, pods)
    stats = node / "plugin-stats.json"
    async with RuntimeSimulator(str(node / "nri.sock")) as sim:
        plugin = PluginProcess(sim.socket_path, cgroup_root, state_dir, BENCH_STATS=str(stats))
        try:
            await sim.wait_for_plugins(1, timeout=30)
            written = await plugin.state_bytes(stats)
            containers = []
            for p in range(pods):
                pod = realistic_pod(p, asking=FILL_ASKING)
                await sim.run_pod_sandbox(pod)
                containers += [
                    realistic_container(pod, p * CONTAINERS_PER_POD + c, state=api.CONTAINER_UNKNOWN)
                    for c in range(len(FILL_ASKING))
                ]
            latencies = []
            plugin_cpu, own_cpu = plugin.cpu_ns(), time.process_time_ns()
            for container in containers:
                started = time.perf_counter()
                await sim.create_container(container)
                latencies.append(time.perf_counter() - started)
            plugin_cpu, own_cpu = plugin.cpu_ns() - plugin_cpu, time.process_time_ns() - own_cpu
            written = await plugin.state_bytes(stats) - written
        finally:
            plugin.stop()
    creations = len(latencies)
    split = (plugin_cpu / creations / 1e3, own_cpu / creations / 1e3)
    _fill_rows(table, [s * 1e6 for s in latencies], split, written, pods)


def _fill_rows(table: Table, us: list[float], split: tuple[float, float], written: int, pods: int) -> None:
    creations = len(us)
    table.add(
        f"asking CreateContainer round trip p50 ({creations:,}, filling a node)",
        statistics.median(us),
        "µs",
        "≤ 150 µs",
        lambda v: v <= 150,
        section=2.1,
    )
    table.add(
        "asking CreateContainer round trip p99",
        percentile(us, 0.99),
        "µs",
        "≤ 500 µs",
        lambda v: v <= 500,
        section=2.1,
    )
    table.add_parts(
        "  where an asking round trip's time goes (means)",
        {
            "wall": (statistics.fmean(us), "µs"),
            "plugin CPU": (split[0], "µs"),
            "simulator CPU": (split[1], "µs"),
        },
        section=2.1,
    )
    window = min(FILL_WINDOW, creations // 2)
    first, last = statistics.median(us[:window]), statistics.median(us[-window:])
    table.add_parts(
        f"creation into an empty node vs one holding {creations - window:,} shared containers in "
        f"{pods:,} pods (medians of {window})",
        {"first": (first, "µs"), "last": (last, "µs"), "ratio": (last / first, "x")},
        "ratio ≤ 1.2",
        lambda v: v["ratio"] <= 1.2,
        section=2.1,
    )
    table.add(
        "bytes written to the state directory per creation, over that fill",
        written / creations,
        "B",
        "≤ 1 KiB",
        lambda v: v <= 1024,
        section=2.1,
    )


async def echo_floor(table: Table, calls: int) -> None:
    """The floor under any round trip here: a bare request of a CreateContainer's size and a short
    reply between two processes each on asyncio's event loop, with no ttrpc, mux or NRI
    (bench/echo_floor.py, which also compares blocking sockets and uvloop)."""
    p50, p99, server_cpu = await asyncio.to_thread(echo_measure, "asyncio", "asyncio", calls)
    table.add_parts(
        "  floor: a bare 1,950-byte request and 100-byte reply, asyncio to asyncio, no ttrpc or NRI",
        {"p50": (p50, "µs"), "p99": (p99, "µs"), "server CPU": (server_cpu, "µs")},
        section=2.1,
    )


async def asking_processing(table: Table, settings: Settings, node: Path) -> None:
    """The plugin's own CPU time per asking CreateContainer, first of its pod, in this process: on the
    fake tree, and (full runs, as root on cgroup v1) on the real kernel's cgroupfs."""
    calls = settings.fill_pods
    cost = await asking_fake_tree_cost(node / "asking", calls)
    table.add(
        "  plugin's own CPU per asking CreateContainer, first of its pod, until its reply"
        " (in-process, fake v1 tree)",
        cost.before_reply * 1e6,
        "µs",
        "≤ 40 µs",
        lambda v: v <= 40,
        section=2.2,
    )
    table.add(
        "  the same: its 'shared CPUs given' info line, written after the reply",
        cost.after_reply * 1e6,
        "µs",
        section=2.2,
    )
    if settings.kernel and kernel_available():
        cost = await asking_kernel_cost(node / "asking-kernel", calls)
        table.add(
            "  plugin's own CPU per asking CreateContainer until its reply (in-process, v1 cgroupfs)",
            cost.before_reply * 1e6,
            "µs",
            section=2.2,
        )


# -- the reconciler -----------------------------------------------------------------------------------


async def heal_round(table: Table, settings: Settings, node: Path) -> None:
    """One whole reconcile pass over books holding `sync_pods` shared pods, nothing to heal (median
    of 20 passes): what the plugin does every reconcile_interval seconds."""
    pods = settings.sync_pods
    samples = await on_fake_tree(node / "heal", pods, passes=20)
    table.add(
        f"reconcile pass over {pods:,} shared pods, nothing to heal (in-process, fake v1 tree)",
        statistics.median(samples) * 1e3,
        "ms",
        section=4,
    )


# -- main ---------------------------------------------------------------------------------------------


async def run(settings: Settings) -> Table:
    table = Table()
    with tempfile.TemporaryDirectory(prefix="nri-bench-") as tmp:
        node = Path(tmp)
        for _ in range(settings.repeat):
            if settings.sync_only:
                await synchronize_round(table, settings, node)
                continue
            await creations_round(table, settings, node)
            await synchronize_round(table, settings, node)
            await fill_round(table, settings, node)
            await echo_floor(table, settings.calls // 2)
            await plugin_processing(table, settings.calls, node)
            await asking_processing(table, settings, node)
            await heal_round(table, settings, node)
    return table


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} CPUs ({model}), Linux {platform.release()}, Python {platform.python_version()}, "
        f"protobuf {api_implementation.Type()} backend; load average {load}"
    )


PLUGIN_IMPORTS = (
    "the development venv's, rich and pygments included (BENCH_DEV_PACKAGES=1)"
    if os.environ.get("BENCH_DEV_PACKAGES") == "1"
    else "as in the image (pip install .): the venv's rich, pygments, grpc_tools refused"
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run (seconds, not minutes)")
    parser.add_argument("--repeat", type=int, default=None, help="rounds; rows show medians (default 3)")
    parser.add_argument("--calls", type=int, default=None, help="timed CreateContainer round trips (10000)")
    parser.add_argument("--sync-only", action="store_true", help="the Synchronize rows alone")
    args = parser.parse_args(argv)
    if args.quick:
        settings = Settings(
            calls=300, burst=200, sync_pods=200, idle_seconds=0.2, repeat=1, fill_pods=100, kernel=False
        )
    else:
        settings = Settings(
            calls=10_000, burst=200, sync_pods=1000, idle_seconds=1.0, repeat=3, fill_pods=1000, kernel=True
        )
    if args.repeat is not None:
        settings = Settings(**{**settings.__dict__, "repeat": max(1, args.repeat)})
    if args.calls is not None:
        settings = Settings(**{**settings.__dict__, "calls": max(1, args.calls)})
    if args.sync_only:
        settings = Settings(**{**settings.__dict__, "sync_only": True})
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    before = machine()
    started = time.perf_counter()
    table = asyncio.run(run(settings))
    print(f"Machine: {before}")
    print(f"Plugin imports: {PLUGIN_IMPORTS}")
    print(
        f"Rounds: {settings.repeat} (median, range in brackets); took {time.perf_counter() - started:.0f} s; "
        f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print()
    print(table.markdown())


if __name__ == "__main__":
    main()
