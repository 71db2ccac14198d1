"""The books on disk: a snapshot, ``<state_dir>/pod-quotas.json``, and a
journal of the changes made since, ``pod-quotas.json.journal.<n>``.

Why a journal: the runtime waits for the plugin on the creation path of every container. Writing the
whole books at each new pod (and fsyncing them) costs what the node holds, not what changed: 2,000
creations into a filling node wrote 444 MiB and made the last creations three times slower than the
first. Now an event costs one append of what it changed (a line or two, no fsync), and the whole
books are written again only when the journal has grown past twice the snapshot, by a worker thread,
off the event loop. Both costs are O(1) per event (the compaction is amortized over the changes that
made the journal grow).

What must survive is a kill of the process at any instant, not a power loss: after a reboot the pod
cgroups are made afresh by kubelet, so nothing on disk is needed then. An append reaches the page
cache before the reply and survives the process; the snapshot is still written atomically and
fsynced (temporary file, fsync, rename), in the worker thread.

* `StateStore` reads and writes the files. A snapshot that is missing, corrupt or from another
  version loads as empty books, with a warning (and its journal is ignored): Synchronize rebuilds
  them. A journal line cut short or unreadable ends the replay there (a warning); the next write is
  then a new snapshot.
* Every number loaded (snapshot and journal) is checked against the kernel's ranges and the node's
  online CPUs (`nri_plugin.mixedcpu.bounds`): a pod's record out of range is set aside (a warning
  naming the pod, the value and the range), Synchronize rebuilds that pod from the runtime's view,
  and the next write is a new snapshot.
* The files are opened as the marker key is (`nri_plugin.deviceplugin.keyfile`): no symlink followed,
  never blocking (a FIFO), a regular file only, at most `MAX_STATE_SIZE` bytes read. A snapshot that is not
  (a link, a FIFO, a device, a directory, a file too large to be ours) is *set aside*: renamed to
  ``pod-quotas.json.refused-<time>`` for a person to look at, with a warning, and the plugin starts
  from empty books that Synchronize rebuilds, as for a corrupt file. It never hangs the start, never
  fills the memory, and never leaves a daemon that is ready but cannot save. Only when it cannot even
  be set aside does the load raise `StateFileError` (the daemon then exits 2 with one line).
When the files are written (at once, deferred, compacted in a worker thread) is the
`nri_plugin.mixedcpu.bookkeeper.Bookkeeper`'s business; this module is the format and the files.

The snapshot (version 1): ``{"devices": {id: {"pod", "container"}}, "journal": n, "pods": {key:
{"cgroup_parent", "baseline", "period", "baseline_source", "target", "containers": {name: {"id",
"shared_cpus", "contribution", "exclusive", "device"}}}}, "spent": {id: {"allocation", "pod",
"container"}}, "version": 1}``, compact, keys sorted.
``target`` and ``contribution`` are for people reading the file; they are recomputed at load. A file
from before the bindings were saved (no ``devices``) gets the bindings of its live slots; one from
before the allocations presented were saved (no ``spent``) gets its bindings' as allocation 0 (older
than any numbered marker: `nri_plugin.mixedcpu.books`). A snapshot with no ``journal``
(`StateStore.save`, earlier versions) has none.

``journal: n`` names the journal that follows it: files ``pod-quotas.json.journal.n``, ``n+1``, ...
are replayed in order, up to the first missing number. Each line is what one write changed: a JSON
array of operations on the books, ``["P", pod, cgroup_parent, baseline, period, source]`` (the
pod's record, its slots kept), ``["C", pod, name, id, shared_cpus, exclusive, device]`` (a slot
held), ``["F", pod, name]`` (a slot freed), ``["X", pod]`` (the pod dropped), ``["B", device, pod,
name]`` (bound), ``["U", device]`` (unbound), ``["A", device, allocation, pod, name]`` (the newest
allocation of the device presented). Each sets a value, so replaying an operation already
in the snapshot is harmless; a line cut short loses one write whole. A compaction first moves the
appends to the next number, then writes the snapshot naming that number, then deletes the journals
before it: killed at any step, the files on disk still replay to the books of some instant after
the last reply. A pod's own quota is journaled ahead of the write that raises its cgroup
(`bookkeeper.Bookkeeper.write_ahead`): killed in between, the next start still knows it.

Saving a snapshot costs what changed, not the number of pods: the store keeps each pod's encoded
text with the `PodRecord` it was made from, and reuses it while the books still hold that same
record object. Records are immutable (`nri_plugin.mixedcpu.books`), so the same object means the
same text.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any, Final

import structlog

from nri_plugin.common.atomicfile import write_atomically
from nri_plugin.common.smallfile import NotRegularFile, SymbolicLink, TooLarge, read_small_file
from nri_plugin.mixedcpu.books import Books, ContainerRecord, Containers, PodRecord, Slot, Spent
from nri_plugin.mixedcpu.bounds import set_aside_out_of_range

__all__ = [
    "MAX_STATE_SIZE",
    "STATE_FILE_NAME",
    "STATE_VERSION",
    "Loaded",
    "StateFileError",
    "StateStore",
    "apply_operation",
    "books_from_json",
    "books_to_json",
    "changes_line",
    "header_line",
    "pod_operations",
    "pod_to_json",
    "same_header",
]

log = structlog.get_logger("nri_plugin.mixedcpu.store")

STATE_FILE_NAME: Final = "pod-quotas.json"
STATE_VERSION: Final = 1
# The books of 1,000 pods take some 600 KB; a file larger than this was not written by us.
MAX_STATE_SIZE: Final = 8 << 20


# -- the format ----------------------------------------------------------------------------------------


def pod_to_json(pod: PodRecord) -> dict[str, Any]:
    return {
        "cgroup_parent": pod.cgroup_parent,
        "baseline": pod.baseline,
        "period": pod.period,
        "baseline_source": pod.baseline_source,
        "target": pod.target(),
        "containers": {
            name: {
                "id": record.id,
                "shared_cpus": record.shared_cpus,
                "contribution": record.shared_cpus * pod.period,
                "exclusive": record.exclusive,
                "device": record.device,
            }
            for name, record in pod.containers.items()
        },
    }


def books_to_json(books: Books) -> dict[str, Any]:
    return {
        "version": STATE_VERSION,
        "pods": {key: pod_to_json(pod) for key, pod in books.pods.items()},
        # Read by this version on; older ones ignore it (and rebuild from the live slots).
        "devices": {
            device: {"pod": slot.pod, "container": slot.name}
            for device, slot in sorted(books.devices.items())
        },
        "spent": _spent_to_json(books),
    }


def _spent_to_json(books: Books) -> dict[str, dict[str, Any]]:
    return {
        device: {"allocation": spent.allocation, "pod": spent.pod, "container": spent.name}
        for device, spent in sorted(books.spent.items())
    }


def _dumps(value: object) -> str:
    """Compact: with indent, json runs its pure-Python encoder (3x slower at 1,000 pods)."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def books_from_json(data: object) -> Books:
    """Rebuild from `books_to_json` output; ValueError (with the reason) for anything else."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("version") != STATE_VERSION:
        raise ValueError(f"state version {data.get('version')!r}, expected {STATE_VERSION}")
    pods = data.get("pods")
    if not isinstance(pods, dict):
        raise ValueError('"pods" is not an object')
    books = Books({_text(key, "pod key"): _pod_from_json(raw) for key, raw in pods.items()}, {})
    devices = data.get("devices")
    if devices is None:
        # A file from before the bindings were saved: the live slots' devices are all we know.
        books.devices = books.live_devices()
    else:
        if not isinstance(devices, dict):
            raise ValueError('"devices" is not an object')
        for device, entry in devices.items():
            if not isinstance(entry, dict):
                raise ValueError("a device entry is not an object")
            books.devices[_text(device, "device id")] = Slot(
                _text(entry.get("pod"), "device pod"), _text(entry.get("container"), "device container")
            )
        for device, slot in books.live_devices().items():
            books.devices.setdefault(device, slot)
    _spent_from_json(books, data.get("spent"))
    return books


def _spent_from_json(books: Books, spent: object) -> None:
    """`books`' spent allocations from a snapshot's ``spent`` (None: a file from before it)."""
    if spent is not None and not isinstance(spent, dict):
        raise ValueError('"spent" is not an object')
    for device, entry in (spent or {}).items():
        if not isinstance(entry, dict):
            raise ValueError("a spent entry is not an object")
        books.spent[_text(device, "device id")] = _spent(
            [entry.get("allocation"), entry.get("pod"), entry.get("container")]
        )
    # Bound before allocations were numbered (or saved): allocation 0, older than any numbered one.
    for device, slot in books.devices.items():
        books.spent.setdefault(device, Spent(0, slot.pod, slot.name))


def _spent(args: list[Any]) -> Spent:
    allocation = args[0]
    if isinstance(allocation, bool) or not isinstance(allocation, int) or not 0 <= allocation < 10**20:
        raise ValueError(f"allocation {allocation!r} is not a number from 0 to 10**20 - 1")
    return Spent(allocation, _text(args[1], "spent pod"), _text(args[2], "spent container"))


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} {value!r} is not a string")
    return value


def _int(value: object, what: str, minimum: int | None = None) -> int:
    """`value` if it is an integer (at least `minimum`, when given: the ranges of a pod's numbers
    are checked once the books are loaded, `nri_plugin.mixedcpu.bounds`)."""
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        raise ValueError(
            f"{what} {value!r} is not an integer" + ("" if minimum is None else f" >= {minimum}")
        )
    return value


def _pod_from_json(raw: object) -> PodRecord:
    if not isinstance(raw, dict):
        raise ValueError("a pod entry is not an object")
    baseline = raw.get("baseline")
    containers = raw.get("containers")
    if not isinstance(containers, dict):
        raise ValueError('"containers" is not an object')
    return PodRecord(
        cgroup_parent=_text(raw.get("cgroup_parent"), "cgroup_parent"),
        baseline=None if baseline is None else _int(baseline, "baseline"),
        period=_int(raw.get("period"), "period"),
        baseline_source=_text(raw.get("baseline_source", "first-seen"), "baseline_source"),
        containers=Containers(
            (_text(name, "container name"), _container_from_json(entry)) for name, entry in containers.items()
        ),
    )


def _container_from_json(entry: object) -> ContainerRecord:
    if not isinstance(entry, dict):
        raise ValueError("a container entry is not an object")
    device = entry.get("device")
    return ContainerRecord(
        id=_text(entry.get("id"), "container id"),
        shared_cpus=_int(entry.get("shared_cpus"), "shared_cpus"),
        exclusive=_text(entry.get("exclusive", ""), "exclusive"),
        device=None if device is None else _text(device, "device"),
    )


# -- the journal's operations -------------------------------------------------------------------------------

# One operation, encoded: the text of its JSON array (see the module docstring).
Operation = str
_NO_SLOTS: Final = Containers()


def pod_operations(key: str, old: PodRecord | None, new: PodRecord | None) -> list[Operation]:
    """What turns the pod's record `old` into `new` (None: absent), as encoded journal operations.

    Each is written from its template with the C string encoder: an operation holds only strings,
    integers and None, and ``json.dumps`` builds an encoder at every call, which cost more than the
    rest of a creation's write."""
    pod = _text_json(key)
    if new is None:
        return [] if old is None else [f'["X",{pod}]']
    ops: list[Operation] = []
    if old is None or _header(old) != _header(new):
        ops.append(_header_operation(pod, new))
    before = old.containers if old is not None else _NO_SLOTS
    if new.containers is before:
        return ops
    freed, held = new.containers.changes_since(before)
    if freed:
        ops += [f'["F",{pod},{_text_json(name)}]' for name in freed]
    ops += [_slot_operation(pod, name, record) for name, record in held]
    return ops


