"""A scripted day of a node: the real daemon (``run``, a subprocess) against the runtime simulator, in
a directory of its own (fake cgroup v1 tree, state dir, kubelet's device-plugin directory), told a
story that touches every signal an operator reads: containers granted, a creation refused for each
reason, a heal, the runtime restarting (a reconnect and a Synchronize that finds pods).

`story_node` starts it; `tell_the_story` drives it. tests/test_refusals.py reads the daemon's own
/metrics after it, tests/test_prometheus.py has a real Prometheus scrape it and evaluates the
dashboard's queries and the alert rules' expressions, scripts/render_dashboard.py can draw from it.

Each refusal, as it comes on a node:

* ``pod_spec``: a Burstable pod asks (no exclusive CPUs);
* ``node``: the runtime sends a cpuset that is no cpu list;
* ``cgroup``: the pod's cgroup is not there (kubelet removed it, a wrong cgroup_root): it cannot be
  opened, so nothing is written, and no cgroup *write* fails;
* ``state_file``: the books cannot be saved. A full disk is what does it on a node; here the daemon
  is given a file size limit (RLIMIT_FSIZE, set on it from outside with prlimit(2)) that the state
  file's next write exceeds: the kernel refuses the write (EFBIG) as it would a write to a full disk
  (ENOSPC), and the limit is lifted after.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from mixedcpu_support import (
    PERIOD,
    FakeCgroups,
    Naming,
    make_container,
    make_pod,
    marker,
    write_daemon_config,
)
from probe_support import GUARD, Samples, daemon_with_probes, scrape, value

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import write_cpu_quota
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key
from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.nri.simulator import PluginFailed, RuntimeSimulator

__all__ = ["REFUSALS", "StoryNode", "story_node", "tell_the_story"]

NAMING = Naming("containerd", "cgroupfs")
CREATIONS = "mixed_cpu_shared_creations_total"
# Each reason a creation is refused for, and how many times the story has one refused for it.
REFUSALS = {"pod_spec": 2, "node": 1, "cgroup": 3, "state_file": 1}
GRANTED = 4
# Bytes a file of the daemon may grow to while the state file must fail: more than a pod quota
# (``400000\n``), less than any state file snapshot or journal line.
_SMALL_FILES_ONLY = 16


@dataclass
class StoryNode:
    """The daemon (`proc`, its stderr `lines`) serving metrics on `host`:`port`, the runtime `sim`."""

    root: Path
    proc: asyncio.subprocess.Process
    host: str
    port: int
    sim: RuntimeSimulator
    tree: FakeCgroups
    key: HostKey
    lines: list[str]
    pods: int = 0
    told: list[str] = field(default_factory=list)

    async def scrape(self) -> Samples:
        return await scrape(self.host, self.port)

    def new_pod(self, *, qos: str = "", cgroup: bool = True, quota: int = 2 * PERIOD) -> api.PodSandbox:
        self.pods += 1
        pod = make_pod(NAMING, f"{self.pods:04d}-story", qos=qos, name=f"app-{self.pods}")
        if cgroup:
            self.tree.add_pod(pod, quota)
        return pod

    def asking(self, pod: api.PodSandbox, cid: str, *, cpus: str = "2-3") -> api.Container:
        return make_container(NAMING, pod, cid, cpus=cpus, annotations=marker(self.key, f"shared-cpus-{cid}"))


@contextlib.asynccontextmanager
async def story_node(
    root: Path, plugin_dir: Path, *, reconcile_interval: float = 1.0
) -> AsyncIterator[StoryNode]:
    """The daemon serving the simulator, once it is synchronized; SIGTERM after the body (killed if it
    does not end)."""
    # Every part on, each in this directory: the device plugin (no kubelet: never registered), kubelet's
    # PodResources API (no socket: not reachable), the DRA front door (no kubelet plugin watcher, and
    # no API server: it publishes no ResourceSlices).
    config = write_daemon_config(
        root,
        plugin_dir,
        extra=f"reconcile_interval = {reconcile_interval}\n[dra]\nenabled = true\n"
        f'node_name = "story-node"\npublish_resource_slices = false\nregistry_dir = "{root}/reg"\n'
        f'plugins_dir = "{root}/plugins"\ncdi_dir = "{root}/cdi"\n',
        device_plugin_extra=f'pod_resources_socket = "{root}/pod-resources.sock"\n',
    )
    socket_path = root / "nri.sock"
    tree = FakeCgroups(root / "cgroup", 1)
    lines: list[str] = []
    sim = RuntimeSimulator(socket_path, runtime_name="containerd", runtime_version="v2.3.4")
    await sim.start()
    node: StoryNode | None = None
    try:
        async with daemon_with_probes(config, socket_path, lines) as (proc, host, port):
            await sim.wait_for_synchronizations(1, GUARD)
            key = load_or_create_host_key(root / "state")
            node = StoryNode(root, proc, host, port, sim, tree, key, lines)
            yield node
    finally:
        await (sim if node is None else node.sim).close()


async def _refused(node: StoryNode, container: api.Container, reason: str) -> None:
    with contextlib.suppress(PluginFailed):
        await node.sim.create_container(container)
        raise AssertionError(f"the creation of {container.id} was to be refused ({reason})")
    node.told.append(f"refused: {reason}")


async def tell_the_story(node: StoryNode) -> None:
    """Grants, a refusal for each reason (`REFUSALS` times), a pod quota put right by the
    reconciler, then the runtime restarting with the pods it runs: a reconnect and a Synchronize."""
    granted = []
    for n in range(GRANTED):
        pod = node.new_pod()
        await node.sim.run_pod_sandbox(pod)
        await node.sim.create_container(node.asking(pod, f"grant{n}"))
        granted.append(pod)
    node.told.append(f"granted: {GRANTED}")

    for n in range(REFUSALS["pod_spec"]):
        pod = node.new_pod(qos="burstable")
        await node.sim.run_pod_sandbox(pod)
        await _refused(node, node.asking(pod, f"burst{n}"), "pod_spec")
    for n in range(REFUSALS["node"]):
        pod = node.new_pod()
        await node.sim.run_pod_sandbox(pod)
        await _refused(node, node.asking(pod, f"garbled{n}", cpus="2-x"), "node")
    for n in range(REFUSALS["cgroup"]):
        pod = node.new_pod(cgroup=False)
        await node.sim.run_pod_sandbox(pod)
        await _refused(node, node.asking(pod, f"nocg{n}"), "cgroup")
    for n in range(REFUSALS["state_file"]):
        pod = node.new_pod()
        await node.sim.run_pod_sandbox(pod)
        limit = (_SMALL_FILES_ONLY, resource.RLIM_INFINITY)
        before = resource.prlimit(node.proc.pid, resource.RLIMIT_FSIZE, limit)
        try:
            await _refused(node, node.asking(pod, f"full{n}"), "state_file")
        finally:
            resource.prlimit(node.proc.pid, resource.RLIMIT_FSIZE, before)

    # Someone writes a granted pod's quota back down: the reconciler puts it right (a heal).
    write_cpu_quota(node.tree.pod_dir(granted[0]), PERIOD)

    async def healed() -> None:
        # The daemon is another process: its metrics are the only word of the heal.
        while value(await node.scrape(), "mixed_cpu_heals_total", kind="pod_quota") < 1:  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    await asyncio.wait_for(healed(), GUARD)
    node.told.append("healed: pod_quota")

    # The runtime restarts, its pods still running: the daemon reconnects and is synchronized.
    second = RuntimeSimulator(node.sim.socket_path, runtime_name="containerd", runtime_version="v2.3.4")
    second.restore(node.sim)
    await node.sim.close()
    node.sim = second
    await second.start()
    await second.wait_for_synchronizations(1, GUARD)
    node.told.append("reconnected")
