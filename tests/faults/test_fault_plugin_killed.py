"""Fault 3: the daemon is killed (SIGKILL: no shutdown, no state flush) and started again. The new
process rebuilds its books from the runtime's Synchronize and the state file (or from the cgroups
alone when the state file is gone too): every pod quota is what it was, the containers the runtime
created meanwhile are brought up to date, and later events neither grow nor shrink anything."""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_support import (
    PERIOD,
    daemon_running,
    inconsistencies,
    launch_daemon,
    make_node,
    until,
    within,
    write_config,
)

from nri_plugin.mixedcpu.store import StateStore


@pytest.mark.asyncio
@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
@pytest.mark.parametrize("state", ["state-file-kept", "state-file-lost"])
async def test_daemon_killed_and_restarted(short_dir: Path, version: int, state: str) -> None:
    node = make_node(short_dir, version)
    population, runtime = node.population, node.runtime
    config = write_config(short_dir, node.tree)
    state_file = node.state / "pod-quotas.json"
    async with runtime:
        daemon = await launch_daemon(config, node.socket)
        try:
            await within(runtime.wait_for_plugins(1))
            _fwd, duo, _free, _plain = await population.standard()
            assert inconsistencies(population) == []
            # A restart changes only which container holds a slot: written within 1 s, or lost in a kill.
            await population.restart("duo-a", "duo-a2")
            quotas = population.pod_quotas()
        finally:
            await daemon.kill()
        print(f"killed daemon's stderr:\n{daemon.stderr}")
        await until(lambda: not runtime.plugins)
        # While the plugin is dead the runtime goes on: kubelet creates a pod, and (with the state file
        # kept) restarts a shared container, whose old share stays in its pod's quota meanwhile.
        late = population.pod("late", 2 * PERIOD)
        await population.create(late, "late-a", "fwd", "13-14", asks=True, env="stale")
        await population.create(late, "late-b", "side", "9")
        if state == "state-file-kept":
            await population.restart("duo-b", "duo-b2")
            population.specs["duo-b2"].env = "stale"
        else:
            # Without the file, the pod's own quota is rebuilt as its quota less the shares its live
            # containers hold (docs/design.md): a share whose container went away while the plugin
            # was dead cannot be told from the pod's own quota, so nothing stops meanwhile here.
            state_file.unlink()
        async with daemon_running(config, node.socket):
            await within(runtime.wait_for_plugins(1))
            after = population.pod_quotas()
            assert after.pop(late.id) == 4 * PERIOD
            assert after == quotas, "pod quotas unchanged by the kill and restart"
            assert inconsistencies(population) == []
            await population.restart("fwd-a", "fwd-a2")
            await runtime.stop_container("late-a")
            assert population.pod_quotas()[late.id] == 2 * PERIOD
            await population.restart("duo-a2", "duo-a3")
            assert population.pod_quotas()[duo.id] == quotas[duo.id]
            assert inconsistencies(population) == []
        # Stopped with SIGTERM, the daemon saved its books: they name exactly the live shared containers.
        assert inconsistencies(population, books=StateStore(node.state).load()) == []
