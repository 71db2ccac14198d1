"""Runs in the test VM (busybox mode, cgroup v2): the real daemon against the runtime simulator, with
the node's cgroups on the kernel at /sys/fs/cgroup.

The daemon is ``python -m nri_plugin.daemon.cli run`` from this checkout (``cgroup_root =
/sys/fs/cgroup``, version detected, shared CPUs 0-1 of the VM's 0-3, no kubelet: its device plugin
waits). This script plays kubelet and the runtime: it makes the pod cgroups as kubelet does (cgroupfs
``/kubepods/pod<uid>`` and systemd ``/kubepods.slice/kubepods-pod<uid_>.slice``, the controllers
enabled level by level), and, as runc does for the runtime, makes each container's cgroup with the
resources the plugins' adjustment gave, puts a process in it, applies updates and deletes the cgroup
before RemoveContainer. One simulator (containerd's NRI) carries the pods of all four namings
(containerd and CRI-O, cgroupfs and systemd): the naming decides the cgroup paths.

It prints one JSON object (its last line), every reading by step and naming, as the kernel returned it;
the host's tests (test_vm_cgroup_v2.py) assert on them.

    python tests/vm/guest_daemon_v2.py
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixedcpu_support import (
    NAMINGS,
    PERIOD,
    Daemon,
    Naming,
    make_container,
    make_pod,
    marker,
    saved_books,
    start_daemon,
)

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import (
    CgroupError,
    CgroupLayout,
    CgroupPath,
    container_cgroup_path,
    parse_cpuset,
    pod_cgroup_path,
    read_layout,
    write_cpuset,
    write_value,
)
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key
from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.mixedcpu.store import STATE_FILE_NAME
from nri_plugin.nri.simulator import PluginFailed, RuntimeSimulator, env_of

WORK = Path("/tmp/vm-daemon")
SHARED = "0-1"
# Guards against hangs only: under emulation a daemon start takes 5-30 s, an NRI call 0.05-1 s.
GUARD = 120.0
CONTROLLERS = "+cpu +cpuset"
EXCLUSIVE = {
    "containerd-cgroupfs": "2",
    "cri-o-cgroupfs": "3",
    "containerd-systemd": "2",
    "cri-o-systemd": "3",
}
Reading = dict[str, Any]


def read_text(directory: str, name: str) -> str | None:
    try:
        with open(os.path.join(directory, name)) as handle:
            return handle.read().strip()
    except FileNotFoundError:
        return None


def affinity(pid: int) -> str:
    """The CPUs the kernel lets `pid` run on (bounded by its cgroup's effective cpuset)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    return ""


@dataclass
class Kernel:
    """kubelet's and the runtime's part on the kernel's cgroups, and the readings."""

    layout: CgroupLayout
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    made: list[str] = field(default_factory=list)

    def fs(self, path: CgroupPath) -> str:
        return self.layout.cpu.dir(path).fs_path

    def make_levels(self, path: CgroupPath, *, delegate_last: bool = True) -> None:
        """`path` and its missing parents, each enabling cpu and cpuset for its children (as kubelet,
        systemd and runc do); the last one too unless told otherwise."""
        for depth in range(1, len(path.parts) + 1):
            cgroup = self.layout.cpu.dir(CgroupPath(path.parts[:depth]))
            if os.path.isdir(cgroup.fs_path):
                continue
            os.mkdir(cgroup.fs_path)
            self.made.append(cgroup.fs_path)
            if depth < len(path.parts) or delegate_last:
                write_value(cgroup, "cgroup.subtree_control", CONTROLLERS)

    def make_pod(self, pod: api.PodSandbox, baseline: int | None, period: int = PERIOD) -> None:
        """kubelet: the pod cgroup, its quota the sum of its containers' limits (None: a container
        without a limit), at kubelet's CFS period."""
        path = pod_cgroup_path(pod.linux.cgroup_parent)
        self.make_levels(path)
        write_value(self.layout.cpu.dir(path), "cpu.max", f"{baseline or 'max'} {period}")

    def pod_quota(self, pod: api.PodSandbox) -> str | None:
        return read_text(self.fs(pod_cgroup_path(pod.linux.cgroup_parent)), "cpu.max")

    def run_container(self, container: api.Container) -> str | None:
        """runc create + start: the container cgroup with the (adjusted) resources, a process in it.
        The kernel's refusal, if any, as the runtime would report it (the cgroup is then removed)."""
        cgroup = self.layout.cpu.dir(container_cgroup_path(container.linux.cgroups_path))
        os.mkdir(cgroup.fs_path)
        refused = self.apply(container, container.linux.resources)
        if refused is not None:
            os.rmdir(cgroup.fs_path)
            return refused
        proc = subprocess.Popen(["sleep", "3600"])
        self.processes[container.id] = proc
        write_value(cgroup, "cgroup.procs", str(proc.pid))
        return None

    def apply(self, container: api.Container, resources: api.LinuxResources) -> str | None:
        """What runc does with a container's CPU resources (at create, on update): the cpuset, then
        ``cpu.max`` as runc's cgroup v2 code writes it (the quota, or "max", and the period if given)."""
        cgroup = self.layout.cpu.dir(container_cgroup_path(container.linux.cgroups_path))
        cpu = resources.cpu
        quota = cpu.quota.value if cpu.HasField("quota") else 0
        period = cpu.period.value if cpu.HasField("period") else 0
        try:
            if cpu.cpus:
                write_cpuset(cgroup, parse_cpuset(cpu.cpus))
            if quota or period:
                value = str(quota) if quota > 0 else "max"
                write_value(cgroup, "cpu.max", f"{value} {period}" if period else value)
        except CgroupError as exc:
            return str(exc)
        return None

    def stop(self, container_id: str) -> None:
        """The container's process ends; its cgroup stays until the container is removed."""
        proc = self.processes.pop(container_id)
        proc.kill()
        proc.wait()

    def delete(self, container: api.Container) -> None:
        os.rmdir(self.fs(container_cgroup_path(container.linux.cgroups_path)))

    def reading(self, container: api.Container) -> Reading:
        directory = self.fs(container_cgroup_path(container.linux.cgroups_path))
        proc = self.processes.get(container.id)
        return {
            "cpu.max": read_text(directory, "cpu.max"),
            "cpuset.cpus": read_text(directory, "cpuset.cpus"),
            "cpuset.cpus.effective": read_text(directory, "cpuset.cpus.effective"),
            "affinity": affinity(proc.pid) if proc is not None else None,
        }

    def cleanup(self) -> None:
        for container_id in list(self.processes):
            self.stop(container_id)
        for directory in sorted(self.made, key=len, reverse=True):
            for dirpath, _dirs, _files in sorted(os.walk(directory), key=lambda e: -len(e[0])):
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)


