"""Hostile payloads in every handler, through a real ttrpc session on a real unix socket.

For every method of the NRI Plugin service (those our stub serves and those it does not), hypothesis
sends arbitrary bytes, arbitrary well-typed messages with hostile values, and runtime-shaped requests
with hostile fields, to the real `Stub` driving the real `MixedCpuPlugin` on a fake cgroup tree.
Each reply must be OK or an error status the plugin means to send (never UNKNOWN: that is an
exception nobody expected); no reply may give a container the shared CPUs (none of these inputs
holds a marker signed with the node's key, and the pod annotation source is off); a valid request
right after must succeed; nothing may wait longer than the bound; and no file may be written,
created or removed, in the cgroup tree, the state dir (but for the plugin's own state file) or
around the test's directory.

A second run gives hostile values to containers that *do* prove a request (a fresh, validly signed
device id each), so that the policy and cgroup code behind the proof is reached: errors must still
be statuses, and writes may only touch the quota file of a pod that really exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hostile_models import REQUEST_TYPES
from hostile_strategies import messages, realistic_requests
from hostile_support import (
    ERROR_CODES,
    PERIOD,
    Node,
    diff,
    granted,
    snapshot,
    state_file_skip,
    top_level,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.ttrpc.errors import Code

EXAMPLES = 60
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# What the plugin serves (the stub answers 12 for the rest: NRI's "use StateChange instead").
SERVED = {
    "Configure",
    "Synchronize",
    "Shutdown",
    "StateChange",
    "CreateContainer",
    "StartContainer",  # containerd makes the cgroup here: the healer's grace counts from it (issue 25)
    "UpdateContainer",
    "StopContainer",
    "UpdatePodSandbox",  # in-place pod resize (issue 12)
    "StopPodSandbox",
    "RemovePodSandbox",
    "RemoveContainer",
}


def _legit(node: Node) -> api.PodSandbox:
    """One pod with a container that really holds the shared CPUs (device shared-cpus-0)."""
    pod = node.pod("0000-1111", "legit")
    container = node.container(pod, "legit-c", "fwd", annotations=node.marker("shared-cpus-0"))
    reply = node.run(node.create(pod, container))
    assert granted("CreateContainer", reply), reply
    node.running(pod, container, reply)
    return pod


def test_the_stub_serves_what_the_suite_expects(tmp_path: Path) -> None:
    with Node(tmp_path) as node:
        assert node.stub is not None
        assert set(node.stub._methods()) == SERVED
        assert set(REQUEST_TYPES) >= SERVED


@pytest.mark.parametrize("method", sorted(REQUEST_TYPES))
def test_any_payload_in_any_handler(tmp_path: Path, method: str) -> None:
    request_type = REQUEST_TYPES[method]
    with Node(tmp_path) as node:
        legit = _legit(node)
        skip = state_file_skip(node)
        tally = {"inputs": 0, "ok": 0, "refused": 0, "grants": 0}

        @SETTINGS
        @given(
            st.one_of(
                st.binary(max_size=300),
                messages(request_type).map(lambda m: m.SerializeToString()),
                realistic_requests(method).map(lambda m: m.SerializeToString()),
            )
        )
        def check(payload: bytes) -> None:
            before, around = snapshot(tmp_path, skip=skip), top_level(tmp_path.parent)
            reply = node.run(node.channel.call(method, payload))
            tally["inputs"] += 1
            assert reply.ok or reply.code in ERROR_CODES, reply
            if method not in SERVED:
                assert (reply.code, reply.message) == (Code.UNIMPLEMENTED, f"method {method}")
            tally["ok" if reply.ok else "refused"] += 1
            tally["grants"] += granted(method, reply)
            node.run(node.healthy())
            assert diff(before, snapshot(tmp_path, skip=skip)) == []
            assert top_level(tmp_path.parent) == around
            assert not node.channel.stray, "a stream answered twice"

        check()
        assert tally["grants"] == 0, tally
        assert tally["inputs"] >= EXAMPLES
        assert node.tree.pod_quota(legit) == 4 * PERIOD  # the real holder's pod kept its share
        assert node.connection is not None
        assert not node.connection.trunk.closed.is_set()


@pytest.mark.parametrize("method", ["CreateContainer", "UpdateContainer", "Synchronize"])
def test_proven_requests_with_hostile_fields(tmp_path: Path, method: str) -> None:
    with Node(tmp_path) as node:
        real = node.pod("1111-2222", "real")  # realistic_requests' default pod: its cgroup exists
        # The container realistic_requests names, already holding the shared CPUs: updates reach
        # the update policy.
        holder = node.container(real, "c-1", "main", annotations=node.marker("shared-cpus-0"))
        assert granted("CreateContainer", node.run(node.create(real, holder)))
        quota_file = str(Path(node.tree.pod_dir(real).fs_path, "cpu.cfs_quota_us"))
        skip = state_file_skip(node)
        devices = iter(range(1, 10**6))
        outcomes: dict[object, int] = {}

        @SETTINGS
        @given(realistic_requests(method))
        def check(request: Any) -> None:
            # A fresh validly signed device id for each container: the proof check passes.
            containers = [request.container] if hasattr(request, "container") else list(request.containers)
            for container in containers:
                container.annotations.update(node.marker(f"shared-cpus-{next(devices)}"))
            before, around = snapshot(tmp_path, skip=skip), top_level(tmp_path.parent)
            reply = node.run(node.call(method, request))
            assert reply.ok or reply.code in ERROR_CODES, reply
            outcome = ("granted" if granted(method, reply) else "ok") if reply.ok else reply.code
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            changes = diff(before, snapshot(tmp_path, skip=skip))
            # Only the quota of the one pod cgroup that exists may change (its directory's mtime
            # does not: the file is written in place).
            assert set(changes) <= {f"changed {quota_file}"}, changes
            assert top_level(tmp_path.parent) == around
            node.run(node.healthy())

        check()
        # The hostile values did not only bounce off the front door: some requests got through.
        assert outcomes.get("granted", 0) > 0, outcomes
