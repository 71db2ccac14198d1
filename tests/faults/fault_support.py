"""The fault suite's node: a cgroup tree, a runtime that plays the runtime's part on container cgroups,
a population of pods and containers, the daemon as a subprocess, and the one invariant checker every
fault test ends with (`inconsistencies`).

The runtime (`Runtime`) is the project's simulator plus what containerd or CRI-O do to the container
cgroups: create them with the (adjusted) cpuset and quota, write the updates plugins ask for, delete
them before RemoveContainer (or at the stop, with the simulator's `stopped_cgroup_lingers` mode
off). On a fake v1 tree it also enforces the one v1 kernel rule a wrong write order would meet (a
child quota above its parent's is refused); on the real kernel, the kernel does.

`inconsistencies(population, books=...)` walks every container the runtime knows and returns one line
per container (or pod) left inconsistent; a fault test asserts that list is empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kernel_support import make_cgroups, scratch_subtree
from mixedcpu_support import Daemon, fake_layout, make_fake_cgroup, make_plugin, start_daemon

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import (
    CgroupDir,
    CgroupError,
    CgroupLayout,
    CgroupPath,
    container_cgroup_path,
    format_cpuset,
    parse_cpuset,
    pod_cgroup_path,
    read_cpu_quota,
    read_cpuset,
    write_cpu_quota,
    write_cpuset,
)
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key
from nri_plugin.deviceplugin.marker import ANNOTATION_KEY, HostKey
from nri_plugin.mixedcpu.books import Books
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin
from nri_plugin.nri.simulator import CreateResult, RuntimeModes, RuntimeSimulator, env_of

PERIOD = 100_000
ROOT = Path(__file__).resolve().parents[2]
# Guards against hangs only; what is awaited normally takes milliseconds.
GUARD = 15.0
SHARED_ENV, ISOLATED_ENV = "OPENSHIFT_SHARED_CPUS", "OPENSHIFT_ISOLATED_CPUS"

T = TypeVar("T")

# Totals over the session, printed by conftest.py: every check run, every container walked.
TOTALS = {"checks": 0, "containers": 0, "inconsistent": 0}


async def within(awaitable: Awaitable[T], seconds: float = GUARD) -> T:
    return await asyncio.wait_for(awaitable, seconds)


async def until(predicate: Callable[[], bool], seconds: float = GUARD) -> None:
    """Wait until `predicate()` holds (checked every 5 ms: the state it reads has no event to wait on)."""

    async def wait() -> None:
        while not predicate():  # noqa: ASYNC110 (polling state owned by the simulator)
            await asyncio.sleep(0.005)

    await within(wait(), seconds)


# -- the cgroup tree ---------------------------------------------------------------------------------


class Tree:
    """Pod and container cgroups in the `cpu` and `cpuset` hierarchies of a layout: a fake tree in a
    temporary directory (v1 or v2), or a scratch subtree of the real kernel's v1 hierarchies."""

    def __init__(
        self, layout: CgroupLayout, *, kernel_top: str | None = None, root: Path | None = None
    ) -> None:
        self.layout = layout
        self.kernel_top = kernel_top  # the scratch subtree's name on the real kernel
        self.root = root  # cgroup_root of a fake tree (for the daemon's config)
        # Runtime writes refused (by the kernel, or by the fake v1 rule), per container id.
        self.refused: dict[str, list[str]] = defaultdict(list)

    @classmethod
    def fake(cls, root: Path, version: int) -> Tree:
        return cls(fake_layout(root, version), root=root)

    @classmethod
    @contextlib.contextmanager
    def kernel(cls, layout: CgroupLayout) -> Iterator[Tree]:
        """A scratch subtree ``<mount>/mixed-cpu-fault-<pid>-<random>`` of both v1 hierarchies,
        removed afterwards, children first."""
        with scratch_subtree(layout, "mixed-cpu-fault") as top:
            yield cls(layout, kernel_top=top)

    @property
    def version(self) -> int:
        return self.layout.cpu.version

    @property
    def is_kernel(self) -> bool:
        return self.kernel_top is not None

    def describe(self) -> str:
        return "kernel-v1" if self.is_kernel else f"fake-v{self.version}"

    # paths

    def pod_cpu(self, pod: api.PodSandbox) -> CgroupDir:
        return self.layout.cpu.dir(pod_cgroup_path(pod.linux.cgroup_parent))

    def cpu_dir(self, container: api.Container) -> CgroupDir:
        return self.layout.cpu.dir(container_cgroup_path(container.linux.cgroups_path))

    def cpuset_dir(self, container: api.Container) -> CgroupDir:
        return self.layout.cpuset.dir(container_cgroup_path(container.linux.cgroups_path))

    def quota_file(self, pod: api.PodSandbox) -> Path:
        return Path(self.pod_cpu(pod).fs_path, "cpu.cfs_quota_us" if self.version == 1 else "cpu.max")

    # what kubelet and the runtime do

    def add_pod(self, pod: api.PodSandbox, quota: int | None) -> None:
        """kubelet's pod cgroup, its quota the sum of its containers' limits (None: unlimited)."""
        path = pod_cgroup_path(pod.linux.cgroup_parent)
        if self.is_kernel:
            for hierarchy in (self.layout.cpu, self.layout.cpuset):
                make_cgroups(self.layout, hierarchy, path)
            write_cpu_quota(self.pod_cpu(pod), quota)
            return
        make_fake_cgroup(self.pod_cpu(pod), quota, PERIOD)
        if self.version == 1:
            os.makedirs(self.layout.cpuset.dir(path).fs_path, exist_ok=True)

    def run_container(self, container: api.Container) -> None:
        """The runtime creates the container cgroups with the container's (adjusted) resources."""
        cpu, cpuset = self.cpu_dir(container), self.cpuset_dir(container)
        if self.is_kernel:
            make_cgroups(self.layout, self.layout.cpu, cpu.path)
            make_cgroups(self.layout, self.layout.cpuset, cpuset.path)
        else:
            make_fake_cgroup(cpu, None, container.linux.resources.cpu.period.value or PERIOD)
            os.makedirs(cpuset.fs_path, exist_ok=True)
            Path(cpuset.fs_path, "cpuset.cpus").write_text("\n")
        self.apply(container, container.linux.resources)

    def apply(self, container: api.Container, resources: api.LinuxResources) -> None:
        """The runtime writes a container's cpuset and quota (at creation, on an update)."""
        cpu = resources.cpu
        try:
            if cpu.cpus:
                write_cpuset(self.cpuset_dir(container), parse_cpuset(cpu.cpus))
            if cpu.HasField("quota") and cpu.quota.value != 0:
                quota = None if cpu.quota.value < 0 else cpu.quota.value
                if self.version == 1 and not self.is_kernel and quota is not None:
                    path = self.cpu_dir(container).path
                    parent = read_cpu_quota(self.layout.cpu.dir(CgroupPath(path.parts[:-1]))).quota
                    if parent is not None and quota > parent:
                        raise CgroupError(f"v1 refuses quota {quota} above the pod's {parent} (EINVAL)")
                write_cpu_quota(self.cpu_dir(container), quota)
        except CgroupError as exc:
            self.refused[container.id].append(f"runtime write refused: {exc}")

    def delete_pod(self, pod: api.PodSandbox) -> None:
        """kubelet removes a pod's cgroups once the pod is gone (its containers' first)."""
        path = pod_cgroup_path(pod.linux.cgroup_parent)
        for hierarchy in (self.layout.cpu, self.layout.cpuset):
            cgroup = hierarchy.dir(path)
            if self.is_kernel:
                for dirpath, _, _ in sorted(os.walk(cgroup.fs_path), key=lambda e: -e[0].count("/")):
                    os.rmdir(dirpath)
            else:
                shutil.rmtree(cgroup.fs_path, ignore_errors=True)

    def delete_container(self, container: api.Container) -> None:
        for cgroup in (self.cpu_dir(container), self.cpuset_dir(container)):
            if self.is_kernel:
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(cgroup.fs_path)
            else:
                shutil.rmtree(cgroup.fs_path, ignore_errors=True)

    # reading back

    def pod_quota(self, pod: api.PodSandbox) -> int | None:
        return read_cpu_quota(self.pod_cpu(pod)).quota

    def container_quota(self, container: api.Container) -> int | None:
        return read_cpu_quota(self.cpu_dir(container)).quota

    def container_cpus(self, container: api.Container) -> frozenset[int]:
        return read_cpuset(self.cpuset_dir(container))


