"""Draw the Grafana dashboard's panels from a real Prometheus scraping the real daemon (docs/dashboard.png).

Grafana cannot run here, so this draws the same panels with matplotlib from the answers of Prometheus
itself, as Grafana would ask them. It runs what tests/test_prometheus.py runs: the daemon (``python -m
nri_plugin.daemon.cli run``) against the runtime simulator in a temporary directory (a fake cgroup v1
tree; every part on: device plugin, PodResources, DRA, none with a kubelet to register with), told
tests/node_story.py's story in two waves with pauses between them (grants, a refusal for each reason, a
pod quota put right, the runtime restarting, more grants), and Debian's ``prometheus`` on 127.0.0.1
scraping it every second. Then each panel's query goes to Prometheus' HTTP API: a range query over the
run (step 1 s, $__rate_interval 4 s) for a time series or the heatmap, an instant one over the whole run
($__range) for a stat or a bar gauge; the answers are laid out on the dashboard's own 24-column grid.

Usage: python scripts/render_dashboard.py [OUT.png]
(needs scripts/requirements-dashboard.txt, and the prometheus binary: Debian's prometheus package)
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import matplotlib  # type: ignore[import-not-found,unused-ignore]
import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from node_story import StoryNode, story_node, tell_the_story  # noqa: E402
from prometheus_support import Prometheus, expand_variables, prometheus_scraping, until  # noqa: E402
from promql_support import DASHBOARD  # noqa: E402

RATE_INTERVAL = "4s"  # Grafana's $__rate_interval at a 1 s scrape interval
ROW_INCHES = 0.4  # the height of one row of the dashboard's grid
PAUSE = 6.0  # seconds between the story's waves: room on the graphs for what each did
UNITS = {"bytes": (1 / 2**20, "MiB")}

Answers = dict[tuple[int, str], list[dict[str, Any]]]


async def second_wave(node: StoryNode) -> None:
    """More pods granted after the restart, and one more pod whose cgroup is not there."""
    for n in range(3):
        pod = node.new_pod()
        await node.sim.run_pod_sandbox(pod)
        await node.sim.create_container(node.asking(pod, f"late{n}"))
        await asyncio.sleep(1.0)
    pod = node.new_pod(cgroup=False)
    await node.sim.run_pod_sandbox(pod)
    try:
        await node.sim.create_container(node.asking(pod, "late-nocg"))
    except Exception as exc:  # the refusal the runtime sees (PluginFailed)
        print(f"refused, as it should be: {type(exc).__name__}")


async def run(directory: Path) -> tuple[Answers, float, float]:
    """Play the story under Prometheus, then ask it every panel's query; the answers by (panel
    id, refId), and the run's start and end (seconds since the epoch)."""
    plugin_dir = directory / "dp"
    plugin_dir.mkdir()
    board = json.loads(DASHBOARD.read_text())
    started = time.time()
    async with story_node(directory, plugin_dir) as node:
        instance = f"{node.host}:{node.port}"
        async with prometheus_scraping(directory, instance) as prom:
            await until(lambda: prom.instant('up{job="mixed-cpu-nri-plugin"} == 1'), "the daemon scraped")
            await asyncio.sleep(PAUSE)
            await tell_the_story(node)
            await asyncio.sleep(PAUSE)
            await second_wave(node)
            await asyncio.sleep(PAUSE)
            end = time.time()
            answers: Answers = {}
            for panel in board["panels"]:
                for target in panel["targets"]:
                    expr = expand_variables(
                        target["expr"],
                        instance=instance,
                        range_seconds=int(end - started) + 1,
                        rate_interval=RATE_INTERVAL,
                    )
                    ask = prom.instant if target.get("instant") else _over(prom, started, end)
                    answers[(panel["id"], target["refId"])] = await asyncio.to_thread(ask, expr)
    return answers, started, end


def _over(prom: Prometheus, start: float, end: float) -> Any:
    return lambda expr: prom.over(expr, start, end)


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template) or "value"


def _mapped(panel: dict[str, Any], value: float) -> str:
    for mapping in panel["fieldConfig"]["defaults"].get("mappings", []):
        text = mapping.get("options", {}).get(f"{value:g}", {}).get("text")
        if text:
            return str(text)
    return f"{value:g}"


def draw_heatmap(ax: Any, series: list[dict[str, Any]], started: float) -> None:
    bounds = sorted(float(s["metric"]["le"]) for s in series)
    by_le = {float(s["metric"]["le"]): dict(s["values"]) for s in series}
    times = sorted({t for s in series for t, _ in s["values"]})
    grid = []
    for le_index, le in enumerate(bounds):
        below = by_le[bounds[le_index - 1]] if le_index else {}
        row = [max(float(by_le[le].get(t, 0)) - float(below.get(t, 0)), 0.0) for t in times]
        grid.append(row)
    extent = (times[0] - started, times[-1] - started, -0.5, len(bounds) - 0.5) if times else None
    ax.imshow(
        grid or [[0.0]], aspect="auto", origin="lower", cmap="Oranges", interpolation="nearest", extent=extent
    )
    ax.set_yticks(range(len(bounds)))
    ax.set_yticklabels(["+Inf" if math.isinf(b) else f"{b * 1000:g} ms" for b in bounds], fontsize=6)
    ax.set_xlabel("seconds", fontsize=7)


