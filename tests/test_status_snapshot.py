"""The status snapshot's domain part (`nri_plugin.mixedcpu.status`): pure, from hand-made books and
roster to plain data; and its JSON Schema (docs/status.schema.json) is a valid one."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
from mixedcpu_support import PERIOD

from nri_plugin.mixedcpu.books import Books, ContainerRecord, PodRecord, Slot
from nri_plugin.mixedcpu.policy import SharedPool
from nri_plugin.mixedcpu.status import SCHEMA, HealNote, Holder, QuotaReading, Roster, domain_snapshot

SCHEMA_FILE = Path(__file__).resolve().parent.parent / "docs" / "status.schema.json"
T0 = 1_764_234_000.0  # 2025-11-27T09:00:00Z


def test_the_schema_file_is_a_valid_json_schema_of_this_version() -> None:
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["properties"]["schema"] == {"const": SCHEMA}


# -- pure: books in, dict out ----------------------------------------------------------------------------


def test_the_snapshot_says_who_holds_what_from_the_books_and_the_roster() -> None:
    books = Books()
    pod_a = PodRecord(cgroup_parent="/kubepods/poda", baseline=2 * PERIOD, period=PERIOD)
    books.hold(Slot("a", "main"), ContainerRecord("c1", 1, "2-3", "shared-cpus-0"), new_pod=pod_a)
    pod_b = PodRecord(cgroup_parent="/kubepods/podb", baseline=None, period=PERIOD, baseline_source="rebuilt")
    books.hold(Slot("b", "side"), ContainerRecord("c2", 1, "6", None), new_pod=pod_b)
    roster = Roster()
    roster.given("c1", Holder("ns", "web", "kubelet", T0), books)
    # c2: not in the roster (the books loaded from the state file, before Synchronize).
    pool = SharedPool(frozenset({0, 4}), {0: frozenset({0, 1, 2, 3}), 1: frozenset({4, 5, 6, 7})})
    heal = HealNote(
        T0 + 60,
        "pod_quota",
        "pod quota was off its target: brought back",
        {"why": "x", "pod_key": "a", "namespace": "ns", "pod": "web"},
    )
    snapshot = domain_snapshot(
        books,
        roster,
        pool,
        quotas_now={"a": QuotaReading(2 * PERIOD), "b": QuotaReading(None, "permission denied")},
        retries={"a"},
        heals=[heal],
    )
    assert snapshot == {
        "pool": {
            "cpus": "0,4",
            "numa_local": True,
            "numa_nodes": [
                {"node": 0, "cpus": "0", "containers": 1},
                {"node": 1, "cpus": "4", "containers": 1},
            ],
            "containers": 2,
        },
        "containers": [
            {
                "namespace": "ns",
                "pod": "web",
                "container": "main",
                "pod_key": "a",
                "container_id": "c1",
                "exclusive_cpus": "2-3",
                "shared_cpus": "0",
                "proof": "kubelet-record",
                "device": "shared-cpus-0",
                "since": "2025-11-27T09:00:00Z",
            },
            {
                "namespace": None,
                "pod": None,
                "container": "side",
                "pod_key": "b",
                "container_id": "c2",
                "exclusive_cpus": "6",
                "shared_cpus": "4",
                "proof": None,
                "device": None,
                "since": None,
            },
        ],
        "pods": [
            {
                "pod_key": "a",
                "namespace": "ns",
                "pod": "web",
                "cgroup_parent": "/kubepods/poda",
                "period_us": PERIOD,
                "quota_now_us": 2 * PERIOD,
                "quota_target_us": 3 * PERIOD,
                "quota_baseline_us": 2 * PERIOD,
                "baseline_source": "first-seen",
                "at_target": False,
                "read_error": None,
                "shared_containers": 1,
                "lowering_retry_pending": True,
            },
            {
                "pod_key": "b",
                "namespace": None,
                "pod": None,
                "cgroup_parent": "/kubepods/podb",
                "period_us": PERIOD,
                "quota_now_us": None,
                "quota_target_us": None,
                "quota_baseline_us": None,
                "baseline_source": "rebuilt",
                "at_target": None,
                "read_error": "permission denied",
                "shared_containers": 1,
                "lowering_retry_pending": False,
            },
        ],
        "heals": [
            {
                "at": "2025-11-27T09:01:00Z",
                "kind": "pod_quota",
                "message": "pod quota was off its target: brought back",
                "why": "x",
                "pod_key": "a",
                "container_id": None,
                "namespace": "ns",
                "pod": "web",
            }
        ],
    }


def test_the_roster_keeps_only_what_the_books_hold() -> None:
    books = Books()
    pod = PodRecord(cgroup_parent="/kubepods/poda", baseline=PERIOD, period=PERIOD)
    books.hold(Slot("a", "main"), ContainerRecord("live", 1, "2"), new_pod=pod)
    roster = Roster()
    roster.given("live", Holder("ns", "p", "pod-annotation", T0), books)
    for n in range(200):  # shares given back by heals, with no event to release them
        roster.given(f"gone{n}", Holder("ns", "p", "pod-annotation", T0), books)
    assert len(roster) <= 2 * books.shared_containers + 64 + 1
    assert roster.get("live") is not None
    roster.rebuild(books, {"new": Holder("ns", "p", "kubelet", None)})
    assert len(roster) == 1
    assert roster.get("live") == Holder("ns", "p", "pod-annotation", T0)
    roster.released("live")
    assert roster.get("live") is None


def _field_names(schema: dict[str, object]) -> set[str]:
    """Every property name the schema defines, at any depth."""
    names: set[str] = set()
    properties = schema.get("properties")
    if isinstance(properties, dict):
        names |= set(properties)
        for sub in properties.values():
            if isinstance(sub, dict):
                names |= _field_names(sub)
    items = schema.get("items")
    if isinstance(items, dict):
        names |= _field_names(items)
    return names


def test_docs_status_md_documents_every_field_of_the_schema() -> None:
    schema = json.loads(SCHEMA_FILE.read_text())
    documented = (SCHEMA_FILE.parent / "status.md").read_text()
    missing = sorted(name for name in _field_names(schema) if f"`{name}`" not in documented)
    assert missing == []
