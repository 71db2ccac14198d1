"""Pod cgroup parents, container ids and names with path tricks, through the real stub and plugin.

Every container here proves its request with a validly signed marker (a fresh device id each), so
the plugin does go to the pod's cgroup. A cgroup parent with ``..``, ``/``, NUL, a newline,
look-alike slashes or dots, a right-to-left override, or a symlink planted in the tree (a directory
or a quota file pointing out of it) must be refused with an error status and no write anywhere: not
in the tree, not in the decoy pod cgroup beside the tree, not next to the test's directory.

Container ids and names never name a file: with the same tricks in them, a container of a real pod
is served normally, and the only file touched is that pod's quota (and the plugin's state file).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hostile_models import TRICKS
from hostile_strategies import tricky_text
from hostile_support import (
    ERROR_CODES,
    PERIOD,
    Node,
    diff,
    granted,
    snapshot,
    state_file_skip,
    top_level,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.ttrpc.errors import Code

SETTINGS = settings(
    max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)

# Parents a confused or hostile runtime might send for a pod whose cgroup is /kubepods/pod1111-2222.
FIXED_PARENTS = [
    "/kubepods/pod1111-2222/..",
    "/kubepods/pod1111-2222/../../../outside/kubepods/podvictim",
    "/../outside/kubepods/podvictim",
    "/kubepods/../../outside/kubepods/podvictim",
    "../../outside/kubepods/podvictim",
    "/kubepods/./pod1111-2222",
    "/kubepods//pod1111-2222",
    "/kubepods/pod1111-2222/",
    "//kubepods/pod1111-2222",
    "/kubepods/pod1111-2222\0",
    "/kubepods/pod1111-2222\n",
    "/kubepods\0/../outside",
    "/kubepods\u2215pod1111-2222",
    "/kubepods\uff0fpod1111-2222",
    "/kubepods/\uff0e\uff0e/outside",
    "/kubepods/\u2024\u2024/outside",
    "/kubepods/pod\u202e2222-1111",
    "/kubepods/pod1111-2222\u200b",
    "/kubepods/pod1111%2f2222",
    "/kubepods/...",
    "/kubepods/" + "a" * 256,
    "/" + "a/" * 2100,
    "-.slice",
    "kubepods-..-pod1.slice",
    "kubepods--pod1111_2222.slice",
    "/kubepods.slice/../outside.slice",
    "/kubepods.slice/-.slice/kubepods-pod1111_2222.slice",
    "kubepods-pod1111_2222.slice/../..",
    "/",
    "",
    ".",
    "..",
    "/kubepods/pod-trap",  # a symlink to the decoy directory
    "/kubepods/pod-filetrap",  # a real directory whose quota file links to the decoy's
]


def _plant_traps(node: Node) -> None:
    decoy = node.root / "outside" / "kubepods" / "podvictim"
    kubepods = Path(node.tree.layout.cpu.mount_point, "kubepods")
    kubepods.mkdir(parents=True, exist_ok=True)
    os.symlink(decoy, kubepods / "pod-trap")
    filetrap = kubepods / "pod-filetrap"
    filetrap.mkdir()
    for name in ("cpu.cfs_quota_us", "cpu.max"):
        os.symlink(decoy / name, filetrap / name)
    (filetrap / "cpu.cfs_period_us").write_text("100000\n")


def _proven(
    node: Node, parent: str, device: int, *, cid: str = "c-1", name: str = "main"
) -> api.CreateContainerRequest:
    pod = api.PodSandbox(id="sandbox-x", uid=f"uid-{device}", name="app", namespace="ns")
    pod.linux.cgroup_parent = parent
    container = node.container(pod, cid, name, annotations=node.marker(f"shared-cpus-{device}"))
    container.linux.cgroups_path = parent + "/" + cid
    return api.CreateContainerRequest(pod=pod, container=container)


@pytest.mark.parametrize("version", [1, 2])
def test_tricky_pod_cgroup_parents_are_refused_with_no_write_anywhere(tmp_path: Path, version: int) -> None:
    with Node(tmp_path) as node:
        if version == 2:
            node.tree = type(node.tree)(tmp_path / "node" / "cgroup2", version=2)
            node.plugin.layout = node.tree.layout
        node.pod("1111-2222", "real")
        _plant_traps(node)
        skip = state_file_skip(node)
        devices = iter(range(1, 10**6))
        refused = {"count": 0}

        def attempt(parent: str) -> None:
            before, around = snapshot(tmp_path, skip=skip), top_level(tmp_path.parent)
            books = node.plugin.books.copy()
            reply = node.run(node.call("CreateContainer", _proven(node, parent, next(devices))))
            assert not reply.ok, (parent, reply)
            assert reply.code == Code.FAILED_PRECONDITION, reply
            assert reply.message.startswith("cannot raise the CPU quota of pod ns/app: "), reply
            assert "\n" not in reply.message
            assert diff(before, snapshot(tmp_path, skip=skip)) == [], parent
            assert top_level(tmp_path.parent) == around
            assert node.plugin.books == books, "a refused creation leaves no trace in the books"
            node.run(node.healthy())
            refused["count"] += 1

        for parent in FIXED_PARENTS:
            attempt(parent)

        @SETTINGS
        @given(
            st.one_of(
                tricky_text,
                tricky_text.map(lambda t: "/kubepods/" + t),
                tricky_text.map(lambda t: "/kubepods/pod1111-2222/" + t),
                tricky_text.map(lambda t: "kubepods-pod" + t + ".slice"),
                st.lists(st.sampled_from(TRICKS), min_size=1, max_size=6).map("/".join),
            ).filter(lambda p: p.strip("/") not in ("kubepods/pod1111-2222",))
        )
        def check(parent: str) -> None:
            attempt(parent)

        check()
        assert refused["count"] >= len(FIXED_PARENTS) + SETTINGS.max_examples


def test_tricky_container_ids_and_names_never_name_a_file(tmp_path: Path) -> None:
    with Node(tmp_path) as node:
        real = node.pod("1111-2222", "real")
        quota_file = str(Path(node.tree.pod_dir(real).fs_path, "cpu.cfs_quota_us"))
        skip = state_file_skip(node)
        devices = iter(range(1, 10**6))
        served = {"count": 0}

        @SETTINGS
        @given(st.one_of(st.just(""), tricky_text), st.one_of(st.just(""), tricky_text))
        def check(cid: str, name: str) -> None:
            before, around = snapshot(tmp_path, skip=skip), top_level(tmp_path.parent)
            request = _proven(node, real.linux.cgroup_parent, next(devices), cid=cid, name=name)
            request.pod.uid = real.uid
            reply = node.run(node.call("CreateContainer", request))
            assert reply.ok or reply.code in ERROR_CODES, reply
            assert set(diff(before, snapshot(tmp_path, skip=skip))) <= {f"changed {quota_file}"}
            assert top_level(tmp_path.parent) == around
            if granted("CreateContainer", reply):
                served["count"] += 1
                # Stopped again at once: the next example starts from the pod's own quota.
                stop = api.StopContainerRequest(pod=request.pod, container=request.container)
                assert node.run(node.call("StopContainer", stop)).ok
                assert node.tree.pod_quota(real) == 2 * PERIOD
            node.run(node.healthy())

        check()
        assert served["count"] >= SETTINGS.max_examples // 2, served
        # The books and the database hold such ids and names safely (bound parameters, not text).
        node.plugin.flush()
        assert node.plugin.store.load() == node.plugin.books
