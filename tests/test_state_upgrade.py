"""Upgrades keep the books: state dirs that 0.1.0 wrote, and hand-corrupted copies of them, loaded by
this version under the pods that 0.1.0 left running.

tests/data/state-0.1.0/ was written once by mixed-cpu-nri-plugin 0.1.0 (commit dbec8d5), and
tests/data/state-0.2.0/ by the last JSON books of 0.2.0 from those; neither is ever regenerated (their
READMEs say how they were made): a node (containerd, cgroupfs, cgroup v2) where pod
``fwd`` holds one shared container (restarted once), pod ``web`` two, and pod ``batch`` had one that
was removed. ``killed`` is the state dir as a SIGKILL left it (the last slot change not yet written),
``stopped`` as a stop left it (a snapshot and its journal), ``compacted`` one snapshot.
``runtime.json`` is what the runtime and the cgroup tree held then. This version moves those files
into its database at its first start (`nri_plugin.mixedcpu.store`) and deletes them.

Each test puts the runtime and the cgroup tree back as they were, starts this version's plugin on a
copy of the state dir, and lets the runtime synchronize it: no pod quota may be raised again, no
update sent, no binding lost; then the shared containers stop, and every pod quota must come back to
exactly its baseline. The state dir's format file (`nri_plugin.daemon.stateformat`) is tested here
too: a 0.1.0 state dir gets one, a newer daemon's is refused with one line.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.json_format import ParseDict
from mixedcpu_support import (
    GUARD,
    PERIOD,
    FakeCgroups,
    Naming,
    make_container,
    make_plugin,
    marker,
    plugin_running,
    run_cli,
    write_daemon_config,
)
from redteam_support import short_directory
from wait_support import wait_until

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.common.buildinfo import version_line
from nri_plugin.daemon.stateformat import (
    STATE_FORMAT,
    STATE_FORMAT_FILE,
    StateFormatError,
    read_state_format,
    settle_state_format,
)
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key
from nri_plugin.mixedcpu.books import Slot
from nri_plugin.mixedcpu.legacy import LEGACY_FILE_NAME
from nri_plugin.mixedcpu.store import STATE_FILE_NAME, StateStore
from nri_plugin.nri.simulator import RuntimeSimulator

FIXTURES = Path(__file__).resolve().parent / "data" / "state-0.1.0"
FIXTURES_0_2_0 = Path(__file__).resolve().parent / "data" / "state-0.2.0"
RUNTIME: dict[str, Any] = json.loads((FIXTURES / "runtime.json").read_text())
POD_A, POD_B, POD_C = sorted(RUNTIME["baselines"])
# What 0.1.0 had raised each pod quota to, and each pod's own quota (kubelet's).
RAISED = {POD_A: 500_000, POD_B: 800_000, POD_C: 200_000}
BASELINES = {POD_A: 300_000, POD_B: 400_000, POD_C: 200_000}
# The devices 0.1.0 had bound, as its books said: three held by running containers, one by the
# removed container of pod batch (a binding outlives its holder).
BINDINGS = {
    "shared-cpus-0": Slot(POD_A, "fwd"),
    "shared-cpus-1": Slot(POD_B, "web"),
    "shared-cpus-2": Slot(POD_B, "log"),
    "shared-cpus-3": Slot(POD_C, "job"),
}
LIVE_BINDINGS = {device: slot for device, slot in BINDINGS.items() if slot.pod != POD_C}
SHARED_CONTAINERS = ("a-fwd-2", "b-log", "b-web")
NAMING = Naming("containerd", "cgroupfs")


def test_the_fixtures_are_what_0_1_0_left() -> None:
    """The numbers above are the fixtures', not guesses: the cgroup tree as 0.1.0 left it."""
    assert RUNTIME["pod_quotas"] == RAISED
    assert RUNTIME["baselines"] == BASELINES
    assert {c["id"] for c in RUNTIME["containers"]} == {"a-side", *SHARED_CONTAINERS}
    for name in ("killed", "stopped", "compacted"):
        assert not (FIXTURES / name / STATE_FORMAT_FILE).exists(), "0.1.0 wrote no format file"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    with short_directory("up-") as path:  # unix socket paths are limited to 107 bytes
        yield path


def copy_state(name: str, state: Path, fixtures: Path = FIXTURES) -> Path:
    """The fixture `name` as a state dir at `state`, with the modes the daemon gives it (git keeps
    none but the executable bit)."""
    shutil.copytree(fixtures / name, state)
    os.chmod(state, 0o700)
    for path in state.iterdir():
        os.chmod(path, 0o600)
    return state


