"""Pod quota bookkeeping: what the plugin added to each pod's CFS quota, and for whom.

The model (`Books`) is plain data with pure operations; `StateStore` keeps it in a JSON file in the
state dir (written atomically: temporary file, fsync, rename), so a restarted plugin knows each pod's
own quota without guessing.

Per pod (keyed by pod UID, or the sandbox id when the runtime sends no UID):

* ``baseline``: the pod's own CFS quota in microseconds per ``period`` (None: unlimited), taken from
  ``PodSandbox.linux.pod_resources`` when the runtime sends it, else from the pod cgroup the first
  time a shared container of the pod is seen;
* ``containers``: one *slot* per container **name**, holding the live shared container of that name:
  its id, the number of shared CPUs it was given (its contribution is that many CPUs, i.e.
  ``shared_cpus * period`` microseconds), its exclusive CPUs, and the device id of the marker that
  proved its request.

Target pod quota = baseline + sum of contributions; unlimited stays unlimited.

Why slots are keyed by container name: kubelet never runs two instances of one container of a pod at
once, so a new container id under a name that is already held means the old instance is dead. A
restart therefore *replaces* the old contribution instead of adding to it, whatever order the
runtime reports ``create(new)``, ``stop(old)`` and ``remove(old)`` in; and ``stop``/``remove`` of a
container id only release the slot if that id still holds it.

Device ids are *bound* to slots (``devices``): the first slot that presents a valid marker for a
device id is bound to it, and stays bound while its container stops, restarts and is removed, until
the runtime stops or removes that pod's sandbox (when kubelet's allocation of the device to that pod
ends). A marker whose device id is bound to another slot is a replay, refused even while the
rightful holder is stopped (crash-loop back-off, a restart under way); its own restart is accepted.
The bindings are saved with the books; a file from before them gets the bindings of its live slots.

Saving costs what changed, not the number of pods: each `PodRecord` keeps its pod's JSON text, made
at its first save after a change and dropped by any change to it (a field set, or any change to its
``containers``, a `Containers` dict that counts its changes); a save joins those texts.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from json.encoder import encode_basestring_ascii
from typing import Any, Final

import structlog

from nri_plugin.common.atomicfile import write_atomically

__all__ = [
    "STATE_FILE_NAME",
    "STATE_VERSION",
    "Books",
    "ContainerRecord",
    "Containers",
    "PodRecord",
    "Slot",
    "StateStore",
]

log = structlog.get_logger("nri_plugin.mixedcpu.state")

STATE_FILE_NAME: Final = "pod-quotas.json"
STATE_VERSION: Final = 1


@dataclass(frozen=True, slots=True)
class Slot:
    """One container of one pod, across restarts: the pod key and the container's name."""

    pod: str
    name: str

    def __str__(self) -> str:
        return f"{self.pod}/{self.name}"


@dataclass(frozen=True, slots=True)
class ContainerRecord:
    """The live shared container holding a slot."""

    id: str
    shared_cpus: int
    exclusive: str = ""  # canonical cpu list
    device: str | None = None


# Every change to any `Containers` takes a new number: a pod's cached JSON text is valid while its
# `containers` is the same object, with the same number, as when the text was made.
_changes = itertools.count(1)


class Containers(dict[str, ContainerRecord]):
    """A pod's slots (container name -> record): a dict that takes a new change number at every
    change, through any of dict's mutating methods."""

    change = 0  # until the first change (class default: also right for unpickled/copied dicts)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.change = next(_changes)

    def __setitem__(self, key: str, value: ContainerRecord) -> None:
        self.change = next(_changes)
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self.change = next(_changes)
        super().__delitem__(key)

    def pop(self, *args: Any) -> Any:
        self.change = next(_changes)
        return super().pop(*args)

    def popitem(self) -> tuple[str, ContainerRecord]:
        self.change = next(_changes)
        return super().popitem()

    def clear(self) -> None:
        self.change = next(_changes)
        super().clear()

    def setdefault(self, key: str, default: ContainerRecord | None = None) -> Any:
        self.change = next(_changes)
        return super().setdefault(key, default)  # type: ignore[arg-type]

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.change = next(_changes)
        super().update(*args, **kwargs)

    def __ior__(self, other: Any) -> Containers:  # type: ignore[override,misc]
        self.change = next(_changes)
        return super().__ior__(other)

    def __reduce__(self) -> Any:  # copy/pickle: a plain dict's contents, a fresh change number
        return (Containers, (dict(self),))


