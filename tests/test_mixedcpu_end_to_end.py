"""The mixed-CPU plugin end to end: the stub over a real unix socket, the runtime simulator, and fake
cgroup trees for v1 and v2 x systemd and cgroupfs x CRI-O and containerd naming."""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from mixedcpu_support import (
    GUARD,
    NAMINGS,
    PERIOD,
    FakeCgroups,
    Naming,
    forget_books,
    make_container,
    make_plugin,
    make_pod,
    marker,
    plugin_running,
)

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key
from nri_plugin.mixedcpu import store
from nri_plugin.nri.simulator import PluginFailed, RuntimeSimulator, env_of
from nri_plugin.ttrpc.errors import Code

RUNTIME_VERSIONS: dict[str, dict[str, Any]] = {
    # containerd 2.3 speaks NRI v0.12 (dedicated event methods); CRI-O 1.36 v0.11 (StateChange).
    "containerd": {"runtime_version": "v2.3.4", "nri_version": "v0.12.0"},
    "cri-o": {"runtime_version": "1.36.3", "nri_version": ""},
}
BASELINE = 3 * PERIOD  # fwd: 2 CPUs, sidecar: 1 CPU
RAISED = BASELINE + 2 * PERIOD  # + n(shared) x period

# An open for writing: the plugin holds a pod's quota file read-write from its read to its write.
_FOR_WRITING = os.O_WRONLY | os.O_RDWR


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path for long test ids is longer.
    path = Path(tempfile.mkdtemp(prefix="mcpu-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Node:
    """The simulator plus a fake cgroup tree, doing what the runtime does to container cgroups."""

    def __init__(self, root: Path, naming: Naming, version: int) -> None:
        self.root = root
        self.naming = naming
        self.tree = FakeCgroups(root / "cgroup", version)
        self.state = root / "state"
        self.socket = root / "nri.sock"
        options = RUNTIME_VERSIONS[naming.runtime]
        self.sim = RuntimeSimulator(self.socket, runtime_name=naming.runtime, **options)
        self.key = load_or_create_host_key(self.state)

    def plugin(self, shared: frozenset[int] = frozenset({0, 1}), **options: Any) -> object:
        return make_plugin(self.state, self.tree.layout, shared, **options)[0]

    async def create(self, container: api.Container) -> api.Container:
        result = await self.sim.create_container(container)
        self.tree.run_container(result.container)
        return result.container

    async def remove(self, container_id: str) -> None:
        container = self.sim.containers[container_id]
        await self.sim.remove_container(container_id)
        self.tree.remove_container(container)


def _cpu(container: api.Container) -> tuple[str, int | None]:
    cpu = container.linux.resources.cpu
    return cpu.cpus, cpu.quota.value if cpu.HasField("quota") else None


@pytest.mark.asyncio
@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
@pytest.mark.parametrize("naming", NAMINGS, ids=[n.id for n in NAMINGS])
async def test_create_restart_update_resync_remove(short_dir: Path, naming: Naming, version: int) -> None:
    node = Node(short_dir, naming, version)
    sim, tree = node.sim, node.tree
    pod = make_pod(naming, "7f3c-41aa")
    tree.add_pod(pod, BASELINE)

    def fwd(n: int) -> api.Container:
        return make_container(naming, pod, f"fwd{n}", "fwd", cpus="4-5", annotations=marker(node.key))

    async with sim:
        async with plugin_running(node.plugin(), node.socket):
            await sim.wait_for_plugins(1, GUARD)
            await sim.run_pod_sandbox(pod)
            side = await node.create(make_container(naming, pod, "side", "sidecar", cpus="6", quota=PERIOD))
            assert _cpu(side) == ("6", PERIOD)
            assert tree.pod_quota(pod) == BASELINE

            running = await node.create(fwd(0))
            assert _cpu(running) == ("0-1,4-5", 4 * PERIOD)
            env = env_of(running)
            assert (env["OPENSHIFT_SHARED_CPUS"], env["OPENSHIFT_ISOLATED_CPUS"]) == ("0-1", "4-5")
            assert tree.pod_quota(pod) == RAISED
            # The container's cgroup sits below the pod's, where the runtime put its raised quota.
            assert tree.container_dir(running).path.is_below(tree.pod_dir(pod).path)

            for n in range(1, 6):  # five restarts, in both orders the runtime may report them
                old = f"fwd{n - 1}"
                if n % 2:
                    await sim.stop_container(old)
                    assert tree.pod_quota(pod) == BASELINE, f"restart {n}: stopped"
                    running = await node.create(fwd(n))
                else:
                    running = await node.create(fwd(n))
                    assert tree.pod_quota(pod) == RAISED, f"restart {n}: new instance created first"
                    await sim.stop_container(old)
                assert tree.pod_quota(pod) == RAISED, f"restart {n}: running again"
                await node.remove(old)
                assert tree.pod_quota(pod) == RAISED, f"restart {n}: old instance removed"
                assert _cpu(running) == ("0-1,4-5", 4 * PERIOD)

            # kubelet's CPU manager re-sends the exclusive CPUs only (after every kubelet restart).
            kubelet = api.LinuxResources()
            kubelet.cpu.cpus = "4-5"
            applied = await sim.update_container("fwd5", kubelet)
            assert (applied.cpu.cpus, applied.cpu.quota.value) == ("0-1,4-5", 4 * PERIOD)
            assert _cpu(sim.containers["fwd5"]) == ("0-1,4-5", 4 * PERIOD)
            # Containers that did not ask get exactly what kubelet asked, and no update of ours.
            kubelet.cpu.cpus = "6"
            applied = await sim.update_container("side", kubelet)
            assert applied == kubelet
            assert tree.pod_quota(pod) == RAISED

        updates_before = len(sim.applied_updates)
        # The plugin restarts and is re-synchronized: nothing grows, nothing needs an update.
        async with plugin_running(node.plugin(), node.socket):
            await sim.wait_for_synchronizations(2, GUARD)  # the new instance, not the old one
            assert tree.pod_quota(pod) == RAISED
            assert len(sim.applied_updates) == updates_before
        # ... even with its state dir wiped: the baseline is rebuilt from what the containers hold.
        forget_books(node.state)
        async with plugin_running(node.plugin(), node.socket):
            await sim.wait_for_synchronizations(3, GUARD)  # the new instance, not the old one
            assert tree.pod_quota(pod) == RAISED
            assert len(sim.applied_updates) == updates_before
            await sim.stop_container("fwd5")
            assert tree.pod_quota(pod) == BASELINE
            await node.remove("fwd5")
            assert tree.pod_quota(pod) == BASELINE
            if version == 2:  # the period is kept, whatever the quota
                assert tree.pod_text(pod) == f"{BASELINE} {PERIOD}\n"
            assert [r for r in sim.records if r.outcome != "ok" and r.event != "drop"] == []


@pytest.mark.asyncio
@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
async def test_started_late_then_shared_set_changed(short_dir: Path, version: int) -> None:
    naming = Naming("containerd", "systemd")
    node = Node(short_dir, naming, version)
    sim, tree = node.sim, node.tree
    pod = make_pod(naming, "aa-bb")
    tree.add_pod(pod, BASELINE)
    sim.add_pod(pod)
    # Created while the plugin was away: it holds a valid marker but only its exclusive CPUs.
    sim.add_container(
        make_container(
            naming, pod, "fwd", "fwd", cpus="4-5", annotations=marker(node.key), state=api.CONTAINER_RUNNING
        )
    )
    sim.add_container(
        make_container(naming, pod, "side", "side", cpus="6", quota=PERIOD, state=api.CONTAINER_RUNNING)
    )
    async with sim:
        with structlog.testing.capture_logs() as logs:
            async with plugin_running(node.plugin(), node.socket):
                await sim.wait_for_plugins(1, GUARD)
        assert _cpu(sim.containers["fwd"]) == ("0-1,4-5", 4 * PERIOD)
        assert _cpu(sim.containers["side"]) == ("6", PERIOD)
        assert tree.pod_quota(pod) == RAISED
        [stale] = [e for e in logs if e["event"].startswith("container must restart")]
        assert (stale["container"], stale["OPENSHIFT_SHARED_CPUS"], stale["OPENSHIFT_ISOLATED_CPUS"]) == (
            "fwd",
            "0-1",
            "4-5",
        )
        # The admin widens the shared pool and restarts the plugin.
        # (The second synchronization: the first plugin may still be among `sim.plugins`.)
        async with plugin_running(node.plugin(frozenset({0, 1, 2})), node.socket):
            await sim.wait_for_synchronizations(2, GUARD)
        assert _cpu(sim.containers["fwd"]) == ("0-2,4-5", 5 * PERIOD)
        assert tree.pod_quota(pod) == BASELINE + 3 * PERIOD
        # ... and narrows it again: the pod quota comes down (no container cgroup above it here).
        async with plugin_running(node.plugin(frozenset({0})), node.socket):
            await sim.wait_for_synchronizations(3, GUARD)
        assert _cpu(sim.containers["fwd"]) == ("0,4-5", 3 * PERIOD)
        assert tree.pod_quota(pod) == BASELINE + PERIOD


@pytest.mark.asyncio
async def test_second_shared_container_and_replayed_marker(short_dir: Path) -> None:
    naming = Naming("cri-o", "systemd")
    node = Node(short_dir, naming, 1)
    sim, tree = node.sim, node.tree
    pod, other = make_pod(naming, "11-22"), make_pod(naming, "33-44", name="thief")
    tree.add_pod(pod, 4 * PERIOD)
    tree.add_pod(other, PERIOD)
    async with sim, plugin_running(node.plugin(), node.socket):
        await sim.wait_for_plugins(1, GUARD)
        await sim.run_pod_sandbox(pod)
        await sim.run_pod_sandbox(other)
        await node.create(
            make_container(naming, pod, "a", "a", cpus="2-3", annotations=marker(node.key, "d0"))
        )
        await node.create(
            make_container(naming, pod, "b", "b", cpus="4-5", annotations=marker(node.key, "d1"))
        )
        assert tree.pod_quota(pod) == 8 * PERIOD  # D3: each asking container adds n(shared) x period
        with structlog.testing.capture_logs() as logs:
            stolen = await node.create(
                make_container(
                    naming, other, "t", "t", cpus="6", quota=PERIOD, annotations=marker(node.key, "d1")
                )
            )
        assert _cpu(stolen) == ("6", PERIOD)  # created, but without shared CPUs
        assert tree.pod_quota(other) == PERIOD
        assert any("a replayed marker" in e.get("reason", "") for e in logs)
        await sim.remove_pod_sandbox(other.id)


# -- bad input: each a clear error to the runtime, nothing half-applied, the plugin keeps serving ------------


def _fail_writes(
    monkeypatch: pytest.MonkeyPatch, error: int, names: tuple[str, ...] = ("cpu.cfs_quota_us", "cpu.max")
) -> None:
    """Quota files refuse writes with `error` and keep their value, as the kernel's do (the value is
    put back as it was at open, whatever the open did to a fake tree's file)."""
    real_open, real_write = os.open, os.write
    kept: dict[int, tuple[str, bytes]] = {}

    def open_(path: str, flags: int, *args: object, **kwargs: object) -> int:
        dir_fd = kwargs.get("dir_fd")
        if str(path).endswith(names) and flags & _FOR_WRITING:
            where = f"/proc/self/fd/{dir_fd}/{path}" if isinstance(dir_fd, int) else str(path)
            full = os.path.realpath(where)
            content = Path(full).read_bytes()
            fd = real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]
            kept[fd] = (full, content)
            return fd
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    def write(fd: int, data: bytes) -> int:
        if fd in kept:
            full, content = kept.pop(fd)
            Path(full).write_bytes(content)
            raise OSError(error, os.strerror(error))
        return real_write(fd, data)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "write", write)