class Node:
    """The runtime and the cgroup tree as 0.1.0 left them: pods at their raised quotas, containers
    running with the cpus and quotas 0.1.0 gave them."""

    def __init__(self, root: Path) -> None:
        self.socket = root / "nri.sock"
        self.tree = FakeCgroups(root / "cgroup", 2)
        self.sim = RuntimeSimulator(
            self.socket, runtime_name="containerd", runtime_version="v2.3.4", nri_version="v0.12.0"
        )
        self.pods: dict[str, api.PodSandbox] = {}
        for raw in RUNTIME["pods"]:
            pod = ParseDict(raw, api.PodSandbox())
            self.pods[pod.uid] = pod
            self.sim.add_pod(pod)
            self.tree.add_pod(pod, RUNTIME["pod_quotas"][pod.uid])
        for raw in RUNTIME["containers"]:
            container = ParseDict(raw, api.Container())
            self.sim.add_container(container)
            self.tree.run_container(container)

    def quotas(self) -> dict[str, int | None]:
        return {uid: self.tree.pod_quota(pod) for uid, pod in self.pods.items()}

    async def stop(self, container_id: str) -> None:
        container = self.sim.containers[container_id]
        await self.sim.stop_container(container_id)
        await self.sim.remove_container(container_id)
        self.tree.remove_container(container)


async def upgrade(root: Path, state: Path, *, bindings: dict[str, Slot]) -> None:
    """This version's plugin on `state` under the node 0.1.0 left: nothing raised twice, no update,
    the `bindings` kept; then every shared container ends and each pod is back at its baseline."""
    node = Node(root)
    plugin, _ = make_plugin(state, node.tree.layout)
    async with node.sim, plugin_running(plugin, node.socket):
        await node.sim.wait_for_plugins(1, GUARD)
        assert node.quotas() == RAISED, "a pod quota raised again by the upgrade"
        assert node.sim.applied_updates == [], "the running containers needed no change"
        assert {d: s for d, s in plugin.books.devices.items() if d in bindings} == bindings
        for container_id in SHARED_CONTAINERS:
            await node.stop(container_id)
        assert node.quotas() == BASELINES
        assert [r for r in node.sim.records if r.outcome != "ok" and r.event != "drop"] == []


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["killed", "stopped", "compacted"])
async def test_a_state_dir_of_0_1_0_keeps_every_quota_and_binding(short_dir: Path, name: str) -> None:
    state = copy_state(name, short_dir / "state")
    await upgrade(short_dir, state, bindings=BINDINGS)


def _legacy_files(state: Path) -> list[str]:
    return sorted(path.name for path in state.iterdir() if path.name.startswith(LEGACY_FILE_NAME))


@pytest.mark.parametrize(
    ("fixtures", "name"),
    [(FIXTURES, "killed"), (FIXTURES, "stopped"), (FIXTURES, "compacted"), (FIXTURES_0_2_0, "journaled")],
)
def test_the_old_files_are_moved_into_the_database_once(tmp_path: Path, fixtures: Path, name: str) -> None:
    """Read once, written in one transaction, then deleted; killed before they were deleted, the
    next start moves them again to the same books."""
    state = copy_state(name, tmp_path / "state", fixtures)
    assert _legacy_files(state)
    store = StateStore(str(state))
    books = store.load()
    store.close()
    assert books.devices == BINDINGS, "this version reads the old books"
    assert _legacy_files(state) == []
    assert (state / STATE_FILE_NAME).is_file()
    again = StateStore(str(state)).load()
    assert (again.pods, again.devices, again.spent) == (books.pods, books.devices, books.spent)
    for path in (fixtures / name).iterdir():  # killed between the transaction and the deletes
        if path.name.startswith(LEGACY_FILE_NAME):
            shutil.copy(path, state / path.name)
    after = StateStore(str(state)).load()
    assert (after.pods, after.devices, after.spent) == (books.pods, books.devices, books.spent)
    assert _legacy_files(state) == []


