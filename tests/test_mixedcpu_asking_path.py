"""The asking CreateContainer's lean path (issue #14): the file operations it makes on the pod
cgroup, its info line written after the reply, and the creation plan remembered."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest
import structlog
from mixedcpu_support import FakeCgroups, Naming, make_container, make_plugin, make_pod, marker, saved_books

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.mixedcpu import policy
from nri_plugin.mixedcpu.bookkeeper import Bookkeeper
from nri_plugin.mixedcpu.books import ContainerRecord, Containers, PodRecord
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin
from nri_plugin.mixedcpu.store import StateStore

SHARED = frozenset({0, 1})
NAMING = Naming("containerd", "cgroupfs")


def _node(tmp_path: Path) -> tuple[MixedCpuPlugin, FakeCgroups, HostKey]:
    tree = FakeCgroups(tmp_path / "cgroup", 1)
    plugin, key = make_plugin(tmp_path / "state", tree.layout)
    return plugin, tree, key


@pytest.mark.asyncio
async def test_a_new_pod_costs_one_directory_and_two_file_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below the pods' held parent: the pod's directory, its quota file (read, then written through
    the same descriptor, not read back) and its period; the database is held open too."""
    plugin, tree, key = _node(tmp_path)
    pods = [make_pod(NAMING, f"uid-{n}") for n in range(3)]
    for pod in pods:
        tree.add_pod(pod, 200_000)
    for n in range(2):  # the first pods: the parent walked to, the database made
        first = make_container(NAMING, pods[n], f"c{n}", annotations=marker(key, f"d{n}"))
        assert await plugin.create_container(pods[n], first) is not None
    opened: list[str] = []
    real_open = os.open

    def counting(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        opened.append(os.path.basename(path))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", counting)
    third = make_container(NAMING, pods[2], "c2", annotations=marker(key, "d2"))
    assert await plugin.create_container(pods[2], third) is not None
    monkeypatch.undo()
    assert opened == ["poduid-2", "cpu.cfs_quota_us", "cpu.cfs_period_us"]
    assert tree.pod_quota(pods[2]) == 400_000


@pytest.mark.asyncio
async def test_the_info_line_follows_the_reply_and_precedes_the_next_event(tmp_path: Path) -> None:
    plugin, tree, key = _node(tmp_path)
    pod = make_pod(NAMING, "uid-1")
    tree.add_pod(pod, 200_000)
    asking = make_container(NAMING, pod, "c1", "fwd", annotations=marker(key))
    plain = make_container(NAMING, pod, "c2", "sidecar", cpus="6")
    with structlog.testing.capture_logs() as logs:
        assert await plugin.create_container(pod, asking) is not None
        assert [e["event"] for e in logs if e["log_level"] == "info"] == []  # the reply comes first
        await asyncio.sleep(0)  # the loop's next turn
        given = [e for e in logs if e["event"] == "shared CPUs given"]
        assert [(e["container"], e["pod_quota"]) for e in given] == [("fwd", "200000 -> 400000")]
        logs.clear()
        assert await plugin.create_container(pod, asking) is not None  # again: no new quota
        assert await plugin.create_container(pod, plain) is None  # its lines come after that line
        order = [
            (e["event"], e["container"])
            for e in logs
            if e["event"] == "shared CPUs given" or e["container"] == "sidecar"
        ]
        assert order[0] == ("shared CPUs given", "fwd")
        assert len(order) > 1


@pytest.mark.asyncio
async def test_served_by_the_stub_the_line_waits_for_the_after_reply_not_a_loop_turn(tmp_path: Path) -> None:
    """Once the stub has called `after_reply` (it does after every reply), a creation's line is not
    scheduled on the loop: the stub's next `after_reply` writes it, right after the reply."""
    plugin, tree, key = _node(tmp_path)
    pod = make_pod(NAMING, "uid-1")
    tree.add_pod(pod, 200_000)
    plugin.after_reply()  # the stub's, after Synchronize's reply
    with structlog.testing.capture_logs() as logs:
        assert await plugin.create_container(pod, make_container(NAMING, pod, "c1", annotations=marker(key)))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert [e for e in logs if e["event"] == "shared CPUs given"] == []
        plugin.after_reply()  # the stub's, after the creation's reply
        assert [e["container"] for e in logs if e["event"] == "shared CPUs given"] == ["main"]


@pytest.mark.asyncio
async def test_without_a_running_loop_turn_the_next_event_writes_the_line(tmp_path: Path) -> None:
    plugin, tree, key = _node(tmp_path)
    pod = make_pod(NAMING, "uid-1")
    tree.add_pod(pod, 200_000)
    with structlog.testing.capture_logs() as logs:
        for n in range(3):
            container = make_container(NAMING, pod, f"c{n}", f"ctr{n}", annotations=marker(key, f"d{n}"))
            assert await plugin.create_container(pod, container) is not None
        await plugin.stop_container(pod, container)
    given = [e["container"] for e in logs if e["event"] == "shared CPUs given"]
    assert given == ["ctr0", "ctr1", "ctr2"]


def _container(cpus: str, quota: int | None = 200_000) -> tuple[api.PodSandbox, api.Container]:
    pod = make_pod(NAMING, "uid-1")
    return pod, make_container(NAMING, pod, "c1", cpus=cpus, quota=quota)


def test_the_plan_is_made_once_per_shape() -> None:
    pod, container = _container("4-5")
    plan = policy.plan_create(SHARED, pod, container)
    again = policy.plan_create(SHARED, *_container("4-5"))
    assert again is plan
    other = policy.plan_create(SHARED, *_container("6-7"))
    assert other is not plan
    assert other.adjustment.linux.resources.cpu.cpus == "0-1,6-7"
    unlimited = policy.plan_create(SHARED, *_container("4-5", quota=None))
    assert unlimited is not plan
    assert unlimited.quota is None


def test_a_remembered_plan_does_not_skip_the_checks() -> None:
    pod, container = _container("4-5")
    policy.plan_create(SHARED, pod, container)
    burstable = make_pod(NAMING, "uid-2", qos="burstable")
    same_values = make_container(NAMING, burstable, "c2", cpus="4-5")
    with pytest.raises(policy.PolicyError, match="not Guaranteed"):
        policy.plan_create(SHARED, burstable, same_values)
    with pytest.raises(policy.PolicyError, match=r"ns/app/main.*empty"):
        policy.plan_create(frozenset(), pod, container)
    bad = make_container(NAMING, pod, "c3", "odd", cpus="4-x")
    with pytest.raises(policy.PolicyError, match="ns/app/odd: the runtime sent a malformed cpuset"):
        policy.plan_create(SHARED, pod, bad)


def test_any_strings_go_through_the_database_as_they_are(tmp_path: Path) -> None:
    """Ids and names hold whatever the runtime sent (bound as parameters, never put in SQL text):
    each pod committed over its previous record reads back as it is."""
    rnd = random.Random(14)
    alphabet = "ab-_/:@.\"'\\\n\x00\u2028é\U0001f600"

    def text() -> str:
        return "".join(rnd.choice(alphabet) for _ in range(rnd.randrange(12)))

    def record() -> PodRecord | None:
        if rnd.random() < 0.2:
            return None
        slots = {
            text(): ContainerRecord(
                text(), rnd.randrange(4), rnd.choice(["", "2-3"]), rnd.choice([None, text()])
            )
            for _ in range(rnd.randrange(3))
        }
        baseline = rnd.choice([None, rnd.randrange(1000, 10**6)])  # (in the kernel's ranges)
        return PodRecord(
            cgroup_parent=rnd.choice(["/kubepods/p", text()]),
            baseline=baseline,
            period=rnd.randrange(1000, 10**6),
            baseline_source=text(),
            containers=Containers(slots),
        )

    keeper = Bookkeeper(StateStore(tmp_path))
    for _ in range(300):
        key, new = text(), record()
        if new is None:
            keeper.books.pods.pop(key, None)
        else:
            keeper.books.pods[key] = new
        keeper.commit()
    keeper.store.close()
    assert saved_books(tmp_path).pods == keeper.books.pods


@pytest.mark.asyncio
async def test_shutdown_writes_the_waiting_line(tmp_path: Path) -> None:
    plugin, tree, key = _node(tmp_path)
    pod = make_pod(NAMING, "uid-1")
    tree.add_pod(pod, 200_000)
    with structlog.testing.capture_logs() as logs:
        assert await plugin.create_container(pod, make_container(NAMING, pod, "c1", annotations=marker(key)))
        await plugin.shutdown()
        assert [e["container"] for e in logs if e["event"] == "shared CPUs given"] == ["main"]