# -- the runtime -------------------------------------------------------------------------------------


class Runtime(RuntimeSimulator):
    """The simulator, plus the runtime's part on the container cgroups, plus fault injection:
    `drop_if(method, request)`, when it returns True (once), closes the connection right after that
    request is written, before its reply can arrive: the plugin receives and handles it, and its
    answer is lost, as when a runtime goes away in the middle of a request."""

    def __init__(
        self, socket_path: Path, tree: Tree, *, modes: RuntimeModes | None = None, **options: Any
    ) -> None:
        super().__init__(socket_path, **options)
        self.tree = tree
        self.options = options
        # As CRI-O always does (and containerd for exited containers): cgroups go at removal.
        self.modes = modes if modes is not None else RuntimeModes(stopped_cgroup_lingers=True)
        self.drop_if: Callable[[str, Any], bool] | None = None
        self.calls: dict[str, int] = defaultdict(int)

    async def __aenter__(self) -> Runtime:
        await self.start()
        return self

    def restarted(self) -> Runtime:
        """The same runtime after a restart: a new listener on the same socket, its pods and
        containers restored from its own state (as containerd and CRI-O do)."""
        again = Runtime(Path(self.socket_path), self.tree, **self.options)
        again.restore(self)
        return again

    def make_resources(self, container: api.Container) -> None:
        """The runtime makes the container's cgroups with its adjusted resources (CRI-O's runc
        create, or containerd's task creation at the start: `RuntimeModes.cgroup_made_at_start`)."""
        self.tree.run_container(container)

    def start_without_plugins(self, container: api.Container) -> None:
        """A container the runtime created and started while no plugin was connected."""
        container.state = api.CONTAINER_RUNNING
        self.add_container(container)
        self.tree.run_container(container)

    async def update_container(self, container_id: str, resources: api.LinuxResources) -> api.LinuxResources:
        applied = await super().update_container(container_id, resources)
        self.tree.apply(self.containers[container_id], applied)
        return applied

    def release_resources(self, container: api.Container) -> None:
        self.tree.delete_container(container)  # before plugins hear of the stop or removal

    def _apply_update(self, update: api.ContainerUpdate, *, source: str) -> bool:
        applied = super()._apply_update(update, source=source)
        if applied:
            self.tree.apply(self.containers[update.container_id], update.linux.resources)
        return applied

    async def _call(self, plugin: Any, method: str, request: Any, response_type: Any, **kwargs: Any) -> Any:
        self.calls[method] += 1
        if self.drop_if is not None and self.drop_if(method, request):
            self.drop_if = None
            # Runs once the request is written and the call waits for its reply.
            asyncio.get_running_loop().call_soon(plugin.trunk.close)
        return await super()._call(plugin, method, request, response_type, **kwargs)

    def dropped(self) -> list[str]:
        return [r.detail for r in self.records if r.outcome == "dropped"]


