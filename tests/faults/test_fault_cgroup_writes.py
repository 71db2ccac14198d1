"""Fault 5: the pod cgroup cannot be written (or read). Each failure is a clear error to the runtime
and in the log, naming the file and the fix; nothing is half-applied (the container is not created,
the pod quota and the books are as before); the plugin keeps serving; once the cause is fixed the
retry (or the next synchronization) brings everything to a consistent state.

The errors are real ones: a removed file (ENOENT), a read-only bind mount (EROFS), the v1 kernel's
refusal of a quota above the parent's (EINVAL), a daemon without CAP_DAC_OVERRIDE on a read-only
file (EACCES)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog
from fault_support import (
    PERIOD,
    Node,
    Population,
    Tree,
    books_vs_files,
    daemon_running,
    inconsistencies,
    make_node,
    within,
    write_config,
)
from kernel_support import require_v1_layout
from mixedcpu_support import plugin_running

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import CgroupPath, read_cpuset, write_cpu_quota
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin
from nri_plugin.nri.simulator import PluginFailed
from nri_plugin.ttrpc.errors import Code


def refused_creation(logs: list[MutableMapping[str, Any]]) -> str:
    [error] = [str(e["error"]) for e in logs if e["event"] == "creation refused"]
    return error


def assert_clear(message: str, *fragments: str) -> None:
    """One line naming the file, the cause and the fix."""
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


NEEDS_ROOT = "the plugin needs root (CAP_SYS_ADMIN) and the host's /sys/fs/cgroup mounted read-write"


async def assert_creation_refused(
    node: Node,
    plugin: MixedCpuPlugin,
    pod: api.PodSandbox,
    cid: str,
    name: str,
    cpus: str,
    *,
    path: str,
    cause: str,
    fix: str,
) -> None:
    """Creating container `cid` (`name`, asking) in `pod` fails with FAILED_PRECONDITION: one clear
    line naming `path`, `cause` and `fix` to the runtime, and `path` and `fix` in the log; nothing
    half-applied (the container not created, the books as before)."""
    books = plugin.books.copy()
    with structlog.testing.capture_logs() as logs, pytest.raises(PluginFailed) as info:
        await node.population.create(pod, cid, name, cpus, asks=True)
    assert info.value.code == Code.FAILED_PRECONDITION
    assert_clear(info.value.message, path, cause, fix)
    assert_clear(refused_creation(logs), path, fix)
    assert cid not in node.runtime.containers
    assert plugin.books == books


@contextlib.contextmanager
def read_only(path: str) -> Iterator[None]:
    """A read-only bind mount of `path` over itself (root only), undone afterwards."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    if shutil.which("mount") is None:
        pytest.skip("no mount binary to make a read-only bind mount")
    done = subprocess.run(["mount", "--bind", path, path], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here (no CAP_SYS_ADMIN?): {done.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", path, path], check=True, capture_output=True)
        yield
    finally:
        subprocess.run(["umount", path], check=True, capture_output=True)


# -- ENOENT -----------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
@pytest.mark.parametrize("removed", ["quota-file", "pod-cgroup"])
async def test_enoent_pod_cgroup_gone_at_creation(short_dir: Path, version: int, removed: str) -> None:
    node = make_node(short_dir, version)
    population, runtime, tree = node.population, node.runtime, node.tree
    plugin = node.plugin()
    async with runtime, plugin_running(plugin, node.socket):
        await within(runtime.wait_for_plugins(1, timeout=None))
        pods = await population.standard()
        gone = population.pod("gone", 2 * PERIOD)
        await runtime.run_pod_sandbox(gone)
        quota_file = tree.quota_file(gone)
        if removed == "quota-file":
            quota_file.unlink()
        else:
            shutil.rmtree(quota_file.parent)
        quotas = {p.id: tree.pod_quota(p) for p in pods}
        missing = quota_file if removed == "quota-file" else quota_file.parent
        await assert_creation_refused(
            node,
            plugin,
            gone,
            "gone-a",
            "fwd",
            "13",
            path=str(missing),
            cause="No such file or directory (ENOENT)",
            fix="the pod or container may be gone, or the controller is not enabled for this cgroup",
        )
        # Nothing half-applied: every other pod as before.
        assert {p.id: tree.pod_quota(p) for p in pods} == quotas
        [left] = inconsistencies(population, count=False)  # the checker sees the missing cgroup only
        assert left.startswith("pod gone: pod quota unreadable")
        # The plugin serves the next request.
        await population.create(pods[1], "duo-c", "third", "14", asks=True)
        # kubelet makes the pod cgroup again; its retry succeeds.
        tree.add_pod(gone, 2 * PERIOD)
        await population.create(gone, "gone-a2", "fwd", "13", asks=True)
        assert inconsistencies(population, books=plugin.books) == []


# -- EROFS ------------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
async def test_erofs_pod_cgroup_read_only(short_dir: Path, version: int) -> None:
    node = make_node(short_dir, version)
    population, runtime, tree = node.population, node.runtime, node.tree
    plugin = node.plugin()
    async with runtime, plugin_running(plugin, node.socket):
        await within(runtime.wait_for_plugins(1, timeout=None))
        fwd, duo, _free, _plain = await population.standard()
        before = population.pod_quotas()
        quota_file = str(tree.quota_file(fwd))
        with read_only(tree.pod_cpu(fwd).fs_path):
            await assert_creation_refused(
                node,
                plugin,
                fwd,
                "fwd-b",
                "helper",
                "13",
                path=quota_file,
                cause="Read-only file system (EROFS)",
                fix=NEEDS_ROOT,
            )
            assert population.pod_quotas() == before
            # A stop never fails on our account: the lowering waits for the pod's next event.
            with structlog.testing.capture_logs() as logs:
                await runtime.stop_container("fwd-a")
            [warning] = [e for e in logs if e["event"] == "cannot lower the pod quota"]
            assert_clear(str(warning["error"]), quota_file, "EROFS")
            assert population.pod_quotas()[fwd.id] == before[fwd.id]
            # Other pods are served meanwhile.
            await population.create(duo, "duo-c", "third", "14", asks=True)
        # Read-write again: the pod's next event brings it down, the retried creation up again.
        await runtime.stop_container("fwd-side")
        assert population.pod_quotas()[fwd.id] == 3 * PERIOD
        assert inconsistencies(population, books=plugin.books) == []
        await population.create(fwd, "fwd-b2", "helper", "13", asks=True)
        assert inconsistencies(population, books=plugin.books) == []


# -- EINVAL, from the real v1 kernel -----------------------------------------------------------------


@contextlib.contextmanager
def kernel_node(short_dir: Path) -> Iterator[tuple[Node, str]]:
    """A node on the real kernel's v1 hierarchies, and the path of a capped pod parent in it."""
    layout = require_v1_layout(min_cpus=2)
    cpus = sorted(read_cpuset(layout.cpuset.dir(CgroupPath())))
    with Tree.kernel(layout) as tree:
        yield make_node(short_dir, tree, frozenset(cpus[:1])), str(cpus[1])


def cap(population: Population, quota: int) -> None:
    """The operator caps the ``capped`` parent of pods (a kubepods-like level) to `quota`."""
    tree = population.tree
    write_cpu_quota(tree.layout.cpu.dir(CgroupPath((str(tree.kernel_top), "capped"))), quota)


@pytest.mark.asyncio
async def test_einval_kernel_refuses_pod_quota_above_parent_at_creation(short_dir: Path) -> None:
    with kernel_node(short_dir) as (node, exclusive):
        population, runtime, tree = node.population, node.runtime, node.tree
        plugin = node.plugin()
        async with runtime, plugin_running(plugin, node.socket):
            await within(runtime.wait_for_plugins(1, timeout=None))
            free = population.pod("free", PERIOD)
            capped = population.pod("capped", PERIOD, parent="capped")
            cap(population, PERIOD)
            await population.create(free, "free-a", "fwd", exclusive, asks=True)
            await assert_creation_refused(
                node,
                plugin,
                capped,
                "capped-a",
                "fwd",
                exclusive,
                path=str(tree.quota_file(capped)),
                cause="rejected: Invalid argument (EINVAL)",
                fix="cgroup v1 refuses a quota above the parent's (raise the parent first",
            )
            assert tree.pod_quota(capped) == PERIOD
            assert inconsistencies(population, books=plugin.books) == []
            # The operator raises the parent; kubelet's retry succeeds.
            cap(population, 4 * PERIOD)
            await population.create(capped, "capped-a2", "fwd", exclusive, asks=True)
            assert inconsistencies(population, books=plugin.books) == []


@pytest.mark.asyncio
async def test_einval_kernel_refuses_pod_quota_at_synchronize(short_dir: Path) -> None:
    """Containers started while the plugin was away, one in a pod whose quota the kernel will not
    raise: that one is left as it is (no cpuset or quota update without its pod's quota), the others
    are brought to the shared CPUs; once the parent is raised, the next synchronization finishes."""
    with kernel_node(short_dir) as (node, exclusive):
        population, runtime, tree = node.population, node.runtime, node.tree
        free = population.pod("free", 2 * PERIOD)
        capped = population.pod("capped", 2 * PERIOD, parent="capped")
        cap(population, 2 * PERIOD)
        population.start_while_away(free, "free-a", "fwd", exclusive, asks=True)
        population.start_while_away(free, "free-b", "side", exclusive)
        population.start_while_away(capped, "capped-a", "fwd", exclusive, asks=True)
        population.start_while_away(capped, "capped-b", "side", exclusive)
        plugin = node.plugin()
        async with plugin_running(plugin, node.socket, reconnect=True):
            with structlog.testing.capture_logs() as logs:
                async with runtime:
                    await within(runtime.wait_for_plugins(1, timeout=None))
                    left = inconsistencies(population, count=False)
            [error] = [e for e in logs if e["event"] == "cannot bring the pod quota to its target"]
            assert_clear(
                str(error["error"]), str(tree.quota_file(capped)), "EINVAL", "raise the parent first"
            )
            # Only the capped pod is behind: capped-a untouched (no shared CPUs without the pod quota,
            # nothing the kernel refuses asked of the runtime), the free pod done.
            assert [line.split(":")[0] for line in left] == ["capped-a", "capped-b"], left
            assert f"runtime cpus '{exclusive}', expected" in left[0]
            assert not any("refused" in line or "free" in line for line in left), left
            assert any(e["event"].startswith("container left as it is") for e in logs)
            assert tree.pod_quota(capped) == 2 * PERIOD
            assert books_vs_files(population, plugin.books) == []
            # The operator raises the parent; the runtime restarts (or the plugin does): all done.
            cap(population, 4 * PERIOD)
            population.runtime = runtime.restarted()
            async with population.runtime:
                await within(population.runtime.wait_for_plugins(1, timeout=None))
                assert inconsistencies(population, books=plugin.books) == []


# -- unreadable at Synchronize ----------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
async def test_pod_quota_unreadable_at_synchronize_after_a_plugin_restart(
    short_dir: Path, version: int
) -> None:
    """The pod's quota file is missing while the restarted plugin synchronizes: the saved baseline
    must survive it, so the pod quota neither grows nor shrinks at its next events."""
    node = make_node(short_dir, version)
    population, runtime, tree = node.population, node.runtime, node.tree
    async with runtime:
        first = node.plugin()
        async with plugin_running(first, node.socket):
            await within(runtime.wait_for_plugins(1, timeout=None))
            fwd, _duo, _free, _plain = await population.standard()
        first.flush()  # what the daemon does at exit
        quota_file = tree.quota_file(fwd)
        away = quota_file.with_name(quota_file.name + ".away")
        quota_file.rename(away)
        plugin = node.plugin()
        # The second and third synchronizations: a plugin that left may still be among the runtime's.
        with structlog.testing.capture_logs() as logs:
            async with plugin_running(plugin, node.socket):
                await within(runtime.wait_for_synchronizations(2, timeout=None))
        [error] = [e for e in logs if e["event"] == "cannot bring the pod quota to its target"]
        assert_clear(str(error["error"]), str(quota_file), "ENOENT")
        away.rename(quota_file)
        async with plugin_running(plugin, node.socket):
            await within(runtime.wait_for_synchronizations(3, timeout=None))
            assert books_vs_files(population, plugin.books) == []
            await population.restart("fwd-a", "fwd-a2")  # a restart does not grow the pod quota
            assert inconsistencies(population, books=plugin.books) == []
            await runtime.stop_container("fwd-a2")  # a stop brings it to its own quota, not below
            assert tree.pod_quota(fwd) == 3 * PERIOD
            assert inconsistencies(population, books=plugin.books) == []


# -- EACCES: a daemon without CAP_DAC_OVERRIDE --------------------------------------------------------


def unprivileged() -> list[str]:
    """A command prefix that runs the daemon without the capabilities that let root ignore file
    modes (as root: setpriv); nothing when the tests do not run as root."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("as root, EACCES needs setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


@pytest.mark.asyncio
async def test_eacces_daemon_cannot_write_pod_quota(short_dir: Path) -> None:
    prefix = unprivileged()
    node = make_node(short_dir, 1)
    population, runtime, tree = node.population, node.runtime, node.tree
    config = write_config(short_dir, tree)
    async with runtime, daemon_running(config, node.socket, prefix=prefix) as daemon:
        await within(runtime.wait_for_plugins(1, timeout=None))
        fwd, duo, _free, _plain = await population.standard()
        quota_file = tree.quota_file(duo)
        quota_file.chmod(0o444)
        before = population.pod_quotas()
        with pytest.raises(PluginFailed) as info:
            await population.create(duo, "duo-c", "third", "13", asks=True)
        assert info.value.code == Code.FAILED_PRECONDITION
        assert_clear(info.value.message, str(quota_file), "Permission denied (EACCES)", NEEDS_ROOT)
        line = await daemon.wait_log("creation refused", "Permission denied (EACCES)")
        assert_clear(line, str(quota_file), NEEDS_ROOT, "container=third")
        assert "duo-c" not in runtime.containers
        assert population.pod_quotas() == before
        # The daemon is alive and serves the next request.
        await population.create(fwd, "fwd-b", "helper", "14", asks=True)
        # The permission is fixed; kubelet's retry succeeds.
        quota_file.chmod(0o644)
        await population.create(duo, "duo-c2", "third", "13", asks=True)
        assert inconsistencies(population) == []
