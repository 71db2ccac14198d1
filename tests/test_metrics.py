"""Metrics as Prometheus scrapes them: the stub, the mixed-CPU plugin and a fake cgroup v1 tree against
the runtime simulator over a real unix socket, ``/metrics`` fetched over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kernel_support import require_v1_layout
from mixedcpu_support import (
    PERIOD,
    FakeCgroups,
    Naming,
    make_container,
    make_plugin,
    make_pod,
    marker,
    plugin_running,
)
from probe_support import GUARD, Samples, get, samples, scrape, value

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import CgroupLayout, CgroupPath, write_cpu_quota
from nri_plugin.common.backoff import Backoff
from nri_plugin.daemon.metrics import DURATION_BUCKETS, Metrics
from nri_plugin.daemon.probes import ProbeServer, readiness
from nri_plugin.daemon.wiring import bind_gauges
from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin
from nri_plugin.nri.simulator import PluginFailed, RuntimeSimulator
from nri_plugin.nri.stub import Stub

NAMING = Naming("containerd", "cgroupfs")
REQUESTS = "mixed_cpu_nri_requests_total"
DURATION_COUNT = "mixed_cpu_nri_request_duration_seconds_count"
CREATIONS = "mixed_cpu_shared_creations_total"

# An open for writing: the plugin holds a pod's quota file read-write from its read to its write.
_FOR_WRITING = os.O_WRONLY | os.O_RDWR


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="metrics-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Observed:
    """A plugin observed by `metrics`, served to `sim`, scraped on 127.0.0.1:`port`."""

    sim: RuntimeSimulator
    stub: Stub
    plugin: MixedCpuPlugin
    key: HostKey
    metrics: Metrics
    port: int

    async def scrape(self) -> Samples:
        return await scrape("127.0.0.1", self.port)


@contextlib.asynccontextmanager
async def observed(
    root: Path, layout: CgroupLayout, *, sim_started: bool = True, **stub_options: object
) -> AsyncIterator[Observed]:
    metrics = Metrics()  # first: the parts are built with it as their observer, as `run` does
    plugin, key = make_plugin(root / "state", layout, observer=metrics)
    plugin.creations = metrics  # as `build_plugin` sets it
    socket_path = root / "nri.sock"
    sim = RuntimeSimulator(socket_path)
    if sim_started:
        await sim.start()
    node: Observed | None = None
    try:
        async with plugin_running(plugin, socket_path, observer=metrics, **stub_options) as stub:
            bind_gauges(metrics, stub, plugin, None)
            async with ProbeServer(
                "127.0.0.1:0", metrics=metrics.render, readiness=readiness(stub, None)
            ) as probes:
                [address] = probes.bound
                node = Observed(sim, stub, plugin, key, metrics, int(address.rpartition(":")[2]))
                yield node
    finally:
        await (sim if node is None else node.sim).close()  # a test may have replaced the runtime


def asking(pod: api.PodSandbox, key: HostKey, cid: str, name: str, device: str) -> api.Container:
    return make_container(NAMING, pod, cid, name, cpus="4-5", annotations=marker(key, device))


@pytest.mark.asyncio
async def test_requests_and_shared_containers_follow_the_container_lifecycle(short_dir: Path) -> None:
    tree = FakeCgroups(short_dir / "cgroup", 1)
    async with observed(short_dir, tree.layout) as node:
        await node.sim.wait_for_plugins(1, GUARD)
        first = await node.scrape()
        assert value(first, REQUESTS, event="configure", outcome="ok") == 1
        assert value(first, REQUESTS, event="synchronize", outcome="ok") == 1
        assert value(first, "mixed_cpu_nri_ready") == 1
        assert value(first, "mixed_cpu_shared_containers") == 0
        assert value(first, REQUESTS, event="create_container", outcome="ok") == 0

        pod = make_pod(NAMING, "1111-2222", name="fwd")
        tree.add_pod(pod, 3 * PERIOD)
        await node.sim.run_pod_sandbox(pod)
        await node.sim.create_container(asking(pod, node.key, "c-fwd", "fwd", "shared-cpus-0"))
        after_asking = await node.scrape()
        assert value(after_asking, REQUESTS, event="create_container", outcome="ok") == 1
        assert value(after_asking, DURATION_COUNT, event="create_container") == 1
        assert value(after_asking, "mixed_cpu_shared_containers") == 1

        await node.sim.create_container(make_container(NAMING, pod, "c-side", "sidecar", cpus="6"))
        after_plain = await node.scrape()
        assert value(after_plain, REQUESTS, event="create_container", outcome="ok") == 2
        assert value(after_plain, DURATION_COUNT, event="create_container") == 2
        assert value(after_plain, "mixed_cpu_shared_containers") == 1, "a container that did not ask"
        # Every observation lands in a bucket; the +Inf bucket counts them all.
        bucket = "mixed_cpu_nri_request_duration_seconds_bucket"
        assert value(after_plain, bucket, event="create_container", le="+Inf") == 2
        assert value(after_plain, "mixed_cpu_nri_request_duration_seconds_sum", event="create_container") > 0

        # Asking without exclusive CPUs: the creation fails, and is counted as an error.
        with pytest.raises(PluginFailed):
            await node.sim.create_container(
                make_container(
                    NAMING, pod, "c-bad", "bad", cpus="", annotations=marker(node.key, "shared-cpus-1")
                )
            )
        after_error = await node.scrape()
        assert value(after_error, REQUESTS, event="create_container", outcome="error") == 1
        assert value(after_error, REQUESTS, event="create_container", outcome="ok") == 2
        assert value(after_error, DURATION_COUNT, event="create_container") == 3
        assert value(after_error, "mixed_cpu_shared_containers") == 1
        assert value(after_error, CREATIONS, outcome="granted") == 1, "the plain container asked nothing"
        assert value(after_error, CREATIONS, outcome="pod_spec") == 1
        assert value(after_error, CREATIONS, outcome="node") == 0

        await node.sim.stop_container("c-fwd")
        after_stop = await node.scrape()
        assert value(after_stop, REQUESTS, event="stop_container", outcome="ok") == 1
        assert value(after_stop, "mixed_cpu_shared_containers") == 0
        await node.sim.remove_container("c-fwd")
        after_remove = await node.scrape()
        # RemoveContainer comes on its own NRI v0.12 method; StateChange would count the same.
        assert value(after_remove, REQUESTS, event="remove_container", outcome="ok") == 1
        assert value(after_remove, "mixed_cpu_shared_containers") == 0
        assert value(after_remove, "mixed_cpu_cgroup_write_failures_total", kind="pod_quota_raise") == 0


@pytest.mark.asyncio
async def test_synchronize_size_and_the_process_are_exported(short_dir: Path) -> None:
    """The runtime restarts with a pod and two containers running: the second Synchronize's size."""
    tree = FakeCgroups(short_dir / "cgroup", 1)
    async with observed(short_dir, tree.layout, reconnect=True, backoff=Backoff(0.01, 0.05)) as node:
        await node.sim.wait_for_plugins(1, GUARD)
        empty = await node.scrape()
        assert value(empty, "mixed_cpu_nri_synchronize_pods") == 0
        assert value(empty, "mixed_cpu_nri_synchronize_containers") == 0
        assert value(empty, "mixed_cpu_nri_synchronize_bytes") > 0, "an empty request still has bytes"
        assert value(empty, "process_resident_memory_bytes") > 0
        # The first Synchronize and Configure, kept after the fact (no scrape could see them happen).
        first_sync = value(empty, "mixed_cpu_nri_synchronize_timestamp_seconds")
        assert 0 < first_sync <= time.time()
        assert value(empty, "mixed_cpu_nri_synchronize_duration_seconds") > 0
        assert 0 < value(empty, "mixed_cpu_nri_configure_timestamp_seconds") <= first_sync
        assert value(empty, "mixed_cpu_nri_configure_duration_seconds") > 0
        pod = make_pod(NAMING, "1212-3434", name="fwd")
        tree.add_pod(pod, 3 * PERIOD)
        await node.sim.run_pod_sandbox(pod)
        await node.sim.create_container(asking(pod, node.key, "c-fwd", "fwd", "shared-cpus-0"))
        await node.sim.create_container(make_container(NAMING, pod, "c-side", "sidecar", cpus="6"))

        second = RuntimeSimulator(node.sim.socket_path)
        second.restore(node.sim)
        await node.sim.close()
        node.sim = second
        await second.start()
        await second.wait_for_plugins(1, GUARD)
        await asyncio.wait_for(node.stub.ready.wait(), GUARD)
        found = await node.scrape()
        assert value(found, REQUESTS, event="synchronize", outcome="ok") == 2
        assert value(found, "mixed_cpu_nri_synchronize_pods") == 1
        assert value(found, "mixed_cpu_nri_synchronize_containers") == 2
        grown = value(found, "mixed_cpu_nri_synchronize_bytes")
        assert value(found, "mixed_cpu_nri_synchronize_timestamp_seconds") > first_sync
        assert grown > value(empty, "mixed_cpu_nri_synchronize_bytes")