class Runtime(RuntimeSimulator):
    """The simulator, applying to the kernel what plugins ask outside the events' replies (the
    updates of Synchronize and UpdateContainers), as the runtime does."""

    def __init__(self, socket_path: Path, kernel: Kernel) -> None:
        super().__init__(socket_path, registration_timeout=GUARD, request_timeout=GUARD)
        self.kernel = kernel
        self.refused: list[str] = []

    async def __aenter__(self) -> Runtime:
        await self.start()
        return self

    def _apply_update(self, update: api.ContainerUpdate, *, source: str) -> bool:
        applied = super()._apply_update(update, source=source)
        if applied:
            refused = self.kernel.apply(self.containers[update.container_id], update.linux.resources)
            if refused is not None:
                self.refused.append(refused)
        return applied


@dataclass
class Node:
    kernel: Kernel
    runtime: Runtime
    daemon: Daemon | None = None
    pods: dict[str, api.PodSandbox] = field(default_factory=dict)
    containers: dict[str, api.Container] = field(default_factory=dict)
    exits: list[int] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)

    @property
    def key(self) -> HostKey:
        return load_or_create_host_key(WORK / "state")

    async def start_daemon(self, config: Path = WORK / "config.toml") -> None:
        proc = await start_daemon(
            "--log-level", "info", "run", "--config", str(config), "--socket", str(self.runtime.socket_path),
            stdout=subprocess.DEVNULL, in_vm=True,
        )  # fmt: skip
        self.daemon = Daemon(proc, GUARD)
        await self.runtime.wait_for_plugins(1, GUARD)

    async def stop_daemon(self) -> None:
        assert self.daemon is not None
        self.exits.append(await self.daemon.stop())
        self.logs.extend(self.daemon.lines)
        self.daemon = None
        await asyncio.wait_for(self._disconnected(), GUARD)

    async def _disconnected(self) -> None:
        while self.runtime.plugins:  # noqa: ASYNC110 (the simulator notices the close by itself)
            await asyncio.sleep(0.05)

    def pod(self, naming: Naming, uid: str, baseline: int | None, period: int = PERIOD) -> api.PodSandbox:
        pod = make_pod(naming, uid)
        self.kernel.make_pod(pod, baseline, period)
        self.pods[uid] = pod
        return pod

    def container(
        self,
        naming: Naming,
        pod: api.PodSandbox,
        cid: str,
        cpus: str,
        *,
        device: str | None = None,
        period: int = PERIOD,
        unlimited: bool = False,
    ) -> api.Container:
        """A container of `pod` with exclusive `cpus` and a quota to match (or none: `unlimited`);
        asking (with the device plugin's signed marker for `device`) when a device is given."""
        count = len(parse_cpuset(cpus))
        annotations = marker(self.key, device) if device is not None else None
        container = make_container(
            naming, pod, cid, "main" if device is None else f"main-{device}",
            cpus=cpus, quota=-1 if unlimited else count * period, period=period, shares=1024 * count,
            annotations=annotations,
        )  # fmt: skip
        self.containers[cid] = container
        return container

    async def create(self, container: api.Container) -> Reading:
        """kubelet's CreateContainer and StartContainer: what the plugins answered, the pod quota the
        moment the runtime got the answer, and the container as the kernel then runs it."""
        pod = self.runtime.pods.get(container.pod_sandbox_id)
        if pod is None:
            pod = next(p for p in self.pods.values() if p.id == container.pod_sandbox_id)
            await self.runtime.run_pod_sandbox(pod)
        try:
            result = await self.runtime.create_container(container)
        except PluginFailed as exc:
            return {"refused": exc.message, "code": exc.code, "pod cpu.max": self.kernel.pod_quota(pod)}
        cpu = result.adjustment.linux.resources.cpu
        reading: Reading = {
            "adjusted cpus": cpu.cpus,
            "adjusted quota": cpu.quota.value if cpu.HasField("quota") else None,
            "env": {k: v for k, v in env_of(result.container).items() if k.startswith("OPENSHIFT_")},
            "pod cpu.max at reply": self.kernel.pod_quota(pod),
        }
        refused = self.kernel.run_container(result.container)
        if refused is not None:
            # runc failed: containerd undoes the creation for plugins (StopContainer, RemoveContainer).
            await self.runtime.stop_container(container.id)
            await self.runtime.remove_container(container.id)
            reading["runtime refused"] = refused
            reading["pod cpu.max after undo"] = self.kernel.pod_quota(pod)
            return reading
        await self.runtime.start_container(container.id)
        reading["container"] = self.kernel.reading(result.container)
        return reading

    async def update(self, cid: str, cpus: str) -> Reading:
        """kubelet's CPU manager re-sends the exclusive cpuset alone; the runtime applies the answer."""
        requested = api.LinuxResources()
        requested.cpu.cpus = cpus
        applied = await self.runtime.update_container(cid, requested)
        container = self.runtime.containers[cid]
        refused = self.kernel.apply(container, applied)
        return {
            "answered cpus": applied.cpu.cpus,
            "answered quota": applied.cpu.quota.value if applied.cpu.HasField("quota") else None,
            "refused": refused,
            "container": self.kernel.reading(container),
        }

    async def stop(self, cid: str) -> None:
        self.kernel.stop(cid)
        await self.runtime.stop_container(cid)

    async def remove(self, cid: str) -> None:
        self.kernel.delete(self.runtime.containers[cid])
        await self.runtime.remove_container(cid)


