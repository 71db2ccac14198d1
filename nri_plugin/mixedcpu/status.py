"""The domain's part of ``mixed-cpu-nri-plugin status``: who holds the shared CPUs now, and why.

Pure: the books, the roster and the shared pool in, plain JSON-ready data out; no I/O, no clock.
The daemon (`nri_plugin.daemon.status`) adds what only it knows (the runtime's connection, the
device plugin's registration, kubelet's PodResources API, the pod quotas read from their cgroups),
and serves the whole document; docs/status.md documents every field, docs/status.schema.json is its
JSON Schema.

The books know each shared container by its pod's key (the UID) and its name, with its exclusive
CPUs, its number of shared CPUs and its device id, but not its pod's namespace and name, what proved
its request, nor since when it holds the CPUs: the `Roster` keeps those, by container id, as the
handlers learn them (CreateContainer, Synchronize). A container the books hold and the roster does
not know (the books loaded from the state file, before the runtime's Synchronize) is shown with
those fields null.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from nri_plugin.mixedcpu.books import Books, ContainerRecord, PodRecord, Slot
from nri_plugin.mixedcpu.policy import SharedPool, choose_shared, cpus_or_empty, format_cpuset, shared_by_node

__all__ = [
    "PROOFS",
    "RECENT_HEALS",
    "SCHEMA",
    "HealNote",
    "Holder",
    "QuotaReading",
    "Roster",
    "domain_snapshot",
    "rfc3339",
]

# The document's name and version: a reader checks it before it reads anything else. A field added
# keeps the version; a field removed, renamed or given another meaning makes a new one.
SCHEMA: Final = "mixed-cpu-nri-plugin/status/v1"
# How many of the latest heals the healer keeps for the status.
RECENT_HEALS: Final = 20
# What proved a request (`policy.Proof.source`) -> how the status names it.
PROOFS: Final = {
    "kubelet": "kubelet-record",
    "device-plugin": "marker-binding",
    "pod-annotation": "pod-annotation",
}


class Holder(NamedTuple):
    """What the books do not say about a shared container: its pod's namespace and name, what proved
    its request (a `policy.Proof.source`), and since when it holds the shared CPUs (seconds since the
    epoch; None: not known)."""

    namespace: str
    pod: str
    proof: str
    since: float | None


class HealNote(NamedTuple):
    """One heal, as the healer logged it (`heal.Healer.recent`): when (seconds since the epoch), its
    kind (`heal.HEAL_KINDS`), the log line's message and its fields."""

    at: float
    kind: str
    message: str
    fields: Mapping[str, object]


class QuotaReading(NamedTuple):
    """A pod cgroup's CFS quota as the daemon read it: microseconds per period (None: unlimited), or
    why it could not be read (`error`)."""

    quota: int | None
    error: str | None = None


class Roster:
    """Container id -> its `Holder`, for the containers the books hold; see the module docstring.

    Entries of containers that gave their share back are dropped at their release, at Synchronize
    (which rebuilds the roster with the books), or once the roster holds far more entries than the
    books hold containers (a heal that released them without an event).
    """

    def __init__(self) -> None:
        self._holders: dict[str, Holder] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def get(self, container_id: str) -> Holder | None:
        return self._holders.get(container_id)

    def given(self, container_id: str, holder: Holder, books: Books) -> None:
        """The container was given its share (a creation, or a start after it was given back)."""
        self._holders[container_id] = holder
        if len(self._holders) > 2 * books.shared_containers + 64:
            self._holders = {cid: h for cid, h in self._holders.items() if books.holds(cid)}

    def of_pod(self, record: PodRecord | None) -> Holder | None:
        """Who one of the pod's shared containers is (its namespace and name are the pod's)."""
        if record is None:
            return None
        return next((h for held in record.containers.values() if (h := self.get(held.id)) is not None), None)

    def released(self, container_id: str) -> None:
        self._holders.pop(container_id, None)

    def rebuild(self, books: Books, found: Mapping[str, Holder]) -> None:
        """After Synchronize: an entry for each container `books` hold, the one known before when
        there is one (it keeps its `since`), else the one `found` at Synchronize."""
        holders: dict[str, Holder] = {}
        for record in books.records():
            holder = self._holders.get(record.id) or found.get(record.id)
            if holder is not None:
                holders[record.id] = holder
        self._holders = holders


