"""``mixed-cpu-nri-plugin demo --dra``: a request for shared CPUs served through DRA, in one process.

The real DRA kubelet plugin (`nri_plugin.dra.kubeletplugin`) and the real mixed-CPU NRI plugin run on
a synthetic node in a temporary directory, as in ``demo``. Around them, stand-ins play the parts that
cannot run here, each doing only what the real one does at this point:

* the scheduler: it allocates device ``shared-cpus-0`` of the node's pool to the pod's claim (the
  claim source the kubelet plugin asks is that allocation, in memory, where the daemon reads the
  API server);
* kubelet: its plugin watcher finds our registration socket, calls ``GetInfo`` and
  ``NotifyRegistrationStatus``; before the pod's containers start it calls ``NodePrepareResources``
  over the real ``dra.v1`` gRPC socket, and passes the CDI device id it got to the runtime; once the
  pod is gone it calls ``NodeUnprepareResources``;
* the runtime: the built-in NRI simulator, which injects the CDI spec's env edits before NRI's
  CreateContainer shows the container to our plugin, as containerd and CRI-O do.

Then a container of another pod that copied the marker variable into its own spec asks too, and is
refused: the device is bound to the first container.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path
from typing import TextIO

import grpc

from nri_plugin.api.dra.v1 import api_pb2 as dra
from nri_plugin.api.dra.v1 import api_pb2_grpc as dra_grpc
from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.api.pluginregistration.v1 import api_pb2 as reg
from nri_plugin.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from nri_plugin.cgroups import read_cpu_quota
from nri_plugin.daemon.demo import (
    NAMING,
    NODE_CPUS,
    PERIOD,
    SHARED_CPUS,
    DemoNode,
    DemoScenario,
    Naming,
    describe,
)
from nri_plugin.dra import cdi
from nri_plugin.dra.claims import AllocatedDevice, ClaimError
from nri_plugin.dra.kubeletplugin import DraKubeletPlugin, DraPluginSettings
from nri_plugin.nri.cdispecs import CdiSpecs
from nri_plugin.nri.identity import Identity
from nri_plugin.nri.simulator import PluginFailed, RuntimeSimulator, env_of
from nri_plugin.nri.stub import Stub

NODE_NAME = "demo-node"
DEVICE = "shared-cpus-0"
CLAIM = cdi.ClaimRef("telco", "packet-fwd-shared-cpus", "0b7c2a4e-5d1f-4c3a-9e8b-6f2d1a7c9e30")
CONFIG = """\
# The DRA demo's config file: the shared pool, the node's directories as this demo fakes them, and
# the DRA front door on (off by default). No API server here: the demo plays the scheduler.
shared_cpuset = "{shared}"
cgroup_root = "{root}/cgroup"
cgroup_version = "v1"
sysfs_root = "{root}/sys"
state_dir = "{root}/state"

[device_plugin]
enabled = false        # DRA alone proves requests here
pod_resources_socket = ""

[dra]
enabled = true
registry_dir = "{root}/plugins_registry"
plugins_dir = "{root}/plugins"
cdi_dir = "{root}/cdi"
node_name = "demo-node"
publish_resource_slices = false
"""
# kubelet's DRA calls: against hangs only.
CALL_TIMEOUT = 10.0


class _Allocation:
    """The scheduler's part: which device of our pool each claim was allocated (a `ClaimSource`)."""

    def __init__(self) -> None:
        self.claims: dict[str, tuple[cdi.ClaimRef, tuple[AllocatedDevice, ...]]] = {}

    def allocate(self, claim: cdi.ClaimRef, device: str) -> None:
        self.claims[claim.uid] = (claim, (AllocatedDevice("shared", NODE_NAME, device),))

    async def allocated_devices(self, namespace: str, name: str, uid: str) -> tuple[AllocatedDevice, ...]:
        known = self.claims.get(uid)
        if known is None or (known[0].namespace, known[0].name) != (namespace, name):
            raise ClaimError(f"resourceclaim {namespace}/{name} not found")
        return known[1]


