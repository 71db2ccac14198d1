"""How long the node's ResourceSlices are gone after kubelet wipes them (issue #30).

Usage: python bench/dra_restore.py [--wipes 50] [--devices 256]

The real `ResourceSlicePublisher` (lightkube over HTTP, made by `make_client` from a kubeconfig)
publishes the pool to the tests' fake API server (tests/dra/fake_apiserver.py: real HTTP on
127.0.0.1, watch as chunked events) and keeps it. Then, `--wipes` times, the wipe kubelet sends at
its start (DeleteCollection of the node's ResourceSlices by field selector, over HTTP) and the time
from sending it until the API server holds the whole pool again: the wipe, the watch event reaching
the publisher, one round (read the Node, list the slices, apply each), as the scheduler would see
it. One event loop and one CPU for both sides; the machine's load average is printed first.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx2
from workload import percentile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "dra"))
from fake_apiserver import SLICES, TOKEN, FakeApiServer

from nri_plugin.daemon.logs import configure_logging
from nri_plugin.dra import apiserver, slices

NODE = "bench-node"
DRIVER = "shared-cpus.mixed-cpu.openshift.io"
GUARD = 30.0  # against hangs only


async def _until(predicate: object, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + GUARD
    while not predicate():  # type: ignore[operator]
        if loop.time() > deadline:
            raise SystemExit(f"not within {GUARD} s: {what}")
        await asyncio.sleep(0)


async def run(wipes: int, devices: int) -> None:
    wanted = len(
        slices.resource_slices(
            node_name=NODE, node_uid="x", driver=DRIVER, device_count=devices, generation=1
        )
    )
    with tempfile.TemporaryDirectory(prefix="dra-restore-") as tmp:
        async with FakeApiServer() as server:
            server.add_node(NODE)
            client = apiserver.make_client(str(server.write_kubeconfig(Path(tmp) / "kubeconfig")))
            publisher = apiserver.ResourceSlicePublisher(
                client=client, driver=DRIVER, node_name=NODE, device_count=devices
            )
            task = asyncio.create_task(publisher.run())
            url = f"{server.url}{SLICES}"
            samples = []
            try:
                await asyncio.wait_for(publisher.wait_published(), GUARD)
                await _until(lambda: server.watches >= 1, "the publisher watching")
                async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as kubelet:
                    for _ in range(wipes):
                        start = time.perf_counter()
                        answer = await kubelet.delete(url, params={"fieldSelector": f"spec.nodeName={NODE}"})
                        answer.raise_for_status()
                        await _until(lambda: len(server.objects.get(SLICES, {})) == wanted, "the pool back")
                        samples.append(time.perf_counter() - start)
                        await asyncio.wait_for(publisher.wait_published(), GUARD)
            finally:
                task.cancel()
                await asyncio.wait([task])
                await client.close()
    ms = [s * 1e3 for s in samples]
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print()
    print("| measure | wipes | p50 (ms) | p99 (ms) | max (ms) |")
    print("|---|---|---|---|---|")
    print(
        f"| kubelet's wipe sent → whole pool ({devices} devices, {wanted} slices) back | {len(ms)} "
        f"| {percentile(ms, 0.5):.1f} | {percentile(ms, 0.99):.1f} | {max(ms):.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wipes", type=int, default=50)
    parser.add_argument("--devices", type=int, default=256)
    args = parser.parse_args()
    with open(os.devnull, "w") as devnull:  # logged as the daemon logs, into /dev/null
        configure_logging("info", "json", stream=devnull, cache_loggers=True, node=NODE)
        asyncio.run(run(args.wipes, args.devices))


if __name__ == "__main__":
    main()
