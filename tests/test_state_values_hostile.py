"""Hostile numbers in the state dir (issue #25, break 4): a baseline of 10^30 in the state file was
written to ``cpu.cfs_quota_us`` as 100000000000200000, and one of 6,400,000 for a 2-CPU pod gave it
66 CPUs of quota, with no warning.

Now every loaded record is checked against the kernel's CFS ranges and the node's online CPUs
(`nri_plugin.mixedcpu.bounds`), and at Synchronize against the pod's limit from the runtime: a record
out of range is set aside with one warning (the pod, the value, the range) and the pod rebuilt from
the runtime's view. Checked here on the store, on Synchronize, and through the real daemon on a temp
cgroup tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog
from mixedcpu_support import (
    PERIOD,
    Daemon,
    FakeCgroups,
    make_container,
    make_plugin,
    make_pod,
    marker,
    saved_books,
    start_daemon,
)
from redteam_support import GUARD, NAMING, daemon_node, is_shared, short_directory

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.mixedcpu.bookkeeper import Bookkeeper
from nri_plugin.mixedcpu.books import Books, ContainerRecord, Containers, PodRecord, Slot
from nri_plugin.mixedcpu.bounds import out_of_range
from nri_plugin.mixedcpu.legacy import LEGACY_FILE_NAME
from nri_plugin.mixedcpu.policy import MAX_CFS_QUOTA
from nri_plugin.mixedcpu.store import STATE_FILE_NAME, StateStore

SET_ASIDE = "saved pod record out of range: set aside, the pod is rebuilt from the runtime's view"


def _books(baseline: int, *, period: int = PERIOD, shared: int = 2, exclusive: str = "2-3") -> Books:
    books = Books(
        {
            "sane": PodRecord(cgroup_parent="/kubepods/podsane", baseline=2 * PERIOD, period=PERIOD),
            "bad": PodRecord(cgroup_parent="/kubepods/podbad", baseline=baseline, period=period),
        }
    )
    books.hold(Slot("sane", "app"), ContainerRecord("c-sane", 2, "2-3", "dev-0"))
    books.hold(Slot("bad", "app"), ContainerRecord("c-bad", shared, exclusive, "dev-1"))
    return books


@pytest.mark.parametrize(
    ("record", "field", "allowed"),
    [
        (
            PodRecord(cgroup_parent="/p", baseline=10**30, period=PERIOD),
            "baseline",
            "1000 to 400000 us (4 online CPUs",
        ),
        (
            PodRecord(cgroup_parent="/p", baseline=999, period=PERIOD),
            "baseline",
            "1000 to 400000 us (4 online CPUs",
        ),
        (
            PodRecord(cgroup_parent="/p", baseline=-5, period=PERIOD),
            "baseline",
            "1000 to 400000 us (4 online CPUs",
        ),
        (
            PodRecord(cgroup_parent="/p", baseline=6_400_000, period=PERIOD),
            "baseline",
            "1000 to 400000 us (4 online CPUs x the period",
        ),
        (
            PodRecord(cgroup_parent="/p", baseline=PERIOD, period=999),
            "period",
            "1000 to 1000000 us (the kernel's range)",
        ),
        (
            PodRecord(cgroup_parent="/p", baseline=PERIOD, period=1_000_001),
            "period",
            "1000 to 1000000 us (the kernel's range)",
        ),
        (
            PodRecord(cgroup_parent="/p", baseline=PERIOD, period=0),
            "period",
            "1000 to 1000000 us (the kernel's range)",
        ),
        (
            PodRecord(
                cgroup_parent="/p",
                baseline=PERIOD,
                period=PERIOD,
                containers=Containers({"a": ContainerRecord("c", -1)}),
            ),
            "container a: shared_cpus",
            "0 to 4 CPUs (the online CPUs)",
        ),
        (
            PodRecord(
                cgroup_parent="/p",
                baseline=PERIOD,
                period=PERIOD,
                containers=Containers({"a": ContainerRecord("c", 5)}),
            ),
            "container a: shared_cpus",
            "0 to 4 CPUs (the online CPUs)",
        ),
        (
            PodRecord(
                cgroup_parent="/p",
                baseline=PERIOD,
                period=PERIOD,
                containers=Containers({"a": ContainerRecord("c", 2, "0-63")}),
            ),
            "container a: exclusive",
            "0 to 4 CPUs (the online CPUs)",
        ),
        (
            PodRecord(
                cgroup_parent="/p",
                baseline=PERIOD,
                period=PERIOD,
                containers=Containers({"a": ContainerRecord("c", 2, "zero")}),
            ),
            "container a: exclusive",
            "a list of CPUs",
        ),
    ],
)
def test_each_number_is_checked_against_the_kernel_and_the_node(
    record: PodRecord, field: str, allowed: str
) -> None:
    problem = out_of_range(record, online=4)
    assert problem is not None
    assert problem.field == field
    assert problem.allowed.startswith(allowed)


def test_the_edges_of_the_ranges_are_kept() -> None:
    for record in (
        PodRecord(cgroup_parent="/p", baseline=1_000, period=1_000),
        PodRecord(
            cgroup_parent="/p",
            baseline=4 * PERIOD,
            period=PERIOD,
            containers=Containers({"a": ContainerRecord("c", 4, "0-3")}),
        ),
        PodRecord(cgroup_parent="/p", baseline=None, period=1_000_000),
        PodRecord(
            cgroup_parent="/p", baseline=MAX_CFS_QUOTA, period=1_000_000
        ),  # the kernel's largest, on a node too large to check
    ):
        online = None if record.baseline == MAX_CFS_QUOTA else 4
        assert out_of_range(record, online) is None, record
    # The target counts too: the kernel's largest quota plus a share is over it.
    shared = PodRecord(
        cgroup_parent="/p",
        baseline=MAX_CFS_QUOTA,
        period=PERIOD,
        containers=Containers({"a": ContainerRecord("c", 1)}),
    )
    problem = out_of_range(shared)
    assert problem is not None
    assert problem.field == "target"
    # Without the online CPUs (a store built without them), the kernel's range alone.
    problem = out_of_range(PodRecord(cgroup_parent="/p", baseline=10**30, period=PERIOD))
    assert problem is not None
    assert problem.allowed == f"1000 to {MAX_CFS_QUOTA} us (the kernel's range)"


@pytest.mark.parametrize("online", [1, 4, 5])
def test_exclusive_cpus_up_to_the_online_ones_are_kept_one_more_is_set_aside(online: int) -> None:
    """The boundary itself: exactly as many exclusive CPUs as are online is a record the node can
    hold; one more is not (issue 32: a check off by one survived the tests)."""

    def with_exclusive(cpus: int) -> PodRecord:
        return PodRecord(
            cgroup_parent="/p",
            baseline=PERIOD,
            period=PERIOD,
            containers=Containers({"a": ContainerRecord("c", 0, f"0-{cpus - 1}")}),
        )

    assert out_of_range(with_exclusive(online), online) is None
    problem = out_of_range(with_exclusive(online + 1), online)
    assert problem is not None
    assert (problem.field, problem.value) == ("container a: exclusive", f"0-{online}")
    assert problem.allowed == f"0 to {online} CPUs (the online CPUs)"


def _pod_keys(store: StateStore) -> list[str]:
    with contextlib.closing(sqlite3.connect(store.path)) as db:
        return [key for (key,) in db.execute("SELECT key FROM pods ORDER BY key")]


@pytest.mark.parametrize("baseline", [2**62, 6_400_000])
def test_a_hostile_baseline_in_the_database_is_set_aside(tmp_path: Path, baseline: int) -> None:
    first = StateStore(tmp_path)
    first.save(_books(baseline))
    first.close()
    store = StateStore(tmp_path, online=4)
    with structlog.testing.capture_logs() as logs:
        keeper = Bookkeeper(store)
    assert set(keeper.books.pods) == {"sane"}, "the other pods are kept"
    assert set(keeper.books.devices) == {"dev-0", "dev-1"}, "the bindings are kept: the pod did not end"
    [warning] = [e for e in logs if e["event"] == SET_ASIDE]
    assert warning["log_level"] == "warning"
    assert (warning["pod_key"], warning["field"], warning["value"]) == ("bad", "baseline", str(baseline))
    assert warning["cgroup_parent"] == "/kubepods/podbad"
    assert warning["path"] == store.path
    store.close()
    assert _pod_keys(store) == ["sane"], "its rows are deleted at once"


def _legacy_books(directory: Path, baseline: int, *, journal: bool) -> None:
    """0.2.0's files for pod ``bad`` with `baseline`: in the snapshot, or in its journal."""
    pod = {"cgroup_parent": "/kubepods/podbad", "baseline": baseline, "period": PERIOD, "containers": {}}
    sane = {**pod, "cgroup_parent": "/kubepods/podsane", "baseline": 2 * PERIOD}
    snapshot = {"version": 1, "journal": 1, "pods": {"sane": sane, **({} if journal else {"bad": pod})}}
    (directory / LEGACY_FILE_NAME).write_text(json.dumps(snapshot))
    if journal:
        line = json.dumps([["P", "bad", "/kubepods/podbad", baseline, PERIOD, "pod-resources"]])
        (directory / f"{LEGACY_FILE_NAME}.journal.1").write_text(line + "\n")


