"""Fault 3: the daemon is killed (SIGKILL: no shutdown, no state flush) and started again. The new
process rebuilds its books from the runtime's Synchronize and the database (or from the cgroups
alone when the state file is gone too): every pod quota is what it was, the containers the runtime
created meanwhile are brought up to date, and later events neither grow nor shrink anything."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest
from fault_support import (
    ISOLATED_ENV,
    PERIOD,
    Population,
    daemon_running,
    inconsistencies,
    launch_daemon,
    make_node,
    until,
    within,
    write_config,
)
from mixedcpu_support import Daemon

from nri_plugin.mixedcpu.store import STATE_FILE_NAME, StateStore
from nri_plugin.nri.simulator import env_of


@pytest.mark.asyncio
@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
@pytest.mark.parametrize("state", ["state-file-kept", "state-file-lost"])
async def test_daemon_killed_and_restarted(short_dir: Path, version: int, state: str) -> None:
    node = make_node(short_dir, version)
    population, runtime = node.population, node.runtime
    config = write_config(short_dir, node.tree)
    state_file = node.state / STATE_FILE_NAME
    async with runtime:
        daemon = await launch_daemon(config, node.socket)
        try:
            await within(runtime.wait_for_plugins(1, timeout=None))
            _fwd, duo, _free, _plain = await population.standard()
            assert inconsistencies(population) == []
            # A restart changes only which container holds a slot: committed before the reply.
            await population.restart("duo-a", "duo-a2")
            quotas = population.pod_quotas()
        finally:
            await daemon.kill()
            print(f"killed daemon's stderr:\n{daemon.stderr}")  # shown if the test fails
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
            for suffix in ("", "-wal", "-shm"):
                Path(f"{state_file}{suffix}").unlink(missing_ok=True)  # noqa: ASYNC240
        async with daemon_running(config, node.socket):
            await within(runtime.wait_for_plugins(1, timeout=None))
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


# -- killed at random instants ----------------------------------------------------------------------------

KILLS = 6  # per run: each at a random instant of a stream of events
MAX_PODS = 40


class Churn:
    """kubelet's side of a busy node, one random event at a time: new pods (with containers that ask
    or not), more containers, restarts, stops and removals, whole pods going away."""

    def __init__(self, population: Population, rng: random.Random) -> None:
        self.population = population
        self.rng = rng
        self.made = 0
        self.live: dict[str, list[str]] = {}  # pod id -> its live container ids

    def _id(self, what: str) -> str:
        self.made += 1
        return f"{what}{self.made}"

    async def step(self) -> None:
        rng = self.rng
        roll = rng.random()
        if not self.live or (roll < 0.25 and len(self.live) < MAX_PODS):
            await self._new_pod()
        elif roll < 0.55:
            await self._create(rng.choice(list(self.live)))
        elif roll < 0.75:
            await self._restart()
        elif roll < 0.92:
            await self._stop_and_remove()
        else:
            await self._remove_pod()

    async def _new_pod(self) -> None:
        pod = self.population.pod(self._id("p"), self.rng.choice([2, 3, 4]) * PERIOD)
        self.live[pod.id] = []
        for _ in range(self.rng.choice([1, 1, 2])):
            await self._create(pod.id)

    async def _create(self, pod_id: str) -> None:
        pod = self.population.pods[pod_id].pod
        cid = self._id("c")
        cpus = self.rng.choice(["2", "3-4", "5-6", "7"])
        await self.population.create(pod, cid, f"n{cid}", cpus, asks=self.rng.random() < 0.6)
        self._mark_if_unserved(cid)
        self.live[pod_id].append(cid)

    async def _restart(self) -> None:
        pod_id = self.rng.choice(list(self.live))
        if not self.live[pod_id]:
            return
        old = self.rng.choice(self.live[pod_id])
        new = self._id("c")
        await self.population.restart(old, new)
        self._mark_if_unserved(new)
        self.live[pod_id][self.live[pod_id].index(old)] = new

    async def _stop_and_remove(self) -> None:
        pod_id = self.rng.choice(list(self.live))
        if not self.live[pod_id]:
            return
        cid = self.live[pod_id].pop(self.rng.randrange(len(self.live[pod_id])))
        await self.population.runtime.stop_container(cid)
        await self.population.runtime.remove_container(cid)

    async def _remove_pod(self) -> None:
        pod_id = self.rng.choice(list(self.live))
        runtime = self.population.runtime
        for cid in self.live.pop(pod_id):
            await runtime.stop_container(cid)
            await runtime.remove_container(cid)
        await runtime.stop_pod_sandbox(pod_id)
        await runtime.remove_pod_sandbox(pod_id)
        self.population.tree.delete_pod(self.population.pods.pop(pod_id).pod)

    def _mark_if_unserved(self, cid: str) -> None:
        """An asking container created while the plugin was dead (or killed in the middle of its
        CreateContainer) started without the variables: Synchronize gives it the CPUs, not the env."""
        spec = self.population.specs[cid]
        if spec.asks and ISOLATED_ENV not in env_of(self.population.runtime.containers[cid]):
            spec.env = "stale"


async def _kill_after(daemon: Daemon, seconds: float) -> None:
    await asyncio.sleep(seconds)  # (the random instant is the point: not a wait for a condition)
    await daemon.kill()


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [11, 12, 13])
async def test_daemon_killed_at_random_instants(short_dir: Path, seed: int) -> None:
    """SIGKILL at random instants of a stream of events (in the middle of a CreateContainer, of a
    transaction, of a checkpoint): the database left holds each pod's own quota, never a raised one;
    after each restart every container and every pod quota is right (0 inconsistent, 0 quota drift),
    and so are the books at the end."""
    rng = random.Random(seed)
    node = make_node(short_dir, 1)
    population, runtime = node.population, node.runtime
    config = write_config(short_dir, node.tree)
    churn = Churn(population, rng)
    async with runtime:
        for kill in range(KILLS):
            # daemon_running ends the daemon (and prints its stderr) however the body ends.
            async with daemon_running(config, node.socket) as daemon:
                await within(runtime.wait_for_plugins(1, timeout=None))
                assert inconsistencies(population) == [], f"seed {seed}, after kill {kill}"
                killer = asyncio.ensure_future(_kill_after(daemon, rng.uniform(0.0, 0.4)))
                try:
                    while not killer.done():
                        await churn.step()
                        await asyncio.sleep(0)  # with no plugin connected, a step never waits on anything
                    await killer
                finally:
                    killer.cancel()
            await until(lambda: not runtime.plugins)
            own = {spec.pod.uid: spec.baseline for spec in population.pods.values()}
            saved = StateStore(node.state).load()
            off = {
                k: (r.baseline, own[k]) for k, r in saved.pods.items() if k in own and r.baseline != own[k]
            }
            assert off == {}, f"seed {seed}, kill {kill}: saved baselines (saved, own) off the pods' own"
            for _ in range(rng.randrange(4)):  # the node goes on while the plugin is dead
                await churn.step()
        async with daemon_running(config, node.socket):
            await within(runtime.wait_for_plugins(1, timeout=None))
            assert inconsistencies(population) == [], f"seed {seed}, after the last kill"
            for _ in range(20):
                await churn.step()
            assert inconsistencies(population) == []
        assert inconsistencies(population, books=StateStore(node.state).load()) == []
    print(f"seed {seed}: {churn.made} pods and containers made; state dir {sorted(os.listdir(node.state))}")
