"""NRI benchmarks: CreateContainer round trip, Synchronize of a large node, start-up, resident memory.

Usage: python bench/bench_nri.py [--calls N]

The runtime simulator runs in this process; the plugin runs in a child process (bench/plugin_child.py),
so each side has its own interpreter as on a node. Round-trip times include the simulator's own work
(building the request, merging the reply), so they are an upper bound for the plugin's share.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import structlog

from api.nri import api_pb2 as api
from nri_plugin import mux
from nri_plugin.simulator import RuntimeSimulator
from nri_plugin.stub import PLUGIN_SERVICE, Stub
from nri_plugin.ttrpc import Server
from nri_plugin.ttrpc.protocol import ClientSession

HERE = Path(__file__).resolve().parent


def realistic_pod(n: int) -> api.PodSandbox:
    uid = f"{n:08x}-1b2c-4d5e-8f90-{n:012x}"
    pod = api.PodSandbox(
        id=f"{n:064x}", uid=uid, name=f"workload-{n}-7d9f8c6b5-x2x4q", namespace=f"team-{n % 40}"
    )
    pod.labels.update({"app": f"workload-{n}", "pod-template-hash": "7d9f8c6b5", "tier": "backend"})
    pod.annotations.update(
        {
            "kubernetes.io/config.seen": "2026-11-21T04:00:00.000000000Z",
            "kubernetes.io/config.source": "api",
            "workload.openshift.io/management": '{"effect": "PreferredDuringScheduling"}',
        }
    )
    pod.runtime_handler = "runc"
    pod.linux.cgroup_parent = f"/kubepods/pod{uid}"
    pod.linux.cgroups_path = f"/kubepods/pod{uid}/{pod.id}"
    pod.ips.append(f"10.128.{n // 250}.{n % 250}")
    return pod


def realistic_container(pod: api.PodSandbox, n: int) -> api.Container:
    cid = f"{n:064x}"[::-1]
    container = api.Container(
        id=cid, pod_sandbox_id=pod.id, name=f"app-{n % 5}", state=api.CONTAINER_RUNNING, pid=10000 + n
    )
    container.labels.update(
        {
            "io.kubernetes.container.name": container.name,
            "io.kubernetes.pod.name": pod.name,
            "io.kubernetes.pod.namespace": pod.namespace,
            "io.kubernetes.pod.uid": pod.uid,
        }
    )
    container.annotations.update(
        {
            "io.kubernetes.container.hash": "9f2c4e1a",
            "io.kubernetes.container.restartCount": "0",
            "io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
        }
    )
    container.args.extend(["/usr/bin/app", "--config=/etc/app/config.yaml", "--log-level=info"])
    container.env.extend(
        [
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            f"HOSTNAME={pod.name}",
            "KUBERNETES_SERVICE_HOST=172.30.0.1",
            "KUBERNETES_SERVICE_PORT=443",
        ]
    )
    for dest in ("/etc/hosts", "/dev/termination-log", "/var/run/secrets/kubernetes.io/serviceaccount"):
        container.mounts.add(
            destination=dest,
            type="bind",
            source=f"/var/lib/kubelet/pods/{pod.uid}{dest}",
            options=["rbind", "rprivate", "ro"],
        )
    container.linux.cgroups_path = f"{pod.linux.cgroup_parent}/{cid}"
    cpu = container.linux.resources.cpu
    cpu.shares.value = 2048
    cpu.quota.value = 200000
    cpu.period.value = 100000
    cpu.cpus = f"{2 + n % 60}-{3 + n % 60}"
    cpu.mems = "0"
    container.linux.resources.memory.limit.value = 1 << 30
    return container


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fake_node(root: Path) -> tuple[str, str]:
    """A cgroup v1 tree holding the benchmark pods' cgroups (quota: 5 containers x 2 CPUs), and a
    state dir; returns both paths."""
    for n in range(1000):
        uid = realistic_pod(n).uid
        pod_dir = root / "cgroup" / "cpu" / "kubepods" / f"pod{uid}"
        pod_dir.mkdir(parents=True, exist_ok=True)
        (pod_dir / "cpu.cfs_quota_us").write_text("1000000\n")
        (pod_dir / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cgroup" / "cpuset").mkdir(parents=True, exist_ok=True)
    (root / "state").mkdir(exist_ok=True)
    return str(root / "cgroup"), str(root / "state")


class PluginProcess:
    def __init__(self, socket_path: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
        cgroup_root, state_dir = fake_node(Path(socket_path).parent)
        self.started = time.perf_counter()
        child = os.environ.get("BENCH_CHILD", str(HERE / "plugin_child.py"))  # e.g. a profiling wrapper
        self.proc = subprocess.Popen([sys.executable, child, socket_path, cgroup_root, state_dir], env=env)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


async def bench(calls: int) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="nri-bench-") as tmp:
        socket_path = str(Path(tmp) / "nri.sock")
        async with RuntimeSimulator(socket_path) as sim:
            plugin = PluginProcess(socket_path)
            try:
                await sim.wait_for_plugins(1, timeout=30)
                registered = time.perf_counter() - plugin.started
                rows.append(("start → registered + synchronized", f"{registered * 1000:.0f} ms", "≤ 1 s"))
                await asyncio.sleep(1.0)
                rows.append(("idle plugin RSS", f"{rss_mib(plugin.proc.pid):.1f} MiB", "≤ 50 MB"))
                rows += await create_round_trips(sim, calls)
                rows.append(
                    (f"plugin RSS after {calls} creations", f"{rss_mib(plugin.proc.pid):.1f} MiB", "≤ 50 MB")
                )
            finally:
                plugin.stop()
        for label, limit in (("4 MiB ttrpc limit", 4 << 20), ("1 MiB messages", 1 << 20)):
            rows.append(await synchronize_large(socket_path, label, limit))
    return rows


async def create_round_trips(sim: RuntimeSimulator, calls: int) -> list[tuple[str, str, str]]:
    pod = realistic_pod(0)
    pod.annotations["cpu-shared.crio.io/app-0"] = "enable"
    await sim.run_pod_sandbox(pod)
    samples: list[float] = []
    for n in range(calls + 200):
        container = realistic_container(pod, n)
        container.state = api.CONTAINER_UNKNOWN
        started = time.perf_counter()
        await sim.create_container(container)
        elapsed = time.perf_counter() - started
        del sim.containers[container.id]
        if n >= 200:  # warm-up
            samples.append(elapsed)
    us = [s * 1e6 for s in samples]
    return [
        (f"CreateContainer round trip p50 ({calls} calls)", f"{statistics.median(us):.0f} µs", "≤ 150 µs"),
        ("CreateContainer round trip p99", f"{percentile(us, 0.99):.0f} µs", "≤ 1 ms"),
        ("CreateContainer round trip max", f"{max(us) / 1000:.1f} ms", "< 2 s budget"),
    ]


async def synchronize_large(socket_path: str, label: str, limit: int) -> tuple[str, str, str]:
    sim = RuntimeSimulator(socket_path, max_message_size=limit, request_timeout=10.0)
    for n in range(1000):
        pod = realistic_pod(n)
        sim.add_pod(pod)
        for c in range(5):
            sim.add_container(realistic_container(pod, n * 5 + c))
    size = api.SynchronizeRequest(pods=sim.pods.values(), containers=sim.containers.values()).ByteSize()
    async with sim:
        plugin = PluginProcess(socket_path)
        try:
            await sim.wait_for_plugins(1, timeout=60)
        finally:
            plugin.stop()
    seconds = sim.sync_seconds[-1]
    chunks = len(sim.sync_chunks)
    return (
        f"Synchronize 1,000 pods / 5,000 containers ({size / 1e6:.1f} MB, {label}: {chunks} message(s))",
        f"{seconds * 1000:.0f} ms",
        "≤ 300 ms",
    )


class _CapturingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += 1

    def writelines(self, list_of_data: object) -> None:
        self.written += 1

    def is_closing(self) -> bool:
        return False


async def plugin_processing(calls: int) -> tuple[str, str, str]:
    """The plugin's own work per CreateContainer, bytes in to bytes out, with no socket or peer."""
    from plugin_child import bench_plugin

    with tempfile.TemporaryDirectory(prefix="nri-bench-") as tmp:
        return await _plugin_processing(calls, bench_plugin(*fake_node(Path(tmp))))


