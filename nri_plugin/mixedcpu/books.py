"""The books: what the plugin added to each pod's CFS quota, for whom, and which device ids are bound.

Plain data with pure operations; no I/O (the database is `nri_plugin.mixedcpu.store`).

Per pod (keyed by pod UID, or the sandbox id when the runtime sends no UID), a `PodRecord`:

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

Device ids are *bound* to slots (``devices``): the slot that presents kubelet's newest allocation
of a device id (its marker's allocation number, `nri_plugin.deviceplugin.marker`) is bound to it, and
stays bound while its container stops, restarts and is removed, until the runtime stops or removes
that pod's sandbox (or Synchronize no longer lists it), or until a container presents a newer
allocation of the same device: a fresh ``Allocate`` (or DRA prepare) is kubelet's word that the
previous holder is gone, so the binding moves and the older one ends. ``spent`` remembers, for each
device id, the newest allocation presented and the slot that presented it, also once its binding has
ended: a marker is good for one allocation, so the same or an older allocation presented in any other
slot is a copy and refused, whether its holder is running, stopped or gone; its own slot's restart
(and a re-created sandbox of its pod) is accepted. Nothing is unbound because a pod's cgroup looks
missing: only the runtime's events and kubelet's newer allocations end a binding. ``pod_cgroups``
remembers where each bound pod's cgroup is, even once its record is dropped.

Records are immutable: `PodRecord`, its `Containers` and `ContainerRecord` cannot be changed in place
(assigning a field raises), so every change makes a new record and puts it in ``Books.pods`` in place
of the old one. Whatever is derived from a record, such as the rows last written of it, therefore
stays right for as long as that same record object is in the books: there is no "changed" flag for a
new field or method to forget.
"""

from __future__ import annotations

from collections.abc import (
    Callable,
    ItemsView,
    Iterable,
    Iterator,
    KeysView,
    Mapping,
    MutableMapping,
    ValuesView,
)
from dataclasses import dataclass
from typing import Final, NamedTuple, TypeVar

__all__ = ["Books", "ContainerRecord", "Containers", "PodRecord", "Slot", "Spent", "Watch", "WatchedMap"]


class Slot(NamedTuple):
    """One container of one pod, across restarts: the pod key and the container's name. A named
    tuple: immutable, made and hashed in C (the books index every slot they hold)."""

    pod: str
    name: str

    def __str__(self) -> str:
        return f"{self.pod}/{self.name}"


class Spent(NamedTuple):
    """The newest allocation of a device id presented so far: its number (0: a marker without one,
    or a binding saved before numbers existed) and the slot that presented it."""

    allocation: int
    pod: str
    name: str

    @property
    def slot(self) -> Slot:
        return Slot(self.pod, self.name)


class Watch(NamedTuple):
    """A CRI-O creation in progress, as the books keep it across a restart (`nri_plugin.mixedcpu.heal`):
    the container holding the slot, its cgroup path as the runtime sent it, and when its creation is
    over on the clock (`time.monotonic`: the system's, so the same across a restart of the daemon)."""

    container_id: str
    cgroups_path: str
    due: float


@dataclass(frozen=True, slots=True)
class ContainerRecord:
    """The live shared container holding a slot."""

    id: str
    shared_cpus: int
    exclusive: str = ""  # canonical cpu list
    device: str | None = None


