"""Pod quota bookkeeping: the books' slot rules, the state file, and pod quotas over long event runs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st
from mixedcpu_support import (
    PERIOD,
    FakeCgroups,
    Naming,
    apply_adjustment,
    make_container,
    make_plugin,
    make_pod,
    marker,
    saved_books,
)

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import CpuQuota
from nri_plugin.mixedcpu.baselines import rebase
from nri_plugin.mixedcpu.bookkeeper import Bookkeeper
from nri_plugin.mixedcpu.books import Books, ContainerRecord, Containers, PodRecord, Slot, Watch
from nri_plugin.mixedcpu.bounds import out_of_range
from nri_plugin.mixedcpu.store import (
    CHECKPOINT_EVERY,
    CHECKPOINT_LIMIT,
    SCHEMA_VERSION,
    STATE_FILE_NAME,
    StateStore,
    read_only,
)

CGROUPFS = Naming("containerd", "cgroupfs")


def _books() -> Books:
    books = Books({"pod-a": PodRecord(cgroup_parent="/kubepods/poda", baseline=300_000, period=PERIOD)})
    books.hold(Slot("pod-a", "fwd"), ContainerRecord("fwd-1", 2, "4-5", "shared-cpus-0"))
    books.hold(Slot("pod-a", "log"), ContainerRecord("log-1", 2, "6", None))
    return books


def test_target_is_baseline_plus_contributions() -> None:
    books = _books()
    assert books.pods["pod-a"].contribution == 400_000
    assert books.pods["pod-a"].target() == 700_000
    books.pods["pod-a"] = replace(books.pods["pod-a"], baseline=None)
    assert books.pods["pod-a"].target() is None  # unlimited stays unlimited


def test_restart_replaces_the_slot_and_old_events_are_no_ops() -> None:
    books = _books()
    old = books.displace(Slot("pod-a", "fwd"), "fwd-2")
    assert old is not None
    assert old.id == "fwd-1"
    books.hold(Slot("pod-a", "fwd"), ContainerRecord("fwd-2", 2, "4-5", "shared-cpus-0"))
    assert books.release("fwd-1") is None  # the dead instance no longer holds anything
    assert books.pods["pod-a"].target() == 700_000
    assert books.release("fwd-2") == Slot("pod-a", "fwd")
    assert books.release("fwd-2") is None
    assert books.pods["pod-a"].target() == 500_000


def test_same_id_does_not_displace_itself() -> None:
    books = _books()
    assert books.displace(Slot("pod-a", "fwd"), "fwd-1") is None
    assert books.displace(Slot("pod-b", "fwd"), "x") is None  # unknown pod


def test_a_new_pod_is_put_in_the_books_with_its_slot_held_in_one_write() -> None:
    """The first container of a pod: the pod's record goes in already holding the slot, one write
    (one change recorded, against nothing before), the device bound as for a known pod."""
    books = Books()
    books.take_changes()
    writes: list[str] = []
    recorded = books.pods._written

    def counted(key: str, old: PodRecord | None, new: PodRecord | None) -> None:
        writes.append(key)
        recorded(key, old, new)

    books.pods._written = counted
    record = ContainerRecord("fwd-1", 2, "4-5", "shared-cpus-0")
    assert (
        books.hold(
            Slot("pod-n", "fwd"),
            record,
            new_pod=PodRecord(cgroup_parent="/kubepods/pod-n", baseline=300_000, period=100_000),
        )
        is None
    )
    assert writes == ["pod-n"]
    assert books.pods["pod-n"].containers == {"fwd": record}
    assert books.pods["pod-n"].target() == 500_000
    assert books.take_changes() == ({"pod-n": None}, {"shared-cpus-0": None})
    assert books.find("fwd-1") == (Slot("pod-n", "fwd"), record)
    assert books.device_holders() == {"shared-cpus-0": Slot("pod-n", "fwd")}


def test_device_holders_and_find() -> None:
    books = _books()
    assert books.device_holders() == {"shared-cpus-0": Slot("pod-a", "fwd")}
    found = books.find("log-1")
    assert found is not None
    assert found[0] == Slot("pod-a", "log")
    assert books.find("nope") is None


def test_state_db_round_trip(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    books = _books()
    store.save(books)
    store.close()
    loaded = saved_books(tmp_path)
    assert (loaded, loaded.spent) == (books, books.spent)
    assert (tmp_path / STATE_FILE_NAME).stat().st_mode & 0o777 == 0o600
    with contextlib.closing(sqlite3.connect(tmp_path / STATE_FILE_NAME)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        rows = db.execute("SELECT * FROM slots WHERE pod = 'pod-a' ORDER BY name").fetchall()
    assert rows == [
        ("pod-a", "fwd", "fwd-1", 2, "4-5", "shared-cpus-0"),
        ("pod-a", "log", "log-1", 2, "6", None),
    ]


def test_missing_state_file_is_empty_books(tmp_path: Path) -> None:
    assert StateStore(tmp_path / "not-yet").load() == Books()


def _fill_up(store: StateStore) -> None:
    """No page more for the database: what a full disk does to the next transaction that grows it."""
    db = store._connection()
    db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")


def test_a_failed_transaction_writes_nothing_and_its_changes_wait(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    keeper = Bookkeeper(store, _books())
    keeper.commit()
    _fill_up(store)
    for n in range(200):  # more than the pages left hold
        keeper.books.pods[f"new-{n}"] = PodRecord(
            cgroup_parent=f"/kubepods/new{n}" * 20, baseline=None, period=PERIOD
        )
    keeper.books.release("fwd-1")
    with pytest.raises(OSError, match="full"):
        keeper.commit()
    assert saved_books(tmp_path) == _books(), "nothing of the failed transaction"
    with structlog.testing.capture_logs() as logs:
        keeper.save_quietly()
    assert [e["event"] for e in logs] == ["cannot save the plugin's state"]
    store._connection().execute("PRAGMA max_page_count = 1000000")  # room again
    keeper.commit()  # what failed is written with it
    assert saved_books(tmp_path) == keeper.books


def test_a_state_dir_that_is_a_file_fails_the_save(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    keeper = Bookkeeper(StateStore(tmp_path / "file"), _books())
    with pytest.raises(OSError, match="file"):
        keeper.commit()
    with structlog.testing.capture_logs() as logs:
        keeper.save_quietly()
    assert [e["event"] for e in logs] == ["cannot save the plugin's state"]


def _full_record() -> PodRecord:
    return PodRecord(
        cgroup_parent="/kubepods/podp",
        baseline=300_000,
        period=PERIOD,
        baseline_source="pod-resources",
        containers=Containers({"fwd": ContainerRecord("c1", 2, "4-5", "shared-cpus-0")}),
    )


def test_records_cannot_change_in_place() -> None:
    """The state file reuses a pod's text while the books hold the same record object: that is only
    right because nothing can change a record in place."""
    pod = _full_record()
    for name in (f.name for f in dataclasses.fields(PodRecord)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(pod, name, getattr(pod, name))
    with pytest.raises(TypeError):
        pod.containers["log"] = ContainerRecord("c2", 1)  # type: ignore[index]
    with pytest.raises(TypeError):
        del pod.containers["fwd"]  # type: ignore[attr-defined]
    for method in (
        "pop",
        "popitem",
        "clear",
        "update",
        "setdefault",
        "__ior__",
        "__setitem__",
        "__delitem__",
    ):
        assert not hasattr(pod.containers, method), method
    with pytest.raises(dataclasses.FrozenInstanceError):
        pod.containers["fwd"].shared_cpus = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        pod.containers._extra = {}  # type: ignore[attr-defined]  # no __dict__ to hang state on
    # Every field holds an immutable value: a field of a mutable type (list, dict) would not hash.
    assert hash(pod) == hash(_full_record())


def test_a_record_made_from_a_dict_does_not_share_it() -> None:
    given = {"fwd": ContainerRecord("c1", 2)}
    pod = PodRecord(
        cgroup_parent="/kubepods/podp", baseline=300_000, period=PERIOD, containers=Containers(given)
    )
    given["log"] = ContainerRecord("c2", 1)
    assert list(pod.containers) == ["fwd"]
    assert pod.containers == {"fwd": ContainerRecord("c1", 2)}


def test_changes_make_new_records() -> None:
    pod = _full_record()
    held = pod.holding("log", ContainerRecord("c2", 1))
    assert list(held.containers) == ["fwd", "log"]
    assert list(pod.containers) == ["fwd"]
    assert held.without("fwd").containers == {"log": ContainerRecord("c2", 1)}
    assert held.containers == {**pod.containers, "log": ContainerRecord("c2", 1)}
    assert rebase(pod, CpuQuota(500_000, PERIOD)) is pod  # nothing to change: the same record
    assert rebase(pod, CpuQuota(500_000, 50_000)) == replace(pod, baseline=150_000, period=50_000)


@pytest.mark.parametrize(
    ("baseline", "period", "new_period", "expected"),
    [
        (100_001, 100_000, 50_000, 50_001),  # 50,000.5: up, never below the pod's own share
        (100_002, 100_000, 50_000, 50_001),  # exact: nothing added
        (199_999, 100_000, 50_000, 100_000),  # 99,999.5
        (100_000, 100_000, 50_000, 50_000),
        (33_334, 100_000, 30_000, 10_001),  # 10,000.2: the smallest remainder still goes up
        (33_333, 100_000, 300_000, 99_999),  # a longer period: exact
        (1_001, 3_000, 1_000, 334),  # 333.67
    ],
)
def test_a_baseline_scaled_to_another_period_is_rounded_up(
    baseline: int, period: int, new_period: int, expected: int
) -> None:
    """Rounded down, a pod would get less than its own CPU time in the new period (issue 32: the only
    test divided exactly, and a mutant rounding down survived)."""
    pod = replace(_full_record(), baseline=baseline, period=period)
    rebased = rebase(pod, CpuQuota(400_000, new_period))
    assert (rebased.baseline, rebased.period) == (expected, new_period)
    assert expected * period >= baseline * new_period  # never less time per period


# -- when the books are written ---------------------------------------------------------------------------


def test_each_commit_is_on_disk_at_once(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    keeper = Bookkeeper(store)
    keeper.books = _books()
    keeper.commit()
    assert saved_books(tmp_path) == keeper.books
    keeper.books.hold(Slot("pod-a", "fwd"), ContainerRecord("fwd-2", 2, "4-5", "shared-cpus-0"))
    keeper.commit()  # a slot change, as a baseline: written before the reply
    assert saved_books(tmp_path).pods["pod-a"].containers["fwd"].id == "fwd-2"
    keeper.books.pods["pod-a"] = replace(keeper.books.pods["pod-a"], baseline=400_000)
    keeper.commit()
    assert saved_books(tmp_path).pods["pod-a"].baseline == 400_000


def test_a_pod_written_ahead_keeps_its_slots_on_disk(tmp_path: Path) -> None:
    """`write_ahead` writes the pod's own record alone; the slots on disk stay until the commit."""
    keeper = Bookkeeper(StateStore(tmp_path), _books())
    keeper.commit()
    ahead = replace(keeper.books.pods["pod-a"], baseline=900_000).without("fwd")
    keeper.write_ahead("pod-a", ahead)
    on_disk = saved_books(tmp_path).pods["pod-a"]
    assert (on_disk.baseline, on_disk.containers) == (900_000, _books().pods["pod-a"].containers)
    keeper.books.pods["pod-a"] = ahead
    keeper.commit()
    assert saved_books(tmp_path) == keeper.books