def _fail_opens(monkeypatch: pytest.MonkeyPatch, error: int) -> None:
    real = os.open

    def open_(path: str, flags: int, *args: object, **kwargs: object) -> int:
        if str(path).endswith(("cpu.cfs_quota_us", "cpu.max")) and flags & _FOR_WRITING:
            raise OSError(error, os.strerror(error), str(path))
        return real(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", open_)


def _fail_state_save(monkeypatch: pytest.MonkeyPatch, _error: int) -> None:
    """Every transaction ends as SQLite ends one on a full disk (rolled back, by the real code)."""
    real = store._in_transaction

    def full(db: sqlite3.Connection, work: Callable[[sqlite3.Connection], object]) -> None:
        def then_full(db: sqlite3.Connection) -> None:
            work(db)
            raise sqlite3.OperationalError("database or disk is full")

        real(db, then_full)

    monkeypatch.setattr(store, "_in_transaction", full)


BAD_CASES = [
    pytest.param(
        {"cpus": "4-x"},
        None,
        None,
        Code.FAILED_PRECONDITION,
        'runtime sent a malformed cpuset: invalid cpu list "4-x"',
        id="malformed-cpuset-from-runtime",
    ),
    pytest.param(
        {"parent": "/kubepods/../../etc"},
        None,
        None,
        Code.FAILED_PRECONDITION,
        'invalid pod cgroup parent "/kubepods/../../etc": component ".." is not allowed',
        id="parent-escapes",
    ),
    pytest.param(
        {"parent": "kubepods--pod1.slice"},
        None,
        None,
        Code.FAILED_PRECONDITION,
        "contains '--'",
        id="bad-slice-name",
    ),
    pytest.param(
        {"parent": "/kubepods/pod\nfoo"},
        None,
        None,
        Code.FAILED_PRECONDITION,
        "control character U+000A",
        id="parent-control-character",
    ),
    pytest.param(
        {"no_pod_dir": True},
        None,
        None,
        Code.FAILED_PRECONDITION,
        "the pod or container may be gone",
        id="pod-cgroup-missing",
    ),
    pytest.param(
        {"no_quota_file": True},
        None,
        None,
        Code.FAILED_PRECONDITION,
        "No such file or directory (ENOENT)",
        id="quota-file-missing",
    ),
    pytest.param(
        {},
        _fail_writes,
        errno.EINVAL,
        Code.FAILED_PRECONDITION,
        "rejected: Invalid argument (EINVAL)",
        id="EINVAL-on-write",
    ),
    pytest.param(
        {},
        _fail_opens,
        errno.EACCES,
        Code.FAILED_PRECONDITION,
        "Permission denied (EACCES); the plugin needs root",
        id="EACCES-on-open",
    ),
    pytest.param(
        {},
        _fail_writes,
        errno.EACCES,
        Code.FAILED_PRECONDITION,
        "rejected: Permission denied (EACCES)",
        id="EACCES-on-write",
    ),
    pytest.param(
        {},
        _fail_state_save,
        0,
        Code.INTERNAL,
        "cannot save the plugin's state",
        id="state-save-fails-rolls-back",
    ),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
@pytest.mark.parametrize(("setup", "fault", "error", "code", "message"), BAD_CASES)
async def test_bad_input_is_a_clear_error_and_nothing_half_applied(
    short_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    version: int,
    setup: dict[str, object],
    fault: Callable[[pytest.MonkeyPatch, int], None] | None,
    error: int,
    code: int,
    message: str,
) -> None:
    naming = Naming("containerd", "cgroupfs")
    node = Node(short_dir, naming, version)
    sim, tree = node.sim, node.tree
    pod = make_pod(naming, "bad-1")
    good_pod = make_pod(naming, "good-1", name="good")
    tree.add_pod(good_pod, BASELINE)
    if not setup.get("no_pod_dir"):
        quota_file = Path(
            tree.add_pod(pod, BASELINE).fs_path, "cpu.cfs_quota_us" if version == 1 else "cpu.max"
        )
        if setup.get("no_quota_file"):
            quota_file.unlink()  # noqa: ASYNC240 (setting up, before any event)
    if "parent" in setup:
        pod.linux.cgroup_parent = str(setup["parent"])
    bad = make_container(
        naming, pod, "bad", "main", cpus=str(setup.get("cpus", "4-5")), annotations=marker(node.key)
    )
    async with sim, plugin_running(node.plugin(), node.socket):
        await sim.wait_for_plugins(1, GUARD)
        await sim.run_pod_sandbox(pod)
        await sim.run_pod_sandbox(good_pod)
        before = tree.pod_quota(pod) if not setup else None
        with monkeypatch.context() as patch:
            if fault is not None:
                fault(patch, error)
            with pytest.raises(PluginFailed) as info:
                await sim.create_container(bad)
        assert info.value.code == code
        assert message in info.value.message
        assert "\n" not in info.value.message
        assert "bad" not in sim.containers
        if before is not None:
            assert tree.pod_quota(pod) == before  # nothing half-applied: rolled back or never written
            if fault is _fail_state_save:  # the books are committed ahead of the raise: none made
                assert not info.value.message.endswith("the pod quota was put back")
        # The plugin is still connected and serves the next request.
        assert len(sim.plugins) == 1
        good = await node.create(
            make_container(naming, good_pod, "good", "main", annotations=marker(node.key, "d9"))
        )
        assert _cpu(good) == ("0-1,4-5", 4 * PERIOD)
        assert tree.pod_quota(good_pod) == RAISED


@pytest.mark.asyncio
async def test_malformed_update_request_is_refused(short_dir: Path) -> None:
    naming = Naming("containerd", "cgroupfs")
    node = Node(short_dir, naming, 1)
    sim, tree = node.sim, node.tree
    pod = make_pod(naming)
    tree.add_pod(pod, BASELINE)
    async with sim, plugin_running(node.plugin(), node.socket):
        await sim.wait_for_plugins(1, GUARD)
        await sim.run_pod_sandbox(pod)
        await node.create(make_container(naming, pod, "c", annotations=marker(node.key)))
        kubelet = api.LinuxResources()
        kubelet.cpu.cpus = "4-"
        with pytest.raises(PluginFailed, match="malformed requested cpuset") as info:
            await sim.update_container("c", kubelet)
        assert info.value.code == Code.INVALID_ARGUMENT
        assert _cpu(sim.containers["c"]) == ("0-1,4-5", 4 * PERIOD)
        kubelet.cpu.cpus = "4-5"
        assert (await sim.update_container("c", kubelet)).cpu.cpus == "0-1,4-5"


@pytest.mark.asyncio
async def test_lowering_refused_by_the_kernel_is_retried(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v1 refuses a pod quota below a stopped container whose cgroup still holds its raised quota."""
    naming = Naming("cri-o", "cgroupfs")
    node = Node(short_dir, naming, 1)
    sim, tree = node.sim, node.tree
    pod = make_pod(naming)
    tree.add_pod(pod, BASELINE)
    async with sim, plugin_running(node.plugin(), node.socket):
        await sim.wait_for_plugins(1, GUARD)
        await sim.run_pod_sandbox(pod)
        await node.create(make_container(naming, pod, "c", annotations=marker(node.key)))
        with monkeypatch.context() as patch:
            _fail_writes(patch, errno.EINVAL)
            await sim.stop_container("c")  # succeeds: stop never fails on our account
        assert tree.pod_quota(pod) == RAISED  # kept until the container's cgroup is gone
        await node.remove("c")
        assert tree.pod_quota(pod) == BASELINE
        assert [r.outcome for r in sim.records if r.container == "c"] == ["ok"] * 3


@pytest.mark.asyncio
async def test_unlimited_pod_and_pod_resources_baseline(short_dir: Path) -> None:
    naming = Naming("containerd", "systemd")
    node = Node(short_dir, naming, 2)
    sim, tree = node.sim, node.tree
    unlimited, sized = make_pod(naming, "u-1"), make_pod(naming, "s-1", name="sized")
    tree.add_pod(unlimited, None)
    # The runtime sends the pod's own resources: they are the baseline, even if the cgroup already
    # holds more (a previous plugin's raise, with the state lost).
    sized.linux.pod_resources.cpu.quota.value = BASELINE
    sized.linux.pod_resources.cpu.period.value = PERIOD
    tree.add_pod(sized, RAISED)
    async with sim, plugin_running(node.plugin(), node.socket):
        await sim.wait_for_plugins(1, GUARD)
        await sim.run_pod_sandbox(unlimited)
        await sim.run_pod_sandbox(sized)
        created = await node.create(
            make_container(naming, unlimited, "u", quota=-1, annotations=marker(node.key))
        )
        assert _cpu(created) == ("0-1,4-5", -1)  # an unlimited container stays unlimited
        assert tree.pod_text(unlimited) == f"max {PERIOD}\n"
        await node.create(make_container(naming, sized, "s", annotations=marker(node.key, "d2")))
        assert tree.pod_quota(sized) == RAISED  # pod_resources + 2 shared CPUs, not RAISED + 2 CPUs
        await sim.stop_container("s")
        assert tree.pod_quota(sized) == BASELINE


@pytest.mark.asyncio
async def test_pod_annotation_source_on_cri_o(short_dir: Path) -> None:
    naming = Naming("cri-o", "systemd")
    node = Node(short_dir, naming, 1)
    sim, tree = node.sim, node.tree
    pod = make_pod(naming)
    pod.annotations["cpu-shared.crio.io/main"] = "enable"
    tree.add_pod(pod, BASELINE)
    async with sim:
        async with plugin_running(node.plugin(trust_pod_annotation=True), node.socket):
            await sim.wait_for_plugins(1, GUARD)
            await sim.run_pod_sandbox(pod)
            assert _cpu(await node.create(make_container(naming, pod, "c1"))) == ("0-1,4-5", 4 * PERIOD)
            assert tree.pod_quota(pod) == RAISED
            await sim.stop_container("c1")
            await node.remove("c1")
        # Off by default: the same pod gets nothing.
        async with plugin_running(node.plugin(), node.socket):
            await sim.wait_for_synchronizations(2, GUARD)  # the new instance, not the old one
            assert _cpu(await node.create(make_container(naming, pod, "c2"))) == ("4-5", 2 * PERIOD)
            assert tree.pod_quota(pod) == BASELINE


@pytest.mark.asyncio
async def test_many_pods_synchronize_in_chunks(short_dir: Path) -> None:
    naming = Naming("containerd", "cgroupfs")
    node = Node(short_dir, naming, 1)
    sim, tree = node.sim, node.tree
    sim.max_message_size = 64 * 1024
    pods = [make_pod(naming, f"p-{n}") for n in range(120)]
    for n, pod in enumerate(pods):
        for i in range(4):
            pod.annotations[f"example.com/a{i}"] = "x" * 64
        tree.add_pod(pod, BASELINE)
        sim.add_pod(pod)
        sim.add_container(
            make_container(
                naming,
                pod,
                f"c-{n}",
                cpus="4-5",
                annotations=marker(node.key, f"dev-{n}"),
                state=api.CONTAINER_RUNNING,
            )
        )
    async with sim, plugin_running(node.plugin(), node.socket):
        await sim.wait_for_plugins(1, GUARD)
    assert len(sim.sync_chunks) > 1
    assert all(tree.pod_quota(pod) == RAISED for pod in pods)
    assert all(_cpu(c) == ("0-1,4-5", 4 * PERIOD) for c in sim.containers.values())