class Containers(Mapping[str, ContainerRecord]):
    """A pod's slots, container name -> the record holding it: a mapping no method changes.

    `with_holder` and `without` return a new one. Equal to any mapping with the same items.
    """

    __slots__ = ("_records",)

    def __init__(
        self, records: Mapping[str, ContainerRecord] | Iterable[tuple[str, ContainerRecord]] = ()
    ) -> None:
        self._records: dict[str, ContainerRecord] = dict(records)

    def __getitem__(self, name: str) -> ContainerRecord:
        return self._records[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    # A record holding these is hashable, as a frozen dataclass is (`Mapping` defines none).
    def __hash__(self) -> int:
        return hash(frozenset(self._records.items()))

    def __repr__(self) -> str:
        return f"Containers({self._records!r})"

    def changes_since(self, before: Containers) -> tuple[list[str], list[tuple[str, ContainerRecord]]]:
        """What turns `before` into these slots: the names it held that these do not, and the slots
        these hold with another record than `before`'s (all of them when `before` is empty)."""
        old, new = before._records, self._records
        if not old:
            return [], list(new.items())
        freed = [name for name in old if name not in new]
        return freed, [(name, record) for name, record in new.items() if old.get(name) != record]

    def with_holder(self, name: str, record: ContainerRecord) -> Containers:
        """These slots with `name` held by `record` (given or replaced)."""
        return Containers({**self._records, name: record})

    def without(self, name: str) -> Containers:
        """These slots with `name` free."""
        return Containers({key: value for key, value in self._records.items() if key != name})


_NO_CONTAINERS: Final = Containers()


@dataclass(frozen=True, slots=True, kw_only=True)
class PodRecord:
    """One pod's quota bookkeeping; immutable (see the module docstring). Built with keywords only:
    three of its fields are ints."""

    cgroup_parent: str
    baseline: int | None  # microseconds per period; None = unlimited
    period: int
    baseline_source: str = "first-seen"  # pod-resources | first-seen | rebuilt | unknown
    containers: Containers = _NO_CONTAINERS

    @property
    def contribution(self) -> int:
        """Microseconds per period added for the live shared containers."""
        return sum([record.shared_cpus for record in self.containers._records.values()]) * self.period

    def target(self) -> int | None:
        """The pod's quota as it should be: baseline + contributions; None when unlimited."""
        return None if self.baseline is None else self.baseline + self.contribution

    def holding(self, name: str, record: ContainerRecord) -> PodRecord:
        """This pod with slot `name` held by `record`."""
        return self.with_slots(self.containers.with_holder(name, record))

    def without(self, name: str) -> PodRecord:
        """This pod with slot `name` free."""
        return self.with_slots(self.containers.without(name))

    def with_slots(self, containers: Containers) -> PodRecord:
        """This pod with `containers` for its slots."""
        return PodRecord(
            cgroup_parent=self.cgroup_parent,
            baseline=self.baseline,
            period=self.period,
            baseline_source=self.baseline_source,
            containers=containers,
        )

    def with_baseline(self, baseline: int | None, source: str, period: int | None = None) -> PodRecord:
        """This pod with `baseline` from `source` (and `period`, when given) for its own quota."""
        return PodRecord(
            cgroup_parent=self.cgroup_parent,
            baseline=baseline,
            period=self.period if period is None else period,
            baseline_source=source,
            containers=self.containers,
        )


class Books:
    """Every pod the plugin has raised (or may have to lower), and the device ids bound to slots
    (see the module docstring). ``pods`` and ``devices`` are mappings like dicts: change a pod by
    putting a new `PodRecord` under its key.

    Every write to them goes through the two methods of `WatchedMap`, which keep what events need
    at O(1) (the slot holding a container id, the devices of a slot or a pod) and note which keys
    changed since the last `take_changes`, so that saving costs what changed, not the whole books.
    """

    def __init__(
        self,
        pods: Mapping[str, PodRecord] | None = None,
        devices: Mapping[str, Slot] | None = None,
        pod_cgroups: dict[str, str] | None = None,
        spent: Mapping[str, Spent] | None = None,
    ) -> None:
        # Container id -> the slots holding it (one, unless the books were edited by hand).
        self._holding: dict[str, dict[Slot, None]] = {}
        # Device id -> the slots whose live record presented it.
        self._presented: dict[str, dict[Slot, None]] = {}
        # Slot -> its bound device ids; pod key -> the device ids bound to its slots.
        self._by_slot: dict[Slot, dict[str, None]] = {}
        self._by_pod: dict[str, dict[str, None]] = {}
        self._slot_count = 0
        # Pod key -> its record when it first changed since `take_changes` (None: it was absent);
        # the same for device ids.
        self._pod_changes: dict[str, PodRecord | None] = {}
        self._device_changes: dict[str, Slot | None] = {}
        self._spent_changes: dict[str, Spent | None] = {}
        self._pods: WatchedMap[PodRecord] = WatchedMap(self._pod_written)
        self._devices: WatchedMap[Slot] = WatchedMap(self._device_written)
        self._spent: WatchedMap[Spent] = WatchedMap(self._spent_written)
        self._pods.update(pods or {})
        # Device id -> the slot it is bound to. Without saved bindings, those of the live slots.
        self._devices.update(devices if devices is not None else self.live_devices())
        # Device id -> the newest allocation presented. Without saved ones (books from before they
        # were kept), the bindings' as allocation 0: older than any numbered marker.
        if spent is None:
            spent = {device: Spent(0, *slot) for device, slot in self._devices.items()}
        self._spent.update(spent)
        # Pod key -> cgroup parent of the pods devices were bound to, as the binding event (or
        # Synchronize) named it: where to look for a bound pod whose record is gone. An index, not
        # part of the books' value (not compared, not saved: Synchronize rebuilds it).
        self.pod_cgroups: dict[str, str] = pod_cgroups if pod_cgroups is not None else {}

    @property
    def pods(self) -> WatchedMap[PodRecord]:
        return self._pods

    @pods.setter
    def pods(self, pods: Mapping[str, PodRecord]) -> None:
        self._pods.replace_all(pods)

    @property
    def devices(self) -> WatchedMap[Slot]:
        return self._devices

    @devices.setter
    def devices(self, devices: Mapping[str, Slot]) -> None:
        self._devices.replace_all(devices)

    @property
    def spent(self) -> WatchedMap[Spent]:
        """Device id -> the newest allocation of it presented (see the module docstring)."""
        return self._spent

    @spent.setter
    def spent(self, spent: Mapping[str, Spent]) -> None:
        self._spent.replace_all(spent)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Books) and self.pods == other.pods and self.devices == other.devices

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Books({dict(self.pods)!r}, {dict(self.devices)!r})"

    def copy(self) -> Books:
        """Books that change apart from these (the records themselves are immutable, so shared)."""
        return Books(self.pods, self.devices, dict(self.pod_cgroups), self.spent)

    # -- what changed ------------------------------------------------------------------------------

    @property
    def changed(self) -> bool:
        """Whether anything was written since the last `take_changes`."""
        return bool(self._pod_changes or self._device_changes or self._spent_changes)

    def take_changes(self) -> tuple[dict[str, PodRecord | None], dict[str, Slot | None]]:
        """The pod keys and device ids written since the last call, each with what it held before
        the first of those writes (None: absent); the record starts afresh (`spent`'s too: take
        those first with `take_spent_changes` where they are saved)."""
        changes = self._pod_changes, self._device_changes
        self._pod_changes, self._device_changes, self._spent_changes = {}, {}, {}
        return changes

    def take_spent_changes(self) -> dict[str, Spent | None]:
        """The device ids whose `spent` entry was written since the last call (or `take_changes`),
        each with its entry before the first of those writes (None: absent)."""
        changes, self._spent_changes = self._spent_changes, {}
        return changes

    def _pod_written(self, key: str, old: PodRecord | None, new: PodRecord | None) -> None:
        self._pod_changes.setdefault(key, old)
        if old is not None:
            if new is not None and old.containers is new.containers:
                return  # the same slots (a new baseline, period or source): nothing to re-index
            slots = old.containers._records  # (the dict itself: Containers' methods cost a call each)
            self._slot_count -= len(slots)
            for name, record in slots.items():
                slot = Slot(key, name)
                _unindex(self._holding, record.id, slot)
                if record.device is not None:
                    _unindex(self._presented, record.device, slot)
        if new is not None:
            slots = new.containers._records
            self._slot_count += len(slots)
            for name, record in slots.items():
                slot = Slot(key, name)
                self._holding.setdefault(record.id, {})[slot] = None
                if record.device is not None:
                    self._presented.setdefault(record.device, {})[slot] = None

    def _device_written(self, device: str, old: Slot | None, new: Slot | None) -> None:
        self._device_changes.setdefault(device, old)
        if old is not None:
            _unindex(self._by_slot, old, device)
            _unindex(self._by_pod, old.pod, device)
        if new is not None:
            self._by_slot.setdefault(new, {})[device] = None
            self._by_pod.setdefault(new.pod, {})[device] = None

    def _spent_written(self, device: str, old: Spent | None, new: Spent | None) -> None:
        self._spent_changes.setdefault(device, old)

    # -- reading -----------------------------------------------------------------------------------

    def slots(self) -> Iterator[tuple[Slot, ContainerRecord]]:
        for key, pod in self.pods.items():
            for name, record in pod.containers.items():
                yield Slot(key, name), record

    def records(self) -> list[ContainerRecord]:
        """The record of every slot held (`slots` without naming the slots)."""
        return [record for pod in self.pods.values() for record in pod.containers._records.values()]

    def holder(self, slot: Slot) -> ContainerRecord | None:
        pod = self.pods.get(slot.pod)
        return pod.containers.get(slot.name) if pod is not None else None

    def holds(self, container_id: str) -> bool:
        """Whether the container id holds a slot (`find` without building its answer)."""
        return container_id in self._holding

    def find(self, container_id: str) -> tuple[Slot, ContainerRecord] | None:
        """The slot the container id holds, if any."""
        slots = self._holding.get(container_id)
        if not slots:
            return None
        slot = next(iter(slots))
        return slot, self.pods[slot.pod].containers[slot.name]

    @property
    def shared_containers(self) -> int:
        """How many containers hold a slot."""
        return self._slot_count

    def live_devices(self) -> dict[str, Slot]:
        """Device id -> the slot whose live container presented it."""
        return {record.device: slot for slot, record in self.slots() if record.device is not None}

    def device_holders(self) -> Mapping[str, Slot]:
        """Device id -> the slot it is bound to (for replay refusal): the bindings, and the device of
        every live slot (always bound to it already, unless the books were edited by hand). A view:
        looking one device up costs the same whatever the size of the books."""
        return _DeviceHolders(self)

    def bound_pods(self) -> set[str]:
        """The keys of the pods some device id is bound to."""
        return set(self._by_pod)

    def cgroup_parent(self, key: str) -> str | None:
        """The pod's cgroup parent as its record, or the event that bound a device to it, named it."""
        record = self.pods.get(key)
        return record.cgroup_parent if record is not None else self.pod_cgroups.get(key)

    # -- changing ----------------------------------------------------------------------------------

    def bind(self, device: str, slot: Slot, allocation: int | None = None) -> None:
        """Bind a device id to the slot that proved its request with it. A slot has one device: a
        slot presenting another one (a new allocation) gives up the one it had.

        `allocation`: the number of the allocation the slot presented (the caller has checked that it
        may: `policy.check_request`); it becomes the device's `spent` entry, or raises the slot's own.
        None: the slot's record again (a restart given back, an update): bound only while no other
        slot has presented a newer allocation of the device."""
        last = self.spent.get(device)
        if allocation is None:
            if last is not None and last.slot != slot:
                return  # a newer allocation took the device: it stays with that one
            allocation = 0
        if last is None or last.slot != slot or allocation > last.allocation:
            self.spent[device] = Spent(allocation, slot.pod, slot.name)
        for other in [d for d in self._by_slot.get(slot, ()) if d != device]:
            del self.devices[other]
        if self.devices.get(device) != slot:
            self.devices[device] = slot

    def newest_allocation(self) -> int:
        """The largest allocation number the books hold (0: none)."""
        return max((spent.allocation for spent in self.spent.values()), default=0)

    def bindings_at(self, slot: Slot, device: str | None) -> Bindings:
        """What `hold` of a record presenting `device` in `slot` may change of the bindings (the
        device's, and the slot's other devices'), to put back with `restore_bindings`."""
        touched: dict[str, Slot | None] = dict.fromkeys(self._by_slot.get(slot, ()), slot)
        spent: dict[str, Spent | None] = {}
        if device is not None:
            touched[device] = self.devices.get(device)
            spent[device] = self.spent.get(device)
        return Bindings(touched, spent)

    def restore_bindings(self, bindings: Bindings) -> None:
        """Put back bindings taken with `bindings_at` (None: unbound)."""
        for device, slot in bindings.devices.items():
            if slot is None:
                self.devices.pop(device, None)
            elif self.devices.get(device) != slot:
                self.devices[device] = slot
        for device, spent in bindings.spent.items():
            if spent is None:
                self.spent.pop(device, None)
            elif self.spent.get(device) != spent:
                self.spent[device] = spent

    def unbind_pod(self, key: str) -> list[str]:
        """The pod's sandbox was stopped or removed: kubelet's allocations to it are over. Returns the
        device ids set free (their `spent` entries stay: a copy of their markers is still refused)."""
        freed = sorted(self._by_pod.get(key, ()))
        for device in freed:
            del self.devices[device]
        self.pod_cgroups.pop(key, None)
        return freed

    def hold(
        self,
        slot: Slot,
        record: ContainerRecord,
        *,
        new_pod: PodRecord | None = None,
        allocation: int | None = None,
    ) -> ContainerRecord | None:
        """Give the slot to `record` (its pod must be known, or given as `new_pod`: a pod the books
        do not hold yet, put in with the slot held in one step) and bind its device id, if any, to
        the slot (`bind`, with `allocation`). Returns the record it replaced, if any."""
        pod = self.pods[slot.pod] if new_pod is None else new_pod
        previous = pod.containers.get(slot.name)
        self.pods[slot.pod] = pod.holding(slot.name, record)
        if record.device is not None:
            self.bind(record.device, slot, allocation)
            self.pod_cgroups[slot.pod] = pod.cgroup_parent
        return previous

    def displace(self, slot: Slot, container_id: str) -> ContainerRecord | None:
        """A container named like the slot is being created: an older instance holding it is dead."""
        pod = self.pods.get(slot.pod)
        if pod is None:
            return None
        previous = pod.containers.get(slot.name)
        if previous is None or previous.id == container_id:
            return None
        self.pods[slot.pod] = pod.without(slot.name)
        return previous

    def release(self, container_id: str) -> Slot | None:
        """The container stopped or went away: free its slot if it still holds one."""
        found = self.release_holder(container_id)
        return found[0] if found is not None else None

    def release_holder(self, container_id: str) -> tuple[Slot, ContainerRecord] | None:
        """`release`, returning the slot and the record that held it."""
        found = self.find(container_id)
        if found is None:
            return None
        slot, _ = found
        self.pods[slot.pod] = self.pods[slot.pod].without(slot.name)
        return found


