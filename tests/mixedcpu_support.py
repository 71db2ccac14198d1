"""Helpers for the mixed-CPU plugin tests: fake cgroup trees, runtime naming, pods and containers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from host_guard import refuse_host_paths

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import (
    CgroupDir,
    CgroupLayout,
    CgroupMode,
    Hierarchy,
    container_cgroup_path,
    pod_cgroup_path,
    read_cpu_quota,
    write_cpu_quota,
)
from nri_plugin.common.backoff import Backoff
from nri_plugin.common.clock import LOOP_CLOCK, Clock
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key
from nri_plugin.deviceplugin.marker import ANNOTATION_KEY, HostKey
from nri_plugin.mixedcpu.allocations import AllocationRecord
from nri_plugin.mixedcpu.books import Books, Slot, Watch
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin, PluginObserver, TrustedSources
from nri_plugin.mixedcpu.policy import SharedPool
from nri_plugin.mixedcpu.store import STATE_FILE_NAME, StateStore
from nri_plugin.nri.identity import Identity
from nri_plugin.nri.stub import Stub

PERIOD = 100_000
GUARD = 10.0
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Naming:
    """How a runtime with a cgroup driver names pod and container cgroups in NRI."""

    runtime: str  # containerd | cri-o
    driver: str  # cgroupfs | systemd

    @property
    def id(self) -> str:
        return f"{self.runtime}-{self.driver}"

    def pod_parent(self, uid: str, qos: str = "") -> str:
        if self.driver == "systemd":
            level = f"kubepods-{qos}" if qos else "kubepods"
            short = f"{level}-pod{uid.replace('-', '_')}.slice"
            if self.runtime == "cri-o":
                return short  # CRI-O keeps the base name only
            parents = "/kubepods.slice" + (f"/kubepods-{qos}.slice" if qos else "")
            return f"{parents}/{short}"  # containerd passes kubelet's expanded form
        return f"/kubepods/{qos}/pod{uid}" if qos else f"/kubepods/pod{uid}"

    def container_path(self, pod: api.PodSandbox, cid: str) -> str:
        if self.driver == "systemd":
            prefix = "crio" if self.runtime == "cri-o" else "cri-containerd"
            return f"{pod.linux.cgroup_parent.rsplit('/', 1)[-1]}:{prefix}:{cid}"
        name = f"crio-{cid}" if self.runtime == "cri-o" else cid
        return f"{pod.linux.cgroup_parent}/{name}"


NAMINGS = [Naming(r, d) for r in ("containerd", "cri-o") for d in ("cgroupfs", "systemd")]


def fake_layout(root: Path, version: int = 1) -> CgroupLayout:
    """The layout of a fake cgroup tree in `root`: a v1 host's ``cpu`` and ``cpuset`` hierarchies
    (made here), or a v2 host's unified one (`root` itself)."""
    if version == 1:
        cpu, cpuset = root / "cpu", root / "cpuset"
        cpu.mkdir(parents=True, exist_ok=True)
        cpuset.mkdir(parents=True, exist_ok=True)
        return CgroupLayout(CgroupMode.V1, Hierarchy(1, str(cpu)), Hierarchy(1, str(cpuset)))
    root.mkdir(parents=True, exist_ok=True)
    return CgroupLayout(CgroupMode.V2, Hierarchy(2, str(root)), Hierarchy(2, str(root)))


def make_fake_cgroup(cgroup: CgroupDir, quota: int | None, period: int) -> None:
    """A cgroup (and its parents) in a fake tree, with a CFS limit in the files of its version."""
    os.makedirs(cgroup.fs_path, exist_ok=True)
    if cgroup.hierarchy.version == 1:
        Path(cgroup.fs_path, "cpu.cfs_quota_us").write_text(f"{-1 if quota is None else quota}\n")
        Path(cgroup.fs_path, "cpu.cfs_period_us").write_text(f"{period}\n")
    else:
        Path(cgroup.fs_path, "cpu.max").write_text(f"{'max' if quota is None else quota} {period}\n")


