"""``mixed-cpu-nri-plugin demo``: the real plugin against the built-in runtime simulator, in one process.

A synthetic 8-CPU node (CPUs 0-1 shared) with its own sysfs, a cgroup v1 tree and a state dir, all in
a temporary directory, runs a short scenario through real NRI over a unix socket. For every step the
demo prints the container's cpuset, CFS quota and environment before and after, and the pod cgroup's
quota as the plugin left it in the tree. Pod and container cgroups are named as the chosen runtime
names them: containerd with the cgroupfs driver (``/kubepods/pod<uid>/<id>``), CRI-O with the systemd
driver (``kubepods-pod<uid>.slice`` and ``crio-<id>.scope``).

Containers ask for shared CPUs the way a real pod does: kubelet's device manager hands the runtime
the allocation marker our device plugin returned, signed with the node's key (here the demo signs
it, as the device plugin would).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from api.nri import api_pb2 as api
from cgroups import CgroupDir, CgroupLayout, pod_cgroup_path, read_cpu_quota
from nri_plugin.daemon.cli import build_plugin, load_marker_key
from nri_plugin.daemon.config import build_layout, load_config
from nri_plugin.deviceplugin.marker import ANNOTATION_KEY, HostKey
from nri_plugin.nri.events import events_in
from nri_plugin.nri.simulator import PluginFailed, RuntimeSimulator, env_of
from nri_plugin.nri.stub import Stub

NODE_CPUS = "0-7"
SHARED_CPUS = "0-1"
PERIOD = 100_000
ENV_KEYS = ("OPENSHIFT_SHARED_CPUS", "OPENSHIFT_ISOLATED_CPUS")
CONFIG = """\
# The demo's config file: the shared pool, and the node's directories as this demo fakes them.
shared_cpuset = "{shared}"
cgroup_root = "{root}/cgroup"
cgroup_version = "v1"
sysfs_root = "{root}/sys"
state_dir = "{root}/state"
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


NAMING = {"containerd": Naming("cgroupfs"), "cri-o": Naming("systemd")}


def _pod(naming: Naming, uid: str, namespace: str, name: str, qos: str = "") -> api.PodSandbox:
    pod = api.PodSandbox(id=f"sandbox-{uid}", uid=uid, namespace=namespace, name=name)
    pod.linux.cgroup_parent = naming.pod_parent(uid, qos)
    return pod


