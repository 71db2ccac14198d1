"""The containers a Synchronize in chunks keeps for the mixed-CPU plugin (`MixedCpuPlugin.sync_filter`,
the stub's `SyncSelector`): whatever the others are, leaving them out changes nothing the plugin does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import structlog
from mixedcpu_support import FakeCgroups, Naming, make_container, make_plugin, make_pod, marker

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.mixedcpu import trace
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin

NAMING = Naming("containerd", "cgroupfs")
BASELINE = 400_000


def _node(root: Path) -> tuple[MixedCpuPlugin, FakeCgroups, list[api.PodSandbox], list[api.Container]]:
    """A node of 6 pods, each with one container of every kind: asking by pod annotation, presenting
    a signed marker, a forged one, CPU variables in its env, stopped, and plain."""
    tree = FakeCgroups(root / "cgroup")
    plugin, key = make_plugin(root / "state", tree.layout, trust_pod_annotation=True)
    pods, containers = [], []
    for n in range(6):
        pod = make_pod(NAMING, f"{n:04d}-aaaa", name=f"app-{n}")
        pod.annotations["cpu-shared.crio.io/asks"] = "enable"
        pod.annotations["cpu-shared.crio.io/gone"] = "enable"  # names no container
        tree.add_pod(pod, BASELINE)
        pods.append(pod)
        kinds = {
            "asks": {},
            "signed": {"annotations": marker(key, f"shared-cpus-{n}")},
            "forged": {"annotations": {"cpu-shared.crio.io/marker": "forged"}},
            "noted": {"env": ("OPENSHIFT_SHARED_CPUS=0-1",)},
            "halted": {"state": api.CONTAINER_STOPPED},
            "plain": {},
        }
        for i, (name, options) in enumerate(kinds.items()):
            cpus = f"{2 + 2 * i}-{3 + 2 * i}"
            container = make_container(NAMING, pod, f"c-{n}-{name}", name, cpus=cpus, **options)  # type: ignore[arg-type]
            tree.run_container(container)
            containers.append(container)
    return plugin, tree, pods, containers


def _outcome(
    plugin: MixedCpuPlugin,
    tree: FakeCgroups,
    pods: list[api.PodSandbox],
    updates: Sequence[api.ContainerUpdate],
    logs: Sequence[Mapping[str, Any]],
) -> tuple[object, ...]:
    books = {
        key: (record.baseline, sorted(record.containers.items())) for key, record in plugin.books.pods.items()
    }
    return (
        [u.SerializeToString() for u in updates],
        books,
        [tree.pod_quota(pod) for pod in pods],
        sorted((str(e["event"]), str(e.get("container_id", ""))) for e in logs),
    )


@pytest.mark.asyncio
@pytest.mark.parametrize("restart", [False, True], ids=["first-start", "restart"])
async def test_the_containers_left_out_change_nothing(
    tmp_path: Path, restart: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trace, "tracing", lambda: False)  # tracing, every container is kept
    results = []
    for side in ("all", "needed"):
        plugin, tree, pods, containers = _node(tmp_path / side)
        if restart:
            await plugin.synchronize(pods, containers)  # the books now hold the shared ones
            plugin.healer.stop()
            # One the books hold now shows nothing: still looked at (the healer asks its state).
            [held] = [c for c in containers if c.id == "c-0-signed"]
            del held.annotations[next(iter(held.annotations))]
        by_sandbox = {pod.id: pod for pod in pods}
        given = containers
        if side == "needed":
            given = [c for c in containers if plugin.sync_filter()(by_sandbox[c.pod_sandbox_id], c)]
            assert len(given) < len(containers)
        with structlog.testing.capture_logs() as logs:
            updates = await plugin.synchronize(pods, given)
        plugin.healer.stop()
        results.append(_outcome(plugin, tree, pods, updates, logs))
    assert results[0] == results[1]


def test_a_container_whose_pod_has_not_come_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "tracing", lambda: False)
    plugin, _, pods, containers = _node(tmp_path)
    assert all(plugin.sync_filter()(None, container) for container in containers)
    plain = [c for c in containers if c.name == "plain"]
    assert not any(plugin.sync_filter()(pods[0], c) for c in plain)


def test_tracing_keeps_every_container(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "tracing", lambda: True)
    plugin, _, pods, containers = _node(tmp_path)
    by_sandbox = {pod.id: pod for pod in pods}
    assert all(plugin.sync_filter()(by_sandbox[c.pod_sandbox_id], c) for c in containers)
