"""The books on disk: an SQLite database, ``<state_dir>/books.sqlite`` (the standard library's
`sqlite3`), one row per record, one transaction per event.

The tables (schema version `SCHEMA_VERSION`, kept in ``PRAGMA user_version`` and checked at open):

* ``pods(key, cgroup_parent, baseline, period, baseline_source)``: each pod's own record;
* ``slots(pod, name, id, shared_cpus, exclusive, device)``: the live shared container holding each
  slot of a pod (`nri_plugin.mixedcpu.books`);
* ``bindings(device, pod, name)``: which slot each device id is bound to;
* ``spent(device, allocation, pod, name)``: the newest allocation of each device id presented;
* ``watches(pod, name, container_id, cgroups_path, due)``: the CRI-O creations in progress
  (`nri_plugin.mixedcpu.heal`), so that a daemon restarted during a slow ``runc create`` still knows
  it (`books.Watch`).

**What must survive** is a kill of the process at any instant, not a power loss: after a reboot the
pod cgroups are made afresh by kubelet and the books are rebuilt from the runtime, so nothing on disk
is needed then. The database runs in WAL mode with ``synchronous=OFF``: a COMMIT appends the
transaction's pages to the ``-wal`` file with write(2) and returns, no fsync; the kernel holds those
pages whatever becomes of the process, so a kill -9 right after the COMMIT loses nothing, and one
before it loses the transaction whole (SQLite ignores a WAL frame not followed by its commit
record). ``FULL`` would add an fsync to every event, ``NORMAL`` one to every checkpoint, for a power
loss we do not need to survive: the reboot after it clears the node's cgroups, a database it damaged
fails the check at open and is set aside (below), and one it left stale (valid pages of an older
state) holds slots of containers gone, which Synchronize drops, and pods' own quotas, which it checks
against the runtime's limits as it checks any saved quota.

**One connection, locked** (``locking_mode=EXCLUSIVE``, set before the WAL is first used): the
process holds the database's lock from its open to its close, so a transaction takes no ``fcntl``
lock and SQLite keeps the WAL's index in the process's memory instead of a shared ``-shm`` file.
No other process can read the database while the daemon runs (one that tries is told it is in use,
and nothing is set aside): what the books hold is the daemon's to show (its status socket), and the
file is read when it is stopped.

**Checkpoints** (the WAL copied back into the database) are kept off the reply: SQLite's own, run
inside the COMMIT that takes the WAL past 1,000 pages, took milliseconds of a creation's reply once
in 250 creations (``docs/performance.md``). They are turned off (``wal_autocheckpoint = 0``); once
`CHECKPOINT_EVERY` transactions have been written, `checkpoint_if_due` (called right after a reply
is written: `nri_plugin.nri.stub.AfterReply`) runs a ``PASSIVE`` checkpoint on the same connection,
which copies the whole WAL (no other connection holds it back), and the next transaction rewinds
the WAL. Transactions that no reply follows (the reconciler's) checkpoint in place once
`CHECKPOINT_LIMIT` have gone by without one. `checkpoint` folds the WAL in at shutdown.

**Hostile files.** The state dir is the plugin's, but whoever can write it can put anything there. A
database path (or its ``-wal``, ``-shm``) that is a symbolic link, a FIFO, a device or a directory,
or a file that cannot be opened or read, is not a database, fails ``PRAGMA quick_check``, holds
another schema or a row of the wrong type, is *set aside*: renamed to
``books.sqlite.refused-<time>`` (with its ``-wal`` and ``-shm``) for a person to look at, with one
warning, and the plugin starts from empty books that Synchronize rebuilds. It never hangs the start
and never leaves a daemon that is ready but cannot save. Only when it cannot even be set aside does
the load raise `StateFileError` (the daemon then exits 2 with one line). Every number loaded is
checked against the kernel's ranges and the node's online CPUs (`nri_plugin.mixedcpu.bounds`): a pod
out of range is set aside (a warning naming the pod, the value and the range) and its rows deleted;
Synchronize rebuilds it.

**Migration.** The books of 0.1.0 and 0.2.0 (``pod-quotas.json`` and its journals,
`nri_plugin.mixedcpu.legacy`) found at open are the books: written into the database in one
transaction (replacing what it holds), then the old files are deleted, so that they are read once.
Killed in between, the next start finds them again and does the same.

When the books are written is `nri_plugin.mixedcpu.bookkeeper.Bookkeeper`'s business; this module is
the tables and the file.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Final

import structlog

from nri_plugin.mixedcpu.books import Books, ContainerRecord, Containers, PodRecord, Slot, Spent, Watch
from nri_plugin.mixedcpu.bounds import set_aside_out_of_range
from nri_plugin.mixedcpu.legacy import (
    LegacyRefused,
    checked_spent,
    checked_text,
    container_record,
    legacy_paths,
    pod_record,
    read_legacy,
)

__all__ = [
    "CHECKPOINT_EVERY",
    "CHECKPOINT_LIMIT",
    "SCHEMA_VERSION",
    "STATE_FILE_NAME",
    "StateFileError",
    "StateStore",
    "StateWriteError",
    "read_only",
]

log = structlog.get_logger("nri_plugin.mixedcpu.store")

STATE_FILE_NAME: Final = "books.sqlite"
SCHEMA_VERSION: Final = 1
# Transactions between two checkpoints after a reply: a creation writes 2 to 5 pages, so the WAL
# stays under SQLite's own threshold of 1,000.
CHECKPOINT_EVERY: Final = 200
# Transactions after which one is checkpointed in place, no reply having come to do it.
CHECKPOINT_LIMIT: Final = 2 * CHECKPOINT_EVERY

_SCHEMA: Final = (
    "CREATE TABLE pods (key TEXT PRIMARY KEY, cgroup_parent TEXT NOT NULL, baseline INTEGER,"
    " period INTEGER NOT NULL, baseline_source TEXT NOT NULL) WITHOUT ROWID",
    "CREATE TABLE slots (pod TEXT NOT NULL, name TEXT NOT NULL, id TEXT NOT NULL,"
    " shared_cpus INTEGER NOT NULL, exclusive TEXT NOT NULL, device TEXT, PRIMARY KEY (pod, name))"
    " WITHOUT ROWID",
    "CREATE TABLE bindings (device TEXT PRIMARY KEY, pod TEXT NOT NULL, name TEXT NOT NULL) WITHOUT ROWID",
    "CREATE TABLE spent (device TEXT PRIMARY KEY, allocation INTEGER NOT NULL, pod TEXT NOT NULL,"
    " name TEXT NOT NULL) WITHOUT ROWID",
    "CREATE TABLE watches (pod TEXT NOT NULL, name TEXT NOT NULL, container_id TEXT NOT NULL,"
    " cgroups_path TEXT NOT NULL, due REAL NOT NULL, PRIMARY KEY (pod, name)) WITHOUT ROWID",
    f"PRAGMA user_version = {SCHEMA_VERSION}",
)
_PUT_POD: Final = "INSERT OR REPLACE INTO pods VALUES (?, ?, ?, ?, ?)"
_PUT_SLOT: Final = "INSERT OR REPLACE INTO slots VALUES (?, ?, ?, ?, ?, ?)"
_PUT_BINDING: Final = "INSERT OR REPLACE INTO bindings VALUES (?, ?, ?)"
_PUT_SPENT: Final = "INSERT OR REPLACE INTO spent VALUES (?, ?, ?, ?)"
_PUT_WATCH: Final = "INSERT OR REPLACE INTO watches VALUES (?, ?, ?, ?, ?)"
_NO_SLOTS: Final = Containers()


class StateFileError(OSError):
    """The database is unusable and cannot be set aside either; the message says what to do."""


class StateWriteError(OSError):
    """A transaction failed (a full disk, an I/O error): nothing of it was written."""


class _InUse(Exception):
    """Another process holds the database (a daemon running on the same state dir)."""


class _Unusable(Exception):
    """The database is not one we could have written (the reason, for the log line)."""


def _header(pod: PodRecord) -> tuple[str, int | None, int, str]:
    """What a pod's row holds: what Synchronize cannot rebuild."""
    return pod.cgroup_parent, pod.baseline, pod.period, pod.baseline_source


