"""Read-only: the books as 0.1.0 and 0.2.0 kept them, to move them into the database once.

Those versions wrote ``<state_dir>/pod-quotas.json`` (a JSON snapshot) and the journal that follows
it, ``pod-quotas.json.journal.<n>`` (one JSON array of operations per write). `read_legacy` turns
them into `Books`; `nri_plugin.mixedcpu.store` writes those into the database in one transaction
and then deletes the files. Nothing here writes.

What the reader keeps of the old rules, so that an upgrade loses nothing the old daemon would have
kept: a snapshot that is missing, not JSON or of another version gives empty books (a warning; its
journal is ignored), and Synchronize rebuilds them; a journal line cut short or unreadable ends the
replay there (a warning); a snapshot without ``devices`` (0.1.0's first files) gets the bindings of
its live slots, one without ``spent`` its bindings' as allocation 0. A snapshot or journal that is
not a regular file of at most `MAX_LEGACY_SIZE` bytes raises `LegacyRefused` (the store sets it aside).
The numbers' ranges are checked where the database's are (`nri_plugin.mixedcpu.bounds`).

The snapshot: ``{"version": 1, "pods": {key: {"cgroup_parent", "baseline", "period",
"baseline_source", "containers": {name: {"id", "shared_cpus", "exclusive", "device"}}}}, "devices":
{id: {"pod", "container"}}, "spent": {id: {"allocation", "pod", "container"}}, "journal": n}``. The
journal's operations: ``["P", pod, cgroup_parent, baseline, period, source]`` (a pod's own record),
``["C", pod, name, id, shared_cpus, exclusive, device]`` (a slot held), ``["F", pod, name]`` (freed),
``["X", pod]`` (pod dropped), ``["B", device, pod, name]`` (bound), ``["U", device]`` (unbound),
``["A", device, allocation, pod, name]`` (the newest allocation presented).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, Final

import structlog

from nri_plugin.common.smallfile import NotRegularFile, SymbolicLink, TooLarge, read_small_file
from nri_plugin.mixedcpu.books import Books, ContainerRecord, Containers, PodRecord, Slot, Spent

__all__ = [
    "LEGACY_FILE_NAME",
    "MAX_LEGACY_SIZE",
    "LegacyRefused",
    "checked_int",
    "checked_spent",
    "checked_text",
    "container_record",
    "legacy_paths",
    "pod_record",
    "read_legacy",
]

log = structlog.get_logger("nri_plugin.mixedcpu.store")

LEGACY_FILE_NAME: Final = "pod-quotas.json"
_VERSION: Final = 1
MAX_LEGACY_SIZE: Final = 8 << 20  # 1,000 pods took some 600 KB


class LegacyRefused(Exception):
    """`path` is not a file the old daemon could have written (`reason`, for the log line)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(reason)
        self.path = path


def legacy_paths(directory: str) -> list[str]:
    """The old files in `directory`: the journals (in order), then the snapshot, those that exist."""
    prefix = f"{LEGACY_FILE_NAME}.journal."
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    numbers = sorted(
        int(name[len(prefix) :])
        for name in names
        if name.startswith(prefix) and name[len(prefix) :].isdigit()
    )
    found = [os.path.join(directory, f"{prefix}{number}") for number in numbers]
    return found + ([os.path.join(directory, LEGACY_FILE_NAME)] if LEGACY_FILE_NAME in names else [])


def read_legacy(directory: str) -> Books:
    """The books the old files replay to (see the module docstring); `LegacyRefused` for a file we
    could not have written."""
    path = os.path.join(directory, LEGACY_FILE_NAME)
    data = _read(path)
    if data is None:
        return Books()
    try:
        raw = json.loads(data)
        books = _books_from_json(raw)
        first = None if "journal" not in raw else checked_int(raw["journal"], "journal", 1)
    except (ValueError, UnicodeDecodeError) as exc:
        log.warning(
            "state file is corrupt or from another version; starting with empty books "
            "(pod quotas are rebuilt at the next synchronization)",
            path=path,
            error=str(exc),
        )
        return Books()
    number = first
    while number is not None:
        journal = os.path.join(directory, f"{LEGACY_FILE_NAME}.journal.{number}")
        try:
            data = _read(journal)
        except LegacyRefused as exc:
            log.warning("cannot read the state journal; the rest is lost", path=journal, error=str(exc))
            break
        if data is None or not _replay(books, data, journal):
            break
        number += 1
    return books


def _read(path: str) -> bytes | None:
    try:
        return read_small_file(path, MAX_LEGACY_SIZE)
    except FileNotFoundError:
        return None
    except SymbolicLink:
        raise LegacyRefused(path, "a symbolic link, never written by the plugin") from None
    except NotRegularFile as exc:
        raise LegacyRefused(path, f"a {exc.kind}, not a regular file") from None
    except TooLarge:
        raise LegacyRefused(path, f"over the {MAX_LEGACY_SIZE}-byte limit of a state file") from None
    except OSError as exc:
        raise LegacyRefused(path, f"unreadable ({exc.strerror or exc})") from None


def _replay(books: Books, data: bytes, path: str) -> bool:
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
                _apply(books, op)
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


# -- checked values -----------------------------------------------------------------------------------------


def checked_text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} {value!r} is not a string")
    return value


