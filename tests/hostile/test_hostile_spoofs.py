"""Spoofed requests for shared CPUs, through the real stub and plugin: every one refused, 0 granted.

The thief is a container of a Guaranteed pod with exclusive CPUs, so it *would* get the shared CPUs
if any of its evidence were taken as proof: ``OPENSHIFT_*`` variables in its env; unsigned, malformed,
other-node, device-swapped markers; a valid marker in the pod's annotations or under a look-alike key;
a valid marker copied from another container (while that holder runs, after it stopped, after it was
removed, after the plugin restarted, from a sibling container of the same pod); the pod annotation
``cpu-shared.crio.io/<container>`` while that source is off; a valid marker while the marker source is
off. Grants are counted over every attempt (the fixed list and hypothesis' combinations): 0.

The replay cases after the holder stopped are the regression tests of the marker binding (a device
id stays bound to the pod and container name that first presented it until that pod's sandbox is
stopped or removed); `test_marker_binding.py` has the unit-level ones.
"""

from __future__ import annotations

from pathlib import Path

from hostile_strategies import annotation_maps as hostile_annotations
from hostile_strategies import env_entries
from hostile_support import PERIOD, Node, Reply, granted, other_node_key
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.deviceplugin.marker import ANNOTATION_KEY
from nri_plugin.nri.events import Event

HOLDER_DEVICE = "shared-cpus-7"


class Thief:
    """Attempts from one pod of its own; counts what was granted."""

    def __init__(self, node: Node, uid: str = "7777-eeee") -> None:
        self.node = node
        self.pod = node.pod(uid, "thief")
        self.attempts = 0
        self.grants = 0
        self._ids = iter(range(10**6))

    def container(self, **kw: object) -> api.Container:
        return self.node.container(self.pod, f"t-{next(self._ids)}", str(kw.pop("name", "copy")), **kw)

    def create(self, container: api.Container, pod: api.PodSandbox | None = None) -> Reply:
        reply = self.node.run(self.node.create(pod or self.pod, container))
        self.attempts += 1
        self.grants += granted("CreateContainer", reply)
        return reply

    def attempt(self, **kw: object) -> Reply:
        return self.create(self.container(**kw))


def _holder(node: Node) -> tuple[api.PodSandbox, api.Container, dict[str, str]]:
    pod = node.pod("3333-cccc", "holder")
    annotations = node.marker(HOLDER_DEVICE)
    container = node.container(pod, "h1", "fwd", annotations=annotations)
    reply = node.run(node.create(pod, container))
    assert granted("CreateContainer", reply)
    node.running(pod, container, reply)
    return pod, container, annotations


def _stop(node: Node, pod: api.PodSandbox, container: api.Container) -> None:
    container.state = api.CONTAINER_STOPPED
    reply = node.run(node.call("StopContainer", api.StopContainerRequest(pod=pod, container=container)))
    assert reply.ok


def test_spoofed_evidence_is_never_proof(tmp_path: Path) -> None:
    with Node(tmp_path) as node:
        holder_pod, holder, stolen = _holder(node)
        thief = Thief(node)
        key, other = node.key, other_node_key()
        mac = key.sign("shared-cpus-3").rsplit(":", 1)[1]
        markers = [
            "v1:shared-cpus-3:" + "A" * 43,  # unsigned
            "v1:shared-cpus-3:" + mac[:-1],  # MAC cut short
            "v1:shared-cpus-3:" + mac + "=",  # padded
            "v1:shared-cpus-3:" + mac.swapcase(),
            "v2:shared-cpus-3:" + mac,  # another version
            " v1:shared-cpus-3:" + mac,
            "v1:shared-cpus-3:" + mac + "\n",
            "V1:shared-cpus-3:" + mac,
            other.sign("shared-cpus-3"),  # signed on another node
            key.sign("shared-cpus-3").replace("shared-cpus-3", "shared-cpus-4"),  # MAC of another device
            key.sign("shared-cpus-3").replace("shared-cpus-3", "shared-cpus-3\0"),
            key.sign("shared-cpus-3").replace("shared-cpus-3", "shared\uff0dcpus-3"),  # fullwidth hyphen
        ]
        for value in markers:
            assert not thief.attempt(annotations={ANNOTATION_KEY: value}).payload
        for env in (
            ("OPENSHIFT_SHARED_CPUS=0-1",),
            ("OPENSHIFT_ISOLATED_CPUS=4-5",),
            ("OPENSHIFT_MUTUAL_CPUS=0-1",),
            ("OPENSHIFT_SHARED_CPUS=0-1", "OPENSHIFT_ISOLATED_CPUS=4-5", "OPENSHIFT_MUTUAL_CPUS=0-1"),
        ):
            thief.attempt(env=env)
        # A valid marker of a free device, but where only a pod author could have put it.
        valid = key.sign("shared-cpus-5")
        pod = thief.node.pod("8888-ffff", "annotated")
        pod.annotations[ANNOTATION_KEY] = valid
        thief.create(node.container(pod, "a-1", "main"), pod)
        for look_alike in (
            ANNOTATION_KEY.upper(),
            ANNOTATION_KEY + " ",
            " " + ANNOTATION_KEY,
            ANNOTATION_KEY.replace("/", "\u2215"),
            ANNOTATION_KEY.replace(".", "\uff0e"),
        ):
            thief.attempt(annotations={look_alike: valid})
        # The pod annotation, while trusted_sources.pod_annotation is false.
        for value in ("enable", "true"):
            annotated = node.pod(f"9999-{value}", "annotated")
            annotated.annotations["cpu-shared.crio.io/main"] = value
            thief.create(node.container(annotated, f"p-{value}", "main"), annotated)
        # Replays of the holder's marker: while it runs; from a sibling container of its own pod;
        # after it stopped (crash-loop back-off); after it was removed with its pod still there.
        thief.attempt(annotations=stolen)
        thief.create(node.container(holder_pod, "sib-1", "sidecar", annotations=stolen), holder_pod)
        _stop(node, holder_pod, holder)
        thief.attempt(annotations=stolen)
        thief.create(node.container(holder_pod, "sib-2", "sidecar", annotations=stolen), holder_pod)
        reply = node.run(
            node.call("RemoveContainer", api.RemoveContainerRequest(pod=holder_pod, container=holder))
        )
        assert reply.ok
        thief.attempt(annotations=stolen)
        # The rightful holder's restart is accepted.
        restart = node.container(holder_pod, "h2", "fwd", annotations=stolen)
        assert granted("CreateContainer", node.run(node.create(holder_pod, restart)))

        assert thief.attempts == len(markers) + 4 + 1 + 5 + 2 + 5
        assert thief.grants == 0
        assert node.tree.pod_quota(thief.pod) == 2 * PERIOD


