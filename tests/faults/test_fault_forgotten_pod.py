"""Fault 7a: containerd forgets its pods across its own restart (its issue 8426), and kubelet gives the
forgotten pod's device to a new pod (issue 29, items 2 and 3), through the daemon process.

The runtime simulator restarts with `RuntimeModes.forgets_pods_on_restart` and then loses the pod with
no event at all (`RuntimeSimulator.lose_pod`: no StopPodSandbox, RemovePodSandbox, StopContainer or
RemoveContainer; its cgroups gone). kubelet (the fake kubelet of the device-plugin tests, through the
daemon's own device plugin) allocates the device again: the new pod's marker, from that Allocate, is
granted at its first creation, without waiting for any look. Copies of the old marker and of the new
one, in pods kubelet gave nothing, are refused: before the reconciler has looked, after it dropped
the forgotten pod's books, and after a daemon restart. In both marker-only configurations: no
PodResources socket configured, and one configured whose socket is absent (kubelet's record never
answers)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_kubelet import FakeKubelet
from fault_support import PERIOD, daemon_running, inconsistencies, make_node, within, write_config

from nri_plugin.mixedcpu.store import StateStore

RESOURCE = "workload.openshift.io/enable-shared-cpus"
INTERVAL = 2  # the reconcile interval of these daemons, in seconds
DEVICE = "shared-cpus-7"


async def allocate(kubelet: FakeKubelet, device: str) -> dict[str, str]:
    """kubelet admits a container asking for one device: the annotations it passes to the runtime."""
    [container] = (await kubelet.allocate(RESOURCE, [device])).container_responses
    return dict(container.annotations)


@pytest.mark.asyncio
@pytest.mark.parametrize("pod_resources", ["not-configured", "configured-but-absent"])
async def test_a_forgotten_pods_device_is_granted_to_kubelets_next_allocation_at_once(
    short_dir: Path, pod_resources: str
) -> None:
    plugin_dir = short_dir / "kubelet"
    node = make_node(short_dir, 1)  # containerd's naming, cgroupfs driver, v1
    population, first = node.population, node.runtime
    first.modes.forgets_pods_on_restart = True
    socket = "" if pod_resources == "not-configured" else str(short_dir / "pod-resources" / "kubelet.sock")
    config = write_config(
        short_dir,
        node.tree,
        plugin_dir=plugin_dir,
        extra=f"reconcile_interval = {INTERVAL}",
        device_plugin=f'pod_resources_socket = "{socket}"',
    )
    kubelet = await FakeKubelet(plugin_dir).start()
    try:
        async with daemon_running(config, node.socket) as daemon:
            async with first:
                await within(first.wait_for_plugins(1, timeout=None))
                await within(kubelet.registered.wait())
                old_marker = await allocate(kubelet, DEVICE)
                old = population.pod("old", 2 * PERIOD)
                await population.create(old, "old-a", "fwd", "2-3", asks=True, annotations=old_marker)
                assert inconsistencies(population) == []
            # containerd restarts: it restores its containers for NRI, and forgets its pods ...
            second = population.runtime = first.restarted()
            async with second:
                await within(second.wait_for_plugins(1, timeout=None))
                # ... then loses the pod with no event at all; kubelet removes its cgroups.
                assert await second.lose_pod(old.id) == ["old-a"]
                node.tree.delete_pod(old)
                del population.pods[old.id]
                # kubelet gives the device to a new pod: its fresh marker is granted at once.
                new_marker = await allocate(kubelet, DEVICE)
                assert new_marker != old_marker
                new = population.pod("new", 2 * PERIOD)
                await population.create(new, "new-a", "fwd", "4-5", asks=True, annotations=new_marker)
                assert not daemon.logged("request refused"), daemon.stderr
                await within(daemon.wait_log("shared CPUs given", "container_id=new-a"))
                # Copies of either marker in pods kubelet gave nothing: refused.
                thief = population.pod("thief", 2 * PERIOD)
                await population.create(thief, "copy-old", "x", "6-7", annotations=dict(old_marker))
                await population.create(thief, "copy-new", "y", "8-9", annotations=dict(new_marker))
                for cid in ("copy-old", "copy-new"):
                    line = await within(daemon.wait_log("request refused", f"container_id={cid}"))
                    assert "a replayed marker" in line, line
                # The reconciler drops the forgotten pod's books at its second look; the binding
                # is not its to end, and the old marker stays spent.
                await within(daemon.wait_log("pod gone", "pod_key=old"))
                await population.create(thief, "copy-old-2", "z", "10-11", annotations=dict(old_marker))
                line = await within(daemon.wait_log("request refused", "container_id=copy-old-2"))
                assert "a replayed marker" in line, line
                assert inconsistencies(population) == []
        books = StateStore(node.state).load()
        assert books.spent[DEVICE].pod == "new"
        assert inconsistencies(population, books=books) == []
        # A restarted daemon still refuses the old marker (the allocations presented are saved).
        async with daemon_running(config, node.socket) as daemon, population.runtime.restarted() as third:
            population.runtime = third
            await within(third.wait_for_plugins(1, timeout=None))
            other = population.pod("other", 2 * PERIOD)
            await population.create(other, "copy-old-3", "w", "12-13", annotations=dict(old_marker))
            line = await within(daemon.wait_log("request refused", "container_id=copy-old-3"))
            assert "a replayed marker" in line, line
            assert inconsistencies(population) == []
    finally:
        await kubelet.stop()