# -- the population ----------------------------------------------------------------------------------


@dataclass
class Spec:
    """What one container asked kubelet for, and what the checker expects of it."""

    id: str
    pod: str  # sandbox id
    name: str
    exclusive: frozenset[int]
    quota: int  # -1: unlimited
    asks: bool
    env: str = "injected"  # injected | stale (created while the plugin was away: env cannot change)


@dataclass
class PodSpec:
    pod: api.PodSandbox
    baseline: int | None  # the pod's own quota; None: unlimited


@dataclass
class Population:
    """Pods and containers of one node, created through the runtime; `runtime` is replaced when the
    runtime restarts."""

    runtime: Runtime
    tree: Tree
    key: HostKey
    shared: frozenset[int] = frozenset({0, 1})
    pods: dict[str, PodSpec] = field(default_factory=dict)
    specs: dict[str, Spec] = field(default_factory=dict)

    def pod(
        self, uid: str, baseline: int | None, *, name: str = "", parent: str = "kubepods"
    ) -> api.PodSandbox:
        """A Guaranteed pod whose cgroup kubelet made with quota `baseline`; on the real kernel, in
        ``/<scratch>/<parent>/pod<uid>``."""
        pod = api.PodSandbox(id=f"sandbox-{uid}", uid=uid, name=name or f"pod-{uid}", namespace="ns")
        if self.tree.is_kernel:
            pod.linux.cgroup_parent = f"/{self.tree.kernel_top}/{parent}/pod{uid}"
        elif self.tree.version == 1:
            pod.linux.cgroup_parent = f"/kubepods/pod{uid}"  # containerd, cgroupfs driver
        else:
            pod.linux.cgroup_parent = f"kubepods-pod{uid.replace('-', '_')}.slice"  # CRI-O, systemd
        self.tree.add_pod(pod, baseline)
        self.pods[pod.id] = PodSpec(pod, baseline)
        return pod

    def container(
        self,
        pod: api.PodSandbox,
        cid: str,
        name: str,
        cpus: str,
        *,
        quota: int = 0,
        asks: bool = False,
        annotations: dict[str, str] | None = None,
        env: str = "injected",
    ) -> api.Container:
        """A container with `cpus` exclusive CPUs and a quota to match (or `quota`; -1 unlimited);
        `asks`: with the device plugin's signed marker (one device per pod and name)."""
        exclusive = parse_cpuset(cpus)
        quota = quota or len(exclusive) * PERIOD
        if asks and annotations is None:
            annotations = {ANNOTATION_KEY: self.key.sign(f"dev-{pod.uid}-{name}")}
        container = api.Container(
            id=cid, pod_sandbox_id=pod.id, name=name, env=["PATH=/bin"], annotations=annotations or {}
        )
        if self.tree.version == 1:
            container.linux.cgroups_path = f"{pod.linux.cgroup_parent}/{cid}"
        else:
            container.linux.cgroups_path = f"{pod.linux.cgroup_parent}:crio:{cid}"
        resources = container.linux.resources.cpu
        resources.cpus = cpus
        resources.quota.value = quota
        resources.period.value = PERIOD
        resources.shares.value = 1024 * len(exclusive)
        self.specs[cid] = Spec(cid, pod.id, name, exclusive, quota, asks, env)
        return container

    async def create(
        self, pod: api.PodSandbox, cid: str, name: str, cpus: str, **options: Any
    ) -> CreateResult:
        """kubelet's CreateContainer (and RunPodSandbox first if the pod is new to the runtime)."""
        if pod.id not in self.runtime.pods:
            await self.runtime.run_pod_sandbox(pod)
        result = await self.runtime.create_container(self.container(pod, cid, name, cpus, **options))
        await self.runtime.start_container(cid)
        return result

    def start_while_away(self, pod: api.PodSandbox, cid: str, name: str, cpus: str, **options: Any) -> None:
        """A container the runtime started while the plugin was not connected."""
        if pod.id not in self.runtime.pods:
            self.runtime.add_pod(pod)
        self.runtime.start_without_plugins(self.container(pod, cid, name, cpus, env="stale", **options))

    async def restart(self, old: str, new: str) -> CreateResult:
        """kubelet restarts a container: the new instance is created, the old one stopped and removed."""
        spec = self.specs[old]
        pod = self.pods[spec.pod].pod
        current = self.runtime.containers[old]
        result = await self.runtime.create_container(
            self.container(
                pod,
                new,
                spec.name,
                format_cpuset(spec.exclusive),
                quota=spec.quota,
                asks=spec.asks,
                annotations=dict(current.annotations),
            )
        )
        await self.runtime.start_container(new)
        await self.runtime.stop_container(old)
        await self.runtime.remove_container(old)
        return result

    async def standard(self, tag: str = "") -> list[api.PodSandbox]:
        """The usual node: four Guaranteed pods, eight containers, five of them asking for shared CPUs.

        * ``fwd``: a forwarder (asks, 2 exclusive CPUs) beside a sidecar that does not ask;
        * ``duo``: two containers that both ask;
        * ``free``: an unlimited pod whose asking container has an unlimited quota;
        * ``plain``: nobody asks (the pod must stay untouched).
        """
        fwd = self.pod(f"fwd{tag}", 3 * PERIOD)
        duo = self.pod(f"duo{tag}", 4 * PERIOD)
        free = self.pod(f"free{tag}", None)
        plain = self.pod(f"plain{tag}", 2 * PERIOD)
        await self.create(fwd, f"fwd{tag}-a", "fwd", "2-3", asks=True)
        await self.create(fwd, f"fwd{tag}-side", "sidecar", "4")
        await self.create(duo, f"duo{tag}-a", "left", "5-6", asks=True)
        await self.create(duo, f"duo{tag}-b", "right", "7-8", asks=True)
        await self.create(free, f"free{tag}-a", "spin", "9", quota=-1, asks=True)
        await self.create(free, f"free{tag}-side", "logger", "10", quota=-1)
        await self.create(plain, f"plain{tag}-a", "web", "11")
        await self.create(plain, f"plain{tag}-b", "db", "12")
        return [fwd, duo, free, plain]

    def pod_quotas(self) -> dict[str, int | None]:
        """Every pod's quota as its cgroup file says now."""
        return {pod_id: self.tree.pod_quota(spec.pod) for pod_id, spec in self.pods.items()}