def test_hostile_evidence_combinations_are_never_proof(tmp_path: Path) -> None:
    with Node(tmp_path) as node:
        _, _, stolen = _holder(node)
        thief = Thief(node)

        @settings(
            max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
        )
        @given(hostile_annotations, env_entries, hostile_annotations, st.booleans())
        def check(
            annotations: dict[str, str], env: list[str], pod_annotations: dict[str, str], replay: bool
        ) -> None:
            if replay:
                annotations = {**annotations, **stolen}
            pod = node.pod("7777-eeee", "thief") if not pod_annotations else node.pod("7777-ffff", "thief")
            pod.annotations.update(pod_annotations)
            thief.create(node.container(pod, "t", "main", annotations=annotations, env=tuple(env)), pod)

        check()
        assert thief.attempts >= 120
        assert thief.grants == 0


def test_pod_annotation_and_marker_sources_when_off(tmp_path: Path) -> None:
    with Node(tmp_path, trust_marker=False, trust_pod_annotation=True) as node:
        thief = Thief(node)
        thief.attempt(annotations=node.marker("shared-cpus-1"))  # valid, but the source is off
        for value in ("true", "Enable", "enable ", "enable\n", "", "ENABLE"):
            pod = node.pod(f"9999-{len(value)}{value.strip() or 'x'}", "annotated")
            pod.annotations["cpu-shared.crio.io/main"] = value
            thief.create(node.container(pod, f"a-{value!r}", "main"), pod)
        # The annotation names another container of the pod.
        pod = node.pod("9999-other", "annotated")
        pod.annotations["cpu-shared.crio.io/other"] = "enable"
        thief.create(node.container(pod, "o-1", "main"), pod)
        assert (thief.attempts, thief.grants) == (8, 0)
        # The source that is on still works.
        pod = node.pod("9999-good", "annotated")
        pod.annotations["cpu-shared.crio.io/main"] = "enable"
        assert granted("CreateContainer", node.run(node.create(pod, node.container(pod, "g-1", "main"))))


def test_copy_refused_after_plugin_restart_while_the_holder_is_stopped(tmp_path: Path) -> None:
    with Node(tmp_path) as node:
        holder_pod, holder, stolen = _holder(node)
        _stop(node, holder_pod, holder)
    # A new plugin process (same state dir and tree) is synchronized with the stopped holder and a
    # copy that started while the plugin was down.
    node = Node(tmp_path)
    thief = node.pod("7777-eeee", "thief")
    copy = node.container(thief, "t-1", "copy", annotations=stolen, state=api.CONTAINER_RUNNING)
    node.runtime.pods[:] = [holder_pod, thief]
    node.runtime.containers[:] = [holder, copy]
    with node:
        assert node.connection is not None
        assert node.connection.synchronized == api.SynchronizeResponse()  # no update for the copy
        assert node.tree.pod_quota(thief) == 2 * PERIOD
        assert not node.plugin.books.find("t-1")
        restart = node.container(holder_pod, "h2", "fwd", annotations=stolen)
        assert granted("CreateContainer", node.run(node.create(holder_pod, restart)))


def test_a_stopped_pod_sandbox_frees_its_devices_for_kubelets_next_allocation_only(tmp_path: Path) -> None:
    """The holder's pod ends: its binding ends, but its allocation is spent. The copy presented
    meanwhile is still refused; kubelet's next allocation of the device (a fresh marker) is granted."""
    for how in ("StopPodSandbox", "RemovePodSandbox", "StateChange"):
        with Node(tmp_path / how) as node:
            holder_pod, holder, stolen = _holder(node)
            _stop(node, holder_pod, holder)
            newcomer = node.pod("5555-aaaa", "newcomer")
            assert not granted(
                "CreateContainer",
                node.run(node.create(newcomer, node.container(newcomer, "n1", "x", annotations=stolen))),
            )
            if how == "StateChange":  # runtimes before NRI v0.12
                request = api.StateChangeEvent(
                    event=api.Event.ValueType(Event.STOP_POD_SANDBOX), pod=holder_pod
                )
            else:
                request = getattr(api, f"{how}Request")(pod=holder_pod)
            assert node.run(node.call(how, request)).ok
            # kubelet's allocation to the holder's pod is over: a copy of its marker is still one.
            again = node.container(newcomer, "n2", "x", annotations=stolen)
            assert not granted("CreateContainer", node.run(node.create(newcomer, again))), how
            # The device id given again by kubelet comes with a new allocation: granted.
            fresh = {ANNOTATION_KEY: node.key.sign(HOLDER_DEVICE)}
            given_again = node.container(newcomer, "n3", "x", annotations=fresh)
            assert granted("CreateContainer", node.run(node.create(newcomer, given_again))), how
