"""kubelet's record as the proof, through the real daemon (issue #13, break 4): ``mixed-cpu-nri-plugin
run`` as a subprocess, the NRI runtime simulator, and a fake kubelet serving both the device-plugin
and the pod-resources APIs, over real unix sockets.

Every replayed, harvested or planted marker gets nothing (the daemon says why); each container kubelet
admitted with a device gets the shared CPUs, the rightful owner after a sibling that tried first
included, and after a restart that lost the state file. With no pod-resources socket the daemon falls
back to the marker binding, and says so at start, in its metrics and in ``check``; when the socket
comes, kubelet's record takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fake_kubelet import FakeKubelet
from mixedcpu_support import run_cli
from probe_support import scrape, value
from redteam_support import RESOURCE, DaemonNode, daemon_node, is_shared, short_directory, within

from nri_plugin.mixedcpu.store import STATE_FILE_NAME


def pod_resources_line(root: Path) -> str:
    return f'pod_resources_socket = "{root / "pr" / "kubelet.sock"}"\n'


@contextlib.asynccontextmanager
async def kubelet_and_daemon(
    root: Path, *, record: bool = True, get_enabled: bool = True, crowded: bool = False
) -> AsyncIterator[tuple[FakeKubelet, DaemonNode]]:
    kubelet = FakeKubelet(
        root / "dp", pod_resources=root / "pr" / "kubelet.sock" if record else None, get_enabled=get_enabled
    )
    if crowded:
        kubelet.records.crowd()
    await kubelet.start()
    try:
        async with daemon_node(root, device_plugin_extra=pod_resources_line(root)) as node:
            await within(kubelet.registered.wait())
            await within(kubelet.wait_lists(RESOURCE, 1))
            yield kubelet, node
    finally:
        await kubelet.stop()


class Spoofs:
    """Attempts with a marker kubelet did not allocate to the container; what they got."""

    def __init__(self, node: DaemonNode) -> None:
        self.node = node
        self.attempts = 0
        self.grants = 0

    async def attempt(self, pod_uid: str, pod_name: str, cid: str, name: str, marker: dict[str, str]) -> None:
        pod = self.node.sim.pods.get(f"sandbox-{pod_uid}") or self.node.pod(pod_uid, pod_name)
        result = await self.node.create(pod, cid, name, annotations=marker)
        self.attempts += 1
        self.grants += is_shared(result)


async def metrics_port(node: DaemonNode) -> int:
    line = await node.daemon.wait_log("serving metrics and probes")
    match = re.search(r"127\.0\.0\.1:(\d+)", line)
    assert match, line
    return int(match.group(1))


@pytest.mark.asyncio
async def test_replayed_harvested_and_planted_markers_get_nothing() -> None:
    with short_directory("kp-") as root:
        async with kubelet_and_daemon(root) as (kubelet, node):
            await node.daemon.wait_log("kubelet's pod-resources API proves requests")
            spoofs = Spoofs(node)
            # The holder, admitted by kubelet with shared-cpus-7.
            stolen = await kubelet.admit(RESOURCE, "ns", "holder", "fwd", "shared-cpus-7")
            holder = node.pod("3333-cccc", "holder")
            assert is_shared(await node.create(holder, "h1", "fwd", annotations=stolen))
            line = await node.daemon.wait_log("shared CPUs given", "kubelet's allocation (shared-cpus-7)")
            assert json.loads(line)["pod"] == "holder"
            # Replays while the holder runs, from a sibling, after it stopped.
            await spoofs.attempt("4444-dddd", "thief", "t1", "copy", stolen)
            await spoofs.attempt("3333-cccc", "holder", "s1", "sidecar", stolen)
            await node.sim.stop_container("h1")
            await spoofs.attempt("4444-dddd", "thief", "t2", "copy", stolen)
            # 1. After the holder's pod sandbox stopped (the marker binding would have ended there).
            await node.sim.stop_pod_sandbox("sandbox-3333-cccc")
            kubelet.forget("ns", "holder")
            await spoofs.attempt("5555-eeee", "newcomer", "n1", "main", stolen)
            # 2. A device no container used: admitted for a pod whose container never came.
            harvested = await kubelet.admit(RESOURCE, "ns", "ghost", "main", "shared-cpus-9")
            await spoofs.attempt("6666-ffff", "thief2", "g1", "main", harvested)
            # 3. Planted on a sibling started before its rightful owner.
            planted = await kubelet.admit(RESOURCE, "ns", "pair", "fwd", "shared-cpus-4")
            await spoofs.attempt("7777-aaaa", "pair", "p1", "sidecar", planted)
            owner = node.sim.pods["sandbox-7777-aaaa"]
            assert is_shared(await node.create(owner, "p2", "fwd", annotations=planted)), (
                "the owner gets them"
            )
            refusal = await node.daemon.wait_log(
                "request refused", "kubelet's record shows no shared-CPUs device"
            )
            assert '"level": "warning"' in refusal
            print(f"\nthrough the daemon: {spoofs.attempts} spoof attempts, {spoofs.grants} grants")
            assert (spoofs.attempts, spoofs.grants) == (6, 0)
            port = await metrics_port(node)
            found = await scrape("127.0.0.1", port)
            assert value(found, "mixed_cpu_pod_resources_reachable") == 1
            assert (
                value(found, "mixed_cpu_pod_resources_lookups_total", outcome="ok") >= 5
            )  # a pod found is remembered 2 s
            assert value(found, "mixed_cpu_pod_resources_lookups_total", outcome="unavailable") == 0


@pytest.mark.asyncio
async def test_4_a_lost_state_file_gives_a_replay_nothing() -> None:
    with short_directory("kp-") as root:
        async with kubelet_and_daemon(root) as (kubelet, node):
            stolen = await kubelet.admit(RESOURCE, "ns", "holder", "fwd", "shared-cpus-7")
            holder = node.pod("3333-cccc", "holder")
            assert is_shared(await node.create(holder, "h1", "fwd", annotations=stolen))
            await node.sim.stop_container("h1")
        (root / "state" / STATE_FILE_NAME).unlink()  # lost while the holder is stopped
        async with kubelet_and_daemon(root) as (kubelet2, node):
            kubelet2.records.pods = kubelet.records.pods  # kubelet's record survives its restart
            node.sim.add_pod(holder)
            spoofs = Spoofs(node)
            await spoofs.attempt("4444-dddd", "thief", "t1", "copy", stolen)
            assert (spoofs.attempts, spoofs.grants) == (1, 0)
            assert is_shared(await node.create(holder, "h2", "fwd", annotations=stolen))


@pytest.mark.asyncio
async def test_without_the_socket_the_marker_decides_and_the_daemon_says_so() -> None:
    with short_directory("kp-") as root:
        async with kubelet_and_daemon(root, record=False) as (kubelet, node):
            line = await node.daemon.wait_log("kubelet's pod-resources API cannot be asked")
            fields = json.loads(line)
            assert fields["level"] == "warning"
            assert fields["reason"] == f"{root / 'pr' / 'kubelet.sock'} does not exist"
            marker = await kubelet.admit(RESOURCE, "ns", "fwd", "main", "shared-cpus-1")
            pod = node.pod("1111-aaaa", "fwd")
            assert is_shared(await node.create(pod, "c1", "main", annotations=marker))
            await node.daemon.wait_log("shared CPUs given", "device-plugin marker (shared-cpus-1)")
            port = await metrics_port(node)
            found = await scrape("127.0.0.1", port)
            assert value(found, "mixed_cpu_pod_resources_reachable") == 0
            assert value(found, "mixed_cpu_pod_resources_lookups_total", outcome="unavailable") == 1
            # `check` says it in one line.
            report = run_cli("check", "--config", str(root / "config.toml"), timeout=20)
            [warn] = [entry for entry in report.stdout.splitlines() if "pod-resources API" in entry]
            assert warn == (
                f"WARN  pod-resources API      {root / 'pr' / 'kubelet.sock'} does not exist: the allocation "
                "marker alone proves requests for shared CPUs"
            )
            # kubelet's pod-resources socket comes: kubelet's record proves from the next request on.
            kubelet.records.socket_path = root / "pr" / "kubelet.sock"
            await kubelet.records.start()
            copy = node.pod("2222-bbbb", "thief")
            assert not is_shared(
                await node.create(
                    copy,
                    "c2",
                    "main",
                    annotations=await kubelet.admit(RESOURCE, "ns", "elsewhere", "main", "shared-cpus-2"),
                )
            )
            await node.daemon.wait_log("kubelet's pod-resources API answers again")
            await asyncio.sleep(0)
            found = await scrape("127.0.0.1", port)
            assert value(found, "mixed_cpu_pod_resources_reachable") == 1


@pytest.mark.asyncio
async def test_get_disabled_and_a_full_node_still_prove_by_kubelets_record() -> None:
    """Issue 25, break 8: one "Get disabled" answer switched to List for good, and a List answer over
    gRPC's 4 MB default then forced the marker fallback, where a harvested marker for a device no
    container holds was granted (3 of 3). Now a kubelet without Get, on a node of 110 pods whose List
    answer is over 4 MB, still proves: the harvested marker gets nothing, the rightful container
    gets the shared CPUs, and the degraded proof shows in a warning, the metrics and ``check``."""
    with short_directory("kp-") as root:
        async with kubelet_and_daemon(root, get_enabled=False, crowded=True) as (kubelet, node):
            spoofs = Spoofs(node)
            harvested = await kubelet.admit(RESOURCE, "ns", "ghost", "main", "shared-cpus-9")
            for uid, name in (("6666-ffff", "thief"), ("7777-aaaa", "thief2"), ("8888-bbbb", "thief3")):
                await spoofs.attempt(uid, name, f"c-{name}", "main", harvested)
            assert (spoofs.attempts, spoofs.grants) == (3, 0)
            marker = await kubelet.admit(RESOURCE, "ns", "fwd", "main", "shared-cpus-1")
            assert is_shared(
                await node.create(node.pod("1111-aaaa", "fwd"), "c1", "main", annotations=marker)
            )
            line = await node.daemon.wait_log("kubelet does not serve the pod-resources Get")
            assert json.loads(line)["level"] == "warning"
            found = await scrape("127.0.0.1", await metrics_port(node))
            assert value(found, "mixed_cpu_pod_resources_degraded") == 1
            assert value(found, "mixed_cpu_pod_resources_reachable") == 1
            assert value(found, "mixed_cpu_pod_resources_lookups_total", outcome="list") >= 1
            assert value(found, "mixed_cpu_pod_resources_lookups_total", outcome="unavailable") == 0
            # `check` asks kubelet itself (from a thread: the fake kubelet answers on this loop).
            report = await asyncio.to_thread(
                run_cli, "check", "--config", str(root / "config.toml"), timeout=20
            )
            [warn] = [entry for entry in report.stdout.splitlines() if "pod-resources API" in entry]
            assert warn.startswith("WARN  pod-resources API      kubelet does not serve Get"), warn
