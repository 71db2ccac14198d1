"""kubelet's own record as the proof (issue #13, break 4: markers were bearer tokens for ever).

Through the real stub and plugin (`hostile_support`), with kubelet's record reachable (an in-memory
`FakeKubeletRecord`): every replay case of the spoof suite, hypothesis' combinations with a replayed
marker, and the four the red team found end with 0 grants, while each container kubelet really
allocated a device to gets the shared CPUs:

1. a marker replayed after its holder's pod sandbox stopped (the binding had ended with it);
2. a marker for a device no container used (harvested from kubelet's checkpoint file);
3. a marker planted on a sibling container started before its rightful owner (the owner was then
   refused, with only a warning);
4. a marker replayed after the state file was lost while its holder was stopped.

With kubelet unreachable the plugin falls back to the marker binding, as before.
"""

from __future__ import annotations

from pathlib import Path

from hostile_strategies import annotation_maps as hostile_annotations
from hostile_strategies import env_entries
from hostile_support import PERIOD, Node, Reply, granted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mixedcpu_support import FakeKubeletRecord

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.mixedcpu.store import STATE_FILE_NAME

DEVICE = "shared-cpus-7"


class Tally:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.attempts = 0
        self.grants = 0

    def create(self, pod: api.PodSandbox, container: api.Container) -> Reply:
        reply = self.node.run(self.node.create(pod, container))
        self.attempts += 1
        self.grants += granted("CreateContainer", reply)
        assert reply.ok, reply
        return reply


def _call(node: Node, method: str, request: object) -> None:
    assert node.run(node.call(method, request)).ok


def _stop(node: Node, pod: api.PodSandbox, container: api.Container) -> None:
    container.state = api.CONTAINER_STOPPED
    _call(node, "StopContainer", api.StopContainerRequest(pod=pod, container=container))


def _holder(node: Node, kubelet: FakeKubeletRecord) -> tuple[api.PodSandbox, api.Container, dict[str, str]]:
    pod = node.pod("3333-cccc", "holder")
    kubelet.allocate(pod, "fwd", DEVICE)
    annotations = node.marker(DEVICE)
    container = node.container(pod, "h1", "fwd", annotations=annotations)
    reply = node.run(node.create(pod, container))
    assert granted("CreateContainer", reply)
    node.running(pod, container, reply)
    return pod, container, annotations


def test_every_replay_case_of_the_spoof_suite_gets_nothing(tmp_path: Path) -> None:
    kubelet = FakeKubeletRecord()
    with Node(tmp_path, allocations=kubelet) as node:
        holder_pod, holder, stolen = _holder(node, kubelet)
        thieves = Tally(node)
        thief = node.pod("7777-eeee", "thief")
        thieves.create(thief, node.container(thief, "t-1", "copy", annotations=stolen))  # holder runs
        thieves.create(holder_pod, node.container(holder_pod, "sib-1", "sidecar", annotations=stolen))
        _stop(node, holder_pod, holder)
        thieves.create(thief, node.container(thief, "t-2", "copy", annotations=stolen))  # holder stopped
        thieves.create(holder_pod, node.container(holder_pod, "sib-2", "sidecar", annotations=stolen))
        _call(node, "RemoveContainer", api.RemoveContainerRequest(pod=holder_pod, container=holder))
        thieves.create(thief, node.container(thief, "t-3", "copy", annotations=stolen))  # holder removed
        # Another device's marker, valid, on a container kubelet gave nothing.
        thieves.create(thief, node.container(thief, "t-4", "copy", annotations=node.marker("shared-cpus-5")))
        print(f"\nreplay cases with kubelet's record: {thieves.attempts} attempts, {thieves.grants} grants")
        assert (thieves.attempts, thieves.grants) == (6, 0)
        assert node.tree.pod_quota(thief) == 2 * PERIOD
        # The rightful holder's restart is accepted: kubelet's record still gives it the device.
        restart = node.container(holder_pod, "h2", "fwd", annotations=stolen)
        assert granted("CreateContainer", node.run(node.create(holder_pod, restart)))


def test_the_copy_is_not_adopted_at_synchronize_after_a_restart(tmp_path: Path) -> None:
    kubelet = FakeKubeletRecord()
    with Node(tmp_path, allocations=kubelet) as node:
        holder_pod, holder, stolen = _holder(node, kubelet)
        _stop(node, holder_pod, holder)
    node = Node(tmp_path, allocations=kubelet)
    thief = node.pod("7777-eeee", "thief")
    copy = node.container(thief, "t-1", "copy", annotations=stolen, state=api.CONTAINER_RUNNING)
    node.runtime.pods[:] = [holder_pod, thief]
    node.runtime.containers[:] = [holder, copy]
    with node:
        assert node.connection is not None
        assert node.connection.synchronized == api.SynchronizeResponse()
        assert not node.plugin.books.find("t-1")
        assert node.tree.pod_quota(thief) == 2 * PERIOD


def test_hostile_combinations_with_a_replayed_marker_get_nothing(tmp_path: Path) -> None:
    kubelet = FakeKubeletRecord()
    with Node(tmp_path, allocations=kubelet) as node:
        _, _, stolen = _holder(node, kubelet)
        thieves = Tally(node)

        @settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
        @given(hostile_annotations, env_entries, st.booleans())
        def check(annotations: dict[str, str], env: list[str], sibling: bool) -> None:
            pod = node.pod("3333-cccc", "holder") if sibling else node.pod("7777-eeee", "thief")
            container = node.container(
                pod, "t", "copy", annotations={**annotations, **stolen}, env=tuple(env)
            )
            reply = node.run(node.create(pod, container))
            thieves.attempts += 1
            thieves.grants += granted("CreateContainer", reply)

        check()
        print(f"\nhypothesis replays, kubelet asked: {thieves.attempts} attempts, {thieves.grants} grants")
        assert thieves.attempts >= 80
        assert thieves.grants == 0