def draw_lines(ax: Any, panel: dict[str, Any], answers: Answers, started: float) -> None:
    defaults = panel["fieldConfig"]["defaults"]
    unit = defaults.get("unit", "short")
    scale, shown = UNITS.get(unit, (1.0, ""))
    found = [s for target in panel["targets"] for s in answers[(panel["id"], target["refId"])]]
    if unit == "s":  # milliseconds for what takes less than a second
        values = [float(v) for s in found for _, v in s["values"] if not math.isnan(float(v))]
        small = max(values, default=0.0) < 1
        scale, shown = (1000.0, "ms") if small else (1.0, "s")
    stepped = defaults["custom"].get("lineInterpolation") == "stepAfter"
    highest, drawn = 0.0, 0
    for target in panel["targets"]:
        for s in answers[(panel["id"], target["refId"])]:
            xs = [float(t) - started for t, _ in s["values"]]
            ys = [float(v) * scale for _, v in s["values"]]
            highest = max([highest, *(y for y in ys if not math.isnan(y))])
            name = legend(target.get("legendFormat", ""), s["metric"])
            ax.plot(xs, ys, label=name, linewidth=1.2, drawstyle="steps-post" if stepped else "default")
            drawn += 1
    ax.set_ylim(0, highest * 1.25 if highest > 0 else 1)
    ax.set_xlabel("seconds", fontsize=7)
    if shown:
        ax.set_ylabel(shown, fontsize=7)
    if drawn:
        ax.legend(fontsize=6, loc="upper left", ncol=2)


def draw_counts(ax: Any, panel: dict[str, Any], answers: Answers) -> None:
    """A bar gauge: one bar per series, its whole count written beside it."""
    items = [
        (legend(target.get("legendFormat", ""), s["metric"]), float(s["value"][1]))
        for target in panel["targets"]
        for s in answers[(panel["id"], target["refId"])]
    ]
    items.sort()
    names = [name for name, _ in items]
    values = [value for _, value in items]
    ax.barh(names, values, color=["tab:orange" if v >= 1 else "tab:green" for v in values])
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:g}", va="center", fontsize=7)
    ax.set_xlim(0, max([1.0, *values]) * 1.3)
    ax.tick_params(axis="y", labelsize=7)


def draw_stat(ax: Any, panel: dict[str, Any], answers: Answers) -> None:
    lines = [
        f"{legend(target.get('legendFormat', ''), s['metric'])}: {_mapped(panel, float(s['value'][1]))}"
        for target in panel["targets"]
        for s in answers[(panel["id"], target["refId"])]
    ]
    ax.text(0.5, 0.5, "\n".join(lines) or "no data", ha="center", va="center", fontsize=12, weight="bold")
    ax.set_axis_off()


def render(answers: Answers, started: float, end: float, out: Path) -> None:
    """Each panel at its place on the dashboard's grid (24 columns; a grid row is `ROW_INCHES`)."""
    matplotlib.use("Agg")  # files only, no display
    board = json.loads(DASHBOARD.read_text())
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"])
    height = rows * ROW_INCHES + 0.6
    figure = plt.figure(figsize=(18, height))
    for panel in board["panels"]:
        g = panel["gridPos"]
        left = g["x"] / 24 + 0.035
        width = g["w"] / 24 - 0.045
        top = 1 - (0.6 + g["y"] * ROW_INCHES) / height - 0.3 / height
        bottom = 1 - (0.6 + (g["y"] + g["h"]) * ROW_INCHES) / height + 0.45 / height
        ax = figure.add_axes((left, bottom, width, top - bottom))
        ax.set_title(panel["title"], fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        if panel["type"] == "heatmap":
            [target] = panel["targets"]
            draw_heatmap(ax, answers[(panel["id"], target["refId"])], started)
            ax.set_xlim(0, end - started)
        elif panel["type"] == "bargauge":
            draw_counts(ax, panel, answers)
        elif panel["type"] == "stat":
            draw_stat(ax, panel, answers)
        else:
            draw_lines(ax, panel, answers, started)
            ax.set_xlim(0, end - started)
    figure.suptitle(
        f"{board['title']}: the dashboard's panels as Prometheus answered their queries, scraping the "
        "daemon every second during a scripted simulator run (scripts/render_dashboard.py)",
        fontsize=11,
        y=1 - 0.15 / height,
    )
    figure.savefig(out, dpi=80)


async def main(out: Path) -> None:
    directory = Path(tempfile.mkdtemp(prefix="dash-", dir="/tmp"))  # short: unix socket paths
    try:
        answers, started, end = await run(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    render(answers, started, end, out)
    print(f"{out}: {len(answers)} queries over {end - started:.0f} s")


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "dashboard.png"))
