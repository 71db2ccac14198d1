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
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from node_story import CREATIONS, REFUSALS, story_node, tell_the_story
from probe_support import value
from promql_support import ALERT_RULES, dashboard

GUARD = 60.0  # against hangs only
SCRAPE_SECONDS = 1
RATE_INTERVAL = "10s"  # Grafana's $__rate_interval at a 1 s scrape interval is 4 s or more


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("prometheus is not installed: .ci/run installs Debian's prometheus package")
        pytest.skip("prometheus is not installed (Debian's prometheus package; .ci/run installs it)")
    return found


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes: the NRI socket, the device plugin's, the DRA ones.
    path = Path(tempfile.mkdtemp(prefix="pm-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Prometheus:
    """Prometheus' HTTP API on 127.0.0.1:`port` (blocking calls: run them in a thread)."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as reply:
            document = json.loads(reply.read())
        assert document["status"] == "success", document
        return document["data"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def instant(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr, time=str(time.time()))
        result: list[dict[str, Any]] = data["result"]
        return result

    def over(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        data = self.get(
            "/api/v1/query_range", query=expr, start=str(start), end=str(end), step=str(SCRAPE_SECONDS)
        )
        result: list[dict[str, Any]] = data["result"]
        return result


@contextlib.asynccontextmanager
async def prometheus_scraping(directory: Path, target: str) -> AsyncIterator[Prometheus]:
    """Prometheus on a free port of 127.0.0.1, scraping `target` every second and evaluating the
    alert rules every second, its data in `directory`; stopped (killed if need be) after the body."""
    binary = prometheus_binary()
    config = directory / "prometheus.yml"
    config.write_text(
        f"global: {{scrape_interval: {SCRAPE_SECONDS}s, evaluation_interval: {SCRAPE_SECONDS}s}}\n"
        f"rule_files: [{json.dumps(str(ALERT_RULES))}]\n"
        "scrape_configs:\n"
        "  - job_name: mixed-cpu-nri-plugin\n"
        f"    static_configs: [{{targets: [{json.dumps(target)}]}}]\n"
    )
    port = _free_port()
    log = (directory / "prometheus.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={directory / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
    )
    api = Prometheus(port)
    try:

        async def started() -> None:
            while not await asyncio.to_thread(api.ready):
                assert proc.returncode is None, (directory / "prometheus.log").read_text()
                await asyncio.sleep(0.2)

        await asyncio.wait_for(started(), GUARD)
        yield api
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), GUARD)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        log.close()


async def until(check: Any, what: str) -> None:
    """Ask `check` (a blocking callable) again until it is true; `what` says what was awaited."""

    async def wait() -> None:
        # Prometheus is another process: its API is the only word of what it has seen.
        while not await asyncio.to_thread(check):  # noqa: ASYNC110
            await asyncio.sleep(0.25)

    try:
        await asyncio.wait_for(wait(), GUARD)
    except asyncio.TimeoutError:
        raise AssertionError(f"Prometheus never showed {what} within {GUARD} s") from None


def _panel_queries() -> list[tuple[str, dict[str, Any]]]:
    return [(panel["title"], target) for panel in dashboard()["panels"] for target in panel["targets"]]


def _expand(expr: str, instance: str, range_seconds: int) -> str:
    text = (
        expr.replace("$__rate_interval", RATE_INTERVAL)
        .replace("$__range", f"{range_seconds}s")
        .replace("$instance", re.escape(instance).replace("\\", "\\\\"))
    )
    assert "$" not in text, f"a dashboard variable the test does not know, in {expr!r}"
    return text


def _whole_counts(series: list[dict[str, Any]], label: str) -> dict[str, float]:
    counts = {s["metric"].get(label, ""): float(s["value"][1]) for s in series}
    assert all(c == int(c) for c in counts.values()), f"a fractional count: {counts}"
    return counts


@pytest.mark.asyncio
async def test_every_panel_query_and_alert_rule_in_a_real_prometheus(short_dir: Path) -> None:
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
                expr = _expand(target["expr"], instance, range_seconds)
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