async def run_dra_demo(
    out: TextIO, *, runtime_name: str = "containerd", runtime_version: str = "v2.3.4"
) -> int:
    """Run the DRA scenario and print it; returns a process exit status."""
    tmp = tempfile.mkdtemp(prefix="mixed-cpu-dra-")
    try:
        root = Path(tmp)
        node = DemoNode(root, CONFIG)
        for directory in ("plugins_registry", "plugins"):
            (root / directory).mkdir()
        async with RuntimeSimulator(
            str(root / "nri.sock"), runtime_name=runtime_name, runtime_version=runtime_version
        ) as sim:
            sim.cdi = CdiSpecs([root / "cdi"])
            return await _DraScenario(sim, node, NAMING.get(runtime_name, Naming("cgroupfs")), out).run()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _DraScenario(DemoScenario):
    """The story, one method per part, printed to `out` as it happens."""

    def __init__(self, sim: RuntimeSimulator, node: DemoNode, naming: Naming, out: TextIO) -> None:
        super().__init__(sim, node, naming, out)
        self.allocation = _Allocation()
        dra_config = self.config.dra
        self.settings = DraPluginSettings(
            driver_name=dra_config.driver_name,
            registry_dir=dra_config.registry_dir,
            plugins_dir=dra_config.plugins_dir,
            cdi_dir=dra_config.cdi_dir,
            pool_name=NODE_NAME,
            device_names=(DEVICE, "shared-cpus-1"),
            fsync=False,
        )
        self.kubelet_plugin = DraKubeletPlugin(self.settings, self.key, self.allocation)
        self.pod = naming.pod("5555-dddd", "telco", "packet-fwd")

    async def run(self) -> int:
        stub = Stub(
            self.plugin,
            identity=Identity(name="mixed-cpu", index="10"),
            socket_path=self.sim.socket_path,
            reconnect=False,
        )
        task = asyncio.ensure_future(stub.run())
        try:
            async with self.kubelet_plugin:
                [connected] = await self.sim.wait_for_plugins(1)
                self.say(
                    f"NRI runtime simulator: {self.sim.runtime_name} {self.sim.runtime_version}; NRI plugin "
                    f"{connected.full_name} registered; node CPUs {NODE_CPUS}, shared pool {SHARED_CPUS}"
                )
                self.say()
                await self.register()
                cdi_id = await self.prepare()
                if cdi_id is None:
                    return 1
                granted = await self.create(cdi_id)
                await self.replay()
                await self.unprepare()
                return 0 if granted else 1
        finally:
            stub.stop()
            await task

    async def register(self) -> None:
        socket_path = self.settings.registration_socket
        self.say(f"kubelet's plugin watcher: a new socket {socket_path.name} in {socket_path.parent}")
        async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
            registration = reg_grpc.RegistrationStub(channel)
            info = await registration.GetInfo(reg.InfoRequest(), timeout=CALL_TIMEOUT)
            self.say(
                f"  GetInfo: type {info.type}, name {info.name}, "
                f"versions {', '.join(info.supported_versions)}"
            )
            self.say(f"           endpoint {info.endpoint}")
            await registration.NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=True), timeout=CALL_TIMEOUT
            )
        self.say(
            "  NotifyRegistrationStatus(registered): the driver says "
            f"registered={self.kubelet_plugin.registered}"
        )
        self.say()

    async def prepare(self) -> str | None:
        self.allocation.allocate(CLAIM, DEVICE)
        self.say(
            f"scheduler: claim {CLAIM.namespace}/{CLAIM.name} (uid {CLAIM.uid[:8]}...) allocated "
            f"{DEVICE} of pool {NODE_NAME}, driver {self.settings.driver_name}"
        )
        request = dra.NodePrepareResourcesRequest()
        request.claims.add(namespace=CLAIM.namespace, name=CLAIM.name, uid=CLAIM.uid)
        async with grpc.aio.insecure_channel(f"unix:{self.settings.endpoint}") as channel:
            answer = await dra_grpc.DRAPluginStub(channel).NodePrepareResources(request, timeout=CALL_TIMEOUT)
        result = answer.claims[CLAIM.uid]
        if result.error:
            self.say(f"kubelet: NodePrepareResources FAILED: {result.error}")
            return None
        [device] = result.devices
        [cdi_id] = device.cdi_device_ids
        self.say(f"kubelet: NodePrepareResources -> device {device.device_name}, CDI id {cdi_id}")
        spec_file = cdi.spec_path(self.settings.cdi_dir, CLAIM.uid)
        spec = json.loads(spec_file.read_text())
        [entry] = spec["devices"][0]["containerEdits"]["env"]
        self.say(f"  CDI spec {spec_file.name}: cdiVersion {spec['cdiVersion']}, kind {spec['kind']}")
        name, _, marker = entry.partition("=")
        version, signed_for, _ = marker.split(":", 2)
        self.say(
            f"  its container edits: env {name}={version}:{signed_for}:... (the marker: its allocation, "
            "pods and MAC cut)"
        )
        self.say()
        return str(cdi_id)

    def container(self, pod: api.PodSandbox, cid: str, name: str, env: tuple[str, ...] = ()) -> api.Container:
        return self.naming.container(pod, cid, name, cpus="4-5", quota=2 * PERIOD, shares=2048, env=env)

    async def create(self, cdi_id: str) -> bool:
        pod_dir = self.node.add_pod_cgroup(self.layout, self.pod, 2 * PERIOD)
        await self.sim.run_pod_sandbox(self.pod)
        container = self.container(self.pod, "fwd-1", "fwd")
        self.say(
            f"runtime: CreateContainer {self.pod.namespace}/{self.pod.name}/fwd with CDI device {cdi_id}"
        )
        self.say(f"  as kubelet asks:  {describe(container)}")
        before = read_cpu_quota(pod_dir).quota
        result = await self.sim.create_container(container, cdi_devices=[cdi_id])
        injected = cdi.marker_env(DEVICE) in env_of(result.container)
        self.say(
            f"  CDI injected {cdi.marker_env(DEVICE)}: {'yes' if injected else 'no'}; "
            "the NRI plugin proves it and adjusts"
        )
        self.say(f"  as it is created: {describe(result.container)}")
        self.say(f"  pod quota: {before} -> {read_cpu_quota(pod_dir).quota} per {PERIOD} us")
        granted = result.container.linux.resources.cpu.cpus != container.linux.resources.cpu.cpus
        self.say(f"  shared CPUs granted: {'yes' if granted else 'NO'}")
        self.say()
        return granted

    async def replay(self) -> None:
        """Another pod copies the marker into its own spec: refused, the device is the first one's."""
        thief_pod = self.naming.pod("6666-eeee", "batch", "copycat")
        self.node.add_pod_cgroup(self.layout, thief_pod, 2 * PERIOD)
        await self.sim.run_pod_sandbox(thief_pod)
        fwd = self.sim.containers["fwd-1"]
        copied = next(entry for entry in fwd.env if entry.startswith(cdi.marker_env(DEVICE) + "="))
        container = self.container(thief_pod, "copy-1", "copy", env=(copied,))
        self.say(
            f"runtime: CreateContainer {thief_pod.namespace}/{thief_pod.name}/copy "
            "(its spec copies the variable)"
        )
        try:
            result = await self.sim.create_container(container)
        except PluginFailed as exc:
            self.say(f"  FAILED: {exc.message}")
            return
        self.say(f"  as it is created: {describe(result.container)} (left alone: the device is fwd's)")
        self.say()

    async def unprepare(self) -> None:
        await self.sim.stop_container("fwd-1")
        await self.sim.remove_container("fwd-1")
        request = dra.NodeUnprepareResourcesRequest()
        request.claims.add(namespace=CLAIM.namespace, name=CLAIM.name, uid=CLAIM.uid)
        async with grpc.aio.insecure_channel(f"unix:{self.settings.endpoint}") as channel:
            answer = await dra_grpc.DRAPluginStub(channel).NodeUnprepareResources(
                request, timeout=CALL_TIMEOUT
            )
        error = answer.claims[CLAIM.uid].error
        gone = not cdi.spec_path(self.settings.cdi_dir, CLAIM.uid).exists()
        self.say(
            f"pod gone; kubelet: NodeUnprepareResources -> {error or 'ok'}; "
            f"CDI spec removed: {'yes' if gone else 'no'}"
        )
