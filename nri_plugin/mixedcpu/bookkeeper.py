"""When the books are written: the plugin's current `Books` and their writing to a `StateStore`.

The files and their format are `nri_plugin.mixedcpu.store`'s. The `Bookkeeper` decides when they
are written: at once (before the reply that depends on it) when something Synchronize cannot
rebuild changed, a pod's baseline or a device binding; else within `FLUSH_DELAY`, so that a burst of
slot changes costs one write. `Books` notes which pods and devices each event wrote
(`Books.take_changes`): no write looks at the pods that did not change. An event costs one append
to the journal of what it changed; once the journal holds twice the snapshot (`COMPACT_MIN_BYTES`
at least), a new snapshot is written by a worker thread, off the event loop (a compaction: the
journal is rotated first, the snapshot names the new one, then the journals before it go).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Final

import structlog

from nri_plugin.common.clock import LOOP_CLOCK, Clock, Timer
from nri_plugin.mixedcpu.books import Books, Containers, PodRecord, Slot, Spent
from nri_plugin.mixedcpu.logfields import LOGGER_NAME
from nri_plugin.mixedcpu.store import Loaded, StateStore, changes_line, header_line, same_header

__all__ = ["COMPACT_MIN_BYTES", "FLUSH_DELAY", "Bookkeeper"]

# A failed save is about the plugin's work: logged with the rest of it.
plugin_log = structlog.get_logger(LOGGER_NAME)

# Changes to the books that Synchronize can rebuild (which container holds a slot) are written to the
# state file this long after they happen; a new or dropped pod baseline is written at once.
FLUSH_DELAY = 1.0
# The journal is compacted into a new snapshot once it holds this much, and twice the snapshot.
COMPACT_MIN_BYTES: Final = 16 * 1024
_COMPACT_RATIO: Final = 2
# After a compaction failed (a full disk), none is tried again for this long.
_COMPACT_COOLDOWN: Final = 10.0


class Bookkeeper:
    """The plugin's current books and their writing to `store` (see the module docstring).

    ``books`` may be replaced as a whole (Synchronize does). Timers run on `clock`; without a running
    loop to run them (a script, a plain test), what would wait is written at once. Given `books`
    (rather than loading them) were never written: the first write is a snapshot.
    """

    def __init__(self, store: StateStore, books: Books | None = None, *, clock: Clock = LOOP_CLOCK) -> None:
        self.store = store
        loaded = store.load_state() if books is None else Loaded(books)
        self._books = loaded.books
        self._books.take_changes()
        self._clock = clock
        # The journal appends go to (None: the next write must be a snapshot), the bytes it and its
        # predecessors hold since the snapshot, the snapshot's size.
        self._journal = loaded.journal
        self._journal_bytes = loaded.journal_bytes
        self._snapshot_bytes = loaded.snapshot_bytes
        self._unsaved = books is not None  # books never written at all
        # Changed since the last write: pod key (device id) -> what the files hold for it.
        self._pods: dict[str, PodRecord | None] = {}
        self._devices: dict[str, Slot | None] = {}
        self._spent: dict[str, Spent | None] = {}
        self._flush_timer: Timer | None = None
        self._compaction: Future[int] | None = None
        self._compacted_bytes = 0  # of the journal, by the compaction under way
        self._compact_not_before = 0.0
        self._compact_timer: Timer | None = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def books(self) -> Books:
        return self._books

    @books.setter
    def books(self, books: Books) -> None:
        """Replace the books as a whole: every pod and device that differs is written as changed."""
        old = self._books
        self._absorb()
        books.take_changes()
        for key in old.pods.keys() | books.pods.keys():
            if books.pods.get(key) is not old.pods.get(key):
                self._pods.setdefault(key, old.pods.get(key))
        for device in old.devices.keys() | books.devices.keys():
            if books.devices.get(device) != old.devices.get(device):
                self._devices.setdefault(device, old.devices.get(device))
        for device in old.spent.keys() | books.spent.keys():
            if books.spent.get(device) != old.spent.get(device):
                self._spent.setdefault(device, old.spent.get(device))
        self._books = books
        if self._journal is None:
            self._unsaved = True  # Synchronize: start the journal now, not at the first creation

    @property
    def flush_pending(self) -> bool:
        """True while a change waits for the deferred write."""
        return self._flush_timer is not None

    def commit(self, *, establish: bool = True) -> None:
        """Persist the changes: at once when what Synchronize cannot rebuild changed (raises OSError),
        else within `FLUSH_DELAY`. `establish` False: when that would take a whole snapshot (no journal
        yet), leave it to the next commit (a creation writes its books ahead of the pod cgroup only
        when that costs one append)."""
        if not establish and self._journal is None:
            return
        self._absorb()
        if self._pods or self._devices or self._spent or self._unsaved:
            if self._unrebuildable_changed() or (self._unsaved and self._journal is None and self._pods):
                self._write()
            elif (self._pods or self._devices or self._spent or self._unsaved) and self._flush_timer is None:
                self._defer()
        self._maybe_compact()

    def commit_ahead(self) -> None:
        """A creation's books journaled before its pod cgroup is raised: `commit` with `establish`
        False. What it leaves (no journal yet: the next write is a snapshot) is `waiting`."""
        self.commit(establish=False)

    @property
    def waiting(self) -> bool:
        """Whether the books hold changes a `commit` would write or schedule (without any, it only
        looks at the compaction: a creation's commit after a commit ahead that wrote its books
        can be left out)."""
        return bool(self._books.changed or self._pods or self._devices or self._spent or self._unsaved)

    def _defer(self) -> None:
        try:
            self._flush_timer = self._clock.call_later(FLUSH_DELAY, self._deferred_flush)
        except RuntimeError:  # no running loop: nothing would ever fire the timer
            self._write()

    def flush(self, *, force: bool = False) -> None:
        """Write the books now as one snapshot if anything is waiting or journaled (or `force`), after
        any compaction under way. Raises OSError."""
        self._absorb()
        self._cancel_timer()
        self._finish_compaction(wait=True)
        if (
            force
            or self._pods
            or self._devices
            or self._spent
            or self._unsaved
            or self._journal_bytes
            or self._journal is None
        ):
            self._compact_now()

    def write_ahead(self, key: str, record: PodRecord, *, establish: bool = True) -> None:
        """Journal a pod's own quota (its record bar the slots) now, before its pod cgroup is raised:
        a process killed right after that write must not take the raised quota for the pod's own at
        its next start. `record` may be in other books than these (Synchronize builds the books that
        replace them). Without a journal yet, a snapshot starts one, or with `establish` False nothing
        is written (the write after the raise will be a snapshot). Raises OSError."""
        if self._journal is None:
            if not establish:
                return
            self._compact_now()
        self._absorb()
        on_disk = self._pods[key] if key in self._pods else self._books.pods.get(key)
        if on_disk is None or not same_header(on_disk, record):
            self._append(header_line(key, record))
        # What the files replay to once this is appended: its header, the slots they held.
        self._pods[key] = record.with_slots(on_disk.containers if on_disk is not None else Containers())

    def save_quietly(self, *, force: bool = False) -> None:
        """`commit` (or `flush` when `force`), logging a failure instead of raising it: for changes
        that are already made and that the next save or Synchronize will carry."""
        try:
            if force:
                self.flush(force=True)
            else:
                self.commit()
        except OSError as exc:
            plugin_log.error("cannot save the plugin's state", path=self.store.path, error=str(exc))

    # -- steps ---------------------------------------------------------------------------------------

    def _absorb(self) -> None:
        """Take the books' changes; for a key already waiting, the files still hold the older value."""
        spent = self._books.take_spent_changes()
        for device, spent_before in spent.items():
            self._spent.setdefault(device, spent_before)
        pods, devices = self._books.take_changes()
        if not self._pods:
            self._pods = pods  # (the books start new ones: these are ours)
        else:
            for key, old in pods.items():
                self._pods.setdefault(key, old)
        if not self._devices:
            self._devices = devices
        else:
            for device, slot in devices.items():
                self._devices.setdefault(device, slot)

    def _unrebuildable_changed(self) -> bool:
        """Whether a waiting change is one Synchronize cannot rebuild: a pod's baseline (or the pod
        itself), a device binding, an allocation presented."""
        pods = self._books.pods
        for key, old in self._pods.items():
            new = pods.get(key)
            if new is not old and (old is None or new is None or not same_header(old, new)):
                return True
        if self._spent:
            spent = self._books.spent
            if any(spent.get(device) != old for device, old in self._spent.items()):
                return True
        if self._devices:
            devices = self._books.devices
            return any(devices.get(device) != slot for device, slot in self._devices.items())
        return False

    def _write(self) -> None:
        """Append what waits to the journal, or write a snapshot when the journal cannot take it."""
        if self._flush_timer is not None:
            self._cancel_timer()
        if self._journal is None:
            self._compact_now()
            return
        data = changes_line(self._books, self._pods, self._devices, self._spent)
        if data:
            self._append(data)
        self._pods.clear()
        self._devices.clear()
        self._spent.clear()

    def _append(self, data: bytes) -> None:
        assert self._journal is not None
        try:
            self.store.append(self._journal, data)
        except OSError:
            self._journal = None  # the file may end in part of a line: the next write is a snapshot
            raise
        self._journal_bytes += len(data)

    def _compact_now(self) -> None:
        """Write the whole books as a new snapshot, here and now, starting a new journal."""
        self._cancel_compaction_timer()
        self._finish_compaction(wait=True)
        first = max([self._journal or 0, *self.store.journal_numbers()]) + 1
        data = self.store.encode(self._books, b"\n", journal=first)
        self.store.write_snapshot(data, first)
        self.store.close_journal()
        self._journal, self._journal_bytes, self._snapshot_bytes = first, 0, len(data)
        self._pods.clear()
        self._devices.clear()
        self._spent.clear()
        self._unsaved = False

    def _maybe_compact(self) -> None:
        """Have a compaction started, right after the current event, once the journal holds enough
        to be worth it (without a running loop: now)."""
        if self._compaction is not None:
            self._finish_compaction(wait=False)
        if (
            self._compaction is not None
            or self._compact_timer is not None
            or self._journal is None
            or self._journal_bytes < max(COMPACT_MIN_BYTES, _COMPACT_RATIO * self._snapshot_bytes)
            or time.monotonic() < self._compact_not_before
        ):
            return
        try:
            self._compact_timer = self._clock.call_later(0.0, self._start_compaction)
        except RuntimeError:
            self._start_compaction()

    def _start_compaction(self) -> None:
        """Rotate the journal and hand the snapshot to the worker thread (see the module docstring)."""
        self._compact_timer = None
        if self._compaction is not None or self._journal is None:
            return
        try:
            self._write()  # what waits goes to the journal being closed: the snapshot may yet fail
        except OSError as exc:
            plugin_log.error("cannot save the plugin's state", path=self.store.path, error=str(exc))
            return
        assert self._journal is not None
        first = self._journal + 1
        data = self.store.encode(self._books, b"\n", journal=first)
        self.store.close_journal()
        self._journal, self._compacted_bytes = first, self._journal_bytes
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-compaction")
        self._compaction = self._executor.submit(self.store.write_snapshot, data, first)

    def _finish_compaction(self, *, wait: bool) -> None:
        """Take the outcome of the compaction under way, if it is done (or once it is, with `wait`)."""
        compaction = self._compaction
        if compaction is None or not (wait or compaction.done()):
            return
        self._compaction = None
        try:
            size = compaction.result()
        except OSError as exc:
            # The journals still follow the previous snapshot: nothing is lost, the next one retries.
            plugin_log.error("cannot compact the plugin's state", path=self.store.path, error=str(exc))
            self._compact_not_before = time.monotonic() + _COMPACT_COOLDOWN
            return
        self._snapshot_bytes = size
        self._journal_bytes -= self._compacted_bytes

    def _cancel_timer(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None

    def _cancel_compaction_timer(self) -> None:
        if self._compact_timer is not None:
            self._compact_timer.cancel()
            self._compact_timer = None

    def _deferred_flush(self) -> None:
        self._flush_timer = None
        try:
            self._write()
            self._maybe_compact()
        except OSError as exc:
            plugin_log.error("cannot save the plugin's state", path=self.store.path, error=str(exc))