async def _plugin_processing(calls: int, plugin: object) -> tuple[str, str, str]:
    stub = Stub(plugin, name="bench", index="10", socket_path="/nonexistent")
    trunk = mux.Trunk()
    transport = _CapturingTransport()
    trunk.connection_made(transport)
    server = Server({PLUGIN_SERVICE: stub._methods()}, functools.partial(trunk.send, mux.PLUGIN_SERVICE_CONN))
    trunk.channel(mux.PLUGIN_SERVICE_CONN, server)
    pod = realistic_pod(0)
    pod.annotations["cpu-shared.crio.io/app-0"] = "enable"
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
        trunk.data_received(frame)
    elapsed = time.perf_counter() - started
    assert transport.written == calls, "every request must be answered without waiting"
    return (
        "plugin processing per CreateContainer (no socket)",
        f"{elapsed / calls * 1e6:.0f} µs",
        "(share of p50)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--calls", type=int, default=10000, help="CreateContainer calls to time (default 10000)"
    )
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    rows = asyncio.run(bench(args.calls))
    rows.insert(3, asyncio.run(plugin_processing(args.calls)))
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'result':>10}  target")
    for label, value, target in rows:
        print(f"{label:<{width}}  {value:>10}  {target}")


if __name__ == "__main__":
    main()
