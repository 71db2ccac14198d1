"""Fault 1: the runtime restarts (its socket closed, then created again). The plugin reconnects,
registers, is re-synchronized; every shared container stays correct, and the containers the runtime
started (or stopped) while the plugin was away are brought up to date at Synchronize."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import structlog
from fault_support import PERIOD, inconsistencies, make_node, within
from mixedcpu_support import plugin_running

from nri_plugin.api.nri import api_pb2 as api


@pytest.mark.asyncio
@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
async def test_runtime_restart(short_dir: Path, version: int) -> None:
    node = make_node(short_dir, version)
    population = node.population
    plugin = node.plugin()
    async with contextlib.AsyncExitStack() as stack:
        stub = await stack.enter_async_context(plugin_running(plugin, node.socket, reconnect=True))
        first = await stack.enter_async_context(node.runtime)
        await within(first.wait_for_plugins(1, timeout=None))
        fwd, duo, _free, plain = await population.standard()
        assert inconsistencies(population, books=plugin.books) == []
        quotas = population.pod_quotas()

        await first.close()  # the runtime goes away: its socket is closed and removed
        second = population.runtime = first.restarted()
        # While the plugin is away, the restarted runtime restarts fwd's container (kubelet), stops one
        # of duo's, and starts new ones: one asking in the plain pod, one in a new pod.
        second.containers["fwd-a"].state = api.CONTAINER_STOPPED
        population.start_while_away(fwd, "fwd-a2", "fwd", "2-3", asks=True)
        second.containers["duo-b"].state = api.CONTAINER_STOPPED
        population.start_while_away(plain, "plain-c", "cache", "13", asks=True)
        late = population.pod("late", 2 * PERIOD)
        population.start_while_away(late, "late-a", "fwd", "14-15", asks=True)
        population.start_while_away(late, "late-b", "side", "6")
        with structlog.testing.capture_logs() as logs:
            await stack.enter_async_context(second)
            await within(second.wait_for_plugins(1, timeout=None))
        assert stub.connections >= 2
        assert stub.synchronizations == 2
        assert inconsistencies(population, books=plugin.books) == []
        assert population.pod_quotas()[fwd.id] == quotas[fwd.id], "the restarted container kept its share"
        assert population.pod_quotas()[duo.id] == 6 * PERIOD, "the stopped one's share is gone"
        stale = {e["container_id"] for e in logs if e["event"].startswith("container must restart")}
        assert stale == {"fwd-a2", "plain-c", "late-a"}

        # ... and the plugin serves the runtime's next events as before.
        await population.restart("duo-a", "duo-a3")
        await second.stop_container("late-a")
        await population.create(late, "late-c", "extra", "3", asks=True)
        assert inconsistencies(population, books=plugin.books) == []