def test_the_journal_of_0_2_0_is_replayed(tmp_path: Path) -> None:
    """The journal's last line (pod fwd's own quota written ahead, from another source) is in the
    books moved; the snapshot alone has the one before it."""
    journaled = StateStore(str(copy_state("journaled", tmp_path / "j", FIXTURES_0_2_0))).load()
    snapshot = StateStore(str(copy_state("snapshot", tmp_path / "s", FIXTURES_0_2_0))).load()
    assert journaled.pods[POD_A].baseline_source == "pod-resources"
    assert snapshot.pods[POD_A].baseline_source == "first-seen"
    assert journaled.pods[POD_A].with_baseline(300_000, "first-seen") == snapshot.pods[POD_A]
    assert (journaled.pods[POD_B], journaled.devices) == (snapshot.pods[POD_B], snapshot.devices)


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["journaled", "snapshot"])
async def test_a_state_dir_of_0_2_0_keeps_every_quota_and_binding(short_dir: Path, name: str) -> None:
    state = copy_state(name, short_dir / "state", FIXTURES_0_2_0)
    await upgrade(short_dir, state, bindings=BINDINGS)


def _cut_journal(state: Path) -> None:
    journal = state / f"{LEGACY_FILE_NAME}.journal.1"
    data = journal.read_bytes()
    journal.write_bytes(data[: len(data) - 20])  # the last line cut short, as a full disk leaves it


def _garbage_journal_line(state: Path) -> None:
    journal = state / f"{LEGACY_FILE_NAME}.journal.1"
    lines = journal.read_bytes().splitlines(keepends=True)
    journal.write_bytes(lines[0] + b'["Q", "not an operation"]\n' + b"".join(lines[1:]))


def _snapshot(edit: Callable[[dict[str, Any]], object]) -> Callable[[Path], None]:
    def corrupt(state: Path) -> None:
        path = state / LEGACY_FILE_NAME
        data = json.loads(path.read_bytes())
        edit(data)
        path.write_text(json.dumps(data))

    return corrupt


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    def corrupt(state: Path) -> None:
        (state / name).write_bytes(data)

    return corrupt


CORRUPTIONS: dict[str, Callable[[Path], None]] = {
    "journal-cut-short": _cut_journal,
    "journal-bad-line": _garbage_journal_line,
    "snapshot-not-json": _write(LEGACY_FILE_NAME, b'{"devices": {"shared-cpus-0": '),
    "snapshot-empty": _write(LEGACY_FILE_NAME, b""),
    "snapshot-other-version": _snapshot(lambda d: d.update(version=0)),
    "snapshot-pods-not-an-object": _snapshot(lambda d: d.update(pods=[1, 2])),
    "snapshot-baseline-out-of-range": _snapshot(
        lambda d: d["pods"][POD_A].update(baseline=-5)  # set aside: that pod rebuilt from the runtime
    ),
    "snapshot-gone": lambda state: (state / LEGACY_FILE_NAME).unlink(),
    "journal-gone": lambda state: (state / f"{LEGACY_FILE_NAME}.journal.1").unlink(),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
async def test_a_hand_corrupted_0_1_0_state_dir_raises_no_quota_twice(
    short_dir: Path, corruption: str
) -> None:
    """Whatever the files lost, the books are rebuilt from what the runtime and the cgroups show:
    the quotas stay as 0.1.0 raised them, fall back to each baseline exactly, and the bindings of
    the running containers are kept (one of a removed container may go with a lost file)."""
    state = copy_state("stopped", short_dir / "state")
    CORRUPTIONS[corruption](state)
    await upgrade(short_dir, state, bindings=LIVE_BINDINGS)


def test_a_0_1_0_state_dir_gets_its_format_recorded_and_loads_the_same(tmp_path: Path) -> None:
    state = copy_state("stopped", tmp_path / "state")
    before = StateStore(str(state)).load()
    assert read_state_format(str(state)) is None
    assert settle_state_format(str(state), version_line()) is True
    assert read_state_format(str(state)) == (STATE_FORMAT, version_line())
    assert (state / STATE_FORMAT_FILE).stat().st_mode & 0o777 == 0o600
    assert settle_state_format(str(state), version_line()) is False  # nothing to write again
    # Another version of the same format: recorded as the one that wrote it last.
    assert settle_state_format(str(state), "mixed-cpu-nri-plugin 0.2.1 (commit x)") is True
    after = StateStore(str(state)).load()
    assert (after.pods, after.devices) == (before.pods, before.devices)


def _newer(state: Path) -> bytes:
    text = json.dumps({"format": STATE_FORMAT + 1, "written_by": "mixed-cpu-nri-plugin 9.0.0 (commit abc)"})
    (state / STATE_FORMAT_FILE).write_text(text)
    return text.encode()


def test_a_newer_format_is_refused_and_left_alone(tmp_path: Path) -> None:
    state = copy_state("stopped", tmp_path / "state")
    written = _newer(state)
    with pytest.raises(StateFormatError) as info:
        settle_state_format(str(state), version_line())
    message = str(info.value)
    assert (
        f"is in state format {STATE_FORMAT + 1}, written by mixed-cpu-nri-plugin 9.0.0 (commit abc)"
        in message
    )
    assert f"reads format {STATE_FORMAT} only: run that version (or a later one) again" in message
    assert f"remove {state}/{STATE_FILE_NAME}* and {STATE_FORMAT_FILE}" in message
    assert (state / STATE_FORMAT_FILE).read_bytes() == written


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"format 2\n", "unreadable (Expecting value"),
        (b'{"format": "2"}', "no format number in it"),
        (b'{"format": 0}', "no format number in it"),
        (b'{"format": true}', "no format number in it"),
        (b"[2]", "no format number in it"),
        (b"x" * 5000, "unreadable (5000 bytes, over the limit of 4096)"),
    ],
)
def test_a_format_file_we_did_not_write_is_refused(tmp_path: Path, content: bytes, problem: str) -> None:
    state = copy_state("stopped", tmp_path / "state")
    (state / STATE_FORMAT_FILE).write_bytes(content)
    with pytest.raises(StateFormatError) as info:
        settle_state_format(str(state), version_line())
    assert str(info.value).startswith(f"{state / STATE_FORMAT_FILE}: {problem}")
    assert str(info.value).endswith("remove the file and start again")


