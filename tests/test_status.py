"""The status snapshot (`nri_plugin.mixedcpu.status`, `nri_plugin.daemon.status.status_document`): pure
from hand-made books, then read back against the books after a scripted run through the runtime
simulator, every document checked against its JSON Schema (docs/status.schema.json)."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from mixedcpu_support import (
    GUARD,
    NAMINGS,
    PERIOD,
    FakeCgroups,
    FakeKubeletRecord,
    make_container,
    make_plugin,
    make_pod,
    marker,
    plugin_running,
)

from nri_plugin.common.backoff import Backoff
from nri_plugin.common.clock import ManualClock
from nri_plugin.daemon.status import StatusParts, count_prepared_claims, status_document
from nri_plugin.daemon.status_client import render_table
from nri_plugin.deviceplugin.marker import MARKER_ENV
from nri_plugin.dra import cdi
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin
from nri_plugin.mixedcpu.policy import choose_shared, cpus_or_empty, format_cpuset
from nri_plugin.mixedcpu.status import SCHEMA
from nri_plugin.nri.connection import ConnectionState
from nri_plugin.nri.identity import Identity
from nri_plugin.nri.simulator import RuntimeSimulator
from nri_plugin.nri.stub import Stub

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_FILE = ROOT / "docs" / "status.schema.json"
NAMING = NAMINGS[0]  # containerd, cgroupfs
T0 = 1_764_234_000.0  # 2025-11-27T09:00:00Z


def validate(document: dict[str, Any]) -> None:
    """The document against docs/status.schema.json (which is itself checked to be a valid schema)."""
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(document)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path for long test ids is longer.
    path = Path(tempfile.mkdtemp(prefix="mcpu-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


# -- read back against the books after a run through the simulator ----------------------------------------


DRA_OFF = {
    "enabled": False,
    "driver": None,
    "node": None,
    "kubelet": None,
    "resource_slices": None,
    "prepared_claims": None,
}


def _document(plugin: MixedCpuPlugin, stub: Stub, state: Path) -> dict[str, Any]:
    document = status_document(StatusParts(plugin, stub, None, "/etc/config.toml", str(state)))
    validate(document)
    assert document["schema"] == SCHEMA
    assert document["dra"] == DRA_OFF  # no DRA front door: off, like the device plugin's section
    return document


def _check_against_books(document: dict[str, Any], plugin: MixedCpuPlugin) -> None:
    """Every slot of the books is one container row with its record's values, every pod record a pod
    row with its baseline and target, and the quota now is what its cgroup file holds."""
    rows = {row["container_id"]: row for row in document["containers"]}
    held = {record.id: (slot, record) for slot, record in plugin.books.slots()}
    assert rows.keys() == held.keys()
    for cid, (slot, record) in held.items():
        row = rows[cid]
        assert (row["pod_key"], row["container"]) == (slot.pod, slot.name)
        assert row["exclusive_cpus"] == record.exclusive
        assert row["device"] == record.device
        pool = plugin.pool
        shared = choose_shared(pool.cpus, cpus_or_empty(record.exclusive), pool.numa_nodes).cpus
        assert row["shared_cpus"] == format_cpuset(shared)
        assert len(shared) == record.shared_cpus
    pods = {row["pod_key"]: row for row in document["pods"]}
    assert pods.keys() == set(plugin.books.pods)
    for key, pod_record in plugin.books.pods.items():
        assert pods[key]["quota_baseline_us"] == pod_record.baseline
        assert pods[key]["quota_target_us"] == pod_record.target()
        assert pods[key]["shared_containers"] == len(pod_record.containers)
    assert document["pool"]["containers"] == plugin.books.shared_containers


@pytest.mark.asyncio
async def test_a_scripted_run_reads_back_as_the_books_say(short_dir: Path) -> None:
    tree = FakeCgroups(short_dir / "cgroup", 2)
    state = short_dir / "state"
    kubelet = FakeKubeletRecord()
    plugin, key = make_plugin(state, tree.layout, trust_pod_annotation=True, allocations=kubelet)
    socket = short_dir / "nri.sock"
    sim = RuntimeSimulator(socket, runtime_name="containerd", runtime_version="v2.3.4", nri_version="v0.12.0")
    web = make_pod(NAMING, "uid-web", name="web")
    batch = make_pod(NAMING, "uid-batch", name="batch")
    batch.annotations["cpu-shared.crio.io/worker"] = "enable"
    legacy = make_pod(NAMING, "uid-legacy", name="legacy")
    for pod in (web, batch, legacy):
        tree.add_pod(pod, 2 * PERIOD)
    kubelet.allocate(web, "main", "shared-cpus-0")

    async with sim, plugin_running(plugin, socket, identity=Identity(name="status-test", index="42")) as stub:
        [registered] = await sim.wait_for_plugins(1, GUARD)
        await sim.wait_for_synchronizations(1, GUARD)
        empty = _document(plugin, stub, state)
        # The identity the stub was handed: the one the runtime knows it by.
        assert empty["runtime"]["plugin"] == registered.full_name == "42-status-test"
        assert empty["containers"] == []
        assert empty["pods"] == []
        assert empty["runtime"]["name"] == "containerd"
        assert empty["runtime"]["state"] == "ready"
        assert empty["runtime"]["connected_since"] is not None

        for pod in (web, batch, legacy):
            await sim.run_pod_sandbox(pod)
        main = make_container(NAMING, web, "c-main", "main", cpus="4-5", annotations=marker(key))
        main.created_at = int(T0 * 1e9)
        await sim.create_container(main)
        worker = make_container(NAMING, batch, "c-worker", "worker", cpus="6")
        await sim.create_container(worker)
        kubelet.reachable = False  # kubelet cannot be asked: the marker binding alone proves
        old = make_container(
            NAMING, legacy, "c-old", "old", cpus="7", annotations=marker(key, "shared-cpus-1")
        )
        await sim.create_container(old)
        tree.run_container(main)

        document = _document(plugin, stub, state)
        _check_against_books(document, plugin)
        proofs = {
            row["container"]: (row["namespace"], row["pod"], row["proof"]) for row in document["containers"]
        }
        assert proofs == {
            "main": ("ns", "web", "kubelet-record"),
            "worker": ("ns", "batch", "pod-annotation"),
            "old": ("ns", "legacy", "marker-binding"),
        }
        assert all(row["since"] is not None and row["shared_cpus"] == "0-1" for row in document["containers"])
        for row in document["pods"]:
            pod = {"uid-web": web, "uid-batch": batch, "uid-legacy": legacy}[row["pod_key"]]
            assert row["quota_now_us"] == tree.pod_quota(pod) == 4 * PERIOD == row["quota_target_us"]
            assert row["at_target"] is True
            assert row["quota_baseline_us"] == 2 * PERIOD

        await sim.stop_container("c-worker")
        await sim.remove_container("c-worker")
        after = _document(plugin, stub, state)
        _check_against_books(after, plugin)
        assert "c-worker" not in {row["container_id"] for row in after["containers"]}
        assert plugin.roster.get("c-worker") is None

    # A restarted daemon: the books from the state file, who holds them unknown until Synchronize,
    # which also heals the container the runtime no longer runs.
    sim.containers.pop("c-old")
    plugin.store.close()  # (the stopped daemon's lock on the database goes with it)
    restarted, _ = make_plugin(state, tree.layout, trust_pod_annotation=True, allocations=kubelet)
    kubelet.reachable = True
    async with sim, plugin_running(restarted, socket) as stub:
        await sim.wait_for_synchronizations(2, GUARD)  # (counted since the first run)
        resynced = _document(restarted, stub, state)
        _check_against_books(resynced, restarted)
        rows = {row["container"]: row for row in resynced["containers"]}
        assert rows.keys() == {"main"}
        assert (rows["main"]["namespace"], rows["main"]["pod"], rows["main"]["proof"]) == (
            "ns",
            "web",
            "kubelet-record",
        )
        assert rows["main"]["since"] == "2025-11-27T09:00:00Z"  # the runtime's creation time
        heals = [(heal["kind"], heal["container_id"] or heal["pod_key"]) for heal in resynced["heals"]]
        assert ("container_gone", "c-old") in heals


@pytest.mark.asyncio
async def test_the_runtime_part_follows_the_connection(short_dir: Path) -> None:
    tree = FakeCgroups(short_dir / "cgroup", 1)
    state = short_dir / "state"
    plugin, _ = make_plugin(state, tree.layout)
    socket = short_dir / "nri.sock"
    sim = RuntimeSimulator(socket, runtime_name="cri-o", runtime_version="1.36.3")
    async with sim, plugin_running(plugin, socket) as stub:
        await sim.wait_for_synchronizations(1, GUARD)
        runtime = _document(plugin, stub, state)["runtime"]
        assert (runtime["name"], runtime["version"], runtime["state"]) == ("cri-o", "1.36.3", "ready")
        assert runtime["connections"] == runtime["synchronizations"] == 1
    stopped = _document(plugin, stub, state)["runtime"]
    assert stopped["state"] == "stopped"
    assert stopped["connected_since"] is None


@pytest.mark.asyncio
async def test_a_lost_connection_shows_its_cause_and_time(short_dir: Path) -> None:
    """After the runtime goes away the runtime part says why and when (issue 31): ``last_lost`` in the
    document, and a line of the table; the stub then waits to reconnect (its clock is never advanced,
    so it stays in backing_off), which is no stall."""
    tree = FakeCgroups(short_dir / "cgroup", 1)
    state = short_dir / "state"
    plugin, _ = make_plugin(state, tree.layout)
    socket = short_dir / "nri.sock"
    sim = RuntimeSimulator(socket, runtime_name="containerd", runtime_version="v2.3.4")
    backoff = Backoff(initial=1.0, maximum=1.0, jitter=(1.0, 1.0))
    async with plugin_running(plugin, socket, reconnect=True, clock=ManualClock(), backoff=backoff) as stub:
        async with sim:
            await sim.wait_for_synchronizations(1, GUARD)
            serving = _document(plugin, stub, state)["runtime"]
            assert (serving["state"], serving["last_lost"], serving["stalled_seconds"]) == ("ready", None, 0)
        await asyncio.wait_for(stub.wait_for_state(ConnectionState.BACKING_OFF), GUARD)
        assert stub.lost is not None
        document = status_document(
            StatusParts(plugin, stub, None, "/etc/config.toml", str(state)), now=stub.lost.at + 12
        )
    validate(document)
    runtime = document["runtime"]
    assert runtime["state"] == "backing_off"
    assert runtime["stalled_seconds"] == 0
    assert runtime["connected_since"] is None
    at = runtime["last_lost"]["at"]
    assert runtime["last_lost"] == {"cause": "the runtime closed the connection", "at": at}
    assert serving["connected_since"] <= at <= document["time"]
    assert render_table(document).splitlines()[1:3] == [
        "runtime        containerd v2.3.4 (NRI v0.12.0): backing_off",
        f"  connection   lost {at} (12s ago): the runtime closed the connection; now backing_off",
    ]


@pytest.mark.asyncio
async def test_containers_served_through_dra_show_their_dra_device(short_dir: Path) -> None:
    """A DRA-served request shows as any other: its proof, and its device id ``dra.<device>``."""
    tree = FakeCgroups(short_dir / "cgroup", 2)
    state = short_dir / "state"
    kubelet = FakeKubeletRecord()
    plugin, key = make_plugin(state, tree.layout, allocations=kubelet)
    socket = short_dir / "nri.sock"
    sim = RuntimeSimulator(socket)
    recorded = make_pod(NAMING, "uid-rec", name="recorded")
    bound = make_pod(NAMING, "uid-bound", name="bound")
    for pod in (recorded, bound):
        tree.add_pod(pod, 2 * PERIOD)
    kubelet.allocate(recorded, "main", "dra.shared-cpus-3")
    async with sim, plugin_running(plugin, socket) as stub:
        await sim.wait_for_synchronizations(1, GUARD)
        for pod in (recorded, bound):
            await sim.run_pod_sandbox(pod)
        env = f"{MARKER_ENV}={key.sign('dra.shared-cpus-3')}"
        await sim.create_container(make_container(NAMING, recorded, "c-rec", "main", cpus="4-5", env=(env,)))
        kubelet.reachable = False  # kubelet cannot be asked: the marker binding alone proves
        env = f"{MARKER_ENV}={key.sign('dra.shared-cpus-4')}"
        await sim.create_container(make_container(NAMING, bound, "c-bound", "main", cpus="6", env=(env,)))
        document = _document(plugin, stub, state)
    _check_against_books(document, plugin)
    rows = {row["pod"]: (row["proof"], row["device"]) for row in document["containers"]}
    assert rows == {
        "recorded": ("kubelet-record", "dra.shared-cpus-3"),
        "bound": ("marker-binding", "dra.shared-cpus-4"),
    }


def test_prepared_claims_are_counted_from_our_spec_file_names(tmp_path: Path) -> None:
    cdi_dir = tmp_path / "cdi"
    assert count_prepared_claims(str(cdi_dir)) == {"count": 0, "capped": False, "read_error": None}
    cdi_dir.mkdir()
    uids = [f"{n:08x}-0000-4000-8000-000000000000" for n in range(5)]
    for uid in uids:
        cdi.spec_path(cdi_dir, uid).write_text("{}")  # the name is what counts: nothing is read
    # Not ours, or not a spec: another vendor's spec, a spec being written (atomicfile's temporary
    # name), a name that is no claim UID, a directory of our name.
    (cdi_dir / "nvidia.com-gpu.json").write_text("{}")
    (cdi_dir / f".{cdi.spec_path(cdi_dir, uids[0]).name}.0a1b2c3d4e5f.tmp").write_text("{}")
    (cdi_dir / "mixed-cpu.openshift.io-shared-cpus_not-a-uid.json").write_text("{}")
    cdi.spec_path(cdi_dir, "ffffffff-0000-4000-8000-000000000000").mkdir()
    assert count_prepared_claims(str(cdi_dir)) == {"count": 5, "capped": False, "read_error": None}
    assert count_prepared_claims(str(cdi_dir), limit=5) == {"count": 5, "capped": False, "read_error": None}
    assert count_prepared_claims(str(cdi_dir), limit=3) == {"count": 3, "capped": True, "read_error": None}

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    unreadable = count_prepared_claims(str(not_a_dir))
    assert unreadable == {
        "count": None,
        "capped": False,
        "read_error": f"cannot list {not_a_dir}: Not a directory",
    }
