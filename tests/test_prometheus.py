"""The dashboard and the alert rules against a real Prometheus: Debian's ``prometheus`` (2.42), on
127.0.0.1 only, in a temporary directory, scraping the real daemon every second while it is told
tests/node_story.py's story (grants, a refusal for each reason, a heal, a runtime restart).

Then every query of every dashboard panel is evaluated through Prometheus' HTTP API, as Grafana
would ask it (a range query, or an instant one over the dashboard's range), and must return series;
the counts the panels show over the range are whole numbers and the story's own. The alert rules
file is loaded as Prometheus' rule_files: every rule evaluates without error, and the alerts the story
calls for are firing (refusals, by reason) or pending (the parts with no kubelet to register with).

Needs the ``prometheus`` binary (.ci/run installs Debian's package): without it the test skips,
saying so, except under CI=true, where it fails.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from node_story import CREATIONS, REFUSALS, story_node, tell_the_story
from probe_support import value
from prometheus_support import (
    PrometheusMissing,
    expand_variables,
    prometheus_binary,
    prometheus_scraping,
    until,
)
from promql_support import ALERT_RULES, dashboard

GUARD = 60.0  # against hangs only
SCRAPE_SECONDS = 1
RATE_INTERVAL = "10s"  # Grafana's $__rate_interval at a 1 s scrape interval is 4 s or more


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes: the NRI socket, the device plugin's, the DRA ones.
    path = Path(tempfile.mkdtemp(prefix="pm-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _panel_queries() -> list[tuple[str, dict[str, Any]]]:
    return [(panel["title"], target) for panel in dashboard()["panels"] for target in panel["targets"]]


def require_prometheus() -> None:
    try:
        prometheus_binary()
    except PrometheusMissing as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{exc}: under CI=true this test does not skip")
        pytest.skip(str(exc))


def _whole_counts(series: list[dict[str, Any]], label: str) -> dict[str, float]:
    counts = {s["metric"].get(label, ""): float(s["value"][1]) for s in series}
    assert all(c == int(c) for c in counts.values()), f"a fractional count: {counts}"
    return counts


@pytest.mark.asyncio
async def test_every_panel_query_and_alert_rule_in_a_real_prometheus(short_dir: Path) -> None:
    require_prometheus()
    plugin_dir = short_dir / "dp"
    plugin_dir.mkdir()
    started = time.time()
    async with story_node(short_dir, plugin_dir) as node:
        instance = f"{node.host}:{node.port}"
        async with prometheus_scraping(short_dir, instance) as prom:
            await until(lambda: prom.instant('up{job="mixed-cpu-nri-plugin"} == 1'), "the daemon scraped")
            await tell_the_story(node)
            final = await node.scrape()
            asked = sum(v for (name, _), v in final.items() if name == CREATIONS)

            def caught_up() -> bool:
                seen = prom.instant(f"sum({CREATIONS})")
                reconnects = prom.instant("mixed_cpu_nri_reconnects_total")
                return bool(seen and reconnects) and (
                    float(seen[0]["value"][1]),
                    float(reconnects[0]["value"][1]),
                ) == (asked, 1.0)

            await until(caught_up, "the story's last counts")
            scrapes = len(prom.instant("mixed_cpu_nri_ready[1h]")[0]["values"])
            # Two scrapes more: a rate() window then holds the last change and a sample after it.
            await until(
                lambda: len(prom.instant("mixed_cpu_nri_ready[1h]")[0]["values"]) >= scrapes + 2,
                "two scrapes more",
            )
            end = time.time()
            range_seconds = int(end - started) + 5
            answers = {}
            for title, target in _panel_queries():
                expr = expand_variables(target["expr"], instance=instance, range_seconds=range_seconds)
                if target.get("instant"):
                    series = await asyncio.to_thread(prom.instant, expr)
                else:
                    series = await asyncio.to_thread(prom.over, expr, started, end)
                assert series, f"panel {title!r}, query {target['refId']}: no series for {expr!r}"
                answers[(title, target["refId"])] = series
            variable = await asyncio.to_thread(
                prom.get, "/api/v1/label/instance/values", **{"match[]": "mixed_cpu_nri_ready"}
            )
            assert instance in variable, "the dashboard's instance variable lists the node"

            def alerts() -> dict[str, dict[tuple[tuple[str, str], ...], str]]:
                found: dict[str, dict[tuple[tuple[str, str], ...], str]] = {}
                for alert in prom.get("/api/v1/alerts")["alerts"]:
                    labels = tuple(sorted((k, v) for k, v in alert["labels"].items() if k == "outcome"))
                    found.setdefault(alert["labels"]["alertname"], {})[labels] = alert["state"]
                return found

            expected = {
                "MixedCpuCreationsRefusedByTheNode": {
                    (("outcome", reason),): "firing" for reason in ("node", "cgroup", "state_file")
                },
                "MixedCpuCreationsRefusedForThePodSpec": {(("outcome", "pod_spec"),): "firing"},
                # Their `for` has not passed: pending, evaluated on the daemon's own series.
                "MixedCpuKubeletNotRegistered": {(): "pending"},
                "MixedCpuDraNotRegistered": {(): "pending"},
                "MixedCpuPodResourcesUnreachable": {(): "pending"},
            }
            await until(lambda: alerts() == expected, f"the alerts {expected}")
            groups = (await asyncio.to_thread(prom.get, "/api/v1/rules"))["groups"]
            rules = [rule for group in groups for rule in group["rules"]]
            assert len(rules) == ALERT_RULES.read_text().count("- alert: ")
            assert all(rule["health"] == "ok" for rule in rules), [r for r in rules if r["health"] != "ok"]

    # What the panels counted over the range: whole numbers, the story's own.
    refusals = _whole_counts(answers[("Refusals by reason (in the dashboard's range)", "A")], "outcome")
    assert refusals == {reason: float(times) for reason, times in REFUSALS.items()}
    heals = _whole_counts(answers[("Heals by kind (in the dashboard's range)", "A")], "kind")
    assert heals["pod_quota"] >= 1
    assert heals["pod_quota"] == value(final, "mixed_cpu_heals_total", kind="pod_quota")
    reconnects = _whole_counts(answers[("NRI reconnects (in the dashboard's range)", "A")], "instance")
    assert reconnects == {instance: 1.0}
    ready = answers[("Serving the runtime (NRI ready)", "A")]
    assert [s["value"][1] for s in ready] == ["1"]