# -- the four the red team found ------------------------------------------------------------------------


def test_1_replay_after_the_holders_sandbox_stopped(tmp_path: Path) -> None:
    kubelet = FakeKubeletRecord()
    with Node(tmp_path, allocations=kubelet) as node:
        holder_pod, holder, stolen = _holder(node, kubelet)
        _stop(node, holder_pod, holder)
        _call(node, "StopPodSandbox", api.StopPodSandboxRequest(pod=holder_pod))
        kubelet.forget(holder_pod)  # the pod is gone; kubelet's allocation with it
        newcomer = node.pod("5555-aaaa", "newcomer")
        thieves = Tally(node)
        thieves.create(newcomer, node.container(newcomer, "n1", "x", annotations=stolen))
        assert thieves.grants == 0
        # kubelet gives the device to the newcomer for real (Allocate hands it the marker): proven.
        kubelet.allocate(newcomer, "x", DEVICE)
        again = node.container(newcomer, "n2", "x", annotations=node.marker(DEVICE))
        assert granted("CreateContainer", node.run(node.create(newcomer, again)))


def test_2_marker_of_a_device_no_container_used(tmp_path: Path) -> None:
    kubelet = FakeKubeletRecord()
    with Node(tmp_path, allocations=kubelet) as node:
        # kubelet allocated shared-cpus-9 to a pod whose container never started; its marker sits in
        # kubelet's checkpoint file, where the thief read it.
        ghost = node.pod("6666-ffff", "ghost")
        kubelet.allocate(ghost, "main", "shared-cpus-9")
        harvested = node.marker("shared-cpus-9")
        thief = node.pod("7777-eeee", "thief")
        thieves = Tally(node)
        thieves.create(thief, node.container(thief, "t-1", "main", annotations=harvested))
        assert thieves.grants == 0
        assert node.tree.pod_quota(thief) == 2 * PERIOD


def test_3_a_sibling_started_first_gets_nothing_and_the_owner_gets_its_cpus(tmp_path: Path) -> None:
    kubelet = FakeKubeletRecord()
    with Node(tmp_path, allocations=kubelet) as node:
        pod = node.pod("3333-cccc", "holder")
        kubelet.allocate(pod, "fwd", DEVICE)
        marker = node.marker(DEVICE)
        thieves = Tally(node)
        thieves.create(pod, node.container(pod, "s1", "sidecar", annotations=marker))
        assert thieves.grants == 0
        owner = node.container(pod, "f1", "fwd", annotations=marker)
        assert granted("CreateContainer", node.run(node.create(pod, owner)))
        assert node.tree.pod_quota(pod) == 4 * PERIOD


def test_4_replay_after_the_state_file_was_lost_while_the_holder_was_stopped(tmp_path: Path) -> None:
    kubelet = FakeKubeletRecord()
    with Node(tmp_path, allocations=kubelet) as node:
        holder_pod, holder, stolen = _holder(node, kubelet)
        _stop(node, holder_pod, holder)
    (tmp_path / "node" / "state" / STATE_FILE_NAME).unlink()
    node = Node(tmp_path, allocations=kubelet)
    node.runtime.pods[:] = [holder_pod]
    node.runtime.containers[:] = [holder]
    with node:
        thief = node.pod("7777-eeee", "thief")
        thieves = Tally(node)
        thieves.create(thief, node.container(thief, "t-1", "copy", annotations=stolen))
        assert thieves.grants == 0
        restart = node.container(holder_pod, "h2", "fwd", annotations=stolen)
        assert granted("CreateContainer", node.run(node.create(holder_pod, restart)))


# -- kubelet away ---------------------------------------------------------------------------------------


def test_with_kubelet_unreachable_the_marker_binding_decides(tmp_path: Path) -> None:
    kubelet = FakeKubeletRecord()
    with Node(tmp_path, allocations=kubelet) as node:
        _holder_pod, _, stolen = _holder(node, kubelet)
        kubelet.reachable = False
        thief = node.pod("7777-eeee", "thief")
        thieves = Tally(node)
        thieves.create(thief, node.container(thief, "t-1", "copy", annotations=stolen))  # bound: refused
        assert thieves.grants == 0
        # A marker nobody holds is taken on its signature alone, as before the record.
        other = node.pod("8888-aaaa", "other")
        assert granted(
            "CreateContainer",
            node.run(
                node.create(other, node.container(other, "o1", "x", annotations=node.marker("shared-cpus-2")))
            ),
        )
        assert kubelet.asked >= 2


def test_containers_without_a_marker_never_ask_kubelet(tmp_path: Path) -> None:
    kubelet = FakeKubeletRecord()
    with Node(tmp_path, allocations=kubelet) as node:
        pod = node.pod("1111-aaaa", "plain")
        for i in range(5):
            reply = node.run(node.create(pod, node.container(pod, f"p{i}", f"c{i}")))
            assert reply.ok
            assert not granted("CreateContainer", reply)
        assert kubelet.asked == 0, "the hot path of ordinary containers stays as it was"
