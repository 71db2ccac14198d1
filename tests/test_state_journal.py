"""The state journal: an event writes what it changed (O(1), no fsync, no whole-file rewrite), a worker
thread compacts the journal into a new snapshot, and the files replay to the right books whatever
instant the process is killed at."""

from __future__ import annotations

import json
import os
import random
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st
from mixedcpu_support import PERIOD
from test_pod_quota_state import _mutate

from nri_plugin.common.clock import ManualClock
from nri_plugin.mixedcpu import bookkeeper
from nri_plugin.mixedcpu import store as state_file
from nri_plugin.mixedcpu.bookkeeper import COMPACT_MIN_BYTES, FLUSH_DELAY, Bookkeeper
from nri_plugin.mixedcpu.books import Books, ContainerRecord, PodRecord, Slot, Spent
from nri_plugin.mixedcpu.store import STATE_FILE_NAME, StateStore, apply_operation


def _pods(count: int) -> Books:
    books = Books(
        {
            f"pod-{i}": PodRecord(cgroup_parent=f"/kubepods/pod{i}", baseline=100_000, period=PERIOD)
            for i in range(count)
        }
    )
    for i in range(count):
        books.hold(Slot(f"pod-{i}", "app"), ContainerRecord(f"c-{i}", 2, "4-5", f"dev-{i}"))
    return books


def _new_pod(books: Books, i: int) -> None:
    """What CreateContainer does for the first shared container of a new pod."""
    books.pods[f"new-{i}"] = PodRecord(cgroup_parent=f"/kubepods/podnew{i}", baseline=300_000, period=PERIOD)
    books.hold(Slot(f"new-{i}", "app"), ContainerRecord(f"n-{i}" * 8, 2, "6-7", f"newdev-{i}"))


