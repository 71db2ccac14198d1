"""``mixed-cpu-nri-plugin demo``: the real plugin against the built-in runtime simulator, in one process.

A synthetic 8-CPU node (CPUs 0-1 shared) with its own sysfs, a cgroup v1 tree and a state dir, all in
a temporary directory, runs a short scenario through real NRI over a unix socket. For every step the
demo prints the container's cpuset, CFS quota and environment before and after, and the pod cgroup's
quota as the plugin left it in the tree. Pod and container cgroups are named as the chosen runtime
names them: containerd with the cgroupfs driver (``/kubepods/pod<uid>/<id>``), CRI-O with the systemd
driver (``kubepods-pod<uid>.slice`` and ``crio-<id>.scope``).

The node has two NUMA nodes, numbered as many two-socket machines do (even CPUs on node 0, odd ones on
node 1), one shared CPU on each, and NUMA-local shared CPUs on (``numa_local_shared_cpus``, off by
default, and the demo says it turns it on): a container gets the shared CPUs of
the nodes its exclusive CPUs are on. The forwarder's are on both nodes, so it gets both; the last
container's are on node 1 alone, so it gets node 1's.

Containers ask for shared CPUs the way a real pod does: kubelet's device manager hands the runtime
the allocation marker our device plugin returned, signed with the node's key (here the demo signs
it, as the device plugin would).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import (
    CgroupDir,
    CgroupLayout,
    format_cpuset,
    parse_cpuset,
    pod_cgroup_path,
    read_cpu_quota,
)
from nri_plugin.daemon.config import build_layout, load_config
from nri_plugin.daemon.wiring import build_plugin, load_marker_key
from nri_plugin.deviceplugin.marker import ANNOTATION_KEY
from nri_plugin.mixedcpu.policy import choose_shared, shared_by_node
from nri_plugin.nri.events import events_in
from nri_plugin.nri.identity import Identity
from nri_plugin.nri.simulator import PluginFailed, RuntimeSimulator, env_of
from nri_plugin.nri.stub import Stub

NODE_CPUS = "0-7"
SHARED_CPUS = "0-1"
# NUMA node -> its CPUs, interleaved as on many two-socket machines.
NUMA_NODES = {0: "0,2,4,6", 1: "1,3,5,7"}
PERIOD = 100_000
ENV_KEYS = ("OPENSHIFT_SHARED_CPUS", "OPENSHIFT_ISOLATED_CPUS")
CONFIG = """\
# The demo's config file: the shared pool, and the node's directories as this demo fakes them.
shared_cpuset = "{shared}"
cgroup_root = "{root}/cgroup"
cgroup_version = "v1"
sysfs_root = "{root}/sys"
state_dir = "{root}/state"
# Off by default; on here, to show a container given only its NUMA nodes' shared CPUs.
numa_local_shared_cpus = true
"""


@dataclass(frozen=True)
class Naming:
    """How one runtime and cgroup driver name a pod's and a container's cgroups."""

    driver: str

    def pod_parent(self, uid: str, qos: str = "") -> str:
        if self.driver == "systemd":
            level = f"kubepods-{qos}" if qos else "kubepods"
            return f"{level}-pod{uid.replace('-', '_')}.slice"
        return f"/kubepods/{qos}/pod{uid}" if qos else f"/kubepods/pod{uid}"

    def container_path(self, pod: api.PodSandbox, cid: str) -> str:
        if self.driver == "systemd":
            return f"{pod.linux.cgroup_parent}:crio:{cid}"
        return f"{pod.linux.cgroup_parent}/{cid}"

    def pod(self, uid: str, namespace: str, name: str, qos: str = "") -> api.PodSandbox:
        pod = api.PodSandbox(id=f"sandbox-{uid}", uid=uid, namespace=namespace, name=name)
        pod.linux.cgroup_parent = self.pod_parent(uid, qos)
        return pod

    def container(
        self,
        pod: api.PodSandbox,
        cid: str,
        name: str,
        *,
        cpus: str,
        quota: int,
        shares: int,
        env: tuple[str, ...] = (),
        annotations: dict[str, str] | None = None,
    ) -> api.Container:
        container = api.Container(
            id=cid, pod_sandbox_id=pod.id, name=name, env=["PATH=/usr/bin", *env], annotations=annotations
        )
        container.linux.cgroups_path = self.container_path(pod, cid)
        cpu = container.linux.resources.cpu
        cpu.cpus = cpus
        cpu.quota.value = quota
        cpu.period.value = PERIOD
        cpu.shares.value = shares
        return container


NAMING = {"containerd": Naming("cgroupfs"), "cri-o": Naming("systemd")}


def describe(container: api.Container) -> str:
    cpu = container.linux.resources.cpu
    quota = cpu.quota.value if cpu.HasField("quota") else "unset"
    env = env_of(container)
    shown = " ".join(f"{k}={env[k]}" for k in ENV_KEYS if k in env) or "-"
    return f"cpus={cpu.cpus or '-':<11} quota={quota!s:<7} env: {shown}"


class DemoNode:
    """The synthetic node's files: sysfs, a v1 cgroup tree, the config (`config_text`, formatted
    with the shared CPUs and the root)."""

    def __init__(self, root: Path, config_text: str = CONFIG) -> None:
        self.root = root
        online = root / "sys" / "devices" / "system" / "cpu"
        online.mkdir(parents=True)
        (online / "online").write_text(NODE_CPUS + "\n")
        for node, cpus in NUMA_NODES.items():
            directory = root / "sys" / "devices" / "system" / "node" / f"node{node}"
            directory.mkdir(parents=True)
            (directory / "cpulist").write_text(cpus + "\n")
        for controller in ("cpu", "cpuset"):
            (root / "cgroup" / controller).mkdir(parents=True)
        (root / "state").mkdir(mode=0o700)
        self.config_path = root / "config.toml"
        self.config_path.write_text(config_text.format(shared=SHARED_CPUS, root=root))

    def add_pod_cgroup(self, layout: CgroupLayout, pod: api.PodSandbox, quota: int) -> CgroupDir:
        """The pod cgroup kubelet would have made (quota = the sum of its containers' limits)."""
        cpu_dir = layout.cpu.dir(pod_cgroup_path(pod.linux.cgroup_parent))
        cpuset_dir = layout.cpuset.dir(pod_cgroup_path(pod.linux.cgroup_parent))
        os.makedirs(cpu_dir.fs_path)
        os.makedirs(cpuset_dir.fs_path)
        Path(cpu_dir.fs_path, "cpu.cfs_quota_us").write_text(f"{quota}\n")
        Path(cpu_dir.fs_path, "cpu.cfs_period_us").write_text(f"{PERIOD}\n")
        Path(cpuset_dir.fs_path, "cpuset.cpus").write_text(NODE_CPUS + "\n")
        return cpu_dir


async def run_demo(
    out: TextIO, *, runtime_name: str = "containerd", runtime_version: str = "v2.3.4", keep: bool = False
) -> int:
    """Run the scenario and print it; returns a process exit status. With `keep` the temporary
    directory stays, and its last line says where it is."""
    tmp = tempfile.mkdtemp(prefix="mixed-cpu-demo-")
    try:
        root = Path(tmp)
        node = DemoNode(root)
        socket_path = str(root / "nri.sock")
        async with RuntimeSimulator(
            socket_path, runtime_name=runtime_name, runtime_version=runtime_version
        ) as sim:
            status = await _Scenario(sim, node, NAMING.get(runtime_name, Naming("cgroupfs")), out).run()
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    if keep:
        print(
            f"kept {tmp}: config.toml, cgroup/ (the pod quotas as the plugin left them), "
            "state/books.sqlite (its books), state/device-plugin-hmac.key",
            file=out,
        )
    return status


class DemoScenario:
    """What every demo's story starts from: the simulator, the node's files and cgroup naming, the
    config, the node's marker key and the real plugin built from them as the daemon builds it."""

    def __init__(self, sim: RuntimeSimulator, node: DemoNode, naming: Naming, out: TextIO) -> None:
        self.sim = sim
        self.node = node
        self.naming = naming
        self.out = out
        self.config = load_config(node.config_path)
        self.layout = build_layout(self.config)
        key = load_marker_key(self.config)
        assert key is not None, "a demo's config trusts the signed allocation marker"
        self.key = key
        self.plugin = build_plugin(self.config, self.layout, key)

    def say(self, text: str = "") -> None:
        print(text, file=self.out)


class _Scenario(DemoScenario):
    """The demo's story, one method per part of it, printed to `out` as it happens. The device
    plugin's half is played here: Allocate answers with a marker signed by the node's key."""

    def __init__(self, sim: RuntimeSimulator, node: DemoNode, naming: Naming, out: TextIO) -> None:
        super().__init__(sim, node, naming, out)
        self.packet = naming.pod("2222-aaaa", "telco", "packet-fwd")
        self.pod_dir: CgroupDir | None = None

    def marker(self, device: str) -> dict[str, str]:
        return {ANNOTATION_KEY: self.key.sign(device)}

    def pod_quota(self) -> str:
        assert self.pod_dir is not None
        quota = read_cpu_quota(self.pod_dir).quota
        return "unlimited" if quota is None else str(quota)

    def fwd(self, cid: str) -> api.Container:
        """The packet forwarder, which asks for the shared CPUs."""
        return self.naming.container(
            self.packet,
            cid,
            "fwd",
            cpus="4-5",
            quota=2 * PERIOD,
            shares=2048,
            annotations=self.marker("shared-cpus-0"),
        )

    async def run(self) -> int:
        self.set_up_node()
        stub = Stub(
            self.plugin,
            identity=Identity(name="mixed-cpu", index="10"),
            socket_path=self.sim.socket_path,
            reconnect=False,
        )
        task = asyncio.ensure_future(stub.run())
        try:
            await self.connect()
            await self.create_containers()
            await self.kubelet_update()
            await self.restart_and_remove()
            self.summary()
            await self.numa_local()
            return 0
        finally:
            stub.stop()
            await task

    def set_up_node(self) -> None:
        """A pod already running before the plugin starts, and the packet-fwd pod's cgroup."""
        monitoring = self.naming.pod("1111", "monitoring", "node-exporter", qos="burstable")
        exporter = self.naming.container(
            monitoring, "exporter", "exporter", cpus="2-7", quota=20000, shares=204
        )
        self.node.add_pod_cgroup(self.layout, monitoring, 20000)
        self.sim.add_pod(monitoring)
        self.sim.add_container(exporter)
        self.pod_dir = self.node.add_pod_cgroup(self.layout, self.packet, 3 * PERIOD)
        sim, config = self.sim, self.config
        self.say(
            f"NRI runtime simulator: {sim.runtime_name} {sim.runtime_version} (NRI {sim.nri_version}), "
            f"socket {sim.socket_path}"
        )
        self.say(
            f"node: CPUs {NODE_CPUS}, shared pool {config.shared_cpuset_text} "
            f"(from {self.node.config_path.name}), cgroup v1 tree in {config.cgroup_root}, "
            f"{self.naming.driver} cgroup names; 1 pod already running"
        )
        numa = self.plugin.pool.numa_nodes
        assert numa is not None, "the demo's config turns numa_local_shared_cpus on"
        split = shared_by_node(config.shared_cpuset, numa)
        self.say(
            "NUMA: "
            + ", ".join(
                f"node{node} CPUs {format_cpuset(numa[node])} (shared {format_cpuset(cpus)})"
                for node, cpus in split.items()
            )
        )
        self.say(
            "this demo turns numa_local_shared_cpus on (off by default: then every container gets the whole "
            "pool): a container gets the shared CPUs of its exclusive CPUs' NUMA nodes"
        )

    async def connect(self) -> None:
        [connected] = await self.sim.wait_for_plugins(1)
        self.say(
            f"plugin {connected.full_name} registered, subscribed to "
            + ", ".join(e.name for e in events_in(connected.events))
        )
        self.say(f"synchronized: {len(self.sim.pods)} pod(s), {len(self.sim.containers)} container(s)")
        self.say()

    async def create_containers(self) -> None:
        packet, naming = self.packet, self.naming
        await self.sim.run_pod_sandbox(packet)
        assert self.pod_dir is not None
        self.say(f"pod {packet.namespace}/{packet.name} (Guaranteed), cgroup {self.pod_dir.path}")
        self.say(f"  pod quota {self.pod_quota()} per {PERIOD} us: fwd 2 CPUs + sidecar 1 CPU")
        sidecar = naming.container(
            packet,
            "sidecar-1",
            "sidecar",
            cpus="6",
            quota=PERIOD,
            shares=1024,
            env=("OPENSHIFT_SHARED_CPUS=0-7",),
        )
        batch = naming.pod("3333-bbbb", "batch", "report", qos="burstable")
        self.node.add_pod_cgroup(self.layout, batch, 50000)
        await self.sim.run_pod_sandbox(batch)
        report = naming.container(
            batch,
            "report-1",
            "report",
            cpus="",
            quota=50000,
            shares=512,
            annotations=self.marker("shared-cpus-1"),
        )
        steps: list[tuple[api.PodSandbox, api.Container, str]] = [
            (packet, self.fwd("fwd-1"), "asks for shared CPUs: device-plugin marker for shared-cpus-0"),
            (
                packet,
                sidecar,
                "no request; its pod spec sets OPENSHIFT_SHARED_CPUS=0-7, which proves nothing",
            ),
            (batch, report, "asks for shared CPUs, but its pod is Burstable"),
        ]
        for pod, container, why in steps:
            await self.create(pod, container, why)
            if container.name == "fwd":
                self.say(self.numa_note(container))
        self.say()

    async def create(self, pod: api.PodSandbox, container: api.Container, why: str) -> None:
        self.say(f"CreateContainer {pod.namespace}/{pod.name}/{container.name} ({why})")
        self.say(f"  before: {describe(container)}")
        quota_before = self.pod_quota()
        try:
            result = await self.sim.create_container(container)
        except PluginFailed as exc:
            self.say(f"  FAILED: {exc.message}")
            return
        self.say(f"  after:  {describe(result.container)}")
        self.say(f"  pod quota: {quota_before} -> {self.pod_quota()}")

    async def kubelet_update(self) -> None:
        self.say("kubelet CPU manager: UpdateContainerResources(fwd, cpus=4-5)")
        resources = api.LinuxResources()
        resources.cpu.cpus = "4-5"
        applied = await self.sim.update_container("fwd-1", resources)
        self.say(f"  applied: cpus={applied.cpu.cpus} quota={applied.cpu.quota.value}")
        self.say()

    async def restart_and_remove(self) -> None:
        self.say(
            "fwd restarts: StopContainer fwd-1, CreateContainer fwd-2 (same allocation), "
            "RemoveContainer fwd-1"
        )
        steps = [f"{self.pod_quota()} (running)"]
        await self.sim.stop_container("fwd-1")
        steps.append(f"{self.pod_quota()} (fwd-1 stopped: its share given back)")
        result = await self.sim.create_container(self.fwd("fwd-2"))
        steps.append(f"{self.pod_quota()} (fwd-2 created: the share again, once)")
        await self.sim.remove_container("fwd-1")
        steps.append(f"{self.pod_quota()} (fwd-1 removed)")
        self.say(f"  after:  {describe(result.container)}")
        self.say(f"  pod quota: {' -> '.join(steps)}")
        self.say("fwd ends: StopContainer, RemoveContainer fwd-2")
        before = self.pod_quota()
        await self.sim.stop_container("fwd-2")
        await self.sim.remove_container("fwd-2")
        self.say(f"  pod quota: {before} (running) -> {self.pod_quota()} (fwd-2 gone: back to the pod's own)")
        self.say()

    def summary(self) -> None:
        failed = sum(r.outcome != "ok" for r in self.sim.records)
        self.say(
            f"{len(self.sim.records)} NRI exchanges, {failed} failed (the Burstable request); "
            f"plugin still connected: {bool(self.sim.plugins)}"
        )

    def numa_note(self, container: api.Container) -> str:
        """Which NUMA nodes a container's exclusive CPUs are on, and the shared CPUs it got for them."""
        pool = self.plugin.pool
        exclusive = parse_cpuset(container.linux.resources.cpu.cpus) - pool.cpus
        choice = choose_shared(pool.cpus, exclusive, pool.numa_nodes)
        nodes = " and ".join(f"node{node}" for node in choice.nodes)
        return (
            f"  NUMA: exclusive CPUs {format_cpuset(exclusive)} on {nodes}: shared CPUs "
            f"{format_cpuset(choice.cpus)}, so its pod quota gains {len(choice.cpus)} CPU(s)"
        )

    async def numa_local(self) -> None:
        """A container on one NUMA node: only that node's shared CPUs, and a pod quota share to match."""
        self.say()
        self.say("NUMA-local shared CPUs: a container whose exclusive CPUs are all on node1")
        naming = self.naming
        pod = naming.pod("4444-cccc", "telco", "dpdk-node1")
        self.pod_dir = self.node.add_pod_cgroup(self.layout, pod, 2 * PERIOD)
        await self.sim.run_pod_sandbox(pod)
        self.say(f"pod {pod.namespace}/{pod.name} (Guaranteed), cgroup {self.pod_dir.path}")
        before = len(self.sim.records)
        worker = naming.container(
            pod,
            "worker-1",
            "worker",
            cpus="3,7",
            quota=2 * PERIOD,
            shares=2048,
            annotations=self.marker("shared-cpus-2"),
        )
        await self.create(pod, worker, "asks for shared CPUs; its exclusive CPUs are all on one node")
        self.say(self.numa_note(worker))
        records = self.sim.records[before:]
        failed = sum(r.outcome != "ok" for r in records)
        self.say(f"{len(records)} more NRI exchange(s), {failed} failed")
