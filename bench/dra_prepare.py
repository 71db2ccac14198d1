"""The DRA kubelet plugin's prepare and unprepare, as kubelet calls them (issue #23).

Usage: python bench/dra_prepare.py [--claims 500] [--batch 32] [--no-fsync]

The real `DraKubeletPlugin` serves its sockets in a temporary directory; a kubelet-like client in the
same process calls ``NodePrepareResources`` and ``NodeUnprepareResources`` over the real ``dra.v1``
unix socket with our generated stubs. The claim source answers from memory (where the daemon reads
the API server: that round trip is the API server's, not ours, and is left out). Each prepare writes
its CDI spec atomically (fsync'd unless ``--no-fsync``). Printed, as a markdown table: one claim per
call (p50, p99, max), a batch of `--batch` claims in one call, a prepare answered from the spec file
because the claim source is down (as after a daemon restart during an API-server outage), and
unprepare. Client and server share one event loop and one CPU here, so each figure is both sides'
work; the machine's load average is printed first.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import uuid
from pathlib import Path

import grpc
from workload import percentile

from nri_plugin.api.dra.v1 import api_pb2 as dra
from nri_plugin.api.dra.v1 import api_pb2_grpc as dra_grpc
from nri_plugin.daemon.logs import configure_logging
from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.dra.claims import AllocatedDevice, ClaimSourceUnreachable
from nri_plugin.dra.kubeletplugin import DraKubeletPlugin, DraPluginSettings

NODE = "bench-node"
DRIVER = "shared-cpus.mixed-cpu.openshift.io"


class _Claims:
    """The scheduler's allocations, in memory; `down` makes every read fail as an unreachable API
    server does."""

    def __init__(self) -> None:
        self.devices: dict[str, tuple[AllocatedDevice, ...]] = {}
        self.down = False

    async def allocated_devices(self, namespace: str, name: str, uid: str) -> tuple[AllocatedDevice, ...]:
        if self.down:
            raise ClaimSourceUnreachable("the API server could not be reached")
        return self.devices[uid]


def _claims(count: int, claims: _Claims) -> list[str]:
    uids = []
    for i in range(count):
        uid = str(uuid.uuid4())
        claims.devices[uid] = (AllocatedDevice("shared", NODE, f"shared-cpus-{i % 256}"),)
        uids.append(uid)
    return uids


def _request(kind: type, uids: list[str]) -> object:
    request = kind()
    for uid in uids:
        request.claims.add(namespace="bench", name=f"claim-{uid[:8]}", uid=uid)
    return request


async def _timed(call: object, uids: list[str], kind: type) -> float:
    start = time.perf_counter()
    answer = await call(_request(kind, uids), timeout=10.0)  # type: ignore[operator]
    elapsed = time.perf_counter() - start
    for uid in uids:
        if answer.claims[uid].error:
            raise SystemExit(f"claim {uid} failed: {answer.claims[uid].error}")
    return elapsed


def _row(what: str, samples: list[float]) -> str:
    us = [s * 1e6 for s in samples]
    return (
        f"| {what} | {len(samples)} | {percentile(us, 0.5):,.0f} | {percentile(us, 0.99):,.0f} "
        f"| {max(us):,.0f} |"
    )


async def run(claims_count: int, batch: int, fsync: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="dra-bench-", dir="/tmp") as tmp:
        root = Path(tmp)
        for name in ("reg", "plugins"):
            (root / name).mkdir()
        settings = DraPluginSettings(
            driver_name=DRIVER,
            registry_dir=root / "reg",
            plugins_dir=root / "plugins",
            cdi_dir=root / "cdi",
            pool_name=NODE,
            device_names=tuple(f"shared-cpus-{i}" for i in range(256)),
            fsync=fsync,
        )
        claims = _Claims()
        plugin = DraKubeletPlugin(settings, HostKey(os.urandom(32)), claims)
        async with plugin, grpc.aio.insecure_channel(f"unix:{plugin.endpoint}") as channel:
            stub = dra_grpc.DRAPluginStub(channel)
            prepare, unprepare = stub.NodePrepareResources, stub.NodeUnprepareResources
            warm = _claims(50, claims)
            for uid in warm:  # connection, imports, first file writes: not measured
                await _timed(prepare, [uid], dra.NodePrepareResourcesRequest)
            one = _claims(claims_count, claims)
            single = [await _timed(prepare, [uid], dra.NodePrepareResourcesRequest) for uid in one]
            batches = []
            for _ in range(max(1, claims_count // (batch * 4))):
                uids = _claims(batch, claims)
                batches.append(await _timed(prepare, uids, dra.NodePrepareResourcesRequest))
            claims.down = True
            again = [await _timed(prepare, [uid], dra.NodePrepareResourcesRequest) for uid in one]
            claims.down = False
            gone = [await _timed(unprepare, [uid], dra.NodeUnprepareResourcesRequest) for uid in one]
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; fsync {'on' if fsync else 'off'}")
    print()
    print("| call | calls | p50 (us) | p99 (us) | max (us) |")
    print("|---|---|---|---|---|")
    print(_row("NodePrepareResources, 1 claim (claim source answers, spec written)", single))
    print(_row(f"NodePrepareResources, {batch} claims in one call", batches))
    print(_row("NodePrepareResources, 1 claim, claim source down: answered from its spec", again))
    print(_row("NodeUnprepareResources, 1 claim (spec removed)", gone))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--no-fsync", action="store_true")
    args = parser.parse_args()
    # Logged as the daemon logs (each prepare's info line is part of its cost), into /dev/null:
    # stdout is the table.
    with open(os.devnull, "w") as devnull:
        configure_logging("info", "json", stream=devnull, cache_loggers=True, node=NODE)
        asyncio.run(run(args.claims, args.batch, not args.no_fsync))


if __name__ == "__main__":
    main()
