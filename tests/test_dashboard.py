"""The Grafana dashboard the chart ships (packaging/helm/mixed-cpu-nri-plugin/dashboards/): a dashboard
model Grafana loads, whose every query names only metrics, and labels, the daemon exports.

The exported names come from a live `Metrics` registry, every observer call made once so that each
labelled family has a sample to show its labels; the names a query uses are parsed out of its PromQL
(tests/promql_support.py). tests/test_prometheus.py evaluates every query in a real Prometheus.
"""

from __future__ import annotations

import re

from promql_support import TARGET_LABELS, dashboard, exported, expressions, selectors

from nri_plugin.daemon.metrics import Metrics


def test_the_parser_finds_names_and_labels() -> None:
    expr = 'histogram_quantile(0.99, sum by (le, event) (rate(a_bucket{instance=~"$i", event="x y"}[5m])))'
    assert list(selectors(expr)) == [("a_bucket", {"le", "event", "instance"})]
    assert [name for name, _ in selectors('sum(rate(b_total[1m])) / max(c{d="sum(e)"})')] == ["b_total", "c"]


def test_every_query_uses_only_what_the_daemon_exports() -> None:
    names = exported()
    assert "mixed_cpu_shared_creations_total" in names  # (the registry is the daemon's)
    used = set()
    for expr in expressions():
        found = list(selectors(expr))
        assert found, f"no metric in {expr!r}"
        for name, labels in found:
            assert name in names, f"{name} (in {expr!r}) is not exported; exported: {sorted(names)}"
            unknown = labels - names[name] - TARGET_LABELS
            assert not unknown, f"{name} has no label {sorted(unknown)} (in {expr!r})"
            used.add(name)
    # The panels issue 22 asks for, each on its metric.
    for name in (
        "mixed_cpu_shared_containers",
        "mixed_cpu_shared_creations_total",
        "mixed_cpu_nri_request_duration_seconds_bucket",
        "mixed_cpu_heals_total",
        "mixed_cpu_cgroup_write_failures_total",
        "mixed_cpu_probe_connections_evicted_total",
        "mixed_cpu_nri_synchronize_containers",
        "mixed_cpu_nri_synchronize_bytes",
        "process_resident_memory_bytes",
    ):
        assert name in used, name


def test_label_values_the_queries_match_exist() -> None:
    """event="synchronize" or outcome="granted" misspelt would match nothing, silently."""
    metrics = Metrics()
    metrics.request_done("create_container", "ok", 0.001)
    metrics.request_done("synchronize", "ok", 0.001)
    text = metrics.render().decode()
    for expr in expressions():
        for label, value in re.findall(r'([A-Za-z_]+)="([^"$]+)"', expr):
            assert f'{label}="{value}"' in text, f'{label}="{value}" in {expr!r}'


def test_the_json_is_a_dashboard_model() -> None:
    doc = dashboard()
    assert doc["title"] == "mixed-cpu-nri-plugin"
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", doc["uid"]), "Grafana's uid: 40 characters at most"
    assert isinstance(doc["schemaVersion"], int)
    assert doc["schemaVersion"] >= 36
    assert "id" not in doc or doc["id"] is None, "an id would clash with the Grafana it is loaded into"
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = doc["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids are unique"
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        assert panel["type"] in {"timeseries", "heatmap", "stat", "bargauge"}, panel["type"]
        assert panel["title"]
        assert panel["description"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"}
        assert all(isinstance(v, int) and v >= 0 for v in grid.values())
        assert min(grid["w"], grid["h"]) > 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
        assert panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert '{instance=~"$instance"' in target["expr"], "every query follows the node picked"


def test_counters_are_only_read_through_rate_or_increase() -> None:
    """A counter's raw value means nothing on a graph (it restarts with the daemon)."""
    for expr in expressions():
        for name, _ in selectors(expr):
            if name.endswith(("_total", "_bucket")):
                assert "rate(" in expr or "increase(" in expr, expr