class FakeCgroups:
    """A cgroup tree in a temporary directory, laid out as a v1 (cpu, cpuset) or v2 host."""

    def __init__(self, root: Path, version: int = 1) -> None:
        self.version = version
        self.layout = fake_layout(root, version)

    def pod_dir(self, pod: api.PodSandbox) -> CgroupDir:
        return self.layout.cpu.dir(pod_cgroup_path(pod.linux.cgroup_parent))

    def container_dir(self, container: api.Container) -> CgroupDir:
        return self.layout.cpu.dir(container_cgroup_path(container.linux.cgroups_path))

    def add_pod(self, pod: api.PodSandbox, quota: int | None, period: int = PERIOD) -> CgroupDir:
        cgroup = self.pod_dir(pod)
        make_fake_cgroup(cgroup, quota, period)
        return cgroup

    def pod_quota(self, pod: api.PodSandbox) -> int | None:
        return read_cpu_quota(self.pod_dir(pod)).quota

    def pod_text(self, pod: api.PodSandbox) -> str:
        name = "cpu.cfs_quota_us" if self.version == 1 else "cpu.max"
        return Path(self.pod_dir(pod).fs_path, name).read_text()

    def run_container(self, container: api.Container) -> CgroupDir:
        """What the runtime does after CreateContainer: make the container cgroup with its quota."""
        cgroup = self.container_dir(container)
        cpu = container.linux.resources.cpu
        make_fake_cgroup(cgroup, None, cpu.period.value or PERIOD)
        if cpu.HasField("quota") and cpu.quota.value > 0:
            write_cpu_quota(cgroup, cpu.quota.value)
        return cgroup

    def remove_container(self, container: api.Container) -> None:
        """What the runtime does at RemoveContainer: delete the container cgroup."""
        path = Path(self.container_dir(container).fs_path)
        for name in os.listdir(path):
            (path / name).unlink()
        path.rmdir()


def make_pod(naming: Naming, uid: str = "0000-1111", *, qos: str = "", name: str = "app") -> api.PodSandbox:
    pod = api.PodSandbox(id=f"sandbox-{uid}", uid=uid, name=name, namespace="ns")
    pod.linux.cgroup_parent = naming.pod_parent(uid, qos)
    return pod


def make_container(
    naming: Naming,
    pod: api.PodSandbox,
    cid: str,
    name: str = "main",
    *,
    cpus: str = "4-5",
    quota: int | None = 200_000,
    shares: int | None = 2048,
    period: int | None = PERIOD,
    env: tuple[str, ...] = (),
    annotations: dict[str, str] | None = None,
    state: api.ContainerState.ValueType = api.CONTAINER_UNKNOWN,
) -> api.Container:
    container = api.Container(
        id=cid,
        pod_sandbox_id=pod.id,
        name=name,
        env=["PATH=/bin", *env],
        annotations=annotations,
        state=state,
    )
    container.linux.cgroups_path = naming.container_path(pod, cid)
    cpu = container.linux.resources.cpu
    cpu.cpus = cpus
    if quota is not None:
        cpu.quota.value = quota
    if period is not None:
        cpu.period.value = period
    if shares is not None:
        cpu.shares.value = shares
    return container


def forget_books(state_dir: Path) -> None:
    """The books lost, as a wiped state dir loses them: the database with its -wal and -shm."""
    for suffix in ("", "-wal", "-shm"):
        (state_dir / f"{STATE_FILE_NAME}{suffix}").unlink(missing_ok=True)


def saved_books(state_dir: Path) -> Books:
    """The books a daemon restarted now would load (`saved_state`)."""
    return saved_state(state_dir)[0]


def saved_state(state_dir: Path) -> tuple[Books, dict[Slot, Watch]]:
    """The books and watches a daemon restarted now would load: what its running writer has
    written (the database and its -wal, as the kernel holds them), read from a copy, the writer's
    connection keeping the database itself to itself (`StateStore`: ``locking_mode=EXCLUSIVE``)."""
    with tempfile.TemporaryDirectory(prefix="books-copy-") as copy:
        for suffix in ("", "-wal"):
            with contextlib.suppress(FileNotFoundError):
                shutil.copyfile(
                    state_dir / f"{STATE_FILE_NAME}{suffix}", Path(copy, f"{STATE_FILE_NAME}{suffix}")
                )
        store = StateStore(copy)
        try:
            return store.load(), store.watches
        finally:
            store.close()