@pytest.mark.asyncio
async def test_state_change_events_are_counted_by_event(short_dir: Path) -> None:
    """An NRI v0.11 runtime (CRI-O 1.36) sends RemoveContainer inside StateChange."""
    tree = FakeCgroups(short_dir / "cgroup", 1)
    metrics = Metrics()
    plugin, _ = make_plugin(short_dir / "state", tree.layout, observer=metrics)
    socket_path = short_dir / "nri.sock"
    async with (
        RuntimeSimulator(socket_path, runtime_name="cri-o", runtime_version="1.36.3", nri_version="") as sim,
        plugin_running(plugin, socket_path, observer=metrics),
    ):
        await sim.wait_for_plugins(1, GUARD)
        pod = make_pod(Naming("cri-o", "cgroupfs"), "3333-4444")
        tree.add_pod(pod, 2 * PERIOD)
        await sim.run_pod_sandbox(pod)
        await sim.create_container(make_container(Naming("cri-o", "cgroupfs"), pod, "c1"))
        await sim.remove_container("c1")
        assert any(r.event == "StateChange" for r in sim.records)
        found = _parse(metrics)
        assert value(found, REQUESTS, event="remove_container", outcome="ok") == 1
        assert value(found, REQUESTS, event="create_container", outcome="ok") == 1