# -- the invariant checker ---------------------------------------------------------------------------


def _cpus_of(text: str) -> frozenset[int] | str:
    try:
        return parse_cpuset(text)
    except Exception as exc:  # a malformed cpuset is an inconsistency, reported as such
        return f"malformed cpuset {text!r}: {exc}"


def inconsistencies(population: Population, *, books: Books | None = None, count: bool = True) -> list[str]:
    """Walk every container the runtime knows; one line per container (or pod) that is inconsistent.

    A container that asked (valid marker) and is not stopped must have exclusive + shared CPUs and a
    quota of n(cpus) x period (unlimited stays unlimited), both in the runtime's view (adjustment and
    updates applied) and in its cgroup files; its environment must name both sets, unless it was started
    while the plugin was away (env cannot change after start). A container that did not ask must be
    exactly as kubelet asked, with no OPENSHIFT_* variable. Every pod's quota file must hold baseline +
    Σ n(shared) x period over its live asking containers (unlimited stays unlimited); on cgroup v1 no
    container quota may exceed its pod's. With `books`, the plugin's books must name exactly the live
    asking containers of each pod and their target must equal the pod's quota file.

    `count`: add this check to the session's totals (off for checks that expect to find a fault's
    damage before it is repaired).
    """
    runtime, tree, shared = population.runtime, population.tree, population.shared
    problems: dict[str, list[str]] = defaultdict(list)
    live_asking: dict[str, dict[str, str]] = defaultdict(dict)  # pod id -> name -> container id
    members: dict[str, list[str]] = defaultdict(list)  # pod id -> live container ids
    for cid, container in sorted(runtime.containers.items()):
        spec = population.specs.get(cid)
        if spec is None:
            problems[cid].append("a container the population did not create")
            continue
        problems[cid].extend(tree.refused.get(cid, []))
        if container.state == api.CONTAINER_STOPPED:
            continue
        members[spec.pod].append(cid)
        env = env_of(container)
        if spec.asks:
            other = live_asking[spec.pod].setdefault(spec.name, cid)
            if other != cid:
                problems[cid].append(f"two live instances of {spec.name}: {other} and {cid}")
            want_cpus = spec.exclusive | shared
            want_quota = len(want_cpus) * PERIOD if spec.quota > 0 else spec.quota
            if spec.env == "injected":
                want_env = {SHARED_ENV: format_cpuset(shared), ISOLATED_ENV: format_cpuset(spec.exclusive)}
                got_env = {name: env.get(name) for name in want_env}
                if got_env != want_env:
                    problems[cid].append(f"env {got_env}, expected {want_env}")
            elif ISOLATED_ENV in env:
                problems[cid].append(f"env shows {ISOLATED_ENV} but it was started without the plugin")
        else:
            want_cpus, want_quota = spec.exclusive, spec.quota
            for name in (SHARED_ENV, ISOLATED_ENV):
                if name in env:
                    problems[cid].append(f"did not ask, yet has {name}={env[name]}")
        cpu = container.linux.resources.cpu
        have_cpus = _cpus_of(cpu.cpus)
        have_quota = cpu.quota.value if cpu.HasField("quota") else 0
        if have_cpus != want_cpus:
            problems[cid].append(f"runtime cpus {cpu.cpus!r}, expected {format_cpuset(want_cpus)!r}")
        if have_quota != want_quota:
            problems[cid].append(f"runtime quota {have_quota}, expected {want_quota}")
        try:
            file_cpus, file_quota = tree.container_cpus(container), tree.container_quota(container)
        except CgroupError as exc:
            problems[cid].append(f"container cgroup unreadable: {exc}")
            continue
        if file_cpus != want_cpus:
            problems[cid].append(
                f"cpuset file {format_cpuset(file_cpus)!r}, expected {format_cpuset(want_cpus)!r}"
            )
        if file_quota != (None if want_quota < 0 else want_quota):
            problems[cid].append(f"quota file {file_quota}, expected {want_quota}")

    for pod_id, pod_spec in sorted(population.pods.items()):
        if pod_id not in runtime.pods:
            continue
        pod = pod_spec.pod
        asking = live_asking.get(pod_id, {})
        owners = members.get(pod_id) or [f"pod {pod.uid}"]
        want: int | None = None
        if pod_spec.baseline is not None:
            want = pod_spec.baseline + len(asking) * len(shared) * PERIOD
        try:
            have = tree.pod_quota(pod)
        except CgroupError as exc:
            for owner in owners:
                problems[owner].append(f"pod quota unreadable: {exc}")
            continue
        pod_problems = []
        if have != want:
            pod_problems.append(f"pod {pod.uid} quota file {have}, expected {want}")
        if tree.version == 1 and have is not None:
            for cid in members.get(pod_id, []):
                with contextlib.suppress(CgroupError):
                    child = tree.container_quota(runtime.containers[cid])
                    if child is not None and child > have:
                        problems[cid].append(f"quota {child} above its pod's {have} (v1 refuses it)")
        if books is not None:
            record = books.pods.get(pod.uid)
            held = {r.id for r in record.containers.values()} if record is not None else set()
            if held != set(asking.values()):
                pod_problems.append(f"books hold {sorted(held)}, live asking {sorted(asking.values())}")
            if record is not None and record.target() != have:
                pod_problems.append(f"books target {record.target()}, pod quota file {have}")
        for owner in owners:
            problems[owner].extend(pod_problems)

    bad = [f"{key}: {'; '.join(found)}" for key, found in sorted(problems.items()) if found]
    if count:
        TOTALS["checks"] += 1
        TOTALS["containers"] += len(runtime.containers)
        TOTALS["inconsistent"] += len(bad)
    return bad


