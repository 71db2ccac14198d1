"""The dashboard's and the alert rules' PromQL, and what the daemon exports: the names and labels a
query selects (parsed out of its PromQL), checked against a live `Metrics` registry."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import yaml
from mixedcpu_support import ROOT

from nri_plugin.daemon.metrics import Metrics

__all__ = [
    "ALERT_RULES",
    "DASHBOARD",
    "TARGET_LABELS",
    "alert_rules",
    "dashboard",
    "exported",
    "expressions",
    "record_every_kind",
    "selectors",
]

CHART = ROOT / "packaging" / "helm" / "mixed-cpu-nri-plugin"
DASHBOARD = CHART / "dashboards" / "mixed-cpu-nri-plugin.json"
ALERT_RULES = CHART / "alerts" / "mixed-cpu-nri-plugin.rules.yaml"

# What a PromQL expression holds besides metric names: functions, aggregations and keywords.
PROMQL_WORDS = frozenset(
    {
        "sum",
        "max",
        "min",
        "avg",
        "count",
        "by",
        "without",
        "rate",
        "increase",
        "irate",
        "histogram_quantile",
        "and",
        "or",
        "unless",
        "on",
        "ignoring",
    }
)
# Labels Prometheus adds to every series it scrapes; `le` on every histogram bucket.
TARGET_LABELS = frozenset({"instance", "job"})

Doc = dict[str, Any]


def dashboard() -> Doc:
    doc: Doc = json.loads(DASHBOARD.read_text())
    return doc


def expressions() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel["targets"]]


def record_every_kind(metrics: Metrics) -> None:
    """One call of every observer method, so that each labelled family has a sample."""
    metrics.request_done("create_container", "ok", 0.001)
    metrics.request_done("configure", "ok", 0.002)
    metrics.reconnecting()
    metrics.cgroup_write_failed("pod_quota_lower")
    metrics.healed("pod_gone")
    metrics.registration_done("ok")
    metrics.pod_resources_lookup("ok")
    metrics.probe_connection_evicted("peer_limit")
    metrics.creation_decided("granted")
    metrics.synchronized(1, 2, 300, 0.01)
    metrics.features(device_plugin=True, pod_resources=True, dra=False, dra_publishing=False)


def exported() -> dict[str, set[str]]:
    """Sample name -> its label names, as a scrape of the daemon shows them once everything happened."""
    metrics = Metrics()
    record_every_kind(metrics)
    names: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def selectors(expr: str) -> Iterator[tuple[str, set[str]]]:
    """Each metric an expression selects, with the label names it matches on or aggregates by."""
    grouped = set()
    for labels in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        grouped |= {label.strip() for label in labels.split(",") if label.strip()}
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # no words inside strings
    bare = re.sub(r"\[[^\]]*\]", "", bare)  # nor in ranges ($__rate_interval)
    bare = re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", bare)
    for match in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?", bare):
        name, matchers = match.group(1), match.group(2) or ""
        if name in PROMQL_WORDS or bare[match.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation, not a metric
        matched = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
        yield name, matched | grouped


def alert_rules() -> list[Doc]:
    """Every rule of the alert rules file, in order."""
    document = yaml.safe_load(ALERT_RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]