@dataclass(slots=True)
class PodRecord:
    """One pod's quota bookkeeping."""

    cgroup_parent: str
    baseline: int | None  # microseconds per period; None = unlimited
    period: int
    baseline_source: str = "first-seen"  # pod-resources | first-seen | rebuilt
    containers: dict[str, ContainerRecord] = field(default_factory=Containers)
    # The pod's JSON entry, the `containers` object and change number and the key it was made from.
    _json: tuple[bytes, object, int, str] | None = field(default=None, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name != "_json":
            object.__setattr__(self, "_json", None)  # any change to a field drops the text

    @property
    def contribution(self) -> int:
        """Microseconds per period added for the live shared containers."""
        return sum(record.shared_cpus for record in self.containers.values()) * self.period

    def target(self) -> int | None:
        """The pod's quota as it should be: baseline + contributions; None when unlimited."""
        return None if self.baseline is None else self.baseline + self.contribution

    def copy(self) -> PodRecord:
        return replace(self, containers=Containers(self.containers))

    def to_json(self) -> dict[str, Any]:
        return {
            "cgroup_parent": self.cgroup_parent,
            "baseline": self.baseline,
            "period": self.period,
            "baseline_source": self.baseline_source,
            "target": self.target(),
            "containers": {
                name: {
                    "id": record.id,
                    "shared_cpus": record.shared_cpus,
                    "contribution": record.shared_cpus * self.period,
                    "exclusive": record.exclusive,
                    "device": record.device,
                }
                for name, record in self.containers.items()
            },
        }

    def json_entry(self, key: str) -> bytes:
        """``"<key>":<to_json() as compact, key-sorted JSON>``, encoded: kept until the record or its
        containers change. A `containers` that is a plain dict (assigned by hand) is encoded every
        time."""
        containers = self.containers
        change = containers.change if type(containers) is Containers else None
        cached = self._json
        if (
            change is not None
            and cached is not None
            and cached[1] is containers
            and cached[2] == change
            and cached[3] == key
        ):
            return cached[0]
        entry = f"{encode_basestring_ascii(key)}:{_dumps(self.to_json())}".encode()
        if change is not None:
            object.__setattr__(self, "_json", (entry, containers, change, key))
        return entry


def _dumps(value: object) -> str:
    """Compact: with indent, json runs its pure-Python encoder (3x slower at 1,000 pods)."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


class Books:
    """Every pod the plugin has raised (or may have to lower), with an index by container id, and
    the device ids bound to slots (see the module docstring)."""

    def __init__(
        self, pods: dict[str, PodRecord] | None = None, devices: dict[str, Slot] | None = None
    ) -> None:
        self.pods: dict[str, PodRecord] = pods if pods is not None else {}
        # Device id -> the slot it is bound to. Without saved bindings, those of the live slots.
        self.devices: dict[str, Slot] = devices if devices is not None else self._live_devices()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Books) and self.pods == other.pods and self.devices == other.devices

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Books({self.pods!r}, {self.devices!r})"

    def copy(self) -> Books:
        return Books({key: record.copy() for key, record in self.pods.items()}, dict(self.devices))

    def slots(self) -> Iterator[tuple[Slot, ContainerRecord]]:
        for key, pod in self.pods.items():
            for name, record in pod.containers.items():
                yield Slot(key, name), record

    def holder(self, slot: Slot) -> ContainerRecord | None:
        pod = self.pods.get(slot.pod)
        return pod.containers.get(slot.name) if pod is not None else None

    def find(self, container_id: str) -> tuple[Slot, ContainerRecord] | None:
        """The slot the container id holds, if any."""
        for slot, record in self.slots():
            if record.id == container_id:
                return slot, record
        return None

    def _live_devices(self) -> dict[str, Slot]:
        return {record.device: slot for slot, record in self.slots() if record.device is not None}

    def device_holders(self) -> dict[str, Slot]:
        """Device id -> the slot it is bound to (for replay refusal): the bindings, and the device of
        every live slot (always bound to it already, unless the books were edited by hand)."""
        holders = self._live_devices()
        holders.update(self.devices)
        return holders

    def bind(self, device: str, slot: Slot) -> None:
        """Bind a device id to the slot that proved its request with it. A slot has one device: a
        slot presenting another one (a new allocation) gives up the one it had."""
        for other in [d for d, s in self.devices.items() if s == slot and d != device]:
            del self.devices[other]
        self.devices[device] = slot

    def unbind_pod(self, key: str) -> list[str]:
        """The pod's sandbox was stopped or removed: kubelet's allocations to it are over. Returns the
        device ids set free."""
        freed = sorted(device for device, slot in self.devices.items() if slot.pod == key)
        for device in freed:
            del self.devices[device]
        return freed

    def hold(self, slot: Slot, record: ContainerRecord) -> ContainerRecord | None:
        """Give the slot to `record` (its pod must be known) and bind its device id, if any, to the
        slot. Returns the record it replaced, if any."""
        pod = self.pods[slot.pod]
        previous = pod.containers.get(slot.name)
        pod.containers[slot.name] = record
        if record.device is not None:
            self.bind(record.device, slot)
        return previous

    def displace(self, slot: Slot, container_id: str) -> ContainerRecord | None:
        """A container named like the slot is being created: an older instance holding it is dead."""
        pod = self.pods.get(slot.pod)
        if pod is None:
            return None
        previous = pod.containers.get(slot.name)
        if previous is None or previous.id == container_id:
            return None
        del pod.containers[slot.name]
        return previous

    def release(self, container_id: str) -> Slot | None:
        """The container stopped or went away: free its slot if it still holds one."""
        found = self.find(container_id)
        if found is None:
            return None
        slot, _ = found
        del self.pods[slot.pod].containers[slot.name]
        return slot

    # -- JSON ------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "pods": {key: pod.to_json() for key, pod in self.pods.items()},
            # Read by this version on; older ones ignore it (and rebuild from the live slots).
            "devices": {
                device: {"pod": slot.pod, "container": slot.name}
                for device, slot in sorted(self.devices.items())
            },
        }

    def dumps(self, end: bytes = b"") -> bytes:
        """``json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True)``, encoded, then `end`;
        each pod's part reused from the last time unless that pod changed since."""
        pods = self.pods
        devices = {device: {"pod": slot.pod, "container": slot.name} for device, slot in self.devices.items()}
        parts = [f'{{"devices":{_dumps(devices)},"pods":{{'.encode()]
        for i, key in enumerate(sorted(pods)):
            if i:
                parts.append(b",")
            parts.append(pods[key].json_entry(key))
        parts.append(f'}},"version":{STATE_VERSION}}}'.encode() + end)
        return b"".join(parts)

    @classmethod
    def from_json(cls, data: object) -> Books:
        """Rebuild from `to_json` output; ValueError (with the reason) for anything else."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"state version {data.get('version')!r}, expected {STATE_VERSION}")
        pods = data.get("pods")
        if not isinstance(pods, dict):
            raise ValueError('"pods" is not an object')
        books = cls()
        for key, raw in pods.items():
            books.pods[_text(key, "pod key")] = _pod_from_json(raw)
        devices = data.get("devices")
        if devices is None:
            # A file from before the bindings were saved: the live slots' devices are all we know.
            books.devices = books._live_devices()
            return books
        if not isinstance(devices, dict):
            raise ValueError('"devices" is not an object')
        for device, entry in devices.items():
            if not isinstance(entry, dict):
                raise ValueError("a device entry is not an object")
            books.devices[_text(device, "device id")] = Slot(
                _text(entry.get("pod"), "device pod"), _text(entry.get("container"), "device container")
            )
        for device, slot in books._live_devices().items():
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
    pod = PodRecord(
        cgroup_parent=_text(raw.get("cgroup_parent"), "cgroup_parent"),
        baseline=None if baseline is None else _int(baseline, "baseline", 1),
        period=_int(raw.get("period"), "period", 1),
        baseline_source=_text(raw.get("baseline_source", "first-seen"), "baseline_source"),
    )
    for name, entry in containers.items():
        if not isinstance(entry, dict):
            raise ValueError("a container entry is not an object")
        device = entry.get("device")
        pod.containers[_text(name, "container name")] = ContainerRecord(
            id=_text(entry.get("id"), "container id"),
            shared_cpus=_int(entry.get("shared_cpus"), "shared_cpus", 0),
            exclusive=_text(entry.get("exclusive", ""), "exclusive"),
            device=None if device is None else _text(device, "device"),
        )
    return pod


class StateStore:
    """`Books` in ``<state_dir>/pod-quotas.json``."""

    def __init__(
        self, directory: str | os.PathLike[str], *, name: str = STATE_FILE_NAME, fsync: bool = True
    ) -> None:
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, name)
        self.fsync = fsync

    def load(self) -> Books:
        """The saved books; empty books (and a warning) when the file is missing, corrupt or old."""
        try:
            with open(self.path, "rb") as file:
                data = file.read()
        except FileNotFoundError:
            return Books()
        except OSError as exc:
            log.warning(
                "cannot read the state file; starting with empty books", path=self.path, error=str(exc)
            )
            return Books()
        try:
            return Books.from_json(json.loads(data))
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning(
                "state file is corrupt or from another version; starting with empty books "
                "(pod quotas are rebuilt at the next synchronization)",
                path=self.path,
                error=str(exc),
            )
            return Books()

    def save(self, books: Books) -> None:
        """Replace the file atomically. Raises OSError when it cannot (the caller rolls back)."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        write_atomically(self.path, books.dumps(b"\n"), fsync=self.fsync)