def marker(key: HostKey, device: str = "shared-cpus-0") -> dict[str, str]:
    """The annotation of kubelet's first allocation of `device` (allocation 1: the same value at every
    call, so two containers given it present one allocation, one of them a copy); a later
    allocation of it is `new_allocation`."""
    return {ANNOTATION_KEY: key.sign(device, allocation=1)}


def new_allocation(key: HostKey, device: str = "shared-cpus-0") -> dict[str, str]:
    """The annotation of a new allocation of `device` by kubelet (a fresh Allocate)."""
    return {ANNOTATION_KEY: key.sign(device)}


# The store each state dir's newest plugin was made with (`make_plugin`); a store no plugin holds any
# more is dropped.
_STORES: weakref.WeakValueDictionary[str, StateStore] = weakref.WeakValueDictionary()


def make_plugin(
    state_dir: Path,
    layout: CgroupLayout,
    shared: frozenset[int] | SharedPool = frozenset({0, 1}),
    *,
    trust_pod_annotation: bool = False,
    trust_marker: bool = True,
    observer: PluginObserver | None = None,
    clock: Clock = LOOP_CLOCK,
    reconcile_interval: float | None = None,
    allocations: AllocationRecord | None = None,
) -> tuple[MixedCpuPlugin, HostKey]:
    key = load_or_create_host_key(state_dir)
    # A plugin made again on the same state dir is a daemon restarted: the previous process is gone,
    # and with it its hold on the books' database (`StateStore` keeps it locked while open).
    previous = _STORES.get(str(Path(state_dir).resolve()))
    if previous is not None:
        previous.close()
    store = StateStore(state_dir)
    _STORES[str(Path(state_dir).resolve())] = store
    plugin = MixedCpuPlugin(
        shared=shared,
        layout=layout,
        store=store,
        trusted=TrustedSources(key if trust_marker else None, trust_pod_annotation, allocations),
        observer=observer,
        clock=clock,
        reconcile_interval=reconcile_interval,
    )
    return plugin, key


