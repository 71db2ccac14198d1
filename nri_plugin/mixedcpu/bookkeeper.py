"""The plugin's current `Books` and their writing to a `StateStore`: one transaction per event.

`Books` notes which pods and devices each event wrote (`Books.take_changes`); `Bookkeeper.commit`
writes those, and only those, to the database in one transaction, before the reply that depends on
it. What the database holds for each key still to be written is kept here (`_pods`, `_devices`,
`_spent`), so that a transaction that fails (a full disk: the store raises OSError and SQLite
rolls it back) leaves them waiting, and the next commit writes them with its own. A pod's own
quota is written ahead of the cgroup write that raises it (`write_ahead`): killed in between, the
next start still knows it.

The healer's CRI-O creations in progress (`books.Watch`) are written with the books: `watch_source`
(settable) gives them as they are now, and each commit writes those that differ from what the
database holds, in the same transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import structlog

from nri_plugin.mixedcpu.books import Books, Containers, PodRecord, Slot, Spent, Watch
from nri_plugin.mixedcpu.logfields import LOGGER_NAME
from nri_plugin.mixedcpu.store import StateStore

__all__ = ["Bookkeeper"]

# A failed save is about the plugin's work: logged with the rest of it.
plugin_log = structlog.get_logger(LOGGER_NAME)


class Bookkeeper:
    """The plugin's current books and their writing to `store` (see the module docstring).

    ``books`` may be replaced as a whole (Synchronize does). Given `books` (rather than loading
    them) replace what the database holds at the first commit.
    """

    def __init__(self, store: StateStore, books: Books | None = None) -> None:
        self.store = store
        self._books = store.load() if books is None else books
        self._books.take_spent_changes()
        self._books.take_changes()
        self._whole = books is not None  # the database holds other books: the first commit replaces them
        # Changed since the last commit: pod key (device id) -> what the database holds for it.
        self._pods: dict[str, PodRecord | None] = {}
        self._devices: dict[str, Slot | None] = {}
        self._spent: dict[str, Spent | None] = {}
        # The watches the database holds (loaded: the healer takes them up), and where they come from.
        self.watches: dict[Slot, Watch] = dict(store.watches) if books is None else {}
        self.watch_source: Callable[[], Mapping[Slot, Watch]] | None = None

    @property
    def books(self) -> Books:
        return self._books

    @books.setter
    def books(self, books: Books) -> None:
        """Replace the books as a whole: every pod and device that differs is written as changed."""
        old = self._books
        self._absorb()
        books.take_spent_changes()
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

    def commit(self) -> None:
        """Write what changed since the last commit, in one transaction. Raises OSError (the
        changes then wait for the next commit)."""
        self._absorb()
        now = self.watches if self.watch_source is None else self.watch_source()
        watches: dict[Slot, Watch | None] = {
            slot: w for slot, w in now.items() if self.watches.get(slot) != w
        }
        watches.update((slot, None) for slot in self.watches.keys() - now.keys())
        if self._whole:
            self.store.save(self._books, watches)
            self._whole = False
        elif self._pods or self._devices or self._spent or watches:
            self.store.write(self._books, self._pods, self._devices, self._spent, watches)
        self.watches = dict(now)
        self._pods.clear()
        self._devices.clear()
        self._spent.clear()

    def write_ahead(self, key: str, record: PodRecord) -> None:
        """Write a pod's own quota (its record bar the slots) now, before its pod cgroup is raised: a
        process killed right after that write must not take the raised quota for the pod's own at
        its next start. `record` may be in other books than these (Synchronize builds the books that
        replace them). Raises OSError."""
        if self._whole:
            self.commit()
        self._absorb()
        in_db = self._pods[key] if key in self._pods else self._books.pods.get(key)
        self.store.write_pod(key, record)
        # What the database holds once this is written: its header, the slots it held.
        self._pods[key] = record.with_slots(in_db.containers if in_db is not None else Containers())

    def save_quietly(self) -> None:
        """`commit`, logging a failure instead of raising it: for changes that are already made and
        that the next commit or Synchronize will carry."""
        try:
            self.commit()
        except OSError as exc:
            plugin_log.error("cannot save the plugin's state", path=self.store.path, error=str(exc))

    def flush(self) -> None:
        """`commit`, then the WAL folded into the database (at shutdown). Raises OSError."""
        self.commit()
        self.store.checkpoint()

    def _absorb(self) -> None:
        """Take the books' changes; for a key already waiting, the database still holds the older
        value."""
        for device, spent in self._books.take_spent_changes().items():
            self._spent.setdefault(device, spent)
        pods, devices = self._books.take_changes()
        for key, old in pods.items():
            self._pods.setdefault(key, old)
        for device, slot in devices.items():
            self._devices.setdefault(device, slot)