@pytest.mark.parametrize("journal", [False, True])
def test_a_hostile_baseline_in_the_old_files_is_set_aside(tmp_path: Path, journal: bool) -> None:
    """Checked before the move (one too large for the database's integers too)."""
    _legacy_books(tmp_path, 10**30, journal=journal)
    with structlog.testing.capture_logs() as logs:
        books = StateStore(tmp_path, online=4).load()
    assert set(books.pods) == {"sane"}
    [warning] = [e for e in logs if e["event"] == SET_ASIDE]
    assert (warning["pod_key"], warning["value"]) == ("bad", str(10**30))
    assert _pod_keys(StateStore(tmp_path)) == ["sane"]


@pytest.mark.asyncio
async def test_synchronize_sets_aside_a_baseline_above_the_runtimes_limit(tmp_path: Path) -> None:
    """The pod's runtime says 2 CPUs; the saved books 3 (in range for the node): the runtime's word."""
    tree = FakeCgroups(tmp_path / "cgroup")
    pod = make_pod(NAMING, "1111-aaaa")
    pod.linux.pod_resources.cpu.quota.value = 2 * PERIOD
    pod.linux.pod_resources.cpu.period.value = PERIOD
    tree.add_pod(pod, 4 * PERIOD)  # its own 2 CPUs and the 2 shared ones of the container below
    saved = Books(
        {
            "1111-aaaa": PodRecord(
                cgroup_parent=pod.linux.cgroup_parent,
                baseline=3 * PERIOD,
                period=PERIOD,
                baseline_source="pod-resources",
            )
        }
    )
    StateStore(tmp_path / "state").save(saved)
    plugin, key = make_plugin(tmp_path / "state", tree.layout)
    container = make_container(
        NAMING,
        pod,
        "c1",
        "fwd",
        cpus="0-3",
        quota=4 * PERIOD,
        env=("OPENSHIFT_SHARED_CPUS=0-1",),
        annotations=marker(key, "shared-cpus-0"),
        state=api.CONTAINER_RUNNING,
    )
    with structlog.testing.capture_logs() as logs:
        await plugin.synchronize([pod], [container])
    record = plugin.books.pods["1111-aaaa"]
    assert (record.baseline, record.baseline_source) == (2 * PERIOD, "pod-resources")
    assert tree.pod_quota(pod) == 4 * PERIOD, "not 5 CPUs: the saved 3 plus the 2 shared ones"
    [warning] = [e for e in logs if e["event"] == SET_ASIDE]
    assert warning["value"] == str(3 * PERIOD)
    assert warning["allowed"] == f"1000 to {2 * PERIOD} us (the pod's limit from the runtime)"
    assert warning["pod"] == "app"


