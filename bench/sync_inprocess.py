"""The plugin's side of a Synchronize of 1,000 pods / 5,000 containers, in process, bytes in to bytes
out: the runtime's messages (2 x 4 MiB, as the simulator splits them) fed to the multiplexer in
256 KiB reads (an asyncio socket transport's read size), through ttrpc, the stub's take-apart, the
plugin's handler with its pod-quota reads and writes on a fake cgroup v1 tree, and the replies
encoded. No socket, no other process: CPU time is this process's (its threads included), and
``--count`` gives the Python bytecodes run (deterministic).

Usage: python bench/sync_inprocess.py [--runs N] [--pods N] [--count] [--top N]

Two kinds, on one node: a *first start* (the asking containers not shared yet: 1,000 updates to
answer, every pod quota raised, every pod's baseline written ahead) and a *restart* over what the first
left (books on disk, quotas raised, containers already shared).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from asking_create import SHARED_CPUS, fake_layout, plugin_behind_trunk
from opcount import OpcodeCounter, print_tables
from workload import already_shared, fake_node, realistic_container, realistic_pod

from nri_plugin.daemon.logs import configure_logging
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin, TrustedSources
from nri_plugin.mixedcpu.store import StateStore
from nri_plugin.nri import mux, stub
from nri_plugin.nri.simulator import RuntimeSimulator
from nri_plugin.nri.stub import PLUGIN_SERVICE
from nri_plugin.ttrpc.protocol import ClientSession

CONTAINERS_PER_POD = 5
READ_SIZE = 256 * 1024  # what asyncio's selector transport asks recv() for
MESSAGE_LIMIT = 4 << 20


class Reads(NamedTuple):
    """A Synchronize as the plugin's socket gives it: its reads, and how many messages they hold."""

    data: list[bytes]
    messages: int


def sync_reads(pods: int, shared: bool) -> Reads:
    """The runtime's Synchronize messages for `pods` realistic pods, as the bytes the plugin's
    socket would give it, cut in reads of READ_SIZE."""
    sim = RuntimeSimulator("/nonexistent", max_message_size=MESSAGE_LIMIT)
    for n in range(pods):
        pod = realistic_pod(n)
        sim.add_pod(pod)
        for c in range(CONTAINERS_PER_POD):
            container = realistic_container(pod, n * CONTAINERS_PER_POD + c)
            sim.add_container(already_shared(container) if shared else container)
    session = ClientSession()
    stream = bytearray()
    # The simulator's own split (Go's rule: a share of the objects, cut until each fits).
    requests = sim._sync_requests(list(sim.pods.values()), list(sim.containers.values()))
    for request in requests:
        _, message = session.send_request(
            PLUGIN_SERVICE, "Synchronize", request.SerializeToString(), timeout_nano=10_000_000_000
        )
        for part in mux.encode(mux.PLUGIN_SERVICE_CONN, message):
            stream += part
    data = [bytes(stream[at : at + READ_SIZE]) for at in range(0, len(stream), READ_SIZE)]
    return Reads(data, len(requests))


async def synchronize(
    plugin: MixedCpuPlugin, reads: Reads, pods: int, counter: OpcodeCounter | None
) -> float:
    """CPU seconds from the first read to the last reply written; the plugin must then share the
    asking container of each of the `pods`."""
    trunk, transport = plugin_behind_trunk(plugin)
    started = time.process_time()
    if counter is not None:
        counter.__enter__()
    for data in reads.data:
        trunk.data_received(data)
    # A few turns: the handler waits on nothing outside this loop; the counting transport has no event.
    # (A large node's reply goes out in parts: the replies written count more than the requests
    # before the handler is done, so the books are waited for too.)
    for _ in range(1_000_000):
        if transport.written >= reads.messages and plugin.books.shared_containers == pods:
            break
        await asyncio.sleep(0 if transport.written < reads.messages else 0.001)
    else:
        raise AssertionError(f"{transport.written} replies to {reads.messages} Synchronize messages")
    if counter is not None:
        counter.__exit__()
    cpu = time.process_time() - started
    shared = plugin.books.shared_containers
    assert shared == pods, f"{shared} containers shared after the Synchronize, not one per pod ({pods})"
    plugin.later.flush()
    plugin.flush()
    plugin.store.close()  # (the next plugin on this state dir opens it: a restart)
    return cpu


def _plugin(cgroup_root: str, state_dir: str) -> MixedCpuPlugin:
    return MixedCpuPlugin(
        shared=SHARED_CPUS,
        layout=fake_layout(cgroup_root),
        store=StateStore(state_dir),
        trusted=TrustedSources(pod_annotation=True),
    )


def _show(cpu: list[float]) -> str:
    return f"min {min(cpu) * 1e3:.1f} ms, median {sorted(cpu)[len(cpu) // 2] * 1e3:.1f} ms" if cpu else "-"


def run(pods: int, runs: int, count: bool) -> tuple[list[float], list[float], dict[str, OpcodeCounter]]:
    first_reads, restart_reads = sync_reads(pods, shared=False), sync_reads(pods, shared=True)
    first: list[float] = []
    restart: list[float] = []
    counters: dict[str, OpcodeCounter] = {}
    for n in range(runs + count):
        counting = count and n == runs
        with tempfile.TemporaryDirectory(prefix="sync-bench-") as tmp:
            cgroup_root, state_dir = fake_node(Path(tmp), pods)
            kinds = (("first start", first_reads, first), ("restart", restart_reads, restart))
            for name, reads, into in kinds:
                counter = OpcodeCounter() if counting else None
                cpu = asyncio.run(synchronize(_plugin(cgroup_root, state_dir), reads, pods, counter))
                if counter is not None:
                    counters[name] = counter
                else:
                    into.append(cpu)
    return first, restart, counters


def main(argv: list[str] | None = None) -> None:
    # A node this large raises max_synchronize_mib (its Synchronize is over the default 32 MiB).
    stub.DEFAULT_MAX_SYNC_BYTES = 1024 << 20
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pods", type=int, default=1000, help="pods, 5 containers each (1000)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs; min and median shown (5)")
    parser.add_argument("--count", action="store_true", help="also count the Python bytecodes (one more run)")
    parser.add_argument("--top", type=int, default=0, help="with --count: the top N functions")
    args = parser.parse_args(argv)
    configure_logging("info", "json", stream=open(os.devnull, "w"), cache_loggers=True, node="bench")  # noqa: SIM115
    first, restart, counters = run(args.pods, args.runs, args.count)
    print(f"Synchronize {args.pods:,} pods / {args.pods * CONTAINERS_PER_POD:,} containers in process, CPU:")
    print(f"  first start: {_show(first)}")
    print(f"  restart:     {_show(restart)}")
    for name, counter in counters.items():
        print(f"  {name}: {counter.total():,} bytecodes")
    for name, counter in counters.items() if args.top else ():
        print_tables(counter, 1, args.top, per=f"Synchronize ({name})")


if __name__ == "__main__":
    main()
