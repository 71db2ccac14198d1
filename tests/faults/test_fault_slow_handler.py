"""Fault 6: a handler slower than the runtime's request timeout. The runtime drops the plugin, as
containerd and CRI-O do, and goes on without it; the plugin sees its connection closed, reconnects,
is re-synchronized, and every container ends consistent, whether the slow handler had applied its
change before stalling or not."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path

import pytest
from fault_support import PERIOD, books_vs_files, inconsistencies, make_node, within
from mixedcpu_support import plugin_running

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin, TrustedSources
from nri_plugin.mixedcpu.store import StateStore

TIMEOUT = 0.2  # the runtime's request timeout here (2 s on a real node)
STALL = 5 * TIMEOUT


class Stalling(MixedCpuPlugin):
    """The real plugin, stalling once in one handler: before doing anything, or after its work."""

    def __init__(self, where: str, victim: str, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.where, self.victim = where, victim
        self.stalled = False

    async def _stall(self) -> None:
        self.stalled = True
        await asyncio.sleep(STALL)

    async def create_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> api.CreateContainerResponse | None:
        if container.id != self.victim or self.stalled:
            return await super().create_container(pod, container)
        if self.where == "create-before":
            await self._stall()
        reply = await super().create_container(pod, container)
        if self.where == "create-after":
            await self._stall()
        return reply

    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        if self.where == "synchronize" and not self.stalled and any(c.id == self.victim for c in containers):
            await self._stall()
        return await super().synchronize(pods, containers)


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["create-before", "create-after", "synchronize"])
async def test_handler_slower_than_the_request_timeout(short_dir: Path, where: str) -> None:
    node = make_node(short_dir, 1, request_timeout=TIMEOUT)
    population = node.population
    plugin = Stalling(
        where,
        "duo-c" if where != "synchronize" else "late-a",
        shared=population.shared,
        layout=node.tree.layout,
        store=StateStore(node.state),
        trusted=TrustedSources(population.key),
    )
    async with contextlib.AsyncExitStack() as stack:
        stub = await stack.enter_async_context(plugin_running(plugin, node.socket, reconnect=True))
        first = await stack.enter_async_context(node.runtime)
        await within(first.wait_for_plugins(1, timeout=None))
        _fwd, duo, _free, _plain = await population.standard()
        assert population.pod_quotas()[duo.id] == 8 * PERIOD  # 4 + 2 x 2
        runtime = first
        if where == "synchronize":
            # The runtime restarts with a container the plugin has not seen: its first sync stalls.
            await first.close()
            runtime = population.runtime = first.restarted()
            late = population.pod("late", 2 * PERIOD)
            population.start_while_away(late, "late-a", "fwd", "13-14", asks=True)
            await stack.enter_async_context(runtime)
        else:
            result = await population.create(duo, "duo-c", "third", "13", asks=True)
            # The runtime gave up on the plugin and created the container without its adjustment.
            assert result.adjustment == api.ContainerAdjustment()
            population.specs["duo-c"].env = "stale"
        await within(runtime.wait_for_plugins(1, timeout=None))
        assert plugin.stalled
        [reason] = [r for r in runtime.dropped()]
        assert reason.endswith("timed out"), reason
        if where == "create-before":
            assert population.pod_quotas()[duo.id] == 10 * PERIOD  # by the sync, not the stall
        assert stub.connections == (3 if where == "synchronize" else 2)
        assert stub.synchronizations == 2  # the stalled one was cancelled before it finished
        assert books_vs_files(population, plugin.books) == []
        assert inconsistencies(population, books=plugin.books) == []
        await population.restart("fwd-a", "fwd-a2")
        assert inconsistencies(population, books=plugin.books) == []
