"""Does a huge NodePrepareResources starve the NRI requests served by the same loop? (issue #30)

Usage: python bench/dra_starvation.py [--claims 6000] [--api-ms 1.0] [--gap-ms 5] [--no-fsync] [--cdi-on DIR]

The daemon serves NRI and the DRA kubelet plugin on one asyncio loop. Here a child process does the
same (the stub with the real mixed-CPU plugin, as bench/plugin_child.py, and the real
`DraKubeletPlugin` beside it), logging at info level as the daemon does (JSON, into /dev/null); its
claim source answers from memory after `--api-ms` of simulated API-server round trip (an
``asyncio.sleep``: waiting, not CPU). The runtime simulator (this process) sends one CreateContainer
after another, `--gap-ms` apart, timing each round trip; a third process, standing in for kubelet,
sends one NodePrepareResources naming `--claims` claims over the real ``dra.v1`` socket, and every
CreateContainer timed while that call is under way counts. Printed as a markdown table: the
round trips before the call (idle) and during it (count, p50, p99, max), the call's own duration
and its failed claims, and the CPU the plugin's process used during the call. The machine's load
average is printed first: on a shared machine the figures move with it. The CDI specs are written
on a tmpfs (`--cdi-on`, default /dev/shm when it is there), as ``/var/run/cdi`` is one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog
from workload import HERE, cpu_ns, fake_node, percentile, realistic_container, realistic_pod

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.nri.identity import Identity
from nri_plugin.nri.simulator import RuntimeSimulator

NODE = "bench-node"
DRIVER = "shared-cpus.mixed-cpu.openshift.io"
DEVICES = 256
IDLE_SECONDS = 2.0


# -- the daemon's side (child process) ---------------------------------------------------------------


async def daemon(socket_path: str, cgroup_root: str, state_dir: str, dra_root: str, options: Any) -> None:
    from plugin_child import bench_plugin

    from nri_plugin.common.backoff import Backoff
    from nri_plugin.deviceplugin.marker import HostKey
    from nri_plugin.dra.claims import AllocatedDevice
    from nri_plugin.dra.kubeletplugin import DraKubeletPlugin, DraPluginSettings
    from nri_plugin.nri.stub import Stub

    class Claims:
        """claim-<n> is allocated shared-cpus-<n mod 256>, after a simulated API round trip."""

        async def allocated_devices(self, namespace: str, name: str, uid: str) -> tuple[AllocatedDevice, ...]:
            await asyncio.sleep(options["api_ms"] / 1000)
            index = int(name.rsplit("-", 1)[1])
            return (AllocatedDevice("shared", NODE, f"shared-cpus-{index % DEVICES}"),)

    root = Path(dra_root)
    settings = DraPluginSettings(
        driver_name=DRIVER,
        registry_dir=root / "reg",
        plugins_dir=root / "plugins",
        cdi_dir=options["cdi_dir"],
        pool_name=NODE,
        device_names=tuple(f"shared-cpus-{i}" for i in range(DEVICES)),
        fsync=options["fsync"],
    )
    plugin = bench_plugin(cgroup_root, state_dir)
    stub = Stub(
        plugin,
        identity=Identity(name="bench", index="10"),
        socket_path=socket_path,
        backoff=Backoff(0.01, 0.05),
    )
    async with DraKubeletPlugin(settings, HostKey(os.urandom(32)), Claims()):
        await stub.run()


def run_daemon(argv: list[str]) -> None:
    from nri_plugin.daemon.app import freeze_start_up_heap
    from nri_plugin.daemon.logs import configure_logging

    socket_path, cgroup_root, state_dir, dra_root, options = argv
    with open(os.devnull, "w") as devnull:
        configure_logging("info", "json", stream=devnull, cache_loggers=True, node=NODE)
        import plugin_child  # noqa: F401  (imported before the heap is frozen, as the daemon's modules are)

        import nri_plugin.dra.kubeletplugin
        import nri_plugin.nri.stub  # noqa: F401

        freeze_start_up_heap()  # as the daemon's `Daemon.run` does
        asyncio.run(daemon(socket_path, cgroup_root, state_dir, dra_root, json.loads(options)))


# -- kubelet's side (another child process) ----------------------------------------------------------


def run_kubelet(endpoint: str, count: int) -> None:
    """One NodePrepareResources of `count` claims; prints its duration and failures as JSON."""
    import uuid

    import grpc

    from nri_plugin.api.dra.v1 import api_pb2 as dra
    from nri_plugin.api.dra.v1 import api_pb2_grpc as dra_grpc

    request = dra.NodePrepareResourcesRequest()
    for n in range(count):
        request.claims.add(namespace="bench", name=f"claim-{n}", uid=str(uuid.uuid4()))
    with grpc.insecure_channel(f"unix:{endpoint}") as channel:
        call = dra_grpc.DRAPluginStub(channel).NodePrepareResources
        started = time.perf_counter()
        answer = call(request, timeout=120.0)
        seconds = time.perf_counter() - started
    failed = [claim.error for claim in answer.claims.values() if claim.error]
    print(json.dumps({"seconds": seconds, "claims": len(answer.claims), "failed": len(failed)}))


# -- the runtime's side and the measurement (this process) -------------------------------------------


async def creations(sim: RuntimeSimulator, gap: float, until: asyncio.Event, first: int) -> list[float]:
    """CreateContainer round trips (seconds), one after another `gap` apart, until `until` is set."""
    pod = realistic_pod(0)
    samples = []
    n = first
    while not until.is_set():
        container = realistic_container(pod, n, state=api.CONTAINER_UNKNOWN)
        n += 1
        started = time.perf_counter()
        await sim.create_container(container)
        samples.append(time.perf_counter() - started)
        del sim.containers[container.id]
        await asyncio.sleep(gap)
    return samples


async def wait_for(path: Path) -> None:
    for _ in range(3000):
        if await asyncio.to_thread(path.exists):
            return
        await asyncio.sleep(0.01)
    raise SystemExit(f"{path} never appeared")


def row(what: str, samples: list[float]) -> str:
    ms = [s * 1e3 for s in samples]
    return f"| {what} | {len(ms)} | {percentile(ms, 0.5):.2f} | {percentile(ms, 0.99):.2f} | {max(ms):.2f} |"


async def measure(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="dra-starve-", dir="/tmp") as tmp:
        root = Path(tmp)
        cgroup_root, state_dir = fake_node(root, 1)
        dra_root = root / "dra"
        (dra_root / "reg").mkdir(parents=True)
        env = {**os.environ, "PYTHONPATH": f"{HERE.parent}:{HERE}"}
        cdi_on = args.cdi_on or ("/dev/shm" if Path("/dev/shm").is_dir() else tmp)  # noqa: ASYNC240
        cdi_dir = tempfile.mkdtemp(prefix="dra-starve-cdi-", dir=cdi_on)
        options = json.dumps({"api_ms": args.api_ms, "fsync": not args.no_fsync, "cdi_dir": cdi_dir})
        async with RuntimeSimulator(str(root / "nri.sock")) as sim:
            sim.add_pod(realistic_pod(0))
            child = subprocess.Popen(  # noqa: ASYNC220 (started once, waited for in `finally`)
                [
                    sys.executable,
                    __file__,
                    "--daemon",
                    sim.socket_path,
                    cgroup_root,
                    state_dir,
                    str(dra_root),
                    options,
                ],
                env=env,
            )
            try:
                await sim.wait_for_plugins(1, timeout=60)
                endpoint = dra_root / "plugins" / DRIVER / "dra.sock"
                await wait_for(endpoint)
                gap = args.gap_ms / 1000
                stop = asyncio.Event()
                idle_task = asyncio.ensure_future(creations(sim, gap, stop, 0))
                await asyncio.sleep(IDLE_SECONDS)
                stop.set()
                idle = await idle_task
                during_stop = asyncio.Event()
                during_task = asyncio.ensure_future(creations(sim, gap, during_stop, 1_000_000))
                cpu_before = cpu_ns(child.pid)
                kubelet = await asyncio.create_subprocess_exec(
                    sys.executable,
                    __file__,
                    "--kubelet",
                    str(endpoint),
                    str(args.claims),
                    env=env,
                    stdout=asyncio.subprocess.PIPE,
                )
                out, _ = await kubelet.communicate()
                cpu = (cpu_ns(child.pid) - cpu_before) / 1e9
                during_stop.set()
                during = await during_task
            finally:
                child.terminate()
                child.wait(30)
                shutil.rmtree(cdi_dir, ignore_errors=True)
    call = json.loads(out)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"load average {load}; {args.claims} claims, API round trip {args.api_ms} ms, "
        f"fsync {'off' if args.no_fsync else 'on'}, CDI specs on {cdi_on}"
    )
    print()
    print("| CreateContainer round trips | count | p50 (ms) | p99 (ms) | max (ms) |")
    print("|---|---|---|---|---|")
    print(row("idle (no DRA call)", idle))
    print(row(f"during one NodePrepareResources of {args.claims} claims", during))
    print()
    print(
        f"NodePrepareResources: {call['seconds']:.2f} s for {call['claims']} claims, "
        f"{call['failed']} failed; the plugin's process used {cpu:.2f} s of CPU meanwhile"
    )


def main() -> None:
    if sys.argv[1:2] == ["--daemon"]:
        run_daemon(sys.argv[2:])
        return
    if sys.argv[1:2] == ["--kubelet"]:
        run_kubelet(sys.argv[2], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=6000)
    parser.add_argument("--api-ms", type=float, default=1.0)
    parser.add_argument("--gap-ms", type=float, default=5.0)
    parser.add_argument("--no-fsync", action="store_true")
    parser.add_argument("--cdi-on", default="", help="the directory the CDI spec directory is made in")
    # The simulator's own lines stay out of the table.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    asyncio.run(measure(parser.parse_args()))


if __name__ == "__main__":
    main()