def books_vs_files(population: Population, books: Books) -> list[str]:
    """Pods whose quota file differs from the books' target (half-applied state), one line each."""
    bad = []
    for spec in population.pods.values():
        record = books.pods.get(spec.pod.uid)
        if record is not None and spec.pod.id in population.runtime.pods:
            have = population.tree.pod_quota(spec.pod)
            if record.target() != have:
                bad.append(f"pod {spec.pod.uid}: books target {record.target()}, quota file {have}")
    return bad


# -- an in-process node ------------------------------------------------------------------------------


@dataclass
class Node:
    """A node for in-process tests: tree, runtime, population, and the plugin's state dir."""

    root: Path
    population: Population
    state: Path
    socket: Path

    @property
    def runtime(self) -> Runtime:
        return self.population.runtime

    @property
    def tree(self) -> Tree:
        return self.population.tree

    def plugin(self) -> MixedCpuPlugin:
        return make_plugin(self.state, self.tree.layout, self.population.shared)[0]


def make_node(
    root: Path, tree: Tree | int, shared: frozenset[int] = frozenset({0, 1}), **options: Any
) -> Node:
    """`tree`: a `Tree`, or 1 / 2 for a fake v1 / v2 tree in `root`; `options` go to the runtime
    (CRI-O's NRI v0.11 naming for a v2 tree, containerd's v0.12 for v1)."""
    if isinstance(tree, int):
        if tree == 2:
            options = {"runtime_name": "cri-o", "runtime_version": "1.36.3", "nri_version": "", **options}
        tree = Tree.fake(root / "cgroup", tree)
    state, socket = root / "state", root / "nri.sock"
    runtime = Runtime(socket, tree, **options)
    population = Population(runtime, tree, load_or_create_host_key(state), shared)
    return Node(root, population, state, socket)