def checked_int(value: object, what: str, minimum: int | None = None) -> int:
    """`value` if it is an integer (at least `minimum`, when given: a pod's numbers' ranges are
    checked once the books are loaded, `nri_plugin.mixedcpu.bounds`)."""
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        raise ValueError(
            f"{what} {value!r} is not an integer" + ("" if minimum is None else f" >= {minimum}")
        )
    return value


def checked_spent(allocation: object, pod: object, name: object) -> Spent:
    if isinstance(allocation, bool) or not isinstance(allocation, int) or not 0 <= allocation < 10**20:
        raise ValueError(f"allocation {allocation!r} is not a number from 0 to 10**20 - 1")
    return Spent(allocation, checked_text(pod, "spent pod"), checked_text(name, "spent container"))


def pod_record(fields: Sequence[object], containers: Containers) -> PodRecord:
    """A pod's record from (cgroup_parent, baseline, period, baseline_source), checked."""
    parent, baseline, period, source = fields
    return PodRecord(
        cgroup_parent=checked_text(parent, "cgroup_parent"),
        baseline=None if baseline is None else checked_int(baseline, "baseline"),
        period=checked_int(period, "period"),
        baseline_source=checked_text(source, "baseline_source"),
        containers=containers,
    )


def container_record(fields: Sequence[object]) -> ContainerRecord:
    """A slot's record from (id, shared_cpus, exclusive, device), checked."""
    container_id, shared, exclusive, device = fields
    return ContainerRecord(
        id=checked_text(container_id, "container id"),
        shared_cpus=checked_int(shared, "shared_cpus"),
        exclusive=checked_text(exclusive, "exclusive"),
        device=None if device is None else checked_text(device, "device"),
    )


# -- the snapshot and the journal's operations --------------------------------------------------------


def _books_from_json(data: object) -> Books:
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("version") != _VERSION:
        raise ValueError(f"state version {data.get('version')!r}, expected {_VERSION}")
    pods = data.get("pods")
    if not isinstance(pods, dict):
        raise ValueError('"pods" is not an object')
    books = Books({checked_text(key, "pod key"): _pod_from_json(raw) for key, raw in pods.items()}, {})
    devices = data.get("devices")
    if devices is None:  # 0.1.0's first files: the live slots' devices are all we know
        books.devices = books.live_devices()
    else:
        for device, entry in _object(devices, "devices").items():
            entry = _object(entry, "a device entry")
            books.devices[checked_text(device, "device id")] = Slot(
                checked_text(entry.get("pod"), "device pod"),
                checked_text(entry.get("container"), "device container"),
            )
        for device, slot in books.live_devices().items():
            books.devices.setdefault(device, slot)
    for device, entry in _object(data.get("spent") or {}, "spent").items():
        entry = _object(entry, "a spent entry")
        books.spent[checked_text(device, "device id")] = checked_spent(
            entry.get("allocation"), entry.get("pod"), entry.get("container")
        )
    # Bound before allocations were numbered (or saved): allocation 0, older than any numbered one.
    for device, slot in books.devices.items():
        books.spent.setdefault(device, Spent(0, slot.pod, slot.name))
    return books


def _object(value: object, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not an object")
    return value


def _pod_from_json(raw: object) -> PodRecord:
    raw = _object(raw, "a pod entry")
    slots = _object(raw.get("containers"), '"containers"')
    containers = Containers(
        (checked_text(name, "container name"), _container_from_json(entry)) for name, entry in slots.items()
    )
    fields = [raw.get("cgroup_parent"), raw.get("baseline"), raw.get("period")]
    return pod_record([*fields, raw.get("baseline_source", "first-seen")], containers)


def _container_from_json(entry: object) -> ContainerRecord:
    entry = _object(entry, "a container entry")
    return container_record(
        [entry.get("id"), entry.get("shared_cpus"), entry.get("exclusive", ""), entry.get("device")]
    )


_ARITY: Final = {"P": 6, "C": 7, "F": 3, "X": 2, "B": 4, "U": 2, "A": 5}


def _apply(books: Books, op: object) -> None:
    """Replay one journal operation onto `books`; ValueError for anything that is not one."""
    if not isinstance(op, list) or not op or op[0] not in _ARITY or len(op) != _ARITY[op[0]]:
        raise ValueError(f"not a journal operation: {op!r}")
    kind, args = op[0], op[1:]
    if kind == "A":
        books.spent[checked_text(args[0], "device id")] = checked_spent(*args[1:])
    elif kind == "B":
        books.devices[checked_text(args[0], "device id")] = Slot(
            checked_text(args[1], "device pod"), checked_text(args[2], "device container")
        )
    elif kind == "U":
        books.devices.pop(checked_text(args[0], "device id"), None)
    else:
        key = checked_text(args[0], "pod key")
        pod = books.pods.get(key)
        if kind == "P":
            books.pods[key] = pod_record(args[1:], pod.containers if pod is not None else Containers())
        elif kind == "X":
            books.pods.pop(key, None)
        elif pod is None:
            raise ValueError(f"slot of pod {key!r}, which the books do not hold")
        elif kind == "F":
            books.pods[key] = pod.without(checked_text(args[1], "container name"))
        else:
            books.pods[key] = pod.holding(checked_text(args[1], "container name"), container_record(args[2:]))
