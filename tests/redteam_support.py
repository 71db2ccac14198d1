"""A node around the real daemon process, for the regression tests of the red team's breaks (issue #13).

`daemon_node` starts ``mixed-cpu-nri-plugin run`` as a subprocess against the NRI runtime simulator
(in this process), on a fake cgroup v1 tree and a state dir of its own, optionally with a fake kubelet
(device-plugin and pod-resources APIs); `DaemonNode` then creates pods and containers as kubelet and
the runtime would. `rss_kib` reads a process's resident size from /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from mixedcpu_support import (
    PERIOD,
    Daemon,
    FakeCgroups,
    Naming,
    make_container,
    make_pod,
    start_daemon,
    write_daemon_config,
)

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key
from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.nri.simulator import CreateResult, RuntimeSimulator, env_of

T = TypeVar("T")

NAMING = Naming("containerd", "cgroupfs")
RESOURCE = "workload.openshift.io/enable-shared-cpus"
# Against hangs only: what is awaited normally takes milliseconds.
GUARD = 20.0


async def within(awaitable: Awaitable[T], seconds: float = GUARD) -> T:
    return await asyncio.wait_for(awaitable, seconds)


@contextlib.contextmanager
def short_directory(prefix: str) -> Iterator[Path]:
    """A directory under /tmp (unix socket paths must fit in 107 bytes), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class DaemonNode:
    """One node: the daemon's files, the runtime simulator, the pod cgroup tree, the daemon."""

    root: Path
    plugin_dir: Path
    sim: RuntimeSimulator
    tree: FakeCgroups
    daemon: Daemon

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def key(self) -> HostKey:
        """The node's marker key, as the daemon created it in its state dir."""
        return load_or_create_host_key(self.state_dir)

    def pod(self, uid: str, name: str, *, namespace: str = "ns") -> api.PodSandbox:
        """A Guaranteed pod (cgroupfs naming) with 2 CPUs of quota in the fake tree."""
        pod = make_pod(NAMING, uid, name=name)
        pod.namespace = namespace
        self.tree.add_pod(pod, 2 * PERIOD)
        return pod

    async def create(
        self,
        pod: api.PodSandbox,
        cid: str,
        name: str = "app",
        *,
        annotations: dict[str, str] | None = None,
    ) -> CreateResult:
        """CreateContainer of a container with 2 exclusive CPUs (2-3) and 2 CPUs of quota."""
        if pod.id not in self.sim.pods:
            await self.sim.run_pod_sandbox(pod)
        container = make_container(
            NAMING, pod, cid, name, cpus="2-3", quota=2 * PERIOD, annotations=annotations
        )
        return await self.sim.create_container(container)


def is_shared(result: CreateResult) -> bool:
    """Did the container get the shared CPUs (exclusive 2-3 plus the pool 0-1)?"""
    cpu = result.container.linux.resources.cpu
    return cpu.cpus == "0-3" and "OPENSHIFT_SHARED_CPUS" in env_of(result.container)


@contextlib.asynccontextmanager
async def daemon_node(
    root: Path,
    *,
    extra: str = "",
    device_plugin_extra: str = "",
    log_level: str = "info",
    expect_status: int | None = 0,
) -> AsyncIterator[DaemonNode]:
    """The simulator listening, the daemon started against it and registered; stopped afterwards
    (with `expect_status`, that exit status and no traceback asserted)."""
    plugin_dir = root / "dp"
    plugin_dir.mkdir(exist_ok=True)
    config = write_daemon_config(root, plugin_dir, extra=extra, device_plugin_extra=device_plugin_extra)
    socket_path = root / "nri.sock"
    async with RuntimeSimulator(socket_path) as sim:
        proc = await start_daemon(
            "--log-level", log_level, "run", "--config", str(config), "--socket", str(socket_path)
        )
        daemon = Daemon(proc, GUARD)
        node = DaemonNode(root, plugin_dir, sim, FakeCgroups(root / "cgroup", 1), daemon)
        try:
            await sim.wait_for_plugins(1, GUARD)
            yield node
        finally:
            if node.daemon is not daemon:  # a test that restarted the daemon: the one it runs now too
                await node.daemon.stop()
                print(f"restarted daemon's stderr:\n{node.daemon.stderr}")  # shown if the test fails
            status = await daemon.stop()
            print(f"daemon stderr (exit status {status}):\n{daemon.stderr}")  # shown if the test fails
    if expect_status is not None:
        assert status == expect_status, daemon.stderr
        assert "Traceback" not in daemon.stderr, daemon.stderr


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """A process's resident size (``VmRSS``) or its peak (``VmHWM``) in KiB, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise LookupError(f"no {field} for pid {pid}")