class FakeKubeletRecord:
    """kubelet's record of device allocations, in memory (an `AllocationRecord`): `allocate` what
    kubelet admitted; `reachable = False` makes every lookup answer "cannot be asked"."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, frozenset[str]]] = {}
        self.reachable = True
        self.asked = 0

    def allocate(self, pod: api.PodSandbox, container: str, device: str) -> None:
        containers = self.pods.setdefault((pod.namespace, pod.name), {})
        containers[container] = containers.get(container, frozenset()) | {device}

    def forget(self, pod: api.PodSandbox) -> None:
        self.pods.pop((pod.namespace, pod.name), None)

    async def pod_allocations(self, namespace: str, name: str) -> Mapping[str, frozenset[str]] | None:
        self.asked += 1
        return dict(self.pods.get((namespace, name), {})) if self.reachable else None

    async def node_allocations(self) -> Mapping[tuple[str, str], Mapping[str, frozenset[str]]] | None:
        self.asked += 1
        return {ref: dict(containers) for ref, containers in self.pods.items()} if self.reachable else None


@contextlib.asynccontextmanager
async def plugin_running(plugin: object, socket: Path, **options: Any) -> AsyncIterator[Stub]:
    """A stub serving `plugin` on `socket` for the body of the `with`; `options` go to `Stub`."""
    defaults = {
        "identity": Identity(name="mixed-cpu", index="10"),
        "reconnect": False,
        "backoff": Backoff(initial=0.01, maximum=0.05),
    }
    stub = Stub(plugin, socket_path=str(socket), **{**defaults, **options})
    task = asyncio.ensure_future(stub.run())
    try:
        yield stub
    finally:
        stub.stop()
        await asyncio.wait_for(task, GUARD)


def apply_adjustment(container: api.Container, adjust: api.ContainerAdjustment | None) -> api.Container:
    """What the runtime does with our adjustment: the container as it then runs."""
    if adjust is None:
        return container
    cpu = adjust.linux.resources.cpu
    if cpu.cpus:
        container.linux.resources.cpu.cpus = cpu.cpus
    if cpu.HasField("quota"):
        container.linux.resources.cpu.quota.value = cpu.quota.value
    names = {e.key for e in adjust.env}
    env = [e for e in container.env if e.partition("=")[0] not in names]
    env += [f"{e.key}={e.value}" for e in adjust.env]
    del container.env[:]
    container.env.extend(env)
    return container


# -- the daemon as a subprocess ----------------------------------------------------------------------------


def write_daemon_config(
    directory: Path,
    plugin_dir: Path,
    *,
    metrics_address: str = "127.0.0.1:0",
    extra: str = "",
    device_plugin_extra: str = "",
) -> Path:
    """A config file for ``run`` in ``directory``: shared CPUs 0-1 of online 0-3 (a fake sysfs file), a
    fake cgroup v1 tree (``cgroup/cpu``, ``cgroup/cpuset``), the state dir ``state``, kubelet's
    device-plugin directory ``plugin_dir`` (keep it short: unix socket paths are limited to 107 bytes),
    and metrics and probes on `metrics_address` (by default a free port: daemons run in parallel; the
    daemon logs the one it bound). `extra`: more top-level lines; `device_plugin_extra`: more lines
    of the ``[device_plugin]`` table. No systemd bus: a test daemon never talks to the host's systemd,
    nor to the host's kubelet (its PodResources socket is ``pr.sock`` in ``directory``, where nobody
    answers, unless `device_plugin_extra` names one).
    The NRI socket ``nri.sock`` in ``directory`` (--socket wins): the node-wide lock lies beside it,
    never in the host's /var/run/nri, where daemons of tests running at once would refuse each other."""
    # kubelet's PodResources socket: never the host's. By default one in `directory` that nobody serves
    # (kubelet cannot be asked, as on a machine without kubelet); a test that wants another names it.
    pod_resources = (
        ""
        if "pod_resources_socket" in device_plugin_extra
        else f'pod_resources_socket = "{directory}/pr.sock"\n'
    )
    online = directory / "sys" / "devices" / "system" / "cpu"
    online.mkdir(parents=True, exist_ok=True)  # (again for a restarted daemon)
    (online / "online").write_text("0-3\n")
    (directory / "cgroup" / "cpu").mkdir(parents=True, exist_ok=True)
    (directory / "cgroup" / "cpuset").mkdir(parents=True, exist_ok=True)
    config = directory / "config.toml"
    config.write_text(
        f'shared_cpuset = "0-1"\nsysfs_root = "{directory}/sys"\nstate_dir = "{directory}/state"\n'
        f'cgroup_root = "{directory}/cgroup"\ncgroup_version = "v1"\n'
        f'metrics_address = "{metrics_address}"\nsystemd_bus = ""\nnri_socket = "{directory}/nri.sock"\n'
        f"{extra}"
        f'[device_plugin]\nplugin_dir = "{plugin_dir}"\n'
        f"{device_plugin_extra}{pod_resources}"
    )
    refuse_host_paths(("run", "--config", str(config)))
    return config


async def start_daemon(
    *args: str,
    prefix: Sequence[str] = (),
    stdout: int = subprocess.PIPE,
    kernel_cgroups: bool = False,
    in_vm: bool = False,
) -> asyncio.subprocess.Process:
    """``python -m nri_plugin.daemon.cli *args`` from this source tree, under the command `prefix` if any
    (e.g. setpriv dropping capabilities); stderr is a pipe, stdout too unless told otherwise. A ``run``
    must name its own places, none of the host's (`host_guard`; `kernel_cgroups`: the real-kernel
    tier's daemon may use the host's cgroup tree; `in_vm`: the VM tier's guest, whose machine is the
    test's own, uses any of its places)."""
    if not in_vm:
        refuse_host_paths(args, kernel_cgroups=kernel_cgroups)
    return await asyncio.create_subprocess_exec(
        *prefix,
        sys.executable,
        "-m",
        "nri_plugin.daemon.cli",
        *args,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=stdout,
        stderr=subprocess.PIPE,
    )


