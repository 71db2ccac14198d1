"""Readiness and metrics with the device plugin: ``/readyz`` waits for both the runtime and kubelet, and
registrations are counted. In process (stub, simulator, fake kubelet, probe server) and through the
daemon (``run`` as a subprocess), over real unix sockets and real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from fake_kubelet import FakeKubelet
from mixedcpu_support import (
    PERIOD,
    FakeCgroups,
    Naming,
    make_container,
    make_plugin,
    make_pod,
    plugin_running,
    write_daemon_config,
)
from probe_support import GUARD, Reply, daemon_with_probes, get, scrape, value

from nri_plugin.common.backoff import Backoff
from nri_plugin.daemon.metrics import Metrics
from nri_plugin.daemon.probes import ProbeServer, readiness
from nri_plugin.daemon.wiring import bind_gauges
from nri_plugin.deviceplugin.config import DevicePluginConfig
from nri_plugin.deviceplugin.marker import ANNOTATION_KEY, HostKey
from nri_plugin.deviceplugin.server import DevicePluginServer
from nri_plugin.nri.simulator import RuntimeSimulator

RESOURCE = "workload.openshift.io/enable-shared-cpus"
HOST = "127.0.0.1"
NAMING = Naming("containerd", "cgroupfs")
REGISTRATIONS = "mixed_cpu_device_plugin_registrations_total"


async def eventually(check: Callable[[], object]) -> None:
    """Until `check()` is true (awaited if it is a coroutine); GUARD against a hang."""

    async def poll() -> None:
        for _ in itertools.count():
            result = check()
            if asyncio.iscoroutine(result):
                result = await result
            if result:
                return
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), GUARD)


async def readyz(port: int) -> Reply:
    return await get(HOST, port, "/readyz")


@contextlib.asynccontextmanager
async def daemon_in_process(
    root: Path, config: DevicePluginConfig, key: HostKey
) -> AsyncIterator[tuple[RuntimeSimulator, DevicePluginServer, int]]:
    """What ``run`` sets up, in this process: stub and device plugin observed, probes on a free port.
    The simulator is created but not started."""
    tree = FakeCgroups(root / "cgroup", 1)
    metrics = Metrics()
    plugin, _ = make_plugin(root / "state", tree.layout, observer=metrics)
    socket_path = root / "nri.sock"
    sim = RuntimeSimulator(socket_path)
    device_plugin = DevicePluginServer(
        config, key, check_interval=0.02, backoff=Backoff(0.01, 0.05), observer=metrics
    )
    try:
        async with plugin_running(plugin, socket_path, reconnect=True, observer=metrics) as stub:
            bind_gauges(metrics, stub, plugin, device_plugin)
            async with (
                ProbeServer(
                    f"{HOST}:0", metrics=metrics.render, readiness=readiness(stub, device_plugin)
                ) as probes,
                device_plugin,
            ):
                [address] = probes.bound
                yield sim, device_plugin, int(address.rpartition(":")[2])
    finally:
        await sim.close()


@pytest.mark.asyncio
async def test_ready_only_with_runtime_and_kubelet(
    tmp_path: Path, plugin_dir: Path, config: DevicePluginConfig, key: HostKey
) -> None:
    async with daemon_in_process(tmp_path, config, key) as (sim, device_plugin, port):
        neither = await readyz(port)
        assert (neither.status, neither.text) == (
            503,
            "not ready: not registered with the runtime (NRI) yet; not registered with kubelet yet\n",
        )
        await sim.start()
        await sim.wait_for_plugins(1, GUARD)
        await eventually(lambda: _text_is(port, "not ready: not registered with kubelet yet\n"))
        assert value(await scrape(HOST, port), "mixed_cpu_kubelet_registered") == 0

        kubelet = await FakeKubelet(plugin_dir).start()
        try:
            await asyncio.wait_for(kubelet.registered.wait(), GUARD)
            await eventually(lambda: _status_is(port, 200))
            assert (await readyz(port)).text == "ok\n"
            found = await scrape(HOST, port)
            assert value(found, "mixed_cpu_kubelet_registered") == 1
            assert value(found, "mixed_cpu_nri_ready") == 1
            assert value(found, REGISTRATIONS, outcome="ok") == 1
        finally:
            await kubelet.stop()
        # kubelet gone (kubelet.sock removed): not ready until it is back.
        await eventually(lambda: _text_is(port, "not ready: not registered with kubelet yet\n"))
        assert device_plugin.registered is False
        assert value(await scrape(HOST, port), "mixed_cpu_kubelet_registered") == 0


async def _status_is(port: int, status: int) -> bool:
    return (await readyz(port)).status == status


async def _failed_at_least(port: int, count: int) -> bool:
    return value(await scrape(HOST, port), REGISTRATIONS, outcome="failed") >= count


async def _text_is(port: int, text: str) -> bool:
    return (await readyz(port)).text == text


@pytest.mark.asyncio
async def test_refused_registrations_are_counted(
    tmp_path: Path, plugin_dir: Path, config: DevicePluginConfig, key: HostKey
) -> None:
    kubelet = await FakeKubelet(plugin_dir, reject="device plugins are not welcome here").start()
    try:
        async with daemon_in_process(tmp_path, config, key) as (sim, _, port):
            await sim.start()
            await sim.wait_for_plugins(1, GUARD)
            await eventually(lambda: kubelet.attempts >= 2)
            # kubelet has refused twice; the daemon counts each refusal once it has read the answer.
            await eventually(lambda: _failed_at_least(port, 2))
            found = await scrape(HOST, port)
            assert value(found, REGISTRATIONS, outcome="failed") >= 2
            assert value(found, REGISTRATIONS, outcome="ok") == 0
            assert (await readyz(port)).text == "not ready: not registered with kubelet yet\n"
    finally:
        await kubelet.stop()


@pytest.mark.asyncio
async def test_daemon_probes_and_metrics(tmp_path: Path, plugin_dir: Path) -> None:
    """``run`` as deployed, on a free metrics port: not ready until both registrations are done; a
    container's creation with its allocated marker shows in ``/metrics``."""
    config = write_daemon_config(tmp_path, plugin_dir)
    socket_path = tmp_path / "nri.sock"
    tree = FakeCgroups(tmp_path / "cgroup", 1)
    lines: list[str] = []
    async with daemon_with_probes(config, socket_path, lines) as (proc, host, port):
        assert (await get(host, port, "/healthz")).status == 200
        assert (await readyz(port)).status == 503
        async with RuntimeSimulator(socket_path) as sim:
            await sim.wait_for_plugins(1, GUARD)
            await eventually(lambda: _text_is(port, "not ready: not registered with kubelet yet\n"))
            kubelet = await FakeKubelet(plugin_dir).start()
            try:
                await asyncio.wait_for(kubelet.registered.wait(), GUARD)
                await eventually(lambda: _status_is(port, 200))

                response = await kubelet.allocate(RESOURCE, ["shared-cpus-0"])
                annotations = dict(response.container_responses[0].annotations)
                assert ANNOTATION_KEY in annotations
                pod = make_pod(NAMING, "8888-9999", name="fwd")
                tree.add_pod(pod, 2 * PERIOD)
                await sim.run_pod_sandbox(pod)
                await sim.create_container(
                    make_container(NAMING, pod, "c1", "fwd", cpus="2-3", annotations=annotations)
                )
                await sim.create_container(make_container(NAMING, pod, "c2", "side", cpus="3"))
                found = await scrape(host, port)
                creates = {"event": "create_container"}
                assert value(found, "mixed_cpu_nri_requests_total", outcome="ok", **creates) == 2
                assert value(found, "mixed_cpu_nri_request_duration_seconds_count", **creates) == 2
                assert value(found, "mixed_cpu_shared_containers") == 1
                assert value(found, "mixed_cpu_nri_ready") == 1
                assert value(found, "mixed_cpu_kubelet_registered") == 1
                assert value(found, REGISTRATIONS, outcome="ok") == 1
            finally:
                await kubelet.stop()
    print("\n".join(lines))  # shown when the test fails
    assert proc.returncode == 0
    assert not any("Traceback" in line for line in lines)
