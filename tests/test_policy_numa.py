"""NUMA-local shared CPUs in the pure policy: which shared CPUs a container gets (`choose_shared`), and
the create, update and sync plans built on that choice, on fake topologies."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mixedcpu_support import PERIOD, Naming, make_container, make_pod

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import format_cpuset, parse_cpuset
from nri_plugin.mixedcpu.policy import (
    ISOLATED_ENV,
    SHARED_ENV,
    NumaNodes,
    SharedChoice,
    choose_shared,
    plan_create,
    plan_sync,
    plan_update,
    shared_by_node,
)

CGROUPFS = Naming("containerd", "cgroupfs")
ONE_NODE: NumaNodes = {0: frozenset(range(16))}
# Two sockets of 8 CPUs; the shared pool has two CPUs on each: 0-1 on node 0, 8-9 on node 1.
TWO_NODES: NumaNodes = {0: frozenset(range(8)), 1: frozenset(range(8, 16))}
SHARED = frozenset({0, 1, 8, 9})
# The same machine with CPUs 6-7 and 14-15 offline: sysfs lists only online CPUs, and so do we.
OFFLINE: NumaNodes = {0: frozenset(range(6)), 1: frozenset(range(8, 14))}


def cpus(text: str) -> frozenset[int]:
    return parse_cpuset(text)


@pytest.mark.parametrize(
    ("nodes", "exclusive", "given", "on_nodes", "fallback"),
    [
        (None, "4-5", "0-1,8-9", (), None),  # the key off: the whole pool, whatever the topology
        (ONE_NODE, "4-5", "0-1,8-9", (0,), None),  # one node: everything is local
        (TWO_NODES, "4-5", "0-1", (0,), None),
        (TWO_NODES, "12-13", "8-9", (1,), None),
        (TWO_NODES, "7-8", "0-1,8-9", (0, 1), None),  # spanning both nodes: the shared CPUs of each
        (OFFLINE, "4-5", "0-1", (0,), None),
        (OFFLINE, "6-7", "0-1,8-9", (), "none of its exclusive CPUs (6-7) is on a NUMA node"),  # offline
        (OFFLINE, "5-7", "0-1", (0,), None),  # its offline CPUs do not count, its online one does
    ],
    ids=["off", "one-node", "node0", "node1", "spanning", "offline-ok", "offline-only", "offline-part"],
)
def test_choose_shared(
    nodes: NumaNodes | None, exclusive: str, given: str, on_nodes: tuple[int, ...], fallback: str | None
) -> None:
    choice = choose_shared(SHARED, cpus(exclusive), nodes)
    assert format_cpuset(choice.cpus) == given
    assert choice.nodes == on_nodes
    if fallback is None:
        assert choice.fallback is None
    else:
        assert choice.fallback is not None
        assert fallback in choice.fallback


def test_no_local_shared_cpu_gives_the_whole_pool_and_says_why() -> None:
    only_node0 = frozenset({0, 1})
    choice = choose_shared(only_node0, cpus("12-13"), TWO_NODES)
    assert choice == SharedChoice(only_node0, (1,), choice.fallback)
    assert choice.fallback == (
        "none of the shared CPUs (0-1) is on NUMA node 1, where its exclusive CPUs (12-13) are; add CPUs of "
        "that node to shared_cpuset (and to kubelet's reservedSystemCPUs)"
    )


def test_shared_by_node_lists_the_nodes_with_cpus() -> None:
    memory_only: NumaNodes = {**TWO_NODES, 2: frozenset()}
    assert shared_by_node(frozenset({0, 1}), memory_only) == {0: frozenset({0, 1}), 1: frozenset()}
    assert shared_by_node(SHARED, {0: frozenset(range(8))}) == {0: frozenset({0, 1})}  # 8-9: on none


# -- properties ----------------------------------------------------------------------------------------


@st.composite
def topologies(draw: st.DrawFn) -> dict[int, frozenset[int]]:
    """Up to four nodes over CPUs 0-31, each CPU on at most one node (offline ones on none)."""
    count = draw(st.integers(1, 4))
    owner = draw(st.lists(st.integers(-1, count - 1), min_size=32, max_size=32))
    return {node: frozenset(cpu for cpu, o in enumerate(owner) if o == node) for node in range(count)}


cpu_sets = st.frozensets(st.integers(0, 31), max_size=10)


@given(topology=topologies(), shared=cpu_sets.filter(bool), exclusive=cpu_sets)
def test_choice_properties(
    topology: dict[int, frozenset[int]], shared: frozenset[int], exclusive: frozenset[int]
) -> None:
    choice = choose_shared(shared, exclusive, topology)
    local_cpus = frozenset().union(*(topology[node] for node in choice.nodes))
    # Its nodes are exactly those its exclusive CPUs are on.
    assert choice.nodes == tuple(sorted(n for n, node_cpus in topology.items() if node_cpus & exclusive))
    assert choice.cpus
    assert choice.cpus <= shared
    if choice.fallback is None:
        # Every shared CPU on its nodes, and no other.
        assert choice.cpus == shared & local_cpus
    else:
        # The whole pool, only when none of it is local.
        assert choice.cpus == shared
        assert not shared & local_cpus
    # The key off: always the whole pool, never a reason.
    assert choose_shared(shared, exclusive, None) == SharedChoice(shared)


@given(topology=topologies(), shared=cpu_sets.filter(bool), exclusive=cpu_sets, more=cpu_sets)
def test_more_exclusive_cpus_never_lose_local_shared_ones(
    topology: dict[int, frozenset[int]],
    shared: frozenset[int],
    exclusive: frozenset[int],
    more: frozenset[int],
) -> None:
    fewer, wider = (
        choose_shared(shared, exclusive, topology),
        choose_shared(shared, exclusive | more, topology),
    )
    if fewer.fallback is None:
        assert wider.fallback is None
        assert fewer.cpus <= wider.cpus


@given(shared=cpu_sets.filter(bool), exclusive=cpu_sets.filter(bool), period=st.integers(1_000, 1_000_000))
def test_create_plan_with_numa_nodes_gives_the_choice_everywhere(
    shared: frozenset[int], exclusive: frozenset[int], period: int
) -> None:
    topology: NumaNodes = {0: frozenset(range(16)), 1: frozenset(range(16, 32))}
    pod = make_pod(CGROUPFS)
    container = make_container(
        CGROUPFS, pod, "c1", cpus=format_cpuset(exclusive), quota=len(exclusive) * period, period=period
    )
    if not exclusive - shared:
        return  # refused as without NUMA nodes (test_policy)
    plan = plan_create(shared, pod, container, numa_nodes=topology)
    assert plan.shared == choose_shared(shared, exclusive - shared, topology)
    assert plan.cpus == (exclusive - shared) | plan.shared.cpus
    assert plan.quota == len(plan.cpus) * period
    env = {e.key: e.value for e in plan.adjustment.env}
    assert env == {
        SHARED_ENV: format_cpuset(plan.shared.cpus),
        ISOLATED_ENV: format_cpuset(exclusive - shared),
    }


# -- the plans -----------------------------------------------------------------------------------------


def test_create_plan_on_one_node() -> None:
    pod = make_pod(CGROUPFS)
    container = make_container(CGROUPFS, pod, "c1", cpus="12-13", quota=2 * PERIOD)
    plan = plan_create(SHARED, pod, container, numa_nodes=TWO_NODES)
    cpu = plan.adjustment.linux.resources.cpu
    assert (cpu.cpus, cpu.quota.value) == ("8-9,12-13", 4 * PERIOD)
    assert {e.key: e.value for e in plan.adjustment.env} == {SHARED_ENV: "8-9", ISOLATED_ENV: "12-13"}
    assert plan.shared == SharedChoice(frozenset({8, 9}), (1,))
    # Without the topology: the whole pool, as ever.
    assert plan_create(SHARED, pod, container).cpus == cpus("0-1,8-9,12-13")


def _kubelet(cpuset: str) -> api.LinuxResources:
    resources = api.LinuxResources()
    resources.cpu.cpus = cpuset
    return resources


@pytest.mark.parametrize(
    ("requested", "update_cpus", "exclusive", "shared"),
    [
        ("12-13", "8-9,12-13", "12-13", "8-9"),  # kubelet re-sends the same exclusive CPUs
        ("", "8-9,12-13", "12-13", "8-9"),  # no cpuset in the request: the current one, pool excluded
        ("4-5", "0-1,4-5", "4-5", "0-1"),  # moved to node 0: node 0's shared CPUs
        ("7,10", "0-1,7-10", "7,10", "0-1,8-9"),  # now spanning both nodes
    ],
    ids=["same", "no-cpuset", "moved", "spanning"],
)
def test_update_plan_follows_the_exclusive_cpus(
    requested: str, update_cpus: str, exclusive: str, shared: str
) -> None:
    pod = make_pod(CGROUPFS)
    container = make_container(CGROUPFS, pod, "c1", cpus="8-9,12-13", quota=4 * PERIOD)
    plan = plan_update(SHARED, pod, container, _kubelet(requested), cpus("12-13"), numa_nodes=TWO_NODES)
    cpu = plan.update.linux.resources.cpu
    assert cpu.cpus == update_cpus
    assert cpu.quota.value == len(cpus(update_cpus)) * PERIOD
    assert format_cpuset(plan.exclusive) == exclusive
    assert format_cpuset(plan.shared.cpus) == shared


def test_update_plan_without_numa_nodes_is_as_before() -> None:
    pod = make_pod(CGROUPFS)
    container = make_container(CGROUPFS, pod, "c1", cpus="0-1,8-9,12-13", quota=6 * PERIOD)
    plan = plan_update(SHARED, pod, container, _kubelet("4-5"), cpus("12-13"))
    assert plan.update.linux.resources.cpu.cpus == "0-1,4-5,8-9"
    assert plan.shared == SharedChoice(SHARED)


@pytest.mark.parametrize(
    ("current", "env", "nodes", "update_cpus", "stale"),
    [
        # Created while the plugin was away: it gets its node's shared CPUs.
        ("12-13", (), TWO_NODES, "8-9,12-13", True),
        # Created with the key off (the whole pool), the key now on: down to its node's.
        (
            "0-1,8-9,12-13",
            ("OPENSHIFT_SHARED_CPUS=0-1,8-9", "OPENSHIFT_ISOLATED_CPUS=12-13"),
            TWO_NODES,
            "8-9,12-13",
            True,
        ),
        # Created with the key on, the key now off: up to the whole pool.
        (
            "8-9,12-13",
            ("OPENSHIFT_SHARED_CPUS=8-9", "OPENSHIFT_ISOLATED_CPUS=12-13"),
            None,
            "0-1,8-9,12-13",
            True,
        ),
        # Already right.
        ("8-9,12-13", ("OPENSHIFT_SHARED_CPUS=8-9", "OPENSHIFT_ISOLATED_CPUS=12-13"), TWO_NODES, None, False),
    ],
    ids=["started-late", "key-turned-on", "key-turned-off", "already-right"],
)
def test_sync_plan_brings_the_container_to_its_subset(
    current: str, env: tuple[str, ...], nodes: NumaNodes | None, update_cpus: str | None, stale: bool
) -> None:
    pod = make_pod(CGROUPFS)
    container = make_container(CGROUPFS, pod, "c1", cpus=current, quota=len(cpus(current)) * PERIOD, env=env)
    plan = plan_sync(SHARED, pod, container, numa_nodes=nodes)
    assert plan.exclusive == cpus("12-13")
    assert plan.env_stale == stale
    assert plan.applied_shared == len(cpus(current)) - 2
    if update_cpus is None:
        assert plan.update is None
        return
    assert plan.update is not None
    assert plan.update.linux.resources.cpu.cpus == update_cpus
    assert plan.update.linux.resources.cpu.quota.value == len(cpus(update_cpus)) * PERIOD
    assert plan.cpus == cpus(update_cpus)
