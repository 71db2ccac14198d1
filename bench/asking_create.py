"""The plugin's own time per CreateContainer of a container that asks for shared CPUs, bytes in to
bytes out, on a fake cgroup v1 tree and on the real kernel's v1 cgroupfs.

Usage: python bench/asking_create.py [--calls N] [--kernel] [--profile] [--books N] [--idle-us N]

Each request is the first container of a new pod that asks (the pod annotation, trusted here): the
whole asking path, in this process, with no socket: the mux and ttrpc framing, the stub, the
policy, the pod cgroup walk, its quota read and raised, the books' transaction committed,
the reply encoded. Requests are encoded beforehand; the pods' cgroups exist (a fake v1 tree of
regular files, or with --kernel a scratch subtree ``<mount>/heal-bench-<pid>`` of the real v1
``cpu`` hierarchy, removed afterwards; root only). --books N first fills the books with N shared
pods (a Synchronize), to see that the cost does not grow with them. --profile prints where the time
goes by layer (cProfile: read shares, not absolute numbers). --idle-us N sleeps N µs before each
request (untimed), as the live plugin waits for the runtime's next one: a process that slept comes
back to cold CPU caches, and the same work costs it more CPU than back to back.

Logging is set up as the daemon sets it (`nri_plugin.daemon.logs.configure_logging` with cached
loggers, JSON, naming a node) at its default level, info, written to /dev/null: each asking
creation renders its "shared CPUs given" line. --log-level picks another level (error: no line).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from heal_pass import kernel_pods
from workload import already_shared, fake_node, lean_container, lean_pod, realistic_container, realistic_pod

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import CgroupLayout, CgroupMode, Hierarchy
from nri_plugin.daemon.logs import LEVELS, configure_logging
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin, TrustedSources
from nri_plugin.mixedcpu.store import StateStore
from nri_plugin.nri import mux
from nri_plugin.nri.identity import Identity
from nri_plugin.nri.stub import PLUGIN_SERVICE, Stub
from nri_plugin.ttrpc.protocol import ClientSession

SHARED_CPUS = frozenset({0, 1})
Profiler = cProfile.Profile | None


class _CountingTransport(asyncio.Transport):
    """Where the replies go: counted, the CPU time of the last one noted, then dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.written = 0
        self.written_at = 0.0  # time.process_time() of the last write

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += 1
        self.written_at = time.process_time()

    def writelines(self, list_of_data: object) -> None:
        self.written += 1

    def is_closing(self) -> bool:
        return False


def plugin_behind_trunk(plugin: MixedCpuPlugin) -> tuple[mux.Trunk, _CountingTransport]:
    """The plugin behind its stub, a ttrpc server and the multiplexer, as the daemon wires it, with
    no socket: feed the trunk a request's bytes, and the transport counts the replies."""
    stub = Stub(plugin, identity=Identity(name="bench", index="10"), socket_path="/nonexistent")
    trunk = mux.Trunk()
    transport = _CountingTransport()
    trunk.connection_made(transport)
    server = stub.server(functools.partial(trunk.send, mux.PLUGIN_SERVICE_CONN))
    trunk.channel(mux.PLUGIN_SERVICE_CONN, server)
    return trunk, transport


async def answered(trunk: mux.Trunk, transport: _CountingTransport, frame: bytes) -> None:
    """Feed the trunk one request and return once its reply is written: within `data_received` where
    a handler that never waits is started eagerly (Python 3.12 and later), else after the turns of
    the event loop its task takes (3.10, 3.11). Either way the cost counted is the whole of it."""
    expected = transport.written + 1
    trunk.data_received(frame)
    while transport.written < expected:  # noqa: ASYNC110 - a turn of the loop, no waiter measured
        await asyncio.sleep(0)


def fake_layout(cgroup_root: str) -> CgroupLayout:
    return CgroupLayout(
        CgroupMode.V1,
        Hierarchy(1, os.path.join(cgroup_root, "cpu")),
        Hierarchy(1, os.path.join(cgroup_root, "cpuset")),
    )


def _frames(parents: list[str], first: int) -> list[bytes]:
    """One CreateContainer per pod from `first` on: its container app-0, which asks."""
    session = ClientSession()
    frames = []
    for n in range(first, len(parents)):
        pod = realistic_pod(n)
        pod.linux.cgroup_parent = parents[n]
        container = realistic_container(pod, n * 5)  # app-0
        container.linux.cgroups_path = f"{parents[n]}/{container.id}"
        request = api.CreateContainerRequest(pod=pod, container=container)
        _, message = session.send_request(
            PLUGIN_SERVICE, "CreateContainer", request.SerializeToString(), timeout_nano=2_000_000_000
        )
        frames.append(b"".join(mux.encode(mux.PLUGIN_SERVICE_CONN, message)))
    return frames


class Cost(NamedTuple):
    """CPU seconds per asking CreateContainer: before its reply is written (what the runtime waits
    for), and after it (the info line and the metrics, written right after the reply)."""

    before_reply: float
    after_reply: float

    @property
    def total(self) -> float:
        return self.before_reply + self.after_reply


