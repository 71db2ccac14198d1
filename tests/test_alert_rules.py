"""The alerting rules the chart ships (packaging/helm/mixed-cpu-nri-plugin/alerts/): checked and unit
tested by Prometheus' own tool, promtool (`promtool check rules`, `promtool test rules` on
tests/prometheus/alerts.test.yaml), and held to what an operator needs of them: each alert tested
firing and silent (on a node with its part off, where it has one), each naming only what the daemon
exports, each annotation saying what to check and linking its section of docs/alerts.md.

promtool comes with Debian's ``prometheus`` package, which .ci/run installs; without it these tests
skip, saying so, except under CI=true, where they fail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml
from mixedcpu_support import ROOT
from promql_support import ALERT_RULES, TARGET_LABELS, alert_rules, exported, record_every_kind, selectors

from nri_plugin.daemon.metrics import Metrics

UNIT_TESTS = ROOT / "tests" / "prometheus" / "alerts.test.yaml"
ALERTS_DOC = ROOT / "docs" / "alerts.md"
GUARD = 120.0  # against hangs only


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(
                "promtool is not installed: .ci/run installs Debian's prometheus package, which has it"
            )
        pytest.skip("promtool is not installed (Debian's prometheus package; .ci/run installs it)")
    return found


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], cwd=ROOT, capture_output=True, text=True, timeout=GUARD, check=False
    )


def unit_tests() -> list[dict[str, object]]:
    groups: list[dict[str, object]] = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    return groups


def test_promtool_checks_the_rules() -> None:
    result = run_promtool("check", "rules", str(ALERT_RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = run_promtool("test", "rules", str(UNIT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_finds_nothing_to_lint_in_the_daemons_metrics() -> None:
    """`promtool check metrics` on what the daemon exposes once every family has a sample: names,
    units, suffixes and help texts as Prometheus' own linter wants them."""
    metrics = Metrics()
    record_every_kind(metrics)
    result = subprocess.run(
        [promtool(), "check", "metrics"],
        input=metrics.render().decode(),
        capture_output=True,
        text=True,
        timeout=GUARD,
        check=False,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_the_unit_tests_read_the_shipped_rules_file() -> None:
    [rule_file] = yaml.safe_load(UNIT_TESTS.read_text())["rule_files"]
    assert (UNIT_TESTS.parent / rule_file).resolve() == ALERT_RULES.resolve()


def _instances(series: str) -> set[str]:
    return set(re.findall(r'instance="([^"]+)"', series))


def test_every_alert_is_tested_firing_and_silent() -> None:
    """Each alert has a check where it fires on one node while the series of another node (healthy,
    or with the alert's part off) are there and leave it silent; an alert on an optional part is
    given a node whose part is off (its mixed_cpu_<part>_enabled gauge 0) that must stay silent."""
    groups = unit_tests()
    for rule in alert_rules():
        name = rule["alert"]
        gated = re.findall(r"(mixed_cpu_[a-z_]+_enabled) == 1", rule["expr"])
        proven = False
        for group in groups:
            series = group["input_series"]
            assert isinstance(series, list)
            checks = [c for c in group["alert_rule_test"] if c["alertname"] == name]  # type: ignore[attr-defined]
            firing = {a["exp_labels"]["instance"] for c in checks for a in c["exp_alerts"]}
            if not firing:
                continue
            seen = set().union(*(_instances(s["series"]) for s in series))
            silent = seen - firing
            off = {
                instance
                for s in series
                for instance in _instances(s["series"])
                for gauge in gated
                if s["series"].startswith(gauge + "{") and re.fullmatch(r"(0(x[0-9]+)? ?)+", str(s["values"]))
            }
            proven = proven or (bool(silent) and (not gated or bool(off & silent)))
        assert proven, f"{name}: no check where it fires beside a node that must stay silent"


def test_every_alert_names_only_what_the_daemon_exports() -> None:
    names = exported()
    for rule in alert_rules():
        found = list(selectors(rule["expr"]))
        assert found, rule["alert"]
        for metric, labels in found:
            assert metric in names, f"{rule['alert']}: {metric} is not exported"
            assert not labels - names[metric] - TARGET_LABELS, f"{rule['alert']}: {metric} {labels}"


def test_each_alert_says_what_to_check_and_links_its_docs() -> None:
    doc = ALERTS_DOC.read_text()
    headings = {line[3:].strip() for line in doc.splitlines() if line.startswith("## ")}
    for rule in alert_rules():
        name = rule["alert"]
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "docs"}, name
        assert "{{ $labels.instance }}" in annotations["summary"], name
        assert "Check" in annotations["description"], f"{name}: the description says what to check"
        assert annotations["docs"] == f"mixed-cpu-nri-plugin docs/alerts.md#{name.lower()}"
        assert name in headings, f"docs/alerts.md has no section '## {name}'"
        assert rule["labels"]["severity"] in {"warning", "info"}, name
    assert len(headings & {r["alert"] for r in alert_rules()}) == len(alert_rules())