def _header_operation(pod: str, record: PodRecord) -> Operation:
    parent, source = _text_json(record.cgroup_parent), _text_json(record.baseline_source)
    baseline = "null" if record.baseline is None else int(record.baseline)
    return f'["P",{pod},{parent},{baseline},{int(record.period)},{source}]'


def _slot_operation(pod: str, name: str, record: ContainerRecord) -> Operation:
    device = "null" if record.device is None else _text_json(record.device)
    return (
        f'["C",{pod},{_text_json(name)},{_text_json(record.id)},{int(record.shared_cpus)},'
        f"{_text_json(record.exclusive)},{device}]"
    )


_text_json = encode_basestring_ascii  # a str as JSON, as json.dumps writes it (ASCII, escaped)


def _header(pod: PodRecord) -> tuple[str, int | None, int, str]:
    """What a pod's record says apart from its slots: what Synchronize cannot rebuild."""
    return pod.cgroup_parent, pod.baseline, pod.period, pod.baseline_source


def _device_operation(device: str, slot: Slot | None) -> Operation:
    if slot is None:
        return f'["U",{_text_json(device)}]'
    return f'["B",{_text_json(device)},{_text_json(slot.pod)},{_text_json(slot.name)}]'


def same_header(old: PodRecord, new: PodRecord) -> bool:
    """Whether two records of a pod agree on what a journal's ``P`` operation holds (the cgroup
    parent, baseline, period and its source): only their slots differ."""
    return _header(old) == _header(new)