def _mutate(books: Books, rng: random.Random, step: int) -> None:
    """One random change to the books, through any of the ways the plugin (or a test) changes them:
    the books' methods, their dicts, and new records made from old ones (records are immutable)."""
    keys = ["p0", "p1", "p2", "p\u00e9", 'p"3']
    names = ["a", "b", "c"]
    key, name, other = rng.choice(keys), rng.choice(names), rng.choice(keys)
    pod = books.pods.get(key)
    record = ContainerRecord(
        f"c{step}", rng.randint(0, 3), rng.choice(["", "4-5"]), rng.choice([None, f"d{step % 4}"])
    )
    kind = rng.randrange(24)
    if kind == 0 or pod is None:
        books.pods[key] = PodRecord(
            cgroup_parent=f"/kubepods/{key}", baseline=rng.choice([None, 100_000, 250_000]), period=PERIOD
        )
    elif kind == 1:
        books.hold(Slot(key, name), record)
    elif kind == 2:
        books.displace(Slot(key, name), f"c{step}")
    elif kind == 3:
        found = rng.choice([*pod.containers.values(), record])
        books.release(found.id)
    elif kind == 4:
        books.bind(f"d{step % 4}", Slot(key, name))
    elif kind == 5:
        books.unbind_pod(key)
    elif kind == 6:
        del books.pods[key]
    elif kind == 7:
        books.pods.pop(key)
    elif kind == 8:
        books.pods[key] = replace(pod, baseline=rng.choice([None, 50_000, pod.baseline and pod.baseline + 1]))
    elif kind == 9:
        books.pods[key] = replace(pod, period=rng.choice([50_000, 100_000, 100_001]))
    elif kind == 10:
        books.pods[key] = replace(pod, baseline_source=rng.choice(["first-seen", "rebuilt", "unknown"]))
    elif kind == 11:
        books.pods[key] = replace(pod, cgroup_parent=f"/kubepods/moved-{step}")
    elif kind == 12:
        books.pods[key] = pod.holding(name, record)
    elif kind == 13:
        books.pods[key] = pod.without(name)
    elif kind == 14 and pod.containers:
        books.pods[key] = pod.without(list(pod.containers)[-1])
    elif kind == 15:
        books.pods[key] = replace(pod, containers=Containers())
    elif kind == 16:
        books.pods[key] = pod if name in pod.containers else pod.holding(name, record)
    elif kind == 17:
        books.pods[key] = replace(pod, containers=Containers({**pod.containers, name: record}))
    elif kind == 18:
        # What the reconciler does with the pod cgroup's limit: a new baseline, period or source.
        current = CpuQuota(rng.choice([None, 300_000, 1_000]), rng.choice([50_000, 100_000]))
        books.pods[key] = rebase(pod, current)
    elif kind == 19:
        containers = rng.choice([Containers({name: record}), Containers()])
        books.pods[key] = replace(pod, containers=containers)
    elif kind == 20 and other in books.pods:
        books.pods[other] = replace(books.pods[other], containers=pod.containers)  # one mapping, two pods
    elif kind == 21 and other in books.pods:
        books.pods[other] = pod  # one record under two keys
    elif kind == 22:
        books.pods[key] = replace(pod)  # an equal record: a rolled-back creation puts the saved one back
    elif kind == 23:
        books.devices = {f"d{step % 4}": Slot(key, name)} if rng.random() < 0.5 else dict(books.devices)
    now = books.pods.get(key)
    if now is not None and name in now.containers and rng.random() < 0.1:
        books.pods[key] = now.without(name)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 120))
