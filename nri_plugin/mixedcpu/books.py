"""The books: what the plugin added to each pod's CFS quota, for whom, and which device ids are bound.

Plain data with pure operations; no I/O (the state file is `nri_plugin.mixedcpu.store`).

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

Device ids are *bound* to slots (``devices``): the first slot that presents a valid marker for a
device id is bound to it, and stays bound while its container stops, restarts and is removed, until
the runtime stops or removes that pod's sandbox (when kubelet's allocation of the device to that pod
ends). A marker whose device id is bound to another slot is a replay, refused even while the
rightful holder is stopped (crash-loop back-off, a restart under way); its own restart is accepted.
A runtime does not always report a pod's end (containerd forgets the pods it ran before its own
restart), so the reconciler (`nri_plugin.mixedcpu.heal`) also ends a binding when the pod's cgroup
is gone: ``pod_cgroups`` remembers where each bound pod's cgroup is, even once its record is dropped.

Records are immutable: `PodRecord`, its `Containers` and `ContainerRecord` cannot be changed in place
(assigning a field raises), so every change makes a new record and puts it in ``Books.pods`` in place
of the old one. Whatever is derived from a record, such as its text in the state file, therefore
stays right for as long as that same record object is in the books: there is no "changed" flag for a
new field or method to forget.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass, field, replace

__all__ = ["Books", "ContainerRecord", "Containers", "PodRecord", "Slot"]


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

    def __contains__(self, name: object) -> bool:
        return name in self._records

    # The dict's own views (read-only) are several times faster to walk than Mapping's generic ones.
    def keys(self) -> KeysView[str]:
        return self._records.keys()

    def values(self) -> ValuesView[ContainerRecord]:
        return self._records.values()

    def items(self) -> ItemsView[str, ContainerRecord]:
        return self._records.items()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Containers):
            return self._records == other._records
        if isinstance(other, Mapping):
            return self._records == dict(other.items())
        return NotImplemented

    def __hash__(self) -> int:
        return hash(frozenset(self._records.items()))

    def __repr__(self) -> str:
        return f"Containers({self._records!r})"

    def __reduce__(self) -> tuple[type[Containers], tuple[dict[str, ContainerRecord]]]:
        return Containers, (self._records,)

    def with_holder(self, name: str, record: ContainerRecord) -> Containers:
        """These slots with `name` held by `record` (given or replaced)."""
        return Containers({**self._records, name: record})

    def without(self, name: str) -> Containers:
        """These slots with `name` free."""
        return Containers({key: value for key, value in self._records.items() if key != name})


@dataclass(frozen=True, slots=True)
class PodRecord:
    """One pod's quota bookkeeping; immutable (see the module docstring)."""

    cgroup_parent: str
    baseline: int | None  # microseconds per period; None = unlimited
    period: int
    baseline_source: str = "first-seen"  # pod-resources | first-seen | rebuilt | unknown
    containers: Containers = field(default_factory=Containers)

    def __post_init__(self) -> None:
        if not isinstance(self.containers, Containers):  # a plain mapping: frozen here, not shared
            object.__setattr__(self, "containers", Containers(self.containers))

    @property
    def contribution(self) -> int:
        """Microseconds per period added for the live shared containers."""
        return sum(record.shared_cpus for record in self.containers.values()) * self.period

    def target(self) -> int | None:
        """The pod's quota as it should be: baseline + contributions; None when unlimited."""
        return None if self.baseline is None else self.baseline + self.contribution

    def holding(self, name: str, record: ContainerRecord) -> PodRecord:
        """This pod with slot `name` held by `record`."""
        return replace(self, containers=self.containers.with_holder(name, record))

    def without(self, name: str) -> PodRecord:
        """This pod with slot `name` free."""
        return replace(self, containers=self.containers.without(name))


class Books:
    """Every pod the plugin has raised (or may have to lower), and the device ids bound to slots
    (see the module docstring). ``pods`` and ``devices`` are plain dicts: change a pod by putting a
    new `PodRecord` under its key."""

    def __init__(
        self,
        pods: dict[str, PodRecord] | None = None,
        devices: dict[str, Slot] | None = None,
        pod_cgroups: dict[str, str] | None = None,
    ) -> None:
        self.pods: dict[str, PodRecord] = pods if pods is not None else {}
        # Device id -> the slot it is bound to. Without saved bindings, those of the live slots.
        self.devices: dict[str, Slot] = devices if devices is not None else self.live_devices()
        # Pod key -> cgroup parent of the pods devices were bound to, as the binding event (or
        # Synchronize) named it: where to look for a bound pod whose record is gone. An index, not
        # part of the books' value (not compared, not saved: Synchronize rebuilds it).
        self.pod_cgroups: dict[str, str] = pod_cgroups if pod_cgroups is not None else {}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Books) and self.pods == other.pods and self.devices == other.devices

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Books({self.pods!r}, {self.devices!r})"

    def copy(self) -> Books:
        """Books that change apart from these (the records themselves are immutable, so shared)."""
        return Books(dict(self.pods), dict(self.devices), dict(self.pod_cgroups))

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

    @property
    def shared_containers(self) -> int:
        """How many containers hold a slot."""
        return sum(len(pod.containers) for pod in self.pods.values())

    def live_devices(self) -> dict[str, Slot]:
        """Device id -> the slot whose live container presented it."""
        return {record.device: slot for slot, record in self.slots() if record.device is not None}

    def device_holders(self) -> dict[str, Slot]:
        """Device id -> the slot it is bound to (for replay refusal): the bindings, and the device of
        every live slot (always bound to it already, unless the books were edited by hand)."""
        holders = self.live_devices()
        holders.update(self.devices)
        return holders

    def bound_pods(self) -> set[str]:
        """The keys of the pods some device id is bound to."""
        return {slot.pod for slot in self.devices.values()}

    def cgroup_parent(self, key: str) -> str | None:
        """The pod's cgroup parent as its record, or the event that bound a device to it, named it."""
        record = self.pods.get(key)
        return record.cgroup_parent if record is not None else self.pod_cgroups.get(key)

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
        self.pod_cgroups.pop(key, None)
        return freed

    def hold(self, slot: Slot, record: ContainerRecord) -> ContainerRecord | None:
        """Give the slot to `record` (its pod must be known) and bind its device id, if any, to the
        slot. Returns the record it replaced, if any."""
        pod = self.pods[slot.pod]
        previous = pod.containers.get(slot.name)
        self.pods[slot.pod] = pod.holding(slot.name, record)
        if record.device is not None:
            self.bind(record.device, slot)
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