def _parse(metrics: Metrics) -> Samples:
    return samples(metrics.render().decode())


@pytest.mark.asyncio
async def test_cgroup_write_failure_is_counted(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pod cgroup cannot be written (as with /sys/fs/cgroup mounted read-only): the creation is
    refused, the write failure counted, and the plugin goes on serving."""
    tree = FakeCgroups(short_dir / "cgroup", 1)
    async with observed(short_dir, tree.layout) as node:
        await node.sim.wait_for_plugins(1, GUARD)
        pod = make_pod(NAMING, "5555-6666")
        tree.add_pod(pod, 2 * PERIOD)
        await node.sim.run_pod_sandbox(pod)
        real_open = os.open

        def read_only(path: str, flags: int, *args: object, **kwargs: object) -> int:
            if str(path).endswith("cpu.cfs_quota_us") and flags & _FOR_WRITING:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

        with monkeypatch.context() as patch:
            patch.setattr(os, "open", read_only)
            with pytest.raises(PluginFailed, match="Read-only file system"):
                await node.sim.create_container(asking(pod, node.key, "c1", "fwd", "shared-cpus-0"))
        found = await node.scrape()
        assert value(found, "mixed_cpu_cgroup_write_failures_total", kind="pod_quota_raise") == 1
        assert value(found, "mixed_cpu_cgroup_write_failures_total", kind="pod_quota_lower") == 0
        assert value(found, REQUESTS, event="create_container", outcome="error") == 1
        assert value(found, CREATIONS, outcome="cgroup") == 1
        assert value(found, CREATIONS, outcome="granted") == 0
        assert value(found, "mixed_cpu_shared_containers") == 0
        # Writable again: the same request succeeds.
        await node.sim.create_container(asking(pod, node.key, "c2", "fwd", "shared-cpus-0"))
        found = await node.scrape()
        assert value(found, "mixed_cpu_cgroup_write_failures_total", kind="pod_quota_raise") == 1
        assert value(found, "mixed_cpu_shared_containers") == 1


@pytest.mark.asyncio
async def test_kernel_refusal_is_counted(short_dir: Path) -> None:
    """The real kernel (cgroup v1) refuses a pod quota above its parent's: a genuine write failure."""
    layout = require_v1_layout()
    top = f"mixed-cpu-metrics-{os.getpid()}-{secrets.token_hex(4)}"
    kubepods = Path(layout.cpu.mount_point, top, "kubepods")
    pod_dir = kubepods / "pod7777"
    pod_dir.mkdir(parents=True)
    try:
        # The pod's parent allows 3 CPUs; raising the pod from 3 to 5 CPUs goes above it.
        write_cpu_quota(layout.cpu.dir(CgroupPath((top, "kubepods"))), 3 * PERIOD)
        write_cpu_quota(layout.cpu.dir(CgroupPath((top, "kubepods", "pod7777"))), 3 * PERIOD)
        async with observed(short_dir, layout) as node:
            await node.sim.wait_for_plugins(1, GUARD)
            pod = api.PodSandbox(id="s7", uid="7777", name="p", namespace="ns")
            pod.linux.cgroup_parent = f"/{top}/kubepods/pod7777"
            await node.sim.run_pod_sandbox(pod)
            container = asking(pod, node.key, "c7", "fwd", "shared-cpus-0")
            container.linux.cgroups_path = f"{pod.linux.cgroup_parent}/c7"
            with pytest.raises(PluginFailed, match="Invalid argument"):
                await node.sim.create_container(container)
            found = await node.scrape()
            assert value(found, "mixed_cpu_cgroup_write_failures_total", kind="pod_quota_raise") == 1
            assert value(found, "mixed_cpu_shared_containers") == 0
    finally:
        for path in (pod_dir, kubepods, kubepods.parent):
            with contextlib.suppress(FileNotFoundError):
                path.rmdir()


@pytest.mark.asyncio
async def test_reconnect_is_counted_and_readiness_follows_the_runtime(short_dir: Path) -> None:
    tree = FakeCgroups(short_dir / "cgroup", 1)
    async with observed(
        short_dir, tree.layout, sim_started=False, reconnect=True, backoff=Backoff(0.01, 0.05)
    ) as node:
        # No runtime yet: alive, not ready.
        assert (await get("127.0.0.1", node.port, "/healthz")).status == 200
        unready = await get("127.0.0.1", node.port, "/readyz")
        assert unready.status == 503
        assert unready.text == "not ready: not registered with the runtime (NRI) yet\n"
        await node.sim.start()
        await node.sim.wait_for_plugins(1, GUARD)
        await asyncio.wait_for(node.stub.ready.wait(), GUARD)
        ready = await get("127.0.0.1", node.port, "/readyz")
        assert (ready.status, ready.text) == (200, "ok\n")
        assert value(await node.scrape(), "mixed_cpu_nri_reconnects_total") == 0

        # The runtime restarts: the stub reconnects and is synchronized again.
        await node.sim.close()
        second = RuntimeSimulator(node.sim.socket_path)
        node.sim = second
        await second.start()
        await second.wait_for_plugins(1, GUARD)
        await asyncio.wait_for(node.stub.ready.wait(), GUARD)
        found = await node.scrape()
        assert value(found, "mixed_cpu_nri_reconnects_total") == 1
        assert value(found, REQUESTS, event="configure", outcome="ok") == 2
        assert value(found, REQUESTS, event="synchronize", outcome="ok") == 2
        assert value(found, "mixed_cpu_nri_ready") == 1
        assert (await get("127.0.0.1", node.port, "/readyz")).status == 200


def test_every_metric_is_exposed_before_anything_happens() -> None:
    """What a dashboard can rely on from the first scrape (the documented names)."""
    text = Metrics().render().decode()
    for name in (
        "mixed_cpu_nri_requests",
        "mixed_cpu_nri_request_duration_seconds",
        "mixed_cpu_shared_containers",
        "mixed_cpu_cgroup_write_failures",
        "mixed_cpu_nri_reconnects",
        "mixed_cpu_device_plugin_registrations",
        "mixed_cpu_nri_ready",
        "mixed_cpu_kubelet_registered",
        "mixed_cpu_probe_connections_evicted",
        "mixed_cpu_shared_creations",
        "mixed_cpu_nri_synchronize_containers",
        "mixed_cpu_nri_synchronize_duration_seconds",
        "mixed_cpu_nri_synchronize_timestamp_seconds",
        "mixed_cpu_nri_configure_duration_seconds",
        "mixed_cpu_nri_configure_timestamp_seconds",
        "mixed_cpu_device_plugin_enabled",
        "mixed_cpu_pod_resources_enabled",
        "mixed_cpu_dra_enabled",
        "mixed_cpu_dra_publishing_enabled",
        "process_resident_memory_bytes",
    ):
        assert f"# TYPE {name}" in text, name
    assert 'mixed_cpu_cgroup_write_failures_total{kind="pod_quota_lower"} 0.0' in text
    assert 'mixed_cpu_device_plugin_registrations_total{outcome="failed"} 0.0' in text
    assert 'mixed_cpu_probe_connections_evicted_total{reason="peer_limit"} 0.0' in text
    assert 'mixed_cpu_probe_connections_evicted_total{reason="total_limit"} 0.0' in text
    assert 'mixed_cpu_probe_connections_evicted_total{reason="hard_limit"} 0.0' in text
    assert 'mixed_cpu_shared_creations_total{outcome="state_file"} 0.0' in text


def test_observer_cost_per_request() -> None:
    """A measurement for the record, not a test of speed: what the observer adds to each request
    (two clock reads and `request_done`, i.e. one counter and one histogram update). Printed with -s."""
    metrics = Metrics()
    rounds = 50_000
    started = time.perf_counter()
    for i in range(rounds):
        t0 = time.perf_counter()
        metrics.request_done("create_container", "ok", time.perf_counter() - t0 + i % 7 * 1e-4)
    per_call = (time.perf_counter() - started) / rounds
    print(f"\nobserver cost per request: {per_call * 1e6:.2f} us over {rounds} calls")
    found = _parse(metrics)
    assert value(found, REQUESTS, event="create_container", outcome="ok") == rounds
    assert value(found, DURATION_COUNT, event="create_container") == rounds
    assert len(DURATION_BUCKETS) + 1 == sum(
        1 for (name, _) in found if name == "mixed_cpu_nri_request_duration_seconds_bucket"
    )