# -- the daemon as a subprocess ----------------------------------------------------------------------


def write_config(
    directory: Path,
    tree: Tree,
    *,
    plugin_dir: Path | None = None,
    shared: frozenset[int] = frozenset({0, 1}),
    metrics: bool = False,
    extra: str = "",
    device_plugin: str = "",
    pod_resources: str | None = None,
) -> Path:
    """The daemon's config: shared CPUs `shared` of online 0-15 (a fake sysfs), the tree `tree` (a
    fake one, or the real kernel's mounts, detected), the state dir ``state``; metrics and probes on
    a free port of 127.0.0.1 with `metrics` (the daemon logs which), else none; kubelet's
    device-plugin directory `plugin_dir` (default ``kubelet`` in `directory`: no kubelet there, the
    device plugin waits for one); `extra`: more top-level lines; `device_plugin`: more lines of the
    ``[device_plugin]`` table. Never the host's system bus, nor kubelet's PodResources socket:
    `pod_resources` (default ``pr.sock`` in `directory`, where nobody answers: kubelet cannot be
    asked; "": no record at all), unless `device_plugin` names one."""
    if pod_resources is None:
        pod_resources = f"{directory}/pr.sock"
    pod_resources_line = f"pod_resources_socket = {json.dumps(pod_resources)}\n"
    if "pod_resources_socket" in device_plugin:  # the test names its own
        pod_resources_line = ""
    online = directory / "sys" / "devices" / "system" / "cpu"
    online.mkdir(parents=True)
    (online / "online").write_text("0-15\n")
    if tree.is_kernel:
        cgroups = 'cgroup_root = "/sys/fs/cgroup"\ncgroup_version = "auto"\n'
    else:
        assert tree.root is not None
        cgroups = f'cgroup_root = "{tree.root}"\ncgroup_version = "v{tree.version}"\n'
    plugin_dir_line = f'plugin_dir = "{plugin_dir or directory / "kubelet"}"'
    config = directory / "config.toml"
    config.write_text(
        f'shared_cpuset = "{format_cpuset(shared)}"\nsysfs_root = "{directory}/sys"\n'
        f'state_dir = "{directory}/state"\n{cgroups}log_format = "console"\n'
        f'metrics_address = "{"127.0.0.1:0" if metrics else ""}"\nsystemd_bus = ""\n{extra}\n'
        f"[device_plugin]\n{plugin_dir_line}\n{pod_resources_line}{device_plugin}\n"
    )
    return config


