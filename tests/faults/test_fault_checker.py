"""The invariant checker itself: it passes a consistent node and names every kind of damage the fault
tests rely on it to find (so "0 containers left inconsistent" means something)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_support import PERIOD, inconsistencies, make_node, within
from mixedcpu_support import plugin_running

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import write_cpu_quota


def flagged(lines: list[str]) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in lines)


@pytest.mark.asyncio
@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
async def test_checker_names_each_inconsistency(short_dir: Path, version: int) -> None:
    node = make_node(short_dir, version)
    population, runtime, tree = node.population, node.runtime, node.tree
    plugin = node.plugin()
    async with runtime:
        async with plugin_running(plugin, node.socket):
            await within(runtime.wait_for_plugins(1, timeout=None))
            fwd, duo, _free, plain = await population.standard()
        assert inconsistencies(population, books=plugin.books) == []

        # A pod quota file that is not baseline + shares: every container of the pod is named.
        write_cpu_quota(tree.pod_cpu(fwd), 9 * PERIOD)
        found = flagged(inconsistencies(population, count=False))
        assert set(found) == {"fwd-a", "fwd-side"}
        assert "pod fwd quota file 900000, expected 500000" in found["fwd-a"]
        write_cpu_quota(tree.pod_cpu(fwd), 5 * PERIOD)

        # A container that did not ask but shows the variables.
        runtime.containers["plain-a"].env.append("OPENSHIFT_SHARED_CPUS=0-1")
        assert flagged(inconsistencies(population, count=False)) == {
            "plain-a": "did not ask, yet has OPENSHIFT_SHARED_CPUS=0-1"
        }
        runtime.containers["plain-a"].env.pop()

        # A cgroup file that lost the shared CPUs, and (v1) a container quota above its pod's.
        narrowed = api.LinuxResources()
        narrowed.cpu.cpus = "5-6"
        narrowed.cpu.quota.value = 20 * PERIOD
        tree.apply(runtime.containers["duo-a"], narrowed)
        found = flagged(inconsistencies(population, count=False))
        assert set(found) == {"duo-a"}
        assert "cpuset file '5-6', expected '0-1,5-6'" in found["duo-a"]
        if version == 1:
            assert "runtime write refused: v1 refuses quota 2000000 above the pod's 800000" in found["duo-a"]
            tree.refused.clear()
        else:
            assert "quota file 2000000, expected 400000" in found["duo-a"]
        tree.apply(runtime.containers["duo-a"], runtime.containers["duo-a"].linux.resources)

        # Books that do not match the node.
        books = plugin.books.copy()
        books.pods[duo.uid] = books.pods[duo.uid].without("right")
        found = flagged(inconsistencies(population, books=books, count=False))
        assert set(found) == {"duo-a", "duo-b"}
        assert "books hold ['duo-a'], live asking ['duo-a', 'duo-b']" in found["duo-b"]

        # A container that asked, created with no plugin connected.
        await population.create(plain, "plain-c", "cache", "13", asks=True)
        found = flagged(inconsistencies(population, count=False))
        assert set(found) == {"plain-a", "plain-b", "plain-c"}
        assert "runtime cpus '13', expected '0-1,13'" in found["plain-c"]
        assert "env {'OPENSHIFT_SHARED_CPUS': None, 'OPENSHIFT_ISOLATED_CPUS': None}" in found["plain-c"]
        assert "pod plain quota file 200000, expected 400000" in found["plain-a"]

        # ... which the next synchronization repairs (all but its environment, fixed at its restart).
        population.specs["plain-c"].env = "stale"
        async with plugin_running(plugin, node.socket):
            await within(runtime.wait_for_plugins(1, timeout=None))
        assert inconsistencies(population, books=plugin.books) == []
