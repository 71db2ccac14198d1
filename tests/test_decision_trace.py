"""The decision trace (issue 15, item 5): with debug on, one container's id leads through every step of
its decision, each line carrying its fields; at info none of it is rendered, nor even formatted.

The plugin's handlers are called directly on a fake cgroup tree, with the daemon's own log
configuration (`configure_logging`, JSON lines), so what is checked is what an operator reads.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from mixedcpu_support import PERIOD, FakeCgroups, Naming, make_container, make_plugin, make_pod, marker

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import format_cpuset
from nri_plugin.daemon.logs import configure_logging, toggle_debug
from nri_plugin.deviceplugin.marker import ANNOTATION_KEY
from nri_plugin.mixedcpu import logfields, trace

NAMING = Naming("containerd", "cgroupfs")
BASELINE = 2 * PERIOD  # the pod's own quota
RAISED = BASELINE + 2 * PERIOD  # with one container holding the 2 shared CPUs
CONTAINER_FIELDS = ("namespace", "pod", "container", "container_id", "event")

Entry = dict[str, Any]


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    structlog.reset_defaults()


async def create_update_stop_remove(tmp_path: Path) -> None:
    """A shared container (c1) and a sidecar that asks for nothing (c2), their events interleaved as
    the runtime sends them: create both, update both, stop and remove both."""
    tree = FakeCgroups(tmp_path / "cgroup")
    plugin, key = make_plugin(tmp_path / "state", tree.layout)
    pod = make_pod(NAMING, "1111-2222", name="packet-fwd")
    pod.namespace = "telco"
    tree.add_pod(pod, BASELINE)
    fwd = make_container(NAMING, pod, "c1", "fwd", annotations=marker(key))
    sidecar = make_container(NAMING, pod, "c2", "sidecar", cpus="6")
    assert await plugin.create_container(pod, fwd) is not None
    assert await plugin.create_container(pod, sidecar) is None
    moved = api.LinuxResources()
    moved.cpu.cpus = "6-7"  # kubelet moves fwd's exclusive CPUs
    assert len(await plugin.update_container(pod, fwd, moved)) == 1
    assert await plugin.update_container(pod, sidecar, moved) == ()
    for container in (fwd, sidecar):
        await plugin.stop_container(pod, container)
        await plugin.remove_container(pod, container)


def lines(out: io.StringIO) -> list[Entry]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def story(entries: list[Entry], container_id: str) -> list[Entry]:
    """What an operator reads with jq 'select(.container_id == "...")'."""
    return [entry for entry in entries if entry.get("container_id") == container_id]


def steps(entries: list[Entry]) -> list[tuple[str, str]]:
    return [(entry["event"], entry.get("step") or entry["msg"]) for entry in entries]


def only(entries: list[Entry], event: str, step: str) -> Entry:
    [entry] = [e for e in entries if e["event"] == event and e.get("step") == step]
    return entry


@pytest.mark.asyncio
async def test_one_container_id_tells_the_whole_story_at_debug(tmp_path: Path) -> None:
    out = io.StringIO()
    configure_logging("debug", "json", stream=out)
    await create_update_stop_remove(tmp_path)
    entries = lines(out)

    fwd = story(entries, "c1")
    assert steps(fwd) == [
        ("CreateContainer", "proof"),
        ("CreateContainer", "eligibility"),
        ("CreateContainer", "adjustment"),
        ("CreateContainer", "pod-quota"),
        ("CreateContainer", "shared CPUs given"),
        ("UpdateContainer", "update"),
        ("UpdateContainer", "books"),
        ("UpdateContainer", "kept shared CPUs on update"),
        ("StopContainer", "release"),
        ("StopContainer", "shared container stopped: its pod quota share is released"),
        ("StopContainer", "pod-quota"),
        ("RemoveContainer", "release"),
        ("RemoveContainer", "pod-quota"),
    ]
    for entry in fwd:
        assert {name: entry[name] for name in CONTAINER_FIELDS[:3]} == {
            "namespace": "telco",
            "pod": "packet-fwd",
            "container": "fwd",
        }
        assert entry["logger"] == "nri_plugin.mixedcpu.plugin"

    proof = only(fwd, "CreateContainer", "proof")
    assert (proof["level"], proof["proven"], proof["proof"]) == (
        "debug",
        True,
        "device-plugin marker (shared-cpus-0)",
    )
    assert "signed with this node's key" in proof["how"]
    assert (proof["evidence_refused"], proof["evidence_ignored"]) == ([], [])
    eligibility = only(fwd, "CreateContainer", "eligibility")
    assert (eligibility["exclusive"], eligibility["requested_cpus"], eligibility["shared"]) == (
        "4-5",
        "4-5",
        "0-1",
    )
    adjustment = only(fwd, "CreateContainer", "adjustment")
    assert (adjustment["cpus"], adjustment["quota"], adjustment["period"]) == ("0-1,4-5", "400000", PERIOD)
    assert adjustment["env"] == {"OPENSHIFT_SHARED_CPUS": "0-1", "OPENSHIFT_ISOLATED_CPUS": "4-5"}
    assert adjustment["sets"] == ["cpus", "quota", "env"]
    raised = only(fwd, "CreateContainer", "pod-quota")
    assert (raised["pod_quota_before"], raised["pod_quota_after"]) == (str(BASELINE), str(RAISED))
    assert (raised["pod_baseline"], raised["pod_shared_containers"], raised["pod_target"]) == (
        str(BASELINE),
        1,
        str(RAISED),
    )

    update = only(fwd, "UpdateContainer", "update")
    assert (update["requested_cpus"], update["exclusive_before"], update["exclusive_after"]) == (
        "6-7",
        "4-5",
        "6-7",
    )
    assert (update["cpus"], update["quota"]) == ("0-1,6-7", "400000")
    assert "exclusive CPUs moved" in only(fwd, "UpdateContainer", "books")["msg"]

    released = only(fwd, "StopContainer", "release")
    assert (released["msg"], released["slot"], released["shared_cpus"]) == ("slot released", "fwd", 2)
    assert (released["exclusive"], released["device"]) == ("6-7", "shared-cpus-0")
    settled = only(fwd, "StopContainer", "pod-quota")
    assert (settled["pod_target_before"], settled["pod_target_after"]) == (str(RAISED), str(BASELINE))
    assert settled["pod_books"].startswith("dropped: no shared container left")
    assert only(fwd, "RemoveContainer", "pod-quota")["pod_books"] == "nothing to settle"
    assert only(fwd, "RemoveContainer", "release")["msg"].startswith("nothing to release")

    # The sidecar's story says why nothing happened to it.
    sidecar = story(entries, "c2")
    assert steps(sidecar) == [
        ("CreateContainer", "proof"),
        ("CreateContainer", "no request for shared CPUs"),
        ("UpdateContainer", "update"),
        ("StopContainer", "release"),
        ("StopContainer", "pod-quota"),
        ("RemoveContainer", "release"),
        ("RemoveContainer", "pod-quota"),
    ]
    unproven = only(sidecar, "CreateContainer", "proof")
    assert (unproven["proven"], unproven["proof"]) == (False, "none")
    assert only(sidecar, "UpdateContainer", "update")["msg"].startswith("update passed through")


@pytest.mark.asyncio
async def test_a_refused_marker_is_in_the_story(tmp_path: Path) -> None:
    out = io.StringIO()
    configure_logging("debug", "json", stream=out)
    tree = FakeCgroups(tmp_path / "cgroup")
    plugin, _ = make_plugin(tmp_path / "state", tree.layout)
    pod = make_pod(NAMING, "3333-4444")
    tree.add_pod(pod, BASELINE)
    forged = make_container(NAMING, pod, "c9", annotations={ANNOTATION_KEY: "v1:x:forged"})
    assert await plugin.create_container(pod, forged) is None
    proof = only(story(lines(out), "c9"), "CreateContainer", "proof")
    assert proof["proven"] is False
    [refused] = proof["evidence_refused"]
    assert "not signed with this node's key" in refused


@pytest.mark.asyncio
@pytest.mark.parametrize("level", ["info", "warning"])
async def test_at_info_no_step_is_rendered_or_even_formatted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, level: str
) -> None:
    """structlog's filter would drop a debug line before rendering it, but only after its fields were
    built; the trace asks the level first, so at info it formats nothing at all."""
    built: list[str] = []

    def counting(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            built.append(original.__name__)
            return original(*args, **kwargs)

        return wrapper

    for name, original in (
        ("pod_fields", logfields.pod_fields),
        ("show_quota", logfields.show_quota),
        ("format_cpuset", format_cpuset),
    ):
        monkeypatch.setattr(f"nri_plugin.mixedcpu.trace.{name}", counting(original))
    out = io.StringIO()
    configure_logging(level, "json", stream=out)
    assert not trace.tracing()
    await create_update_stop_remove(tmp_path)
    entries = lines(out)
    assert not [entry for entry in entries if "step" in entry or entry["level"] == "debug"]
    if level == "info":
        assert story(entries, "c1"), "the info lines are still there"
    assert built == []

    # SIGUSR1's toggle turns the trace on at once, in the same process.
    assert toggle_debug() == "debug"
    assert trace.tracing()
    await create_update_stop_remove(tmp_path / "again")
    assert [entry for entry in lines(out) if entry.get("step") == "proof"]
    assert built