def test_a_format_file_that_is_a_link_is_refused(tmp_path: Path) -> None:
    state = copy_state("stopped", tmp_path / "state")
    (tmp_path / "elsewhere").write_text('{"format": 1}')
    (state / STATE_FORMAT_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StateFormatError, match="unreadable"):
        settle_state_format(str(state), version_line())


def test_run_refuses_a_newer_state_dir_with_one_line_and_status_2(tmp_path: Path) -> None:
    """A daemon rolled back onto a state dir a newer one laid out: it says so and touches nothing."""
    config = write_daemon_config(tmp_path, tmp_path / "dp")
    state = copy_state("stopped", tmp_path / "state")
    _newer(state)
    files = {path.name: path.read_bytes() for path in state.iterdir()}
    result = run_cli("run", "--config", str(config), timeout=GUARD)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {config}: state_dir: {state} is in state format {STATE_FORMAT + 1}")
    after = {path.name: path.read_bytes() for path in state.iterdir() if path.name != "daemon.lock"}
    assert after == files, "nothing in the state dir was changed"


@pytest.mark.asyncio
async def test_what_happened_while_no_daemon_ran_is_settled_at_the_upgrade(short_dir: Path) -> None:
    """A rolling update's gap (docs/operations.md): while no daemon ran, pod web's ``log`` container
    ended, and pod fwd got a new asking container, created without the plugin (NRI fails open). The
    new daemon's Synchronize gives the share back and fixes the new container's CPUs and quota, and
    pod fwd's quota is raised by its share (the two shared CPUs), once."""
    state = copy_state("stopped", short_dir / "state")
    node = Node(short_dir)
    log = node.sim.containers.pop("b-log")
    node.tree.remove_container(log)
    key = load_or_create_host_key(state)
    late = make_container(
        NAMING, node.pods[POD_A], "a-late", "late", cpus="6", annotations=marker(key, "shared-cpus-4")
    )
    late.state = api.CONTAINER_RUNNING
    node.sim.add_container(late)
    node.tree.run_container(late)
    plugin, _ = make_plugin(state, node.tree.layout)
    async with node.sim, plugin_running(plugin, node.socket):
        await node.sim.wait_for_plugins(1, GUARD)
        await wait_until(lambda: node.quotas()[POD_B] == BASELINES[POD_B] + 2 * PERIOD)
        assert node.quotas() == {POD_A: RAISED[POD_A] + 2 * PERIOD, POD_B: 600_000, POD_C: RAISED[POD_C]}
        cpu = node.sim.containers["a-late"].linux.resources.cpu
        assert (cpu.cpus, cpu.quota.value) == ("0-1,6", 3 * PERIOD)  # its exclusive CPU and the two shared
        assert plugin.books.devices["shared-cpus-4"] == Slot(POD_A, "late")
        for container_id in ("a-fwd-2", "a-late", "b-web"):
            await node.stop(container_id)
        assert node.quotas() == BASELINES