def write_config(path: Path, shared: str) -> Path:
    path.write_text(
        f'shared_cpuset = "{shared}"\nstate_dir = "{WORK}/state"\ncgroup_root = "/sys/fs/cgroup"\n'
        f'log_format = "console"\nmetrics_address = ""\n[device_plugin]\nplugin_dir = "{WORK}/kubelet"\n'
    )
    return path


def pod_quotas(node: Node) -> dict[str, str | None]:
    return {uid: node.kernel.pod_quota(pod) for uid, pod in node.pods.items()}


async def lifecycle(node: Node, out: dict[str, Any]) -> None:
    """Per naming: create, update, a container restart, then (later) stop and remove."""
    for index, naming in enumerate(NAMINGS):
        pod = node.pod(naming, f"life-{index}", PERIOD)
        asking = node.container(naming, pod, f"c{index}", EXCLUSIVE[naming.id], device=f"dev-{index}")
        out["create"][naming.id] = await node.create(asking)
        out["update"][naming.id] = await node.update(f"c{index}", EXCLUSIVE[naming.id])
    naming = NAMINGS[0]
    plain = node.pod(naming, "plain", PERIOD)
    out["create"]["plain"] = await node.create(node.container(naming, plain, "plain-c", "3"))
    out["create"]["plain"]["pod cpu.max now"] = node.kernel.pod_quota(plain)
    # A pod without a CPU limit, and a pod at kubelet's cpuCFSQuotaPeriod of 50 ms.
    free = node.pod(naming, "free", None)
    out["create"]["unlimited"] = await node.create(
        node.container(naming, free, "free-c", "2", device="dev-free", unlimited=True)
    )
    short = node.pod(naming, "short", PERIOD // 2, PERIOD // 2)
    out["create"]["period 50 ms"] = await node.create(
        node.container(naming, short, "short-c", "3", device="dev-short", period=PERIOD // 2)
    )

    # kubelet restarts container c0: the new instance first, then the old one stopped and removed.
    naming, pod = NAMINGS[0], node.pods["life-0"]
    again = node.container(naming, pod, "c0-again", EXCLUSIVE[naming.id], device="dev-0")
    restart: Reading = {"create": await node.create(again)}
    await node.stop("c0")
    restart["pod cpu.max after the old one stopped"] = node.kernel.pod_quota(pod)
    await node.remove("c0")
    restart["pod cpu.max after the old one removed"] = node.kernel.pod_quota(pod)
    out["container restart"] = restart


async def daemon_restart(node: Node, out: dict[str, Any]) -> None:
    """The daemon stops; a pod starts meanwhile; the daemon starts again and synchronizes."""
    before = pod_quotas(node)
    await node.stop_daemon()
    naming = NAMINGS[3]  # CRI-O, systemd
    late_pod = node.pod(naming, "late", PERIOD)
    late = node.container(naming, late_pod, "late-c", "3", device="dev-late")
    late.state = api.CONTAINER_RUNNING
    node.runtime.add_pod(late_pod)
    node.runtime.add_container(late)
    node.kernel.run_container(late)
    away = node.kernel.reading(late)
    await node.start_daemon()
    out["daemon restart"] = {
        "pod quotas before": before,
        "pod quotas after": pod_quotas(node),
        "late container while away": away,
        "late container after sync": node.kernel.reading(late),
        "updates at sync": [u.container_id for u in node.runtime.applied_updates],
        "runtime refused": node.runtime.refused,
    }


async def teardown(node: Node, out: dict[str, Any]) -> None:
    """Stop every asking container (pod quota read with its cgroup still there), then remove it."""
    for cid in ("c0-again", "c1", "c2", "c3", "late-c", "free-c", "short-c"):
        container = node.runtime.containers[cid]
        pod = next(p for p in node.pods.values() if p.id == container.pod_sandbox_id)
        await node.stop(cid)
        stopped = {
            "pod cpu.max": node.kernel.pod_quota(pod),
            "container cpu.max": node.kernel.reading(container),
        }
        await node.remove(cid)
        out["stop and remove"][cid] = {
            "after stop": stopped,
            "pod cpu.max after remove": node.kernel.pod_quota(pod),
        }
    for pod in node.pods.values():
        if pod.id in node.runtime.pods:
            await node.runtime.stop_pod_sandbox(pod.id)
            await node.runtime.remove_pod_sandbox(pod.id)


async def refusals(node: Node, out: dict[str, Any]) -> None:
    """The kernel's refusals on the plugin's path: nothing may stay half-applied."""
    naming = NAMINGS[0]
    pod = node.pod(naming, "badcpu", 2 * PERIOD)
    # A cpuset naming CPU 9 (the VM has 0-3): the plugin's answer is written by runc, which fails.
    out["refusals"]["nonexistent cpu"] = await node.create(
        node.container(naming, pod, "bad-c", "3,9", device="dev-bad")
    )
    # A pod cgroup below a parent that does not delegate the cpu controller: no cpu.max to raise.
    lost = make_pod(naming, "nocpu")
    lost.linux.cgroup_parent = "/kubepods-nocpu/podnocpu"
    node.kernel.make_levels(CgroupPath(("kubepods-nocpu",)), delegate_last=False)
    node.kernel.make_levels(pod_cgroup_path(lost.linux.cgroup_parent), delegate_last=False)
    node.pods["nocpu"] = lost
    reading = await node.create(node.container(naming, lost, "nocpu-c", "2", device="dev-nocpu"))
    books = saved_books(WORK / "state")  # the daemon holds the database itself: a copy
    reading["books"] = {"pods": sorted(books.pods), "devices": sorted(books.devices)}
    out["refusals"]["pod without cpu controller"] = reading


async def bad_config(node: Node) -> Reading:
    """A daemon configured with a shared CPU that does not exist: it must refuse to start, and touch
    nothing (the other daemon is stopped; the pod quotas and the state stay as they are)."""
    before = pod_quotas(node)
    state = (WORK / "state" / STATE_FILE_NAME).read_bytes()
    config = write_config(WORK / "bad.toml", "0-1,7")
    proc = await start_daemon("run", "--config", str(config), "--socket", str(WORK / "none.sock"), in_vm=True)
    _, stderr = await asyncio.wait_for(proc.communicate(), GUARD)
    return {
        "exit status": proc.returncode,
        "stderr": stderr.decode(errors="replace"),
        "pod quotas unchanged": pod_quotas(node) == before,
        "state unchanged": (WORK / "state" / STATE_FILE_NAME).read_bytes() == state,
    }


def prepare_workdir() -> None:
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    write_config(WORK / "config.toml", SHARED)


@contextlib.asynccontextmanager
async def node_running() -> AsyncIterator[Node]:
    prepare_workdir()
    kernel = Kernel(read_layout())
    try:
        async with Runtime(WORK / "nri.sock", kernel) as runtime:
            node = Node(kernel, runtime)
            await node.start_daemon()
            try:
                yield node
            finally:
                if node.daemon is not None:
                    await node.stop_daemon()
    finally:
        kernel.cleanup()


async def main() -> dict[str, Any]:
    out: dict[str, Any] = {"create": {}, "update": {}, "stop and remove": {}, "refusals": {}}
    async with node_running() as node:
        await lifecycle(node, out)
        await daemon_restart(node, out)
        await refusals(node, out)
        await teardown(node, out)
        await node.stop_daemon()
        out["refusals"]["nonexistent shared cpu in the config"] = await bad_config(node)
        out["daemon"] = {
            "exit statuses": node.exits,
            "tracebacks": sum("Traceback" in line for line in node.logs),
            "log": node.logs[-400:],
        }
        out["simulator errors"] = [
            f"{r.event} {r.container}: {r.detail}" for r in node.runtime.records if r.outcome != "ok"
        ]
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(asyncio.run(main())) + "\n")
