"""The device-id binding that makes a copied allocation marker useless (unit level).

A device id is bound to the first slot (pod, container name) that proves a request with it, and
stays bound through that container's stops, restarts and removal, until the pod's sandbox is
stopped or removed; its allocation stays spent after that, so a copy is refused still, and only
kubelet's next allocation of the device is granted. The binding is saved in the state file (old
files without it load, bound to their live slots) and Synchronize keeps the bindings of the pods it
lists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mixedcpu_support import (
    FakeCgroups,
    Naming,
    make_container,
    make_plugin,
    make_pod,
    marker,
    new_allocation,
)

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.mixedcpu.books import Books, ContainerRecord, PodRecord, Slot
from nri_plugin.mixedcpu.legacy import LEGACY_FILE_NAME
from nri_plugin.mixedcpu.store import StateStore, read_only
from nri_plugin.nri.errors import PluginRefusal

CGROUPFS = Naming("containerd", "cgroupfs")
SHARED = frozenset({0, 1})


def _setup(tmp_path: Path):  # type: ignore[no-untyped-def]
    tree = FakeCgroups(tmp_path / "cgroup")
    plugin, key = make_plugin(tmp_path / "state", tree.layout, SHARED)
    holder_pod, thief_pod = make_pod(CGROUPFS, "1-1", name="holder"), make_pod(CGROUPFS, "2-2", name="thief")
    tree.add_pod(holder_pod, 200_000)
    tree.add_pod(thief_pod, 200_000)
    return tree, plugin, key, holder_pod, thief_pod


def test_books_bind_until_the_pod_is_unbound() -> None:
    books = Books({"p": PodRecord(cgroup_parent="/kubepods/podp", baseline=100_000, period=100_000)})
    books.hold(Slot("p", "a"), ContainerRecord("c1", 2, "4", "dev-1"))
    assert books.devices == {"dev-1": Slot("p", "a")}
    assert books.release("c1") == Slot("p", "a")
    assert books.device_holders() == {"dev-1": Slot("p", "a")}  # stopped: still bound
    books.hold(Slot("p", "a"), ContainerRecord("c2", 2, "4", "dev-2"))  # a new allocation
    assert books.devices == {"dev-2": Slot("p", "a")}
    assert books.unbind_pod("other") == []
    assert books.unbind_pod("p") == ["dev-2"]
    assert books.device_holders() == {"dev-2": Slot("p", "a")}  # its live slot still shows it
    books.release("c2")
    assert books.device_holders() == {}


def test_state_file_keeps_the_bindings_and_old_files_still_load(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    books = Books({"p": PodRecord(cgroup_parent="/kubepods/podp", baseline=100_000, period=100_000)})
    books.hold(Slot("p", "a"), ContainerRecord("c1", 2, "4", "dev-1"))
    books.release("c1")
    books.devices["dev-9"] = Slot("gone", "x\n\0")
    store.save(books)
    assert store.load() == books
    store.close()  # (its connection holds the database to itself)
    assert read_only(store.path)[0].devices["dev-9"] == Slot("gone", "x\n\0")
    # 0.1.0's first files, written before the bindings: the live slots' devices are bound to them.
    pod = {"cgroup_parent": "/kubepods/podp", "baseline": 100_000, "period": 100_000}
    slot = {"id": "c3", "shared_cpus": 2, "exclusive": "5", "device": "dev-3"}
    data: dict[str, Any] = {"version": 1, "pods": {"p": {**pod, "containers": {"b": slot}}}}
    (tmp_path / LEGACY_FILE_NAME).write_text(json.dumps(data))
    assert StateStore(tmp_path).load().devices == {"dev-3": Slot("p", "b")}
    bad_bindings: list[object] = [[], {"dev": "p/a"}, {"dev": {"pod": 1, "container": "a"}}]
    for bad in bad_bindings:
        data["devices"] = bad
        (tmp_path / LEGACY_FILE_NAME).write_text(json.dumps(data))
        assert StateStore(tmp_path).load() == Books()  # corrupt: logged, empty books, rebuilt at Synchronize


@pytest.mark.asyncio
async def test_a_copy_is_refused_while_the_holder_is_stopped_or_removed(tmp_path: Path) -> None:
    tree, plugin, key, holder_pod, thief_pod = _setup(tmp_path)
    holder = make_container(CGROUPFS, holder_pod, "h1", "fwd", annotations=marker(key, "d-7"))
    assert await plugin.create_container(holder_pod, holder) is not None
    await plugin.stop_container(holder_pod, holder)
    copy = make_container(CGROUPFS, thief_pod, "t1", "x", annotations=marker(key, "d-7"))
    assert await plugin.create_container(thief_pod, copy) is None
    await plugin.remove_container(holder_pod, holder)
    assert await plugin.create_container(thief_pod, copy) is None
    assert tree.pod_quota(thief_pod) == 200_000
    restart = make_container(CGROUPFS, holder_pod, "h2", "fwd", annotations=marker(key, "d-7"))
    assert await plugin.create_container(holder_pod, restart) is not None
    # The binding was written before the reply (a crash right after must not forget it).
    assert plugin.store.load().devices == {"d-7": Slot(holder_pod.uid, "fwd")}
    await plugin.stop_container(holder_pod, restart)
    await plugin.stop_pod_sandbox(holder_pod)
    assert plugin.store.load().devices == {}
    # The binding ended with the pod; the allocation is spent: the copy is still one.
    assert await plugin.create_container(thief_pod, copy) is None
    assert plugin.store.load().spent["d-7"].slot == Slot(holder_pod.uid, "fwd")
    # kubelet gives the device again: a new allocation, granted.
    given = make_container(CGROUPFS, thief_pod, "t2", "x", annotations=new_allocation(key, "d-7"))
    assert await plugin.create_container(thief_pod, given) is not None


@pytest.mark.asyncio
async def test_a_failed_creation_binds_nothing(tmp_path: Path) -> None:
    _, plugin, key, holder_pod, _ = _setup(tmp_path)
    missing = make_pod(CGROUPFS, "3-3", name="missing")  # no pod cgroup: the creation fails
    early = make_container(CGROUPFS, missing, "e1", "x", annotations=marker(key, "d-7"))
    with pytest.raises(PluginRefusal):
        await plugin.create_container(missing, early)
    assert plugin.books.devices == {}
    holder = make_container(CGROUPFS, holder_pod, "h1", "fwd", annotations=marker(key, "d-7"))
    assert await plugin.create_container(holder_pod, holder) is not None


@pytest.mark.asyncio
async def test_synchronize_keeps_bindings_of_listed_pods_only(tmp_path: Path) -> None:
    tree, plugin, key, holder_pod, thief_pod = _setup(tmp_path)
    holder = make_container(CGROUPFS, holder_pod, "h1", "fwd", annotations=marker(key, "d-7"))
    assert await plugin.create_container(holder_pod, holder) is not None
    holder.state = api.CONTAINER_STOPPED
    copy = make_container(CGROUPFS, thief_pod, "t1", "x", annotations=marker(key, "d-7"))
    copy.state = api.CONTAINER_RUNNING
    restarted, _ = make_plugin(tmp_path / "state", tree.layout, SHARED)
    assert list(await restarted.synchronize([holder_pod, thief_pod], [holder, copy])) == []
    assert restarted.books.devices == {"d-7": Slot(holder_pod.uid, "fwd")}
    assert restarted.books.find("t1") is None
    # The holder's pod is gone (its sandbox removed while the plugin was down): its binding ends,
    # and its allocation stays spent: the copy is still refused.
    again, _ = make_plugin(tmp_path / "state", tree.layout, SHARED)
    await again.synchronize([thief_pod], [copy])
    assert again.books.devices == {}
    assert again.books.find("t1") is None
    assert again.books.spent["d-7"].slot == Slot(holder_pod.uid, "fwd")