async def launch_daemon(config: Path, socket: Path, *, prefix: Sequence[str] = ()) -> Daemon:
    """``mixed-cpu-nri-plugin run`` as a subprocess; `prefix`: a command the daemon runs under (e.g.
    setpriv dropping capabilities)."""
    proc = await start_daemon(
        "--log-level",
        "info",
        "run",
        "--config",
        str(config),
        "--socket",
        str(socket),
        prefix=prefix,
        stdout=subprocess.DEVNULL,
        kernel_cgroups=True,  # the real-kernel tier's daemons use the host's tree, and say so
    )
    return Daemon(proc, GUARD)


@contextlib.asynccontextmanager
async def daemon_running(config: Path, socket: Path, **options: Any) -> AsyncIterator[Daemon]:
    """A daemon for the body of the `with`: stopped with SIGTERM after it (exit 0, no traceback),
    unless the body killed it."""
    daemon = await launch_daemon(config, socket, **options)
    try:
        yield daemon
    finally:
        killed = daemon.proc.returncode is not None
        status = await daemon.stop()
        print(f"daemon stderr (exit status {status}):\n{daemon.stderr}")  # shown if the test fails
    if not killed:
        assert status == 0, daemon.stderr
        assert "Traceback" not in daemon.stderr, daemon.stderr