def header_line(key: str, record: PodRecord) -> bytes:
    """The journal line that sets pod `key`'s own record (`record` bar its slots)."""
    return _encode_operations([_header_operation(_text_json(key), record)])


def changes_line(
    books: Books,
    pods: dict[str, PodRecord | None],
    devices: dict[str, Slot | None],
    spent: Mapping[str, Spent | None] | None = None,
) -> bytes:
    """The journal line that turns what the files hold (`pods`, `devices` and `spent`: each key
    changed, with its value in the files) into `books`; empty when nothing differs."""
    ops: list[Operation] = []
    for key, old in pods.items():
        ops += pod_operations(key, old, books.pods.get(key))
    ops += [
        _device_operation(device, now)
        for device, old in devices.items()
        if (now := books.devices.get(device)) != old
    ]
    ops += [
        _spent_operation(device, spent_now)
        for device, spent_before in (spent or {}).items()
        if (spent_now := books.spent.get(device)) is not None and spent_now != spent_before
    ]
    return _encode_operations(ops)


def _spent_operation(device: str, spent: Spent) -> Operation:
    return (
        f'["A",{_text_json(device)},{int(spent.allocation)},{_text_json(spent.pod)},{_text_json(spent.name)}]'
    )


def _encode_operations(ops: list[Operation]) -> bytes:
    """One journal line: the operations of one write, as a JSON array (empty: no line)."""
    return f"[{','.join(ops)}]\n".encode() if ops else b""