def test_the_database_always_holds_the_books_committed(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        keeper = Bookkeeper(StateStore(tmp))
        for step in range(steps):
            _mutate(keeper.books, rng, step)
            if rng.random() < 0.1:
                keeper.books = keeper.books.copy()
            if rng.random() < 0.1:
                key = rng.choice(sorted(keeper.books.pods) or ["p0"])
                record = PodRecord(
                    cgroup_parent=f"/kubepods/{key}", baseline=rng.choice([None, 70_000]), period=PERIOD
                )
                keeper.write_ahead(key, record)
            if rng.random() < 0.6:  # not after every change: several may pile up between commits
                keeper.commit()
                books = keeper.books
                keeper.store.close()  # (another connection reads it: the next commit opens it again)
                loaded, _ = read_only(keeper.store.path)  # (as they are: a load sets some aside)
                assert (loaded.pods, loaded.devices, loaded.spent) == (books.pods, books.devices, books.spent)
        # A record the mutations took out of the kernel's ranges (a baseline rescaled below 1 ms) is
        # set aside at load, and its rows deleted.
        keeper.commit()
        in_range = {key: pod for key, pod in keeper.books.pods.items() if out_of_range(pod) is None}
        keeper.store.close()
        assert dict(StateStore(tmp).load().pods) == in_range
        assert dict(read_only(keeper.store.path)[0].pods) == in_range


# -- a model of kubelet restarting containers, against the plugin and a fake pod cgroup -------------------

NAMES = ("a", "b", "c")
SHARED = frozenset({0, 1})
BASELINE = 600_000

event = st.one_of(
    st.tuples(st.just("restart"), st.sampled_from(NAMES), st.booleans()),  # new before old stops?
    st.tuples(st.just("stop"), st.sampled_from(NAMES), st.just(False)),
    st.tuples(st.just("remove"), st.sampled_from(NAMES), st.just(False)),
    st.tuples(st.just("replay"), st.sampled_from(NAMES), st.just(False)),
    st.tuples(st.just("plugin-restart"), st.just(""), st.just(False)),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(event, max_size=25), st.booleans())
def test_pod_quota_never_grows_beyond_live_shared_containers(
    events: list[tuple[str, str, bool]], keep_state: bool
) -> None:
    asyncio.run(_run_model(events, keep_state))


async def _run_model(events: list[tuple[str, str, bool]], keep_state: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tree = FakeCgroups(root / "cgroup")
        plugin, key = make_plugin(root / "state", tree.layout, SHARED)
        pod = make_pod(CGROUPFS)
        tree.add_pod(pod, BASELINE)
        devices = {name: f"shared-cpus-{i}" for i, name in enumerate(NAMES)}
        cpus = {"a": "2-3", "b": "4-5", "c": "6-7"}
        live: dict[str, api.Container] = {}  # name -> the running instance
        bound: set[str] = set()  # names whose allocation this pod's container presented first
        stolen: set[str] = set()  # names whose allocation the other pod's container presented first
        dead: dict[str, list[api.Container]] = {name: [] for name in NAMES}  # stopped, not removed
        counter = 0
        for kind, name, new_first in events:
            if kind == "restart" and name in stolen:
                continue  # its allocation is spent on the other pod: its marker is refused from now on
            if kind == "restart":
                counter += 1
                new = make_container(
                    CGROUPFS,
                    pod,
                    f"{name}-{counter}",
                    name,
                    cpus=cpus[name],
                    annotations=marker(key, devices[name]),
                )
                old = live.pop(name, None)
                if old is not None and not new_first:
                    await plugin.stop_container(pod, old)
                reply = await plugin.create_container(pod, new)
                assert reply is not None
                apply_adjustment(new, reply.adjust)
                new.state = api.CONTAINER_RUNNING
                live[name] = new
                bound.add(name)
                if old is not None:
                    if new_first:
                        await plugin.stop_container(pod, old)
                    old.state = api.CONTAINER_STOPPED
                    dead[name].append(old)
            elif kind == "stop" and name in live:
                old = live.pop(name)
                await plugin.stop_container(pod, old)
                old.state = api.CONTAINER_STOPPED
                dead[name].append(old)
            elif kind == "remove" and dead[name]:
                await plugin.remove_container(pod, dead[name].pop(0))
            elif kind == "replay":
                # Another pod's container presents this name's marker: refused once this pod's
                # container of that name presented it, running, stopped or gone; else the other pod
                # presents it first, and this name's own container is the copy from then on.
                thief_pod = make_pod(CGROUPFS, "9999-0000")
                tree.add_pod(thief_pod, 100_000)
                thief = make_container(
                    CGROUPFS, thief_pod, f"thief-{counter}", "x", annotations=marker(key, devices[name])
                )
                reply = await plugin.create_container(thief_pod, thief)
                assert (reply is None) == (name in bound)
                if reply is not None:
                    stolen.add(name)
                    await plugin.stop_container(thief_pod, thief)
                    await plugin.remove_container(thief_pod, thief)
                await plugin.remove_pod_sandbox(thief_pod)
            elif kind == "plugin-restart":
                if not keep_state:
                    plugin.store.close()
                    for suffix in ("", "-wal", "-shm"):
                        Path(plugin.store.path + suffix).unlink(missing_ok=True)  # noqa: ASYNC240
                    bound &= set(live)  # without the file, Synchronize binds the running ones only
                plugin, _ = make_plugin(root / "state", tree.layout, SHARED)
                containers = [*live.values(), *(c for group in dead.values() for c in group)]
                updates = await plugin.synchronize([pod], containers)
                assert list(updates) == []  # everything already had its shared CPUs
            assert tree.pod_quota(pod) == BASELINE + len(live) * len(SHARED) * PERIOD, (kind, name)
            assert saved_books(root / "state") == plugin.books


# -- the plugin's use of the state file ----------------------------------------------------------------


def _shared(
    pod: api.PodSandbox, cid: str, key: object, device: str = "shared-cpus-0", **kw: object
) -> api.Container:
    return make_container(CGROUPFS, pod, cid, "main", annotations=marker(key, device), **kw)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_every_change_is_on_disk_before_the_reply(tmp_path: Path) -> None:
    tree = FakeCgroups(tmp_path / "cgroup")
    plugin, key = make_plugin(tmp_path / "state", tree.layout, SHARED)
    pod = make_pod(CGROUPFS)
    tree.add_pod(pod, 300_000)
    await plugin.create_container(pod, _shared(pod, "c1", key))
    saved = saved_books(tmp_path / "state")
    assert saved.pods[pod.uid].baseline == 300_000  # a new baseline: on disk before the reply
    assert saved.pods[pod.uid].containers["main"].id == "c1"
    await plugin.create_container(pod, _shared(pod, "c2", key))  # a restart: only the slot changes
    assert saved_books(tmp_path / "state").pods[pod.uid].containers["main"].id == "c2"
    await plugin.shutdown()
    assert plugin.store.load() == plugin.books
    assert not (tmp_path / "state" / f"{STATE_FILE_NAME}-wal").stat().st_size, "folded in at shutdown"
    await plugin.remove_pod_sandbox(pod)
    assert plugin.books == Books()
    assert plugin.store.load() == Books()


@pytest.mark.asyncio
async def test_replayed_marker_at_synchronize_keeps_the_known_holder(tmp_path: Path) -> None:
    tree = FakeCgroups(tmp_path / "cgroup")
    plugin, key = make_plugin(tmp_path / "state", tree.layout, SHARED)
    pod, thief_pod = make_pod(CGROUPFS), make_pod(CGROUPFS, "9-9", name="thief")
    tree.add_pod(pod, 300_000)
    tree.add_pod(thief_pod, 100_000)
    owner = _shared(pod, "owner", key)
    owner.created_at = 2
    reply = await plugin.create_container(pod, owner)
    assert reply is not None
    apply_adjustment(owner, reply.adjust).state = api.CONTAINER_RUNNING
    # An older container that shows up with the same (valid) marker: refused, the holder keeps it.
    thief = _shared(thief_pod, "thief", key, state=api.CONTAINER_RUNNING)
    thief.created_at = 1
    restarted, _ = make_plugin(tmp_path / "state", tree.layout, SHARED)
    updates = await restarted.synchronize([pod, thief_pod], [thief, owner])
    assert list(updates) == []
    assert restarted.books.device_holders() == {"shared-cpus-0": Slot(pod.uid, "main")}
    assert tree.pod_quota(thief_pod) == 100_000
    assert tree.pod_quota(pod) == 500_000


@pytest.mark.asyncio
async def test_unreadable_pod_cgroup_at_synchronize_is_guessed_later(tmp_path: Path) -> None:
    tree = FakeCgroups(tmp_path / "cgroup")
    plugin, key = make_plugin(tmp_path / "state", tree.layout, SHARED)
    pod = make_pod(CGROUPFS)
    running = _shared(pod, "c1", key, cpus="0-1,4-5", quota=400_000, state=api.CONTAINER_RUNNING)
    with structlog.testing.capture_logs() as logs:
        assert list(await plugin.synchronize([pod], [running])) == []
    assert any(e["event"] == "cannot bring the pod quota to its target" for e in logs)
    # It still counts as shared: kubelet's update keeps the shared CPUs.
    requested = api.LinuxResources()
    requested.cpu.cpus = "4-5"
    [update] = await plugin.update_container(pod, running, requested)
    assert update.linux.resources.cpu.cpus == "0-1,4-5"
    # The pod cgroup shows up already raised: its own quota is guessed as current - our share.
    tree.add_pod(pod, 500_000)
    await plugin.stop_container(pod, running)
    assert tree.pod_quota(pod) == 300_000


@pytest.mark.parametrize("replies", [True, False], ids=["after-replies", "no-reply"])
def test_the_wal_is_checkpointed_and_stays_short(tmp_path: Path, replies: bool) -> None:
    """SQLite's own checkpoints (in a COMMIT) are off; the one after a reply (every
    CHECKPOINT_EVERY transactions), or in place when no reply comes (CHECKPOINT_LIMIT), keeps the
    WAL short and rewound; none is left at shutdown."""
    keeper = Bookkeeper(StateStore(tmp_path))
    wal = tmp_path / f"{STATE_FILE_NAME}-wal"
    frame = 4096 + 24  # a page and its frame header
    every = CHECKPOINT_EVERY if replies else CHECKPOINT_LIMIT
    for n in range(3 * CHECKPOINT_LIMIT):
        slot = Slot(f"pod-{n}", "app")
        new = PodRecord(cgroup_parent=f"/kubepods/pod{n}", baseline=PERIOD, period=PERIOD)
        keeper.books.hold(slot, ContainerRecord(f"c-{n}", 2, "4-5", f"dev-{n}"), new_pod=new, allocation=1)
        keeper.commit()
        if replies:
            keeper.store.checkpoint_if_due()
        # (a creation writes 4 pages: one per table; a few more as the B-trees split)
        assert wal.stat().st_size < (every + 1) * 8 * frame
    assert not (tmp_path / f"{STATE_FILE_NAME}-shm").exists(), "the WAL's index in memory"
    keeper.flush()
    assert wal.stat().st_size == 0
    keeper.store.close()
    assert saved_books(tmp_path) == keeper.books


def test_an_older_versions_wal_and_index_are_read_and_the_index_removed(tmp_path: Path) -> None:
    """The books' database as first released kept the WAL's index in ``-shm`` (shared locking): one left
    so by a killed daemon of that version opens with what its WAL holds, and the stale index goes."""
    path = tmp_path / STATE_FILE_NAME
    made = StateStore(tmp_path)
    made.save(Books())  # (the schema)
    made.close()
    older = sqlite3.connect(path, isolation_level=None)
    older.execute("PRAGMA journal_mode = WAL")
    older.execute("PRAGMA wal_autocheckpoint = 0")
    older.execute("INSERT INTO pods VALUES ('pod-a', '/kubepods/poda', 100000, 100000, 'first-seen')")
    assert (tmp_path / f"{STATE_FILE_NAME}-shm").exists()
    shutil.copytree(tmp_path, tmp_path.parent / "left")  # as a kill leaves it: the WAL not folded in
    older.close()
    left = tmp_path.parent / "left"
    assert set(StateStore(left).load().pods) == {"pod-a"}
    assert not (left / f"{STATE_FILE_NAME}-shm").exists()


def test_a_database_in_use_is_refused_and_not_set_aside(tmp_path: Path) -> None:
    """A second process opening the books of a running daemon is told so; nothing is renamed."""
    keeper = Bookkeeper(StateStore(tmp_path), _books())
    keeper.commit()
    script = (
        "import sys\n"
        "from nri_plugin.mixedcpu.store import StateStore, StateFileError\n"
        "try:\n"
        "    StateStore(sys.argv[1]).load()\n"
        "except StateFileError as exc:\n"
        "    print(exc)\n"
    )
    other = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert "is in use by another process" in other.stdout, other.stdout + other.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE_NAME, f"{STATE_FILE_NAME}-wal"]
    keeper.store.close()
    assert saved_books(tmp_path) == _books()


def test_books_given_replace_the_books_and_the_watches_on_disk(tmp_path: Path) -> None:
    """A keeper given books (not loading them) writes them whole at its first commit: whatever the
    database held is gone, the healer's watches with it."""
    keeper = Bookkeeper(StateStore(tmp_path))
    watch = {Slot("pod-a", "fwd"): Watch("fwd-1", "/kubepods/poda/fwd-1", 5.0)}
    keeper.watch_source = lambda: watch
    keeper.books = _books()
    keeper.commit()
    keeper.store.close()
    assert read_only(keeper.store.path) == (_books(), watch)
    other = Bookkeeper(StateStore(tmp_path), Books())
    other.commit()
    other.store.close()
    assert read_only(other.store.path) == (Books(), {})