class StateStore:
    """`Books` in ``<directory>/books.sqlite`` (see the module docstring). One connection, opened at
    the first `load` (or write), used by the thread that changes the books. `online`: the number of
    online CPUs the loaded records' numbers are checked against (None: the kernel's ranges only)."""

    def __init__(
        self, directory: str | os.PathLike[str], *, name: str = STATE_FILE_NAME, online: int | None = None
    ) -> None:
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, name)
        self.online = online
        self.watches: dict[Slot, Watch] = {}  # what the last `load` found
        self._db: sqlite3.Connection | None = None
        self._since_checkpoint = 0

    # -- opening -----------------------------------------------------------------------------------------

    def load(self) -> Books:
        """The saved books (the old files migrated first); empty books and one warning for a database
        set aside. Raises `StateFileError` only when such a database cannot be set aside."""
        db = self._connection()
        try:
            books = _read(db)
            self.watches = _read_watches(db)
        except (sqlite3.Error, ValueError) as exc:
            self._set_aside(f"unreadable ({exc})")
            return Books()
        dropped = set_aside_out_of_range(books, self.online, self.path)
        if dropped:
            self._transaction(lambda db: _delete_pods(db, dropped))
        books.take_changes()
        return books

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            try:
                self._db = self._open()
            except _InUse:
                raise StateFileError(
                    f"{self.path} is in use by another process (a daemon running on this state dir); "
                    "stop it first"
                ) from None
            except (_Unusable, sqlite3.Error, OSError) as exc:
                self._set_aside(str(exc) if isinstance(exc, _Unusable) else f"cannot be opened ({exc})")
                try:
                    self._db = self._open()
                except (_Unusable, sqlite3.Error, OSError) as again:
                    raise StateFileError(
                        f"{self.path}: cannot be opened ({again}); check the state dir"
                    ) from None
            weakref.finalize(self, self._db.close)  # a store dropped unclosed (tests) closes it
            self._migrate()
        return self._db

    def _open(self) -> sqlite3.Connection:
        """The database, opened and checked (created with its schema when there is none)."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        for path in (self.path, f"{self.path}-wal", f"{self.path}-shm"):
            _refuse_unless_regular(path)
        try:  # made here, so that its mode is ours (and its -wal's)
            os.close(
                os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            )
        except FileExistsError:
            pass
        else:  # a -wal left by a database deleted by hand belongs to no database now
            for stale in (f"{self.path}-wal", f"{self.path}-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stale)
        db = sqlite3.connect(self.path, isolation_level=None, timeout=0)
        try:
            _lock(db)
            with contextlib.suppress(FileNotFoundError):  # (the index of an older version's WAL)
                os.unlink(f"{self.path}-shm")
            db.execute("PRAGMA synchronous = OFF")
            db.execute("PRAGMA wal_autocheckpoint = 0")
            if db.execute("PRAGMA quick_check").fetchall() != [("ok",)]:
                raise _Unusable("damaged (PRAGMA quick_check)")
            [(version,)] = db.execute("PRAGMA user_version").fetchall()
            if version == 0:
                if db.execute("SELECT count(*) FROM sqlite_master").fetchall() != [(0,)]:
                    raise _Unusable("a database of something else (schema version 0, with tables)")
                _in_transaction(db, lambda db: [db.execute(statement) for statement in _SCHEMA])
            elif version != SCHEMA_VERSION:
                raise _Unusable(f"of schema version {version}; this daemon reads {SCHEMA_VERSION}")
        except BaseException:
            db.close()
            raise
        return db

    def _migrate(self) -> None:
        """The old files, if any, into the database (one transaction), then deleted."""
        paths = legacy_paths(self.directory)
        if not paths:
            return
        try:
            books = read_legacy(self.directory)
        except LegacyRefused as exc:
            _rename_aside(exc.path, str(exc))
            books = Books()
        set_aside_out_of_range(books, self.online, paths[-1])  # (a number too large for SQLite too)
        self.save(books)
        for path in legacy_paths(self.directory):  # the journals first: the snapshot names them
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        log.info(
            "the books of the previous version moved into the database", path=self.path, pods=len(books.pods)
        )

    def _set_aside(self, reason: str) -> None:
        """Rename the unusable database (and its -wal, -shm) out of the way, for a person to look at."""
        self.close()
        aside = _rename_aside(self.path, reason)
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(OSError):
                os.rename(f"{self.path}{suffix}", f"{aside}{suffix}")

    def close(self) -> None:
        """Close the connection, releasing the database (the next use opens it again)."""
        if self._db is not None:
            self._db.close()
            self._db = None

    # -- writing -----------------------------------------------------------------------------------------

    def _transaction(self, work: Callable[[sqlite3.Connection], object]) -> None:
        try:
            _in_transaction(self._connection(), work)
        except (sqlite3.Error, OverflowError) as exc:  # (OverflowError: an integer of more than 64 bits)
            raise StateWriteError(f"{self.path}: {exc}") from None
        self._since_checkpoint += 1
        if self._since_checkpoint >= CHECKPOINT_LIMIT:
            self.checkpoint_if_due()

    def checkpoint_if_due(self) -> None:
        """A PASSIVE checkpoint once `CHECKPOINT_EVERY` transactions have been written since the
        last (see the module docstring). A failure is logged: the WAL then waits for the next."""
        if self._since_checkpoint < CHECKPOINT_EVERY or self._db is None:
            return
        self._since_checkpoint = 0
        try:
            self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()  # (all: no statement left open)
        except sqlite3.Error as exc:
            log.warning("cannot checkpoint the books' database", path=self.path, error=str(exc))

    def save(self, books: Books, watches: Mapping[Slot, Watch | None] | None = None) -> None:
        """Replace the whole books and watches (one transaction): `watches` as in `write`, the
        others deleted. Raises `StateWriteError`."""

        def replace_all(db: sqlite3.Connection) -> None:
            for table in ("pods", "slots", "bindings", "spent", "watches"):
                db.execute(f"DELETE FROM {table}")  # (the names above)
            _put_pods(db, books, {key: None for key in books.pods})
            db.executemany(_PUT_BINDING, [(device, *slot) for device, slot in books.devices.items()])
            db.executemany(_PUT_SPENT, [(device, *spent) for device, spent in books.spent.items()])
            _put_watches(db, watches or {})

        self._transaction(replace_all)

    def write(
        self,
        books: Books,
        pods: Mapping[str, PodRecord | None],
        devices: Mapping[str, Slot | None],
        spent: Mapping[str, Spent | None],
        watches: Mapping[Slot, Watch | None] | None = None,
    ) -> None:
        """One transaction turning what the database holds (`pods`, `devices`, `spent`: each key
        changed, with its value in the database; None: absent) into `books`, and the `watches`
        given (None: deleted) written. Raises `StateWriteError` (then nothing of it is written)."""

        def changes(db: sqlite3.Connection) -> None:
            _put_pods(db, books, pods)
            _put_watches(db, watches or {})
            for device, old in devices.items():
                slot = books.devices.get(device)
                if slot is None:
                    db.execute("DELETE FROM bindings WHERE device = ?", (device,))
                elif slot != old:
                    db.execute(_PUT_BINDING, (device, *slot))
            for device, old_spent in spent.items():
                now = books.spent.get(device)
                if now is None:
                    db.execute("DELETE FROM spent WHERE device = ?", (device,))
                elif now != old_spent:
                    db.execute(_PUT_SPENT, (device, *now))

        self._transaction(changes)

    def write_pod(self, key: str, record: PodRecord) -> None:
        """Pod `key`'s own record (bar its slots) now, in a transaction of its own: written ahead of
        the cgroup write that raises the pod. Raises `StateWriteError`."""
        self._transaction(lambda db: db.execute(_PUT_POD, (key, *_header(record))))

    def checkpoint(self) -> None:
        """Copy the WAL back into the database and empty it (at shutdown). Raises
        `StateWriteError`."""
        self._since_checkpoint = 0
        if self._db is not None:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            except sqlite3.Error as exc:
                raise StateWriteError(f"{self.path}: {exc}") from None


def _lock(db: sqlite3.Connection) -> None:
    """The database locked for this connection alone, in WAL mode (`locking_mode` set before the
    WAL's first use: its index then lives in this process, no ``-shm``); `_InUse` when another
    process holds it."""
    db.execute("PRAGMA locking_mode = EXCLUSIVE")
    try:
        db.execute("PRAGMA journal_mode = WAL").fetchall()
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc):
            raise _InUse() from None
        raise


def _in_transaction(db: sqlite3.Connection, work: Callable[[sqlite3.Connection], object]) -> None:
    db.execute("BEGIN")
    try:
        work(db)
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
        raise


def _put_pods(db: sqlite3.Connection, books: Books, pods: Mapping[str, PodRecord | None]) -> None:
    """Write the rows of the pods named in `pods` (each with what the database holds of it)."""
    gone: list[str] = []
    for key, old in pods.items():
        new = books.pods.get(key)
        if new is None:
            if old is not None:
                gone.append(key)
            continue
        if old is None or _header(old) != _header(new):
            db.execute(_PUT_POD, (key, *_header(new)))
        if old is not None and new.containers is old.containers:
            continue
        freed, held = new.containers.changes_since(old.containers if old is not None else _NO_SLOTS)
        if freed:
            db.executemany("DELETE FROM slots WHERE pod = ? AND name = ?", [(key, name) for name in freed])
        db.executemany(
            _PUT_SLOT,
            [(key, name, r.id, r.shared_cpus, r.exclusive, r.device) for name, r in held],
        )
    if gone:
        _delete_pods(db, gone)


def read_only(path: str | os.PathLike[str]) -> tuple[Books, dict[Slot, Watch]]:
    """The books and watches the database at `path` holds, read as they are (no bounds checked,
    nothing set aside or written: for tests, and for a person looking). Raises `sqlite3.Error`,
    ValueError."""
    with contextlib.closing(sqlite3.connect(f"file:{os.fspath(path)}?mode=ro", uri=True)) as db:
        return _read(db), _read_watches(db)


def _put_watches(db: sqlite3.Connection, watches: Mapping[Slot, Watch | None]) -> None:
    for slot, watch in watches.items():
        if watch is None:
            db.execute("DELETE FROM watches WHERE pod = ? AND name = ?", slot)
        else:
            db.execute(_PUT_WATCH, (*slot, *watch))


def _read_watches(db: sqlite3.Connection) -> dict[Slot, Watch]:
    watches = {}
    for pod, name, container_id, path, due in db.execute("SELECT * FROM watches"):
        if isinstance(due, bool) or not isinstance(due, (int, float)):
            raise ValueError(f"a watch's due {due!r} is not a number")
        slot = Slot(checked_text(pod, "watch pod"), checked_text(name, "watch container"))
        watches[slot] = Watch(
            checked_text(container_id, "watch id"), checked_text(path, "watch path"), float(due)
        )
    return watches


def _delete_pods(db: sqlite3.Connection, keys: list[str]) -> None:
    db.executemany("DELETE FROM pods WHERE key = ?", [(key,) for key in keys])
    db.executemany("DELETE FROM slots WHERE pod = ?", [(key,) for key in keys])


def _read(db: sqlite3.Connection) -> Books:
    """The books the tables hold; ValueError for a row of the wrong type or a slot of no pod."""
    headers = {checked_text(key, "pod key"): row for key, *row in db.execute("SELECT * FROM pods")}
    slots: dict[str, dict[str, ContainerRecord]] = {key: {} for key in headers}
    for pod, name, *record in db.execute("SELECT * FROM slots"):
        if pod not in slots:
            raise ValueError(f"a slot of pod {pod!r}, which the books do not hold")
        slots[pod][checked_text(name, "container name")] = container_record(record)
    pods = {key: pod_record(row, Containers(slots[key])) for key, row in headers.items()}
    devices = {
        checked_text(device, "device id"): Slot(
            checked_text(pod, "device pod"), checked_text(name, "device container")
        )
        for device, pod, name in db.execute("SELECT * FROM bindings")
    }
    spent = {
        checked_text(device, "device id"): checked_spent(*row)
        for device, *row in db.execute("SELECT * FROM spent")
    }
    return Books(pods, devices, spent=spent)


def _refuse_unless_regular(path: str) -> None:
    """`_Unusable` when `path` exists and is not a regular file (not followed, if a link)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(mode):
        return
    kinds = ((stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"))
    kind = next((name for test, name in kinds if test(mode)), "device or socket")
    raise _Unusable(f"{os.path.basename(path)} is a {kind}, not a file the plugin writes")


def _rename_aside(path: str, reason: str) -> str:
    """Rename `path` to ``<path>.refused-<time>`` (one warning); the new name. Raises
    `StateFileError` when it cannot be renamed."""
    aside = f"{path}.refused-{time.strftime('%Y%m%dT%H%M%S')}"
    suffix = 0
    while os.path.lexists(aside if not suffix else f"{aside}.{suffix}"):
        suffix += 1
    aside = aside if not suffix else f"{aside}.{suffix}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return aside
    except OSError as exc:
        raise StateFileError(
            f"{path} is {reason}, and it cannot be set aside ({exc.strerror}); remove it, the "
            "plugin rebuilds its books at the next synchronization",
        ) from None
    log.warning(
        "state file refused and set aside; starting with empty books (pod quotas are rebuilt at the "
        "next synchronization)",
        path=path,
        reason=reason,
        moved_to=aside,
    )
    return aside
