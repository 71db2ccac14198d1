"""Every refusal counted by its reason where the README's alert looks: the real daemon (``run``)
refuses creations for each reason the runtime simulator can bring about (tests/node_story.py), and
its own /metrics, fetched over HTTP, counts each in ``mixed_cpu_shared_creations_total{outcome}``;
``mixed_cpu_cgroup_write_failures_total`` counts only the cgroup writes that failed (none here: a
pod cgroup that is not there is never written)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from node_story import CREATIONS, GRANTED, REFUSALS, story_node, tell_the_story
from probe_support import value

from nri_plugin.daemon.metrics import CREATION_OUTCOMES, WRITE_FAILURE_KINDS


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes: the NRI socket, the device plugin's, the status one.
    path = Path(tempfile.mkdtemp(prefix="rf-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.asyncio
async def test_each_refusal_is_counted_by_its_reason_and_no_write_failure_is_invented(
    short_dir: Path,
) -> None:
    plugin_dir = short_dir / "dp"
    plugin_dir.mkdir()
    async with story_node(short_dir, plugin_dir) as node:
        await tell_the_story(node)
        found = await node.scrape()
    assert set(REFUSALS) == set(CREATION_OUTCOMES) - {"granted"}, "the story refuses for every reason"
    assert value(found, CREATIONS, outcome="granted") == GRANTED
    for reason, times in REFUSALS.items():
        assert value(found, CREATIONS, outcome=reason) == times, reason
    refused = sum(
        v for (name, labels), v in found.items() if name == CREATIONS and ("outcome", "granted") not in labels
    )
    assert refused == sum(REFUSALS.values())
    # The runtime saw each refusal as an error answer to its CreateContainer.
    errors = value(found, "mixed_cpu_nri_requests_total", event="create_container", outcome="error")
    assert errors == sum(REFUSALS.values())
    for kind in WRITE_FAILURE_KINDS:
        assert value(found, "mixed_cpu_cgroup_write_failures_total", kind=kind) == 0, kind
    assert value(found, "mixed_cpu_heals_total", kind="pod_quota") >= 1
    assert value(found, "mixed_cpu_nri_reconnects_total") == 1
    assert value(found, "mixed_cpu_shared_containers") == GRANTED
    # The parts this daemon runs (the alerts on their gauges need them), none of them with a kubelet
    # or an API server to talk to: the device plugin, kubelet's PodResources API, DRA.
    for part in ("device_plugin", "pod_resources", "dra"):
        assert value(found, f"mixed_cpu_{part}_enabled") == 1, part
    assert value(found, "mixed_cpu_pod_resources_reachable") == 0
    assert value(found, "mixed_cpu_kubelet_registered") == 0
    assert value(found, "mixed_cpu_dra_registered") == 0
    assert node.proc.returncode == 0, "\n".join(node.lines)