# -- through the daemon --------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("where", "baseline"),
    [("database", 2**62), ("database", 6_400_000), ("old-files", 10**30)],
)
async def test_the_daemon_writes_the_sane_quota_despite_a_hostile_baseline(where: str, baseline: int) -> None:
    with short_directory("sv-") as root:
        async with daemon_node(root) as node:
            # A shared container raises its 2-CPU pod to 4 CPUs; the daemon saves its books and stops.
            pod = node.pod("1111-aaaa", "fwd")
            result = await node.create(pod, "c1", "fwd", annotations=marker(node.key, "shared-cpus-0"))
            assert is_shared(result)
            node.tree.run_container(result.container)
            await node.sim.start_container("c1")
            assert node.tree.pod_text(pod) == f"{4 * PERIOD}\n"
            assert await node.daemon.stop() == 0
            await _until(lambda: not node.sim.plugins)

            # The attack: the pod's own quota in the state dir replaced.
            state = node.state_dir / STATE_FILE_NAME
            if where == "database":
                with contextlib.closing(sqlite3.connect(state)) as db, db:
                    db.execute("UPDATE pods SET baseline = ? WHERE key = '1111-aaaa'", (baseline,))
            else:  # the old files of 0.2.0, met at an upgrade: moved into a new database
                record = StateStore(node.state_dir).load().pods["1111-aaaa"]
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{state}{suffix}").unlink(missing_ok=True)  # noqa: ASYNC240
                raw = {"cgroup_parent": record.cgroup_parent, "baseline": baseline, "period": PERIOD}
                snapshot = {"version": 1, "pods": {"1111-aaaa": {**raw, "containers": {}}}}
                (node.state_dir / LEGACY_FILE_NAME).write_text(json.dumps(snapshot))

            # The daemon started again: Synchronize brings the pod to its target, the sane one.
            config = root / "config.toml"
            proc = await start_daemon("run", "--config", str(config), "--socket", str(root / "nri.sock"))
            node.daemon = Daemon(proc, GUARD)
            await node.sim.wait_for_plugins(1, GUARD)
            line = await node.daemon.wait_log(SET_ASIDE)
            assert '"level": "warning"' in line
            assert '"pod_key": "1111-aaaa"' in line
            assert f'"value": "{baseline}"' in line
            assert "us (the kernel's range)" in line or "4 online CPUs x the period of 100000 us" in line
            assert node.tree.pod_text(pod) == f"{4 * PERIOD}\n"
            # The daemon serves the next pod, and its books hold the rebuilt baseline.
            other = node.pod("2222-bbbb", "other")
            assert is_shared(
                await node.create(other, "c2", "fwd", annotations=marker(node.key, "shared-cpus-1"))
            )
            assert node.tree.pod_text(pod) == f"{4 * PERIOD}\n"
        books = saved_books(root / "state")
        assert (books.pods["1111-aaaa"].baseline, books.pods["1111-aaaa"].baseline_source) == (
            2 * PERIOD,
            "rebuilt",
        )


async def _until(condition: Callable[[], bool]) -> None:
    """Wait (bounded by GUARD) until `condition()` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + GUARD
    while not condition():
        assert loop.time() < deadline, "condition not reached within the guard"
        await asyncio.sleep(0.01)