def _files(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def _keeper(directory: Path, books: Books | None = None) -> Bookkeeper:
    keeper = Bookkeeper(StateStore(directory, fsync=False), books)
    keeper.flush(force=True)  # the snapshot the journal follows
    return keeper


def test_a_new_pod_appends_a_few_lines_whatever_the_books_hold(tmp_path: Path) -> None:
    for count, directory in ((1, tmp_path / "small"), (1000, tmp_path / "large")):
        keeper = _keeper(directory, _pods(count))
        snapshot = (directory / STATE_FILE_NAME).stat()
        written = keeper.store.written
        _new_pod(keeper.books, 1)
        keeper.commit()  # a new baseline and a binding: written before the reply
        assert not keeper.flush_pending
        assert keeper.store.written - written < 300, count  # the new pod's lines, not the books
        again = (directory / STATE_FILE_NAME).stat()
        assert (again.st_ino, again.st_mtime_ns) == (snapshot.st_ino, snapshot.st_mtime_ns)
        assert StateStore(directory).load() == keeper.books


def test_a_commit_ahead_that_wrote_leaves_nothing_waiting_and_one_that_could_not_does(tmp_path: Path) -> None:
    """A creation's commit after the raise is needed only when its commit ahead left the books
    waiting: with a journal the new pod is written ahead (nothing waits); without one yet (a first
    start) nothing is written ahead and the commit after writes the snapshot."""
    keeper = _keeper(tmp_path / "journaled", _pods(2))
    assert not keeper.waiting
    _new_pod(keeper.books, 1)
    assert keeper.waiting
    keeper.commit_ahead()
    assert not keeper.waiting
    assert StateStore(tmp_path / "journaled").load() == keeper.books

    fresh = Bookkeeper(StateStore(tmp_path / "fresh", fsync=False), None)
    _new_pod(fresh.books, 1)
    fresh.commit_ahead()
    assert fresh.waiting
    assert not (tmp_path / "fresh" / STATE_FILE_NAME).exists()
    fresh.commit()
    assert not fresh.waiting
    assert StateStore(tmp_path / "fresh").load() == fresh.books


def test_the_journal_lines_are_the_change(tmp_path: Path) -> None:
    keeper = _keeper(tmp_path, _pods(3))
    _new_pod(keeper.books, 7)
    keeper.books.unbind_pod("pod-0")
    keeper.commit()
    [journal] = [name for name in _files(tmp_path) if name != STATE_FILE_NAME]
    lines = [json.loads(line) for line in (tmp_path / journal).read_text().splitlines()]
    assert lines == [
        [
            ["P", "new-7", "/kubepods/podnew7", 300_000, PERIOD, "first-seen"],
            ["C", "new-7", "app", "n-7" * 8, 2, "6-7", "newdev-7"],
            ["B", "newdev-7", "new-7", "app"],
            ["U", "dev-0"],
            ["A", "newdev-7", 0, "new-7", "app"],  # (dev-0's allocation stays spent: no line)
        ]
    ]
    loaded = StateStore(tmp_path).load()
    assert loaded.spent == keeper.books.spent
    assert loaded.spent["dev-0"] == Spent(0, "pod-0", "app")


def test_the_allocations_presented_are_journaled_and_survive_a_restart(tmp_path: Path) -> None:
    keeper = _keeper(tmp_path, _pods(2))
    keeper.books.hold(Slot("pod-1", "app"), ContainerRecord("c-1b", 2, "4-5", "dev-1"), allocation=41)
    keeper.books.unbind_pod("pod-1")
    keeper.commit()
    loaded = StateStore(tmp_path).load()
    assert "dev-1" not in loaded.devices
    assert loaded.spent["dev-1"] == Spent(41, "pod-1", "app")
    keeper.flush(force=True)  # the snapshot holds it too
    assert StateStore(tmp_path).load().spent["dev-1"] == Spent(41, "pod-1", "app")


def test_a_state_file_from_before_allocations_were_kept_reads_its_bindings_as_allocation_0(
    tmp_path: Path,
) -> None:
    keeper = _keeper(tmp_path, _pods(2))
    keeper.flush(force=True)
    path = tmp_path / STATE_FILE_NAME
    data = json.loads(path.read_text())
    del data["spent"]
    path.write_text(json.dumps(data))
    loaded = StateStore(tmp_path).load()
    assert loaded == keeper.books
    assert dict(loaded.spent) == {device: Spent(0, *slot) for device, slot in loaded.devices.items()}


@pytest.mark.asyncio
async def test_slot_changes_wait_and_go_to_the_journal(tmp_path: Path) -> None:
    clock = ManualClock()
    store = StateStore(tmp_path, fsync=False)
    store.save(_pods(2))
    keeper = Bookkeeper(store, clock=clock)
    keeper.flush(force=True)
    keeper.books.hold(Slot("pod-1", "app"), ContainerRecord("c-1b", 2, "4-5", "dev-1"))  # a restart
    keeper.commit()
    assert keeper.flush_pending
    assert StateStore(tmp_path).load().pods["pod-1"].containers["app"].id == "c-1"
    await clock.advance(FLUSH_DELAY)
    assert not keeper.flush_pending
    assert StateStore(tmp_path).load() == keeper.books
    assert len(_files(tmp_path)) == 2  # the snapshot and its journal


def test_the_journal_is_compacted_in_the_background(tmp_path: Path) -> None:
    keeper = _keeper(tmp_path)
    i = 0
    while keeper._compaction is None:  # each new pod's lines, until past COMPACT_MIN_BYTES
        _new_pod(keeper.books, i)
        keeper.commit()
        i += 1
    assert keeper.store.written > COMPACT_MIN_BYTES
    compaction = keeper._compaction
    _new_pod(keeper.books, i)  # while the worker writes the snapshot: to the next journal
    keeper.commit()
    compaction.result()
    keeper.commit()  # takes the compaction's outcome
    assert keeper._compaction is None
    assert len(_files(tmp_path)) == 2  # the new snapshot, and the journal after it
    assert StateStore(tmp_path).load() == keeper.books
    snapshot = json.loads((tmp_path / STATE_FILE_NAME).read_text())
    assert len(snapshot["pods"]) == i  # the last pod is in the journal only
    assert [snapshot["journal"]] == keeper.store.journal_numbers()


def test_killed_in_the_middle_of_a_compaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker dies (the process is killed) before the snapshot is renamed, then after the rename
    but before the old journal is deleted: both sets of files load as the books."""
    keeper = _keeper(tmp_path, _pods(5))
    _new_pod(keeper.books, 1)
    keeper.commit()
    store = keeper.store

    def killed(*_args: object, **_kwargs: object) -> None:
        raise OSError("killed")

    monkeypatch.setattr(state_file, "write_atomically", killed)
    monkeypatch.setattr(bookkeeper, "COMPACT_MIN_BYTES", 0)
    monkeypatch.setattr(bookkeeper, "_COMPACT_RATIO", 0)
    _new_pod(keeper.books, 2)
    keeper.commit()  # appends to journal n, starts a compaction to n + 1, which dies before renaming
    assert keeper._compaction is not None
    assert isinstance(keeper._compaction.exception(), OSError)
    _new_pod(keeper.books, 3)
    with structlog.testing.capture_logs() as logs:
        keeper.commit()  # journal n + 1; the failed compaction is logged
    assert [entry["event"] for entry in logs] == ["cannot compact the plugin's state"]
    assert len(store.journal_numbers()) == 2
    assert StateStore(tmp_path).load() == keeper.books  # old snapshot, journal n, journal n + 1
    monkeypatch.undo()
    # The snapshot is renamed, and the process dies before deleting journals n and n + 1.
    data = store.encode(keeper.books, b"\n", journal=store.journal_numbers()[-1] + 1)
    (tmp_path / STATE_FILE_NAME).write_bytes(data)
    assert StateStore(tmp_path).load() == keeper.books  # n and n + 1 are before the snapshot's: unread
    assert len(store.journal_numbers()) == 2


def test_a_journal_cut_short_ends_the_replay_and_the_next_write_is_a_snapshot(tmp_path: Path) -> None:
    keeper = _keeper(tmp_path, _pods(2))
    _new_pod(keeper.books, 1)
    keeper.commit()
    [number] = keeper.store.journal_numbers()
    journal = Path(keeper.store.journal_path(number))
    whole = keeper.books.copy()
    with journal.open("ab") as file:
        file.write(b'[["P","new-2","/kubepods/podnew2",30')  # a power loss in the middle of a line
    with structlog.testing.capture_logs() as logs:
        restarted = Bookkeeper(StateStore(tmp_path, fsync=False))
    assert [entry["event"] for entry in logs] == [
        "state journal cut short (a crash while appending): its last line is ignored"
    ]
    assert restarted.books == whole
    _new_pod(restarted.books, 3)
    restarted.commit()
    assert keeper.store.journal_numbers() == []  # a new snapshot, no journal yet
    assert StateStore(tmp_path).load() == restarted.books


def test_an_unreadable_line_loses_the_changes_from_there_on(tmp_path: Path) -> None:
    keeper = _keeper(tmp_path, _pods(2))
    before = keeper.books.copy()
    number = json.loads((tmp_path / STATE_FILE_NAME).read_text())["journal"]
    Path(keeper.store.journal_path(number)).write_bytes(b'[["Q","what"]]\n[["X","pod-0"]]\n')
    with structlog.testing.capture_logs() as logs:
        assert StateStore(tmp_path).load() == before
    assert logs[0]["event"].startswith("state journal line unreadable")
    assert logs[0]["line"] == 1


def test_without_the_snapshot_the_journals_are_ignored(tmp_path: Path) -> None:
    """The state file removed by hand is the state lost, journal included; a new chain starts above
    the old files' numbers, which go at the next snapshot."""
    keeper = _keeper(tmp_path, _pods(2))
    _new_pod(keeper.books, 1)
    keeper.commit()
    old = keeper.store.journal_numbers()
    (tmp_path / STATE_FILE_NAME).unlink()
    assert StateStore(tmp_path).load() == Books()
    restarted = Bookkeeper(StateStore(tmp_path, fsync=False))
    _new_pod(restarted.books, 2)
    restarted.commit()
    assert StateStore(tmp_path).load() == restarted.books
    assert json.loads((tmp_path / STATE_FILE_NAME).read_text())["journal"] > max(old)
    assert restarted.store.journal_numbers() == []


def test_a_snapshot_without_a_journal_reads_no_journal(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.save(_pods(1))
    Path(store.journal_path(1)).write_text('["X","pod-0"]\n')
    assert store.load() == _pods(1)


@pytest.mark.parametrize(
    "op",
    [
        "nope",
        [],
        ["P", "k"],
        ["P", "k", "/x", "lots", PERIOD, "first-seen"],
        ["C", "unknown-pod", "a", "id", 1, "", None],
        ["B", 7, "p", "n"],
        ["C", "pod-0", "a", "id", "1", "", None],
    ],
)
def test_a_bad_operation_is_refused(op: object) -> None:
    with pytest.raises(ValueError, match=r"journal operation|not an integer|not a string|do not hold"):
        apply_operation(_pods(1), op)


def test_a_failed_append_makes_the_next_write_a_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keeper = _keeper(tmp_path, _pods(1))
    real_write = os.write
    calls = 0

    def half_then_full(fd: int, data: bytes) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            real_write(fd, bytes(data)[:10])
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", half_then_full)
    _new_pod(keeper.books, 1)
    with pytest.raises(OSError, match="No space"):
        keeper.commit()
    monkeypatch.undo()
    keeper.commit()
    assert keeper.store.journal_numbers() == []  # a snapshot: the torn journal is gone
    assert StateStore(tmp_path).load() == keeper.books


# -- the books' indexes -----------------------------------------------------------------------------------


def _scan_holders(books: Books) -> dict[str, Slot]:
    holders = books.live_devices()
    holders.update(books.devices)
    return holders


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 150))
def test_indexes_agree_with_a_scan_of_the_books(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    books = Books()
    for step in range(steps):
        _mutate(books, rng, step)
        ids = {record.id for _, record in books.slots()} | {f"c{step}", "nope"}
        for container_id in ids:
            holding = [(slot, record) for slot, record in books.slots() if record.id == container_id]
            found = books.find(container_id)
            assert (found is None) == (not holding)
            assert found is None or found in holding
        assert books.shared_containers == sum(len(pod.containers) for pod in books.pods.values())
        assert books.bound_pods() == {slot.pod for slot in books.devices.values()}
        holders, scanned = books.device_holders(), _scan_holders(books)
        assert holders.keys() == scanned.keys()
        for device in [*scanned, "none"]:
            # Two live slots presenting one unbound device: only books edited by hand; either will do.
            presenting = {slot for slot, record in books.slots() if record.device == device}
            assert holders.get(device) == scanned.get(device) or (
                device not in books.devices and holders.get(device) in presenting
            )


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 80))
def test_killed_at_any_instant_the_files_replay_to_what_was_written(seed: int, steps: int) -> None:
    """Random changes, commits, deferred writes, flushes and compactions; at every step a process
    starting then would load books that differ from the plugin's only by what waits for the deferred
    write, which is never a baseline or a binding."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        keeper = Bookkeeper(StateStore(tmp, fsync=False), Books())
        for step in range(steps):
            _mutate(keeper.books, rng, step)
            action = rng.random()
            if action < 0.5:
                keeper.commit()  # no loop: written at once
            elif action < 0.6:
                keeper.flush(force=rng.random() < 0.5)
            elif action < 0.7:
                keeper.books = keeper.books.copy() if rng.random() < 0.5 else Books()
                keeper.commit()
            else:
                keeper._absorb()  # changed, not written yet
            if keeper._compaction is not None and rng.random() < 0.5:
                keeper._compaction.result()
            if action < 0.7:  # (devices: a snapshot also binds the live slots' devices)
                assert StateStore(tmp).load().pods == keeper.books.pods
        keeper.flush()
        assert StateStore(tmp).load().pods == keeper.books.pods
        assert [name for name in os.listdir(tmp) if name != STATE_FILE_NAME] == []


def test_equal_records_write_nothing(tmp_path: Path) -> None:
    keeper = _keeper(tmp_path, _pods(3))
    written = keeper.store.written
    keeper.books.pods["pod-1"] = replace(keeper.books.pods["pod-1"])  # a rolled-back creation
    keeper.books = keeper.books.copy()  # Synchronize rebuilding the same books
    keeper.commit()
    assert keeper.store.written == written
