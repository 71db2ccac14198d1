"""Fault 4: kubelet restarts. Its new instance deletes every socket in the device-plugin directory
and listens again; the daemon's device plugin notices, serves a new socket and registers again. The
NRI side keeps serving the runtime the whole time, and every container stays consistent."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_kubelet import FakeKubelet
from fault_support import PERIOD, daemon_running, inconsistencies, make_node, until, within, write_config

RESOURCE = "workload.openshift.io/enable-shared-cpus"


async def allocate(kubelet: FakeKubelet, device: str) -> dict[str, str]:
    """kubelet admits a container asking for one device: the annotations it passes to the runtime."""
    [container] = (await kubelet.allocate(RESOURCE, [device])).container_responses
    return dict(container.annotations)


@pytest.mark.asyncio
async def test_kubelet_restart(short_dir: Path) -> None:
    plugin_dir = short_dir / "kubelet"
    node = make_node(short_dir, 1)
    population, runtime = node.population, node.runtime
    config = write_config(short_dir, node.tree, plugin_dir=plugin_dir)
    kubelet = await FakeKubelet(plugin_dir).start()
    try:
        async with runtime, daemon_running(config, node.socket) as daemon:
            await within(runtime.wait_for_plugins(1, timeout=None))
            await within(kubelet.registered.wait())
            fwd = population.pod("fwd", 3 * PERIOD)
            duo = population.pod("duo", 4 * PERIOD)
            await population.create(
                fwd, "fwd-a", "fwd", "2-3", asks=True, annotations=await allocate(kubelet, "shared-cpus-0")
            )
            await population.create(fwd, "fwd-side", "sidecar", "4")
            await population.create(
                duo, "duo-a", "left", "5-6", asks=True, annotations=await allocate(kubelet, "shared-cpus-1")
            )
            await population.create(
                duo, "duo-b", "right", "7-8", asks=True, annotations=await allocate(kubelet, "shared-cpus-2")
            )
            assert inconsistencies(population) == []

            await kubelet.stop()  # kubelet goes away ...
            # ... and the NRI side keeps serving: a container restarts (its marker with it), another
            # is created, one stops.
            await population.restart("fwd-a", "fwd-a2")
            await population.create(duo, "duo-c", "third", "9")
            await runtime.stop_container("duo-b")
            assert inconsistencies(population) == []

            kubelet = await FakeKubelet(plugin_dir).start()  # deletes every socket, then listens
            # How fast is the device-plugin tests' business (tests/deviceplugin); here, that it happens.
            await within(kubelet.registered.wait())
            await within(kubelet.wait_lists(RESOURCE, 1))
            await daemon.wait_log("device plugin registration lost, registering again")
            # kubelet holds the registration before the daemon has logged its success: wait for the line.
            await until(lambda: len(daemon.logged("registered with kubelet")) >= 2)
            late = population.pod("late", 2 * PERIOD)
            await population.create(
                late,
                "late-a",
                "fwd",
                "13-14",
                asks=True,
                annotations=await allocate(kubelet, "shared-cpus-3"),
            )
            assert inconsistencies(population) == []
    finally:
        await kubelet.stop()
