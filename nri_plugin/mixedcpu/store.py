"""The books on disk: ``<state_dir>/pod-quotas.json``, and when it is written.

* `StateStore` loads and saves the file (written atomically: a temporary file, fsync, rename), so a
  restarted plugin knows each pod's own quota without guessing. A file that is missing, corrupt or
  from another version loads as empty books, with a warning: Synchronize rebuilds them.
* The file is opened as the marker key is (`nri_plugin.deviceplugin.keyfile`): no symlink followed,
  never blocking (a FIFO), a regular file only, at most `MAX_STATE_SIZE` bytes read. One that is not
  (a link, a FIFO, a device, a directory, a file too large to be ours) is *set aside*: renamed to
  ``pod-quotas.json.refused-<time>`` for a person to look at, with a warning, and the plugin starts
  from empty books that Synchronize rebuilds, as for a corrupt file. It never hangs the start, never
  fills the memory, and never leaves a daemon that is ready but cannot save. Only when it cannot even
  be set aside does the load raise `StateFileError` (the daemon then exits 2 with one line).
* `Bookkeeper` holds the plugin's current `Books` and decides when they are written: at once (before
  the reply that depends on it) when something Synchronize cannot rebuild changed, a pod's baseline
  or a device binding; else within `FLUSH_DELAY`, so that a burst of slot changes costs one write.

Saving costs what changed, not the number of pods: the store keeps each pod's encoded text with the
`PodRecord` it was made from, and reuses it while the books still hold that same record object.
Records are immutable (`nri_plugin.mixedcpu.books`), so the same object means the same text.

The format (version 1): ``{"devices": {id: {"pod", "container"}}, "pods": {key: {"cgroup_parent",
"baseline", "period", "baseline_source", "target", "containers": {name: {"id", "shared_cpus",
"contribution", "exclusive", "device"}}}}, "version": 1}``, compact, keys sorted. ``target`` and
``contribution`` are for people reading the file; they are recomputed at load. A file from before
the bindings were saved (no ``devices``) gets the bindings of its live slots.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from json.encoder import encode_basestring_ascii
from typing import Any, Final

import structlog

from nri_plugin.common.atomicfile import write_atomically
from nri_plugin.common.clock import LOOP_CLOCK, Clock, Timer
from nri_plugin.mixedcpu.books import Books, ContainerRecord, Containers, PodRecord, Slot
from nri_plugin.mixedcpu.logfields import LOGGER_NAME

__all__ = [
    "FLUSH_DELAY",
    "MAX_STATE_SIZE",
    "STATE_FILE_NAME",
    "STATE_VERSION",
    "Bookkeeper",
    "StateFileError",
    "StateStore",
    "books_from_json",
    "books_to_json",
    "pod_to_json",
]

log = structlog.get_logger("nri_plugin.mixedcpu.store")
# A failed save is about the plugin's work: logged with the rest of it.
plugin_log = structlog.get_logger(LOGGER_NAME)

STATE_FILE_NAME: Final = "pod-quotas.json"
STATE_VERSION: Final = 1
# Changes to the books that Synchronize can rebuild (which container holds a slot) are written to the
# state file this long after they happen; a new or dropped pod baseline is written at once.
FLUSH_DELAY = 1.0
# The books of 1,000 pods take some 600 KB; a file larger than this was not written by us.
MAX_STATE_SIZE: Final = 8 << 20
# Opened like the marker key: a link is not followed, a FIFO does not block the open, a terminal
# device does not become ours.
_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


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
        return books
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
    return books


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} {value!r} is not a string")
    return value


def _int(value: object, what: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{what} {value!r} is not an integer >= {minimum}")
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
        baseline=None if baseline is None else _int(baseline, "baseline", 1),
        period=_int(raw.get("period"), "period", 1),
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
        shared_cpus=_int(entry.get("shared_cpus"), "shared_cpus", 0),
        exclusive=_text(entry.get("exclusive", ""), "exclusive"),
        device=None if device is None else _text(device, "device"),
    )


# -- the file ------------------------------------------------------------------------------------------


class StateFileError(OSError):
    """The state file is unusable and cannot be set aside either; the message says what to do."""


class _Unusable(Exception):
    """The state file is not a file we could have written (the reason, for the log line)."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return "special file"