def _container(
    naming: Naming,
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
    container.linux.cgroups_path = naming.container_path(pod, cid)
    cpu = container.linux.resources.cpu
    cpu.cpus = cpus
    cpu.quota.value = quota
    cpu.period.value = PERIOD
    cpu.shares.value = shares
    return container


def _describe(container: api.Container) -> str:
    cpu = container.linux.resources.cpu
    quota = cpu.quota.value if cpu.HasField("quota") else "unset"
    env = env_of(container)
    shown = " ".join(f"{k}={env[k]}" for k in ENV_KEYS if k in env) or "-"
    return f"cpus={cpu.cpus or '-':<11} quota={quota!s:<7} env: {shown}"


class _Node:
    """The synthetic node's files: sysfs, a v1 cgroup tree, the config."""

    def __init__(self, root: Path) -> None:
        self.root = root
        online = root / "sys" / "devices" / "system" / "cpu"
        online.mkdir(parents=True)
        (online / "online").write_text(NODE_CPUS + "\n")
        for controller in ("cpu", "cpuset"):
            (root / "cgroup" / controller).mkdir(parents=True)
        (root / "state").mkdir(mode=0o700)
        self.config_path = root / "config.toml"
        self.config_path.write_text(CONFIG.format(shared=SHARED_CPUS, root=root))

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


async def run_demo(out: TextIO, *, runtime_name: str = "containerd", runtime_version: str = "v2.3.4") -> int:
    """Run the scenario and print it; returns a process exit status."""
    with tempfile.TemporaryDirectory(prefix="mixed-cpu-demo-") as tmp:
        root = Path(tmp)
        node = _Node(root)
        socket_path = str(root / "nri.sock")
        async with RuntimeSimulator(
            socket_path, runtime_name=runtime_name, runtime_version=runtime_version
        ) as sim:
            return await _scenario(sim, node, NAMING.get(runtime_name, Naming("cgroupfs")), out)


async def _scenario(sim: RuntimeSimulator, node: _Node, naming: Naming, out: TextIO) -> int:
    def say(text: str = "") -> None:
        print(text, file=out)

    config = load_config(node.config_path)
    layout = build_layout(config)
    plugin = build_plugin(config, layout, load_marker_key(config))
    # The device plugin's half: Allocate answers with a marker signed by the node's key.
    key = HostKey.load_or_create(config.state_dir)

    def marker(device: str) -> dict[str, str]:
        return {ANNOTATION_KEY: key.sign(device)}

    monitoring = _pod(naming, "1111", "monitoring", "node-exporter", qos="burstable")
    exporter = _container(naming, monitoring, "exporter", "exporter", cpus="2-7", quota=20000, shares=204)
    node.add_pod_cgroup(layout, monitoring, 20000)
    sim.add_pod(monitoring)
    sim.add_container(exporter)

    packet = _pod(naming, "2222-aaaa", "telco", "packet-fwd")
    pod_dir = node.add_pod_cgroup(layout, packet, 3 * PERIOD)

    def pod_quota() -> str:
        quota = read_cpu_quota(pod_dir).quota
        return "unlimited" if quota is None else str(quota)

    say(
        f"NRI runtime simulator: {sim.runtime_name} {sim.runtime_version} (NRI {sim.nri_version}), "
        f"socket {sim.socket_path}"
    )
    say(
        f"node: CPUs {NODE_CPUS}, shared pool {config.shared_cpuset_text} (from {node.config_path.name}), "
        f"cgroup v1 tree in {config.cgroup_root}, {naming.driver} cgroup names; 1 pod already running"
    )
    stub = Stub(plugin, name="mixed-cpu", index="10", socket_path=sim.socket_path, reconnect=False)
    task = asyncio.ensure_future(stub.run())
    try:
        [connected] = await sim.wait_for_plugins(1)
        say(
            f"plugin {connected.full_name} registered, subscribed to "
            + ", ".join(e.name for e in events_in(connected.events))
        )
        say(f"synchronized: {len(sim.pods)} pod(s), {len(sim.containers)} container(s)")
        say()
        await sim.run_pod_sandbox(packet)
        say(f"pod {packet.namespace}/{packet.name} (Guaranteed), cgroup {pod_dir.path}")
        say(f"  pod quota {pod_quota()} per {PERIOD} us: fwd 2 CPUs + sidecar 1 CPU")
        fwd = _container(
            naming,
            packet,
            "fwd-1",
            "fwd",
            cpus="4-5",
            quota=2 * PERIOD,
            shares=2048,
            annotations=marker("shared-cpus-0"),
        )
        sidecar = _container(
            naming,
            packet,
            "sidecar-1",
            "sidecar",
            cpus="6",
            quota=PERIOD,
            shares=1024,
            env=("OPENSHIFT_SHARED_CPUS=0-7",),
        )
        batch = _pod(naming, "3333-bbbb", "batch", "report", qos="burstable")
        node.add_pod_cgroup(layout, batch, 50000)
        await sim.run_pod_sandbox(batch)
        report = _container(
            naming,
            batch,
            "report-1",
            "report",
            cpus="",
            quota=50000,
            shares=512,
            annotations=marker("shared-cpus-1"),
        )
        steps: list[tuple[api.PodSandbox, api.Container, str]] = [
            (packet, fwd, "asks for shared CPUs: device-plugin marker for shared-cpus-0"),
            (
                packet,
                sidecar,
                "no request; its pod spec sets OPENSHIFT_SHARED_CPUS=0-7, which proves nothing",
            ),
            (batch, report, "asks for shared CPUs, but its pod is Burstable"),
        ]
        for pod, container, why in steps:
            say(f"CreateContainer {pod.namespace}/{pod.name}/{container.name} ({why})")
            say(f"  before: {_describe(container)}")
            quota_before = pod_quota()
            try:
                result = await sim.create_container(container)
            except PluginFailed as exc:
                say(f"  FAILED: {exc.message}")
                continue
            say(f"  after:  {_describe(result.container)}")
            say(f"  pod quota: {quota_before} -> {pod_quota()}")
        say()
        say("kubelet CPU manager: UpdateContainerResources(fwd, cpus=4-5)")
        resources = api.LinuxResources()
        resources.cpu.cpus = "4-5"
        applied = await sim.update_container("fwd-1", resources)
        say(f"  applied: cpus={applied.cpu.cpus} quota={applied.cpu.quota.value}")
        say()
        say(
            "fwd restarts: StopContainer fwd-1, CreateContainer fwd-2 (same allocation), "
            "RemoveContainer fwd-1"
        )
        quotas = [pod_quota()]
        await sim.stop_container("fwd-1")
        quotas.append(pod_quota())
        restarted = _container(
            naming,
            packet,
            "fwd-2",
            "fwd",
            cpus="4-5",
            quota=2 * PERIOD,
            shares=2048,
            annotations=marker("shared-cpus-0"),
        )
        result = await sim.create_container(restarted)
        quotas.append(pod_quota())
        await sim.remove_container("fwd-1")
        quotas.append(pod_quota())
        say(f"  after:  {_describe(result.container)}")
        say(f"  pod quota: {' -> '.join(quotas)}")
        say("StopContainer, RemoveContainer fwd-2")
        before = pod_quota()
        await sim.stop_container("fwd-2")
        await sim.remove_container("fwd-2")
        say(f"  pod quota: {before} -> {pod_quota()}")
        say()
        failed = sum(r.outcome != "ok" for r in sim.records)
        say(
            f"{len(sim.records)} NRI exchanges, {failed} failed (the Burstable request); "
            f"plugin still connected: {bool(sim.plugins)}"
        )
        return 0
    finally:
        stub.stop()
        await task