def apply_operation(books: Books, op: object) -> None:
    """Replay one journal operation onto `books`; ValueError for anything that is not one."""
    if not isinstance(op, list) or not op or op[0] not in _ARITY or len(op) != _ARITY[op[0]]:
        raise ValueError(f"not a journal operation: {op!r}")
    kind, args = op[0], op[1:]
    if kind == "A":
        books.spent[_text(args[0], "device id")] = _spent(args[1:])
        return
    if kind in ("B", "U"):
        device = _text(args[0], "device id")
        if kind == "B":
            books.devices[device] = Slot(_text(args[1], "device pod"), _text(args[2], "device container"))
        else:
            books.devices.pop(device, None)
        return
    key = _text(args[0], "pod key")
    pod = books.pods.get(key)
    if kind == "P":
        books.pods[key] = _pod_header(args[1:], pod.containers if pod is not None else Containers())
    elif kind == "X":
        books.pods.pop(key, None)
    elif pod is None:
        raise ValueError(f"slot of pod {key!r}, which the books do not hold")
    elif kind == "F":
        books.pods[key] = pod.without(_text(args[1], "container name"))
    else:
        books.pods[key] = pod.holding(_text(args[1], "container name"), _slot_record(args[2:]))


_ARITY: Final = {"P": 6, "C": 7, "F": 3, "X": 2, "B": 4, "U": 2, "A": 5}


