"""``mixed-cpu-nri-plugin demo``: the plugin against the built-in runtime simulator, in one process.

A synthetic 4-CPU node (CPUs 0-1 shared, 2-3 exclusive) runs a short scenario through real NRI over a
unix socket in a temporary directory, and the demo prints, for every step, what the runtime asked and
what the plugin changed.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from api.nri import api_pb2 as api
from nri_plugin.events import events_in
from nri_plugin.simulator import PluginFailed, RuntimeSimulator, env_of
from nri_plugin.stub import Stub

SHARED_CPUS = "0-1"
REQUEST_ANNOTATION = "cpu-shared.crio.io/"
ENV_KEYS = ("OPENSHIFT_SHARED_CPUS", "OPENSHIFT_ISOLATED_CPUS")


class DemoPlugin:
    """The demo's placeholder policy: the real mixed-CPU policy replaces it.

    A container whose pod carries ``cpu-shared.crio.io/<container>: enable`` gets the shared CPUs
    appended to its cpuset and both CPU sets in its environment; kubelet's later cpuset updates get the
    shared CPUs re-added. It does not touch CFS quotas, verify requests or check exclusivity.
    """

    def __init__(self, shared: str) -> None:
        self.shared = shared

    def _asks(self, pod: api.PodSandbox, container: api.Container) -> bool:
        return pod.annotations.get(REQUEST_ANNOTATION + container.name) == "enable"

    async def create_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> api.CreateContainerResponse | None:
        if not self._asks(pod, container):
            return None
        exclusive = container.linux.resources.cpu.cpus
        adjust = api.ContainerAdjustment()
        adjust.linux.resources.cpu.cpus = f"{self.shared},{exclusive}" if exclusive else self.shared
        adjust.env.add(key="OPENSHIFT_SHARED_CPUS", value=self.shared)
        adjust.env.add(key="OPENSHIFT_ISOLATED_CPUS", value=exclusive)
        return api.CreateContainerResponse(adjust=adjust)

    async def update_container(
        self, pod: api.PodSandbox, container: api.Container, resources: api.LinuxResources
    ) -> Sequence[api.ContainerUpdate]:
        if not self._asks(pod, container) or not resources.cpu.cpus:
            return ()
        update = api.ContainerUpdate(container_id=container.id)
        update.linux.resources.cpu.cpus = f"{self.shared},{resources.cpu.cpus}"
        return (update,)


def _pod(uid: str, namespace: str, name: str, annotations: dict[str, str] | None = None) -> api.PodSandbox:
    pod = api.PodSandbox(id=f"pod-{uid}", uid=uid, namespace=namespace, name=name, annotations=annotations)
    pod.linux.cgroup_parent = f"/kubepods/pod{uid}"
    return pod


def _container(pod: api.PodSandbox, cid: str, name: str, cpus: str, quota: int) -> api.Container:
    container = api.Container(id=cid, pod_sandbox_id=pod.id, name=name, env=["PATH=/usr/bin"])
    container.linux.cgroups_path = f"{pod.linux.cgroup_parent}/{cid}"
    cpu = container.linux.resources.cpu
    cpu.cpus = cpus
    cpu.quota.value = quota
    cpu.period.value = 100000
    return container


def _describe(container: api.Container) -> str:
    cpu = container.linux.resources.cpu
    quota = cpu.quota.value if cpu.HasField("quota") else "unset"
    env = env_of(container)
    shown = " ".join(f"{k}={env[k]}" for k in ENV_KEYS if k in env) or "-"
    return f"cpus={cpu.cpus or '-':<6} quota={quota!s:<7} env: {shown}"


async def run_demo(out: TextIO, *, runtime_name: str = "containerd", runtime_version: str = "v2.3.4") -> int:
    """Run the scenario and print it; returns a process exit status."""
    with tempfile.TemporaryDirectory(prefix="mixed-cpu-demo-") as tmp:
        socket_path = str(Path(tmp) / "nri.sock")
        async with RuntimeSimulator(
            socket_path, runtime_name=runtime_name, runtime_version=runtime_version
        ) as sim:
            return await _scenario(sim, socket_path, out)


async def _scenario(sim: RuntimeSimulator, socket_path: str, out: TextIO) -> int:
    def say(text: str = "") -> None:
        print(text, file=out)

    monitoring = _pod("1111", "monitoring", "node-exporter")
    exporter = _container(monitoring, "exporter", "exporter", "0-1", 20000)
    sim.add_pod(monitoring)
    sim.add_container(exporter)

    say(
        f"NRI runtime simulator: {sim.runtime_name} {sim.runtime_version} (NRI {sim.nri_version}), "
        f"socket {socket_path}"
    )
    say(f"node: CPUs 0-3, shared pool {SHARED_CPUS}; 1 pod already running")
    stub = Stub(
        DemoPlugin(SHARED_CPUS), name="mixed-cpu", index="10", socket_path=socket_path, reconnect=False
    )
    task = asyncio.ensure_future(stub.run())
    try:
        [plugin] = await sim.wait_for_plugins(1)
        say(
            f"plugin {plugin.full_name} registered, subscribed to "
            + ", ".join(e.name for e in events_in(plugin.events))
        )
        say(f"synchronized: {len(sim.pods)} pod(s), {len(sim.containers)} container(s)")
        say()
        packet = _pod("2222", "telco", "packet-fwd", {REQUEST_ANNOTATION + "fwd": "enable"})
        fwd = _container(packet, "fwd", "fwd", "2-3", 200000)
        sidecar = _container(packet, "sidecar", "sidecar", "2-3", 200000)
        await sim.run_pod_sandbox(packet)
        for container in (fwd, sidecar):
            asks = (
                "asks for shared CPUs" if DemoPlugin(SHARED_CPUS)._asks(packet, container) else "no request"
            )
            say(f"CreateContainer {packet.namespace}/{packet.name}/{container.name} ({asks})")
            say(f"  before: {_describe(container)}")
            try:
                result = await sim.create_container(container)
            except PluginFailed as exc:
                say(f"  FAILED: {exc}")
                continue
            say(f"  after:  {_describe(result.container)}")
        say()
        say("kubelet CPU manager: UpdateContainerResources(fwd, cpus=2-3)")
        resources = api.LinuxResources()
        resources.cpu.cpus = "2-3"
        applied = await sim.update_container("fwd", resources)
        say(f"  applied: cpus={applied.cpu.cpus}")
        await sim.stop_container("fwd")
        await sim.remove_container("fwd")
        say("StopContainer, RemoveContainer fwd: done")
        say()
        failed = sum(r.outcome != "ok" for r in sim.records)
        say(f"{len(sim.records)} NRI exchanges, {failed} failed; plugin still connected: {bool(sim.plugins)}")
        return 0
    finally:
        stub.stop()
        await task
