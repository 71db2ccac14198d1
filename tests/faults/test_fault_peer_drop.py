"""Fault 2: the runtime drops the connection while a request is in flight: the plugin has the request
(and acts on it) but its answer is lost. The plugin reconnects and is re-synchronized; whatever it had
applied agrees with its books the whole time, and every container ends consistent."""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_support import PERIOD, Runtime, books_vs_files, inconsistencies, make_node, until, within
from mixedcpu_support import plugin_running

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.common.backoff import Backoff


async def dropped(runtime: Runtime) -> list[str]:
    """Wait until the runtime has dropped the plugin; the reasons."""
    await until(lambda: bool(runtime.dropped()))
    return runtime.dropped()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("method", "version"),
    [("CreateContainer", 1), ("CreateContainer", 2), ("UpdateContainer", 2), ("StopContainer", 1)],
)
async def test_connection_dropped_while_a_request_is_in_flight(
    short_dir: Path, method: str, version: int
) -> None:
    node = make_node(short_dir, version)
    population, runtime = node.population, node.runtime
    plugin = node.plugin()
    # A reconnect delay long enough to look at the node between the drop and the next sync.
    backoff = Backoff(0.2, 0.2)
    async with runtime, plugin_running(plugin, node.socket, reconnect=True, backoff=backoff) as stub:
        await within(runtime.wait_for_plugins(1, timeout=None))
        _fwd, duo, _free, _plain = await population.standard()
        assert population.pod_quotas()[duo.id] == 8 * PERIOD  # 4 + 2 x 2
        runtime.drop_if = lambda name, _request: name == method
        if method == "CreateContainer":
            result = await population.create(duo, "duo-c", "third", "13", asks=True)
            # Go's NRI adaptation goes on without a plugin whose connection failed: created unadjusted.
            assert result.adjustment == api.ContainerAdjustment()
            population.specs["duo-c"].env = "stale"
        elif method == "UpdateContainer":
            kubelet = api.LinuxResources()
            kubelet.cpu.cpus = "2-3"  # kubelet's CPU manager re-sends the exclusive CPUs only
            applied = await runtime.update_container("fwd-a", kubelet)
            assert applied.cpu.cpus == "2-3", "the runtime applied kubelet's request alone"
        else:
            await runtime.stop_container("duo-b")
        [reason] = await dropped(runtime)
        assert reason.startswith(f"{method}: ")
        # The plugin acted on the request: what it wrote is what it booked.
        assert books_vs_files(population, plugin.books) == []
        if method == "CreateContainer":
            assert population.pod_quotas()[duo.id] == 10 * PERIOD  # 4 + 3 x 2
        elif method == "StopContainer":
            assert population.pod_quotas()[duo.id] == 6 * PERIOD  # 4 + 2
        await within(runtime.wait_for_plugins(1, timeout=None))
        assert stub.synchronizations == 2
        assert inconsistencies(population, books=plugin.books) == []
        # The next request is served as usual.
        await population.create(duo, "duo-d", "fourth", "14", asks=True)
        assert inconsistencies(population, books=plugin.books) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("chunk", ["middle", "last"])
async def test_connection_dropped_while_synchronize_chunks_are_in_flight(short_dir: Path, chunk: str) -> None:
    node = make_node(short_dir, 1)
    population = node.population
    plugin = node.plugin()
    async with plugin_running(plugin, node.socket, reconnect=True, backoff=Backoff(0.2, 0.2)) as stub:
        async with node.runtime as first:
            await within(first.wait_for_plugins(1, timeout=None))
            pods = [p for tag in ("", "-b", "-c") for p in await population.standard(tag)]
        second = population.runtime = first.restarted()
        second.max_message_size = 3072  # Synchronize goes in several chunks
        # Started while the plugin was away: to be repaired by the synchronization that gets through.
        population.start_while_away(pods[3], "plain-c", "cache", "13", asks=True)
        population.start_while_away(pods[7], "plain-b-c", "cache", "13", asks=True)
        before = population.pod_quotas()
        if chunk == "middle":
            second.drop_if = lambda name, request: (
                name == "Synchronize" and request.more and second.calls[name] == 2
            )
        else:
            second.drop_if = lambda name, request: name == "Synchronize" and not request.more
        async with second:
            [reason] = await dropped(second)
            assert reason.startswith("Synchronize: ")
            assert books_vs_files(population, plugin.books) == []
            if chunk == "middle":
                # The plugin never had the whole state: it changed nothing.
                assert population.pod_quotas() == before
                assert stub.synchronizations == 1
            else:
                # It had it all and raised the pods; the runtime never applied its updates.
                assert stub.synchronizations == 2
                assert inconsistencies(population, count=False) != []
            await within(second.wait_for_plugins(1, timeout=None))
            assert len(second.sync_chunks) >= 4
            assert inconsistencies(population, books=plugin.books) == []