class Bindings(NamedTuple):
    """Bindings and spent allocations as `Books.bindings_at` found them (None: absent)."""

    devices: dict[str, Slot | None]
    spent: dict[str, Spent | None]


_K = TypeVar("_K")
_V = TypeVar("_V")


def _unindex(index: dict[_K, dict[_V, None]], key: _K, value: _V) -> None:
    entries = index.get(key)
    if entries is not None:
        entries.pop(value, None)
        if not entries:
            del index[key]


class WatchedMap(MutableMapping[str, _V]):
    """A dict whose every write calls ``written(key, old, new)`` (None: absent), for `Books`.

    Only `__setitem__` and `__delitem__` write: ``pop``, ``update``, ``setdefault``, ``clear`` and
    the rest are `MutableMapping`'s, built on those two, so no way of writing can miss the call.
    Reads go straight to the dict. Equal to any mapping with the same items.
    """

    __slots__ = ("_data", "_written")

    def __init__(self, written: Callable[[str, _V | None, _V | None], None]) -> None:
        self._data: dict[str, _V] = {}
        self._written = written

    def __getitem__(self, key: str) -> _V:
        return self._data[key]

    def __setitem__(self, key: str, value: _V) -> None:
        old = self._data.get(key)
        self._data[key] = value
        self._written(key, old, value)

    def __delitem__(self, key: str) -> None:
        old = self._data.pop(key)
        self._written(key, old, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def get(self, key: str, default: _V | None = None) -> _V | None:  # type: ignore[override]
        return self._data.get(key, default)

    def keys(self) -> KeysView[str]:
        return self._data.keys()

    def values(self) -> ValuesView[_V]:
        return self._data.values()

    def items(self) -> ItemsView[str, _V]:
        return self._data.items()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, WatchedMap):
            return self._data == other._data
        if isinstance(other, Mapping):
            return self._data == dict(other.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._data)

    def replace_all(self, items: Mapping[str, _V]) -> None:
        """Hold exactly `items`: the keys not in it deleted, the others written."""
        given = dict(items.items())
        for key in [key for key in self._data if key not in given]:
            del self[key]
        for key, value in given.items():
            if self._data.get(key) is not value:
                self[key] = value


class _DeviceHolders(Mapping[str, Slot]):
    """`Books.device_holders`: the bindings over the devices the live slots presented."""

    __slots__ = ("_books",)

    def __init__(self, books: Books) -> None:
        self._books = books

    def __getitem__(self, device: str) -> Slot:
        bound = self._books.devices.get(device)
        if bound is not None:
            return bound
        presented = self._books._presented.get(device)
        if not presented:
            raise KeyError(device)
        return next(reversed(presented))

    def __iter__(self) -> Iterator[str]:
        return iter({**dict.fromkeys(self._books._presented), **dict.fromkeys(self._books.devices)})

    def __len__(self) -> int:
        return sum(1 for _ in self)