@contextlib.asynccontextmanager
async def daemon_process(*args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """`start_daemon(*args)` for the body of the `with`; killed after it if still running. If the body
    failed, what the daemon wrote to stderr and the body did not read is printed (pytest shows it)."""
    proc = await start_daemon(*args)
    failed = True
    try:
        yield proc
        failed = False
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if failed and proc.stderr is not None:
            with contextlib.suppress(RuntimeError):  # the body's own reader holds the stream
                rest = await asyncio.wait_for(proc.stderr.read(), GUARD)
                print(f"daemon stderr (exit status {proc.returncode}):\n{rest.decode(errors='replace')}")


async def terminate(proc: asyncio.subprocess.Process, timeout: float, signum: int = signal.SIGTERM) -> bytes:
    """Send `signum` and wait (at most `timeout` s) for the exit; what the process wrote to stderr."""
    proc.send_signal(signum)
    _, stderr = await asyncio.wait_for(proc.communicate(), timeout)
    return stderr


def run_cli(*args: str, timeout: float, check: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m nri_plugin.daemon.cli *args`` from this source tree, to its end; output as text. A
    ``run`` must name its own places, none of the host's (`host_guard`)."""
    refuse_host_paths(args)
    return subprocess.run(
        [sys.executable, "-m", "nri_plugin.daemon.cli", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
    )


async def stream_lines(stream: asyncio.StreamReader) -> AsyncIterator[str]:
    """Every line of `stream` (without its newline), whatever its length, to the end. The stream's
    own line reader raises on a line over its 64 KiB limit; a reader that stopped there would leave
    the writer blocked on a full pipe (issue 32)."""
    pending = b""
    while chunk := await stream.read(1 << 16):
        *complete, pending = (pending + chunk).split(b"\n")
        for raw in complete:
            yield raw.decode(errors="replace")
    if pending:
        yield pending.decode(errors="replace")


class Daemon:
    """A daemon subprocess and every line it wrote to stderr so far (read as they come). `guard`
    bounds each wait (against hangs only)."""

    def __init__(self, proc: asyncio.subprocess.Process, guard: float = GUARD) -> None:
        self.proc = proc
        self.guard = guard
        self.lines: list[str] = []
        self._new_line = asyncio.Condition()
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for line in stream_lines(self.proc.stderr):  # every line, whatever its length
            async with self._new_line:
                self.lines.append(line)
                self._new_line.notify_all()

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)

    def logged(self, *fragments: str) -> list[str]:
        """The lines so far that contain every fragment."""
        return [line for line in self.lines if all(f in line for f in fragments)]

    async def wait_log(self, *fragments: str) -> str:
        """The first line containing every fragment, once the daemon has written it.

        The daemon logs before it answers, but the pipe is read by a task of ours: a line can reach
        us a moment after the answer that followed it."""
        try:
            async with self._new_line:
                await asyncio.wait_for(
                    self._new_line.wait_for(lambda: bool(self.logged(*fragments))), self.guard
                )
        except asyncio.TimeoutError:
            raise AssertionError(
                f"no line with {fragments} on the daemon's stderr within {self.guard} s:\n{self.stderr}"
            ) from None
        return self.logged(*fragments)[0]

    async def kill(self) -> None:
        """SIGKILL: no shutdown, no flush, nothing."""
        self.proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(self.proc.wait(), self.guard)
        await asyncio.wait_for(self._reader, self.guard)

    async def stop(self) -> int:
        """SIGTERM (as when its pod is stopped) and wait; the exit status."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), self.guard)
        finally:
            if self.proc.returncode is None:
                self.proc.kill()
                await self.proc.wait()
            await asyncio.wait_for(self._reader, self.guard)
        assert self.proc.returncode is not None
        return self.proc.returncode