def _pod_header(args: list[Any], containers: Containers) -> PodRecord:
    parent, baseline, period, source = args
    return PodRecord(
        cgroup_parent=_text(parent, "cgroup_parent"),
        baseline=None if baseline is None else _int(baseline, "baseline"),
        period=_int(period, "period"),
        baseline_source=_text(source, "baseline_source"),
        containers=containers,
    )


def _slot_record(args: list[Any]) -> ContainerRecord:
    container_id, shared, exclusive, device = args
    return ContainerRecord(
        id=_text(container_id, "container id"),
        shared_cpus=_int(shared, "shared_cpus"),
        exclusive=_text(exclusive, "exclusive"),
        device=None if device is None else _text(device, "device"),
    )


# -- the files -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Loaded:
    """What `StateStore.load_state` found: the books, and where the journal goes on.

    ``journal``: the number the next append goes to, or None when the files on disk cannot be
    extended (no snapshot, one with no journal, a replay that stopped short): the next write must be
    a new snapshot. ``journal_bytes``: what the journals replayed hold; ``snapshot_bytes``: the
    snapshot's size.
    """

    books: Books
    journal: int | None = None
    journal_bytes: int = 0
    snapshot_bytes: int = 0


_JOURNAL_FLAGS: Final = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


class StateFileError(OSError):
    """The state file is unusable and cannot be set aside either; the message says what to do."""


class _Unusable(Exception):
    """The state file is not a file we could have written (the reason, for the log line)."""


def _read_state(path: str) -> bytes:
    """The state file's bytes, read as the marker key is (`nri_plugin.common.smallfile`); `_Unusable`
    when it is not a regular file of at most `MAX_STATE_SIZE` bytes, FileNotFoundError when there is
    none, OSError when it cannot be read."""
    try:
        return read_small_file(path, MAX_STATE_SIZE)
    except SymbolicLink:
        raise _Unusable("a symbolic link, never written by the plugin") from None
    except NotRegularFile as exc:
        raise _Unusable(f"a {exc.kind}, not a regular file") from None
    except TooLarge as exc:
        over = f"over the {MAX_STATE_SIZE}-byte limit of a state file"
        raise _Unusable(over if exc.grew else f"{exc.size} bytes, {over}") from None