def _read_state(path: str) -> bytes:
    """The state file's bytes; `_Unusable` when it is not a regular file of at most `MAX_STATE_SIZE`
    bytes, FileNotFoundError when there is none, OSError when it cannot be read."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Unusable("a symbolic link, never written by the plugin") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _Unusable(f"a {_kind(info.st_mode)}, not a regular file")
        if info.st_size > MAX_STATE_SIZE:
            raise _Unusable(f"{info.st_size} bytes, over the {MAX_STATE_SIZE}-byte limit of a state file")
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_STATE_SIZE and (chunk := os.read(fd, MAX_STATE_SIZE + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_STATE_SIZE:
            raise _Unusable(f"over the {MAX_STATE_SIZE}-byte limit of a state file")
        return b"".join(chunks)
    finally:
        os.close(fd)


class StateStore:
    """`Books` in ``<state_dir>/pod-quotas.json``."""

    def __init__(
        self, directory: str | os.PathLike[str], *, name: str = STATE_FILE_NAME, fsync: bool = True
    ) -> None:
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, name)
        self.fsync = fsync
        # Pod key -> the record last encoded under it, and its ``"key":{...}`` text.
        self._texts: dict[str, tuple[PodRecord, bytes]] = {}

    def load(self) -> Books:
        """The saved books; empty books (and a warning) when the file is missing, corrupt or old, or
        not a file we could have written (then set aside). Raises `StateFileError` only when such a
        file cannot be set aside."""
        try:
            data = _read_state(self.path)
        except FileNotFoundError:
            return Books()
        except _Unusable as exc:
            self._set_aside(str(exc))
            return Books()
        except OSError as exc:
            log.warning(
                "cannot read the state file; starting with empty books", path=self.path, error=str(exc)
            )
            return Books()
        try:
            return books_from_json(json.loads(data))
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning(
                "state file is corrupt or from another version; starting with empty books "
                "(pod quotas are rebuilt at the next synchronization)",
                path=self.path,
                error=str(exc),
            )
            return Books()

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
        """Replace the file atomically. Raises OSError when it cannot (the caller rolls back)."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        write_atomically(self.path, self.encode(books, b"\n"), fsync=self.fsync)

    def encode(self, books: Books, end: bytes = b"") -> bytes:
        """``json.dumps(books_to_json(books), separators=(",", ":"), sort_keys=True)``, encoded, then
        `end`; a pod's text is reused while its record is the one it was made from."""
        pods = books.pods
        devices = {
            device: {"pod": slot.pod, "container": slot.name} for device, slot in books.devices.items()
        }
        texts: dict[str, tuple[PodRecord, bytes]] = {}
        parts = [f'{{"devices":{_dumps(devices)},"pods":{{'.encode()]
        for i, key in enumerate(sorted(pods)):
            if i:
                parts.append(b",")
            pod = pods[key]
            known = self._texts.get(key)
            text = known[1] if known is not None and known[0] is pod else _pod_text(key, pod)
            texts[key] = (pod, text)
            parts.append(text)
        parts.append(f'}},"version":{STATE_VERSION}}}'.encode() + end)
        self._texts = texts  # only the pods still in the books: a dropped one's text goes too
        return b"".join(parts)


def _pod_text(key: str, pod: PodRecord) -> bytes:
    return f"{encode_basestring_ascii(key)}:{_dumps(pod_to_json(pod))}".encode()


# -- when the file is written ---------------------------------------------------------------------------


def _unrebuildable(books: Books) -> tuple[dict[str, tuple[int | None, int, str, str]], dict[str, Slot]]:
    """What Synchronize cannot rebuild, written before the reply: baselines, device bindings."""
    baselines = {
        key: (pod.baseline, pod.period, pod.baseline_source, pod.cgroup_parent)
        for key, pod in books.pods.items()
    }
    return baselines, dict(books.devices)


class Bookkeeper:
    """The plugin's current books and their writing to `store` (see the module docstring).

    ``books`` may be replaced as a whole (Synchronize does). Timers run on `clock`; without a running
    loop to run them (a script, a plain test), what would wait is written at once.
    """

    def __init__(self, store: StateStore, books: Books | None = None, *, clock: Clock = LOOP_CLOCK) -> None:
        self.store = store
        self.books = store.load() if books is None else books
        self._clock = clock
        self._saved = _unrebuildable(self.books)
        self._flush_timer: Timer | None = None

    @property
    def flush_pending(self) -> bool:
        """True while a change waits for the deferred write."""
        return self._flush_timer is not None

    def commit(self) -> None:
        """Persist the books: at once when what Synchronize cannot rebuild changed (raises OSError),
        else within `FLUSH_DELAY`."""
        if _unrebuildable(self.books) != self._saved:
            self.flush(force=True)
            return
        if self._flush_timer is None:
            try:
                self._flush_timer = self._clock.call_later(FLUSH_DELAY, self._deferred_flush)
            except RuntimeError:  # no running loop: nothing would ever fire the timer
                self.flush(force=True)

    def flush(self, *, force: bool = False) -> None:
        """Write the books now if anything is waiting (or `force`). Raises OSError."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        elif not force:
            return
        self.store.save(self.books)
        self._saved = _unrebuildable(self.books)

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

    def _deferred_flush(self) -> None:
        self._flush_timer = None
        self.save_quietly(force=True)