async def per_create(
    layout: CgroupLayout,
    parents: list[str],
    state_dir: str,
    books: int,
    profiler: Profiler,
    idle: float = 0.0,
) -> Cost:
    """CPU seconds per asking CreateContainer into the pods of `parents` after the first `books`
    (which a Synchronize makes shared first). CPU time, not wall time: on a shared machine the wall
    clock also counts the waits for a core; in one thread with nothing to wait on, the CPU time is
    the work. What the plugin does after each reply (its log line, right after the reply is written:
    `Stub.server`'s after_reply) is timed apart. `idle`: seconds slept before each request, untimed."""
    plugin = MixedCpuPlugin(
        shared=SHARED_CPUS,
        layout=layout,
        store=StateStore(state_dir),
        trusted=TrustedSources(pod_annotation=True),
    )
    if books:
        pods, containers = [], []
        for n in range(books):
            pod = lean_pod(n)
            pod.linux.cgroup_parent = parents[n]
            pods.append(pod)
            containers.append(already_shared(lean_container(pod, n * 5)))
        await plugin.synchronize(pods, containers)
        plugin.flush()
    plugin.later.flush()
    trunk, transport = plugin_behind_trunk(plugin)
    frames = _frames(parents, books)
    clock = time.process_time
    before = after = 0.0
    if profiler is not None:
        profiler.enable()
    for frame in frames:
        if idle:
            time.sleep(idle)  # noqa: ASYNC251 - idle between requests, as a live plugin is; untimed
        started = clock()
        await answered(trunk, transport, frame)  # the work after the reply included (`after_reply`)
        plugin.later.flush()  # (nothing left: as a safeguard)
        before += transport.written_at - started
        after += clock() - transport.written_at
    if profiler is not None:
        profiler.disable()
    assert transport.written == len(frames), "every request must be answered"
    assert plugin.books.shared_containers == books + len(frames), "every container was given shared CPUs"
    plugin.flush()
    return Cost(before / len(frames), after / len(frames))


async def on_fake_tree(
    root: Path, calls: int, books: int = 0, profiler: cProfile.Profile | None = None
) -> float:
    """CPU seconds per asking creation until its reply (`Cost.before_reply`), on a fake v1 tree."""
    return (await fake_tree_cost(root, calls, books, profiler)).before_reply


async def fake_tree_cost(
    root: Path, calls: int, books: int = 0, profiler: Profiler = None, idle: float = 0.0
) -> Cost:
    cgroup_root, state_dir = fake_node(root, books + calls)
    parents = [realistic_pod(n).linux.cgroup_parent for n in range(books + calls)]
    return await per_create(fake_layout(cgroup_root), parents, state_dir, books, profiler, idle)


async def on_kernel(
    root: Path, calls: int, books: int = 0, profiler: cProfile.Profile | None = None
) -> float:
    """The same as `on_fake_tree` on the kernel's cgroup v1 (root)."""
    return (await kernel_cost(root, calls, books, profiler)).before_reply


async def kernel_cost(
    root: Path, calls: int, books: int = 0, profiler: Profiler = None, idle: float = 0.0
) -> Cost:
    state_dir = root / "state"
    state_dir.mkdir(parents=True, exist_ok=True)
    with kernel_pods(books + calls) as (layout, parents):
        return await per_create(layout, parents, str(state_dir), books, profiler, idle)


def kernel_available() -> bool:
    return os.geteuid() == 0 and Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="asking creations timed per run (2000)")
    parser.add_argument("--runs", type=int, default=5, help="runs; the median is shown (5)")
    parser.add_argument("--books", type=int, default=0, help="shared pods in the books beforehand (0)")
    parser.add_argument("--kernel", action="store_true", help="real cgroup v1 cpu hierarchy (root)")
    parser.add_argument("--profile", action="store_true", help="where the time goes, by layer")
    parser.add_argument("--idle-us", type=float, default=0.0, help="µs slept before each request (0)")
    parser.add_argument("--log-level", choices=LEVELS, default="info", help="the daemon's log level (info)")
    args = parser.parse_args(argv)
    # As the daemon's `wiring.load_settings` does, its lines going to /dev/null.
    devnull = open(os.devnull, "w")  # noqa: SIM115 - open for the whole run
    configure_logging(args.log_level, "json", stream=devnull, cache_loggers=True, node="bench-node")
    measure = kernel_cost if args.kernel else fake_tree_cost
    profiler = cProfile.Profile(time.process_time) if args.profile else None
    samples: list[Cost] = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="asking-bench-") as tmp:
            idle = args.idle_us / 1e6
            samples.append(asyncio.run(measure(Path(tmp), args.calls, args.books, profiler, idle)))
    where = "the kernel's cgroup v1 cpu hierarchy" if args.kernel else "a fake cgroup v1 tree"
    print(
        f"asking CreateContainer, first of its pod, on {where} ({args.books:,} shared pods in the books, "
        f"{args.calls:,} calls per run, {args.runs} runs, log level {args.log_level}, "
        f"{args.idle_us:g} µs idle before each), µs of CPU per call:"
    )
    for label, values in (
        ("until the reply", [s.before_reply for s in samples]),
        ("after the reply (its log line)", [s.after_reply for s in samples]),
        ("total", [s.total for s in samples]),
    ):
        us = [v * 1e6 for v in values]
        print(f"  {label}: median {statistics.median(us):.1f} (runs {min(us):.1f}-{max(us):.1f})")
    if profiler is not None:
        from profile_create import report

        report("Plugin, in process", pstats.Stats(profiler), args.calls * args.runs, 25, per="creation")


if __name__ == "__main__":
    main()