def rfc3339(seconds: float | None) -> str | None:
    """Seconds since the epoch as an RFC 3339 UTC time to the second (None stays None)."""
    if seconds is None:
        return None
    moment = datetime.datetime.fromtimestamp(int(seconds), tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def domain_snapshot(
    books: Books,
    roster: Roster,
    pool: SharedPool,
    *,
    quotas_now: Mapping[str, QuotaReading] | None = None,
    retries: Iterable[str] = (),
    heals: Sequence[HealNote] = (),
) -> dict[str, Any]:
    """The ``pool``, ``containers``, ``pods`` and ``heals`` of the status document (docs/status.md).

    `quotas_now`: pod key -> its cgroup's quota as read now (a pod not in it: not read, shown null);
    `retries`: the pod keys whose lowering waits for a retry; `heals`: the latest first."""
    slots = sorted(books.slots(), key=lambda item: (item[0].pod, item[0].name))
    choices = {slot: _shared_of(pool, record) for slot, record in slots}
    return {
        "pool": _pool(pool, choices.values()),
        "containers": [
            _container(slot, record, roster.get(record.id), choices[slot]) for slot, record in slots
        ],
        "pods": _pods(books, roster, quotas_now or {}, frozenset(retries)),
        "heals": [_heal(note) for note in heals],
    }


def _shared_of(pool: SharedPool, record: ContainerRecord) -> frozenset[int]:
    """The shared CPUs the container holds: the pool's choice for its exclusive CPUs."""
    return choose_shared(pool.cpus, cpus_or_empty(record.exclusive), pool.numa_nodes).cpus


def _pool(pool: SharedPool, given: Iterable[frozenset[int]]) -> dict[str, Any]:
    held = list(given)
    nodes = []
    if pool.numa_nodes is not None:
        for node, cpus in shared_by_node(pool.cpus, pool.numa_nodes).items():
            users = sum(1 for shared in held if shared & cpus)
            nodes.append({"node": node, "cpus": format_cpuset(cpus), "containers": users})
    return {
        "cpus": format_cpuset(pool.cpus),
        "numa_local": pool.numa_nodes is not None,
        "numa_nodes": nodes,
        "containers": len(held),
    }


def _container(
    slot: Slot, record: ContainerRecord, holder: Holder | None, shared: frozenset[int]
) -> dict[str, Any]:
    return {
        "namespace": holder.namespace if holder else None,
        "pod": holder.pod if holder else None,
        "container": slot.name,
        "pod_key": slot.pod,
        "container_id": record.id,
        "exclusive_cpus": record.exclusive,
        "shared_cpus": format_cpuset(shared),
        "proof": PROOFS.get(holder.proof, holder.proof) if holder else None,
        "device": record.device,
        "since": rfc3339(holder.since) if holder else None,
    }


def _pods(
    books: Books, roster: Roster, quotas_now: Mapping[str, QuotaReading], retries: frozenset[str]
) -> list[dict[str, Any]]:
    rows = []
    for key in sorted(books.pods):
        record = books.pods[key]
        names = [roster.get(held.id) for held in record.containers.values()]
        known = next((holder for holder in names if holder is not None), None)
        reading = quotas_now.get(key)
        target = record.target()
        now = reading.quota if reading is not None and reading.error is None else None
        rows.append(
            {
                "pod_key": key,
                "namespace": known.namespace if known else None,
                "pod": known.pod if known else None,
                "cgroup_parent": record.cgroup_parent,
                "period_us": record.period,
                "quota_now_us": now,
                "quota_target_us": target,
                "quota_baseline_us": record.baseline,
                "baseline_source": record.baseline_source,
                "at_target": None if reading is None or reading.error is not None else now == target,
                "read_error": reading.error if reading is not None else None,
                "shared_containers": len(record.containers),
                "lowering_retry_pending": key in retries,
            }
        )
    return rows


def _heal(note: HealNote) -> dict[str, Any]:
    fields = note.fields
    slot = fields.get("slot")
    pod_key = fields.get("pod_key") or (str(slot).rpartition("/")[0] if slot else None)
    return {
        "at": rfc3339(note.at),
        "kind": note.kind,
        "message": note.message,
        "why": str(fields.get("why", "")),
        "pod_key": str(pod_key) if pod_key else None,
        "namespace": str(fields["namespace"]) if fields.get("namespace") else None,
        "pod": str(fields["pod"]) if fields.get("pod") else None,
        "container_id": str(fields["container_id"]) if fields.get("container_id") else None,
    }