class StateStore:
    """`Books` in ``<state_dir>/pod-quotas.json`` and its journal (see the module docstring).

    `written` counts the bytes this store has written (snapshots and journal), for the benchmarks.
    `online`: the number of online CPUs, which the loaded records' numbers are checked against
    (`nri_plugin.mixedcpu.bounds`; None: the kernel's ranges only).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        name: str = STATE_FILE_NAME,
        fsync: bool = True,
        online: int | None = None,
    ) -> None:
        self.directory = os.fspath(directory)
        self.online = online
        self.path = os.path.join(self.directory, name)
        self.fsync = fsync
        # Bytes written as snapshots (the worker thread's too: under the lock) and appended (by the
        # event loop's thread only: no lock on the creation path).
        self._written = 0
        self._written_lock = threading.Lock()
        self._appended = 0
        self._journal_prefix = f"{name}.journal."
        # Pod key -> the record last encoded under it, and its ``"key":{...}`` text.
        self._texts: dict[str, tuple[PodRecord, bytes]] = {}
        self._journal_fd: int | None = None
        self._journal_number = 0
        self._close_fd: weakref.finalize[[int], StateStore] | None = None

    @property
    def written(self) -> int:
        """Bytes written so far to the state directory (snapshots and journal)."""
        return self._written + self._appended

    def _count(self, size: int) -> None:
        with self._written_lock:
            self._written += size

    # -- reading (at start) --------------------------------------------------------------------------

    def load(self) -> Books:
        """The saved books; empty books (and a warning) when the file is missing, corrupt or old, or
        not a file we could have written (then set aside). Raises `StateFileError` only when such a
        file cannot be set aside."""
        return self.load_state().books

    def load_state(self) -> Loaded:
        """The snapshot with its journal replayed. Read again when a compaction replaced the snapshot
        meanwhile (only another process can be reading while one runs)."""
        for _ in range(3):
            before = self._snapshot_identity()
            loaded = self._load_once()
            if self._snapshot_identity() == before:
                break
        return loaded

    def _read(self, path: str) -> bytes | None:
        """The whole content of one of the state files, or None when it does not exist: every file
        read at start is opened here, as the marker key is (`_read_state`). Raises `_Unusable` for a
        file we could not have written."""
        try:
            return _read_state(path)
        except FileNotFoundError:
            return None

    def _snapshot_identity(self) -> tuple[int, int, int] | None:
        try:
            found = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return None
        return found.st_ino, found.st_mtime_ns, found.st_size

    def _load_once(self) -> Loaded:
        try:
            data = self._read(self.path)
        except _Unusable as exc:
            self._set_aside(str(exc))
            return Loaded(Books())
        except OSError as exc:
            log.warning(
                "cannot read the state file; starting with empty books", path=self.path, error=str(exc)
            )
            return Loaded(Books())
        if data is None:
            return Loaded(Books())
        try:
            raw = json.loads(data)
            books = books_from_json(raw)
            first = _journal_number(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning(
                "state file is corrupt or from another version; starting with empty books "
                "(pod quotas are rebuilt at the next synchronization)",
                path=self.path,
                error=str(exc),
            )
            return Loaded(Books())
        if first is None:
            return self._checked(Loaded(books, None, 0, len(data)))
        loaded = self._replay(books, first, len(data))
        books.take_changes()
        return self._checked(loaded)

    def _checked(self, loaded: Loaded) -> Loaded:
        """`loaded` with the records holding a number out of range set aside (`bounds`); then the
        next write is a snapshot, so that the files no longer hold them."""
        if not set_aside_out_of_range(loaded.books, self.online, self.path):
            return loaded
        loaded.books.take_changes()
        return Loaded(loaded.books, None, loaded.journal_bytes, loaded.snapshot_bytes)

    def _replay(self, books: Books, first: int, snapshot_bytes: int) -> Loaded:
        """Replay journals `first`, `first` + 1, ... onto `books`, up to the first missing one."""
        number, total = first, 0
        while True:
            path = self.journal_path(number)
            try:
                data = self._read(path)
            except (OSError, _Unusable) as exc:
                log.warning("cannot read the state journal; the rest is lost", path=path, error=str(exc))
                return Loaded(books, None, total, snapshot_bytes)
            if data is None:
                return Loaded(books, number, total, snapshot_bytes)
            total += len(data)
            if not _replay_journal(books, data, path):
                return Loaded(books, None, total, snapshot_bytes)
            number += 1

    # -- writing ---------------------------------------------------------------------------------------

    def _set_aside(self, reason: str) -> None:
        """Rename the unusable file out of the way (kept for a person to look at)."""
        aside = f"{self.path}.refused-{time.strftime('%Y%m%dT%H%M%S')}"
        suffix = 0
        while os.path.lexists(aside if not suffix else f"{aside}.{suffix}"):
            suffix += 1
        aside = aside if not suffix else f"{aside}.{suffix}"
        try:
            os.rename(self.path, aside)
        except OSError as exc:
            raise StateFileError(
                f"{self.path} is {reason}, and it cannot be set aside ({exc.strerror}); remove it, the "
                "plugin rebuilds its books at the next synchronization",
            ) from None
        log.warning(
            "state file refused and set aside; starting with empty books (pod quotas are rebuilt at the "
            "next synchronization)",
            path=self.path,
            reason=reason,
            moved_to=aside,
        )

    def save(self, books: Books) -> None:
        """Replace the snapshot atomically, with no journal. Raises OSError (the caller rolls back)."""
        self.write_snapshot(self.encode(books, b"\n"))

    def write_snapshot(self, data: bytes, journal: int | None = None) -> int:
        """Publish an encoded snapshot (temporary file, fsync, rename), then delete the journals
        before `journal`, the one it names; its size. Safe in a worker thread while the loop appends
        to journal `journal` or later. Raises OSError."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        write_atomically(self.path, data, fsync=self.fsync)
        self._count(len(data))
        for number in self.journal_numbers():
            if journal is None or number < journal:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.journal_path(number))
        return len(data)

    def encode(self, books: Books, end: bytes = b"", *, journal: int | None = None) -> bytes:
        """``json.dumps(books_to_json(books), separators=(",", ":"), sort_keys=True)`` (with
        ``"journal"`` when given), encoded, then `end`; a pod's text is reused while its record is the
        one it was made from."""
        pods = books.pods
        devices = {
            device: {"pod": slot.pod, "container": slot.name} for device, slot in books.devices.items()
        }
        link = "" if journal is None else f'"journal":{journal},'
        texts: dict[str, tuple[PodRecord, bytes]] = {}
        parts = [f'{{"devices":{_dumps(devices)},{link}"pods":{{'.encode()]
        spent = _dumps(_spent_to_json(books))
        for i, key in enumerate(sorted(pods)):
            if i:
                parts.append(b",")
            pod = pods[key]
            known = self._texts.get(key)
            text = known[1] if known is not None and known[0] is pod else _pod_text(key, pod)
            texts[key] = (pod, text)
            parts.append(text)
        parts.append(f'}},"spent":{spent},"version":{STATE_VERSION}}}'.encode() + end)
        self._texts = texts  # only the pods still in the books: a dropped one's text goes too
        return b"".join(parts)

    def journal_path(self, number: int) -> str:
        return os.path.join(self.directory, f"{self._journal_prefix}{number}")

    def journal_numbers(self) -> list[int]:
        """The numbers of the journal files in the state directory, in order."""
        try:
            names = os.listdir(self.directory)
        except (FileNotFoundError, NotADirectoryError):  # nothing written yet (or cannot be: saving says)
            return []
        prefix = self._journal_prefix
        return sorted(
            int(name[len(prefix) :])
            for name in names
            if name.startswith(prefix) and name[len(prefix) :].isdigit()
        )

    def append(self, number: int, data: bytes) -> None:
        """Append to journal `number` (no fsync: see the module docstring). Raises OSError; after a
        failure the file may end in part of `data`, so the caller must not append to it again."""
        try:
            fd = self._journal(number)
            done = os.write(fd, data)
            if done < len(data):  # a short write (a disk filling up): the rest, or the error
                view = memoryview(data)[done:]
                while view:
                    view = view[os.write(fd, view) :]
        except OSError:
            self.close_journal()
            raise
        self._appended += len(data)

    def _journal(self, number: int) -> int:
        if self._journal_fd is not None and self._journal_number == number:
            return self._journal_fd
        self.close_journal()
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        fd = os.open(self.journal_path(number), _JOURNAL_FLAGS, 0o600)
        self._journal_fd, self._journal_number = fd, number
        self._close_fd = weakref.finalize(self, os.close, fd)  # a store dropped unclosed (tests)
        return fd

    def close_journal(self) -> None:
        """Close the journal file held open for appends (the next append opens it again)."""
        if self._close_fd is not None:
            self._close_fd()
        self._journal_fd = self._close_fd = None


def _journal_number(raw: dict[str, Any]) -> int | None:
    if "journal" not in raw:
        return None
    return _int(raw["journal"], "journal", 1)


def _replay_journal(books: Books, data: bytes, path: str) -> bool:
    """Apply one journal's lines; False (logged) when one is cut short or unreadable."""
    *lines, tail = data.split(b"\n")
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            ops = json.loads(line)
            if not isinstance(ops, list):
                raise ValueError(f"not a list of journal operations: {ops!r}")
            for op in ops:
                apply_operation(books, op)
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning(
                "state journal line unreadable: the changes from there on are lost (Synchronize "
                "rebuilds them)",
                path=path,
                line=number,
                error=str(exc),
            )
            return False
    if tail:
        log.warning("state journal cut short (a crash while appending): its last line is ignored", path=path)
        return False
    return True


def _pod_text(key: str, pod: PodRecord) -> bytes:
    return f"{encode_basestring_ascii(key)}:{_dumps(pod_to_json(pod))}".encode()
