"""A Synchronize chunk taken apart one object at a time (`stub._Session.gather_bytes`) gives the
plugin what parsing it whole and selecting gives (`_Session.gather`), and takes apart nothing that
the protobuf decoder would refuse."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.nri.stub import _Session


def _every_other(pod: api.PodSandbox | None, container: api.Container) -> bool:
    """Needs the containers with an even number in their name, and those whose pod is unknown."""
    return pod is None or container.name.endswith(("0", "2", "4", "6", "8"))


def _request(pods: int, containers: list[int], more: bool) -> api.SynchronizeRequest:
    request = api.SynchronizeRequest(more=more)
    for n in range(pods):
        pod = request.pods.add(id=f"p{n}", uid=f"u{n}", name=f"pod-{n}")
        pod.annotations[f"cpu-shared.crio.io/c{n}"] = "enable"
    for n in containers:
        container = request.containers.add(id=f"c{n}", pod_sandbox_id=f"p{n % 7}", name=f"c{n}")
        container.env.append(f"N={n}")
    return request


def _selected(request: api.SynchronizeRequest) -> api.SynchronizeRequest:
    """The request with only the containers `_every_other` needs (every pod comes before them)."""
    pods = {pod.id: pod for pod in request.pods}
    kept = [c for c in request.containers if _every_other(pods.get(c.pod_sandbox_id), c)]
    return api.SynchronizeRequest(pods=request.pods, containers=kept, more=request.more)


def _gathered(session: _Session) -> tuple[list[bytes], list[bytes], int]:
    """What the session hands the plugin (`take`, which starts it afresh) and how many it saw."""
    seen = session.seen
    pods, containers = session.take()
    return [p.SerializeToString() for p in pods], [c.SerializeToString() for c in containers], seen


@given(st.integers(0, 6), st.lists(st.integers(0, 30), max_size=12), st.booleans())
def test_taken_apart_or_parsed_whole_the_plugin_gets_the_same(
    pods: int, containers: list[int], more: bool
) -> None:
    data = _request(pods, containers, more).SerializeToString()
    apart, whole = _Session(), _Session()
    assert apart.gather_bytes(data, _every_other) == more
    whole.gather(_selected(api.SynchronizeRequest.FromString(data)))
    assert apart.seen == len(containers)
    assert _gathered(apart)[:2] == _gathered(whole)[:2]


@given(st.binary(max_size=120))
def test_bytes_the_decoder_refuses_are_never_taken_apart(data: bytes) -> None:
    session = _Session()
    more = session.gather_bytes(data, _every_other)
    if more is None:
        assert _gathered(session) == ([], [], 0)
        return
    whole = _Session()
    request = api.SynchronizeRequest.FromString(data)  # taken apart: the decoder takes it too
    whole.gather(request)
    assert more == request.more
    pods, kept, seen = _gathered(session)
    whole_pods, whole_kept, _ = _gathered(whole)
    assert (pods, seen) == (whole_pods, len(request.containers))
    assert set(kept) <= set(whole_kept)


def _field(number: int, message: api.PodSandbox | api.Container) -> bytes:
    """One SynchronizeRequest field: `message` as pod (1) or container (2)."""
    if number == 1:
        return api.SynchronizeRequest(pods=[message]).SerializeToString()  # type: ignore[list-item]
    return api.SynchronizeRequest(containers=[message]).SerializeToString()  # type: ignore[list-item]


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=20))
def test_pods_and_containers_in_any_order_a_container_sees_the_pods_before_it(
    order: list[tuple[bool, int]],
) -> None:
    """Pods are parsed a run at a time; whatever the order of the fields, the plugin gets every pod,
    in order, and a container is selected knowing exactly the pods that came before it."""
    data, known, expected_pods, expected_kept = b"", set(), [], []
    for n, (is_pod, which) in enumerate(order):
        if is_pod:
            pod = api.PodSandbox(id=f"p{which}", uid=f"u{n}", name=f"pod-{n}")
            data += _field(1, pod)
            known.add(pod.id)
            expected_pods.append(pod.SerializeToString())
        else:
            container = api.Container(id=f"c{n}", pod_sandbox_id=f"p{which}", name=f"c{n}")
            data += _field(2, container)
            if container.pod_sandbox_id not in known or n % 2 == 0:  # as `_every_other` decides
                expected_kept.append(container.SerializeToString())
    session = _Session()
    assert session.gather_bytes(data, _every_other) is False
    assert all(isinstance(item, bytearray) for item in session.containers)  # none held parsed
    pods, kept, seen = _gathered(session)
    assert (pods, kept, seen) == (expected_pods, expected_kept, sum(1 for is_pod, _ in order if not is_pod))
