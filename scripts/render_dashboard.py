"""Draw the Grafana dashboard's panels from a real scrape of the daemon, as a PNG (docs/dashboard.png).

Grafana cannot run here, so this draws the same panels with matplotlib: it reads the dashboard
(packaging/helm/mixed-cpu-nri-plugin/dashboards/mixed-cpu-nri-plugin.json), runs the real daemon
(``python -m nri_plugin.daemon.cli run``) against the runtime simulator on a synthetic 8-CPU node
(a fake cgroup v1 tree in a temporary directory), plays a scripted half minute of pods, refusals,
heals, a runtime restart and a probe-port flood, scrapes ``/metrics`` every `STEP` seconds as
Prometheus would (adding its ``instance`` label), then evaluates each panel's PromQL on those scrapes
(`Query`: the few forms the dashboard uses, and nothing else) and lays the panels out on the
dashboard's own 24-column grid. The fake tree never refuses a quota write, so the pod-quota retries
panel stays at 0 here (a real cgroup v1 node refuses some lowerings right after a container stops).

Usage: python scripts/render_dashboard.py [OUT.png]   (needs scripts/requirements-dashboard.txt)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib  # type: ignore[import-not-found,unused-ignore]
import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
from prometheus_client.parser import text_string_to_metric_families

from api.nri import api_pb2 as api
from nri_plugin.mixedcpu.policy import POD_ANNOTATION_PREFIX, POD_ANNOTATION_VALUE
from nri_plugin.nri.simulator import PluginFailed, RuntimeSimulator

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "packaging" / "helm" / "mixed-cpu-nri-plugin" / "dashboards" / "mixed-cpu-nri-plugin.json"
STEP = 0.5  # seconds between scrapes (Prometheus: the scrape interval)
RATE_INTERVAL = 4 * STEP  # what $__rate_interval becomes (Grafana: four scrape intervals)
INSTANCE = "node-a:8891"
ROW_INCHES = 0.4  # the height of one row of the dashboard's grid
PERIOD = 100_000
GUARD = 20.0  # a guard against hangs, never a measure
CONFIG = """\
shared_cpuset = "0-1"
cgroup_root = "{root}/cgroup"
cgroup_version = "v1"
sysfs_root = "{root}/sys"
state_dir = "{root}/state"
nri_socket = "{root}/nri.sock"
metrics_address = "127.0.0.1:0"
systemd_bus = ""
reconcile_interval = 1
log_format = "json"
[trusted_sources]
device_plugin_marker = false
pod_annotation = true
[device_plugin]
enabled = false
"""

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs
Vector = dict[Labels, float]
Matchers = list[tuple[str, str, str]]  # (label, operator, value)
Compute = Callable[["Scrapes", int], Vector]  # an expression's value at the i-th scrape


# -- the synthetic node and the scenario ---------------------------------------------------------


class Node:
    """A temporary node: sysfs, a cgroup v1 tree, the daemon's config; pods' and containers' cgroups."""

    def __init__(self, root: Path) -> None:
        self.root = root
        cpu = root / "sys" / "devices" / "system" / "cpu"
        cpu.mkdir(parents=True)
        (cpu / "online").write_text("0-7\n")
        for controller in ("cpu", "cpuset"):
            (root / "cgroup" / controller).mkdir(parents=True)
        (root / "state").mkdir(mode=0o700)
        self.config = root / "config.toml"
        self.config.write_text(CONFIG.format(root=root))

    def cgroup(self, path: str, quota: int | None = None) -> Path:
        cpu = self.root / "cgroup" / "cpu" / path.lstrip("/")
        cpu.mkdir(parents=True, exist_ok=True)
        (self.root / "cgroup" / "cpuset" / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
        if quota is not None:
            (cpu / "cpu.cfs_quota_us").write_text(f"{quota}\n")
            (cpu / "cpu.cfs_period_us").write_text(f"{PERIOD}\n")
        return cpu


def make_pod(uid: str, name: str, *, asks: tuple[str, ...] = (), qos: str = "") -> api.PodSandbox:
    pod = api.PodSandbox(id=f"sandbox-{uid}", uid=uid, namespace="telco", name=name)
    pod.linux.cgroup_parent = f"/kubepods/{qos}/pod{uid}" if qos else f"/kubepods/pod{uid}"
    for container in asks:
        pod.annotations[POD_ANNOTATION_PREFIX + container] = POD_ANNOTATION_VALUE
    return pod


def make_container(pod: api.PodSandbox, cid: str, name: str, cpus: str, quota: int) -> api.Container:
    container = api.Container(id=cid, pod_sandbox_id=pod.id, name=name)
    container.linux.cgroups_path = f"{pod.linux.cgroup_parent}/{cid}"
    cpu = container.linux.resources.cpu
    cpu.cpus, cpu.quota.value, cpu.period.value, cpu.shares.value = cpus, quota, PERIOD, 1024
    return container


@dataclass
class Scenario:
    """The scripted run: the runtime's side (the simulator) and the node's (the cgroup tree)."""

    node: Node
    sim: RuntimeSimulator
    pods: list[api.PodSandbox] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)

    async def add_pod(self, n: int, *, burstable: bool = False) -> None:
        """A pod whose fwd container asks for the shared CPUs, and a sidecar that does not."""
        uid = f"{n:04d}-aaaa"
        pod = make_pod(uid, f"fwd-{n}", asks=("fwd",), qos="burstable" if burstable else "")
        self.node.cgroup(pod.linux.cgroup_parent, 3 * PERIOD)
        await self.sim.run_pod_sandbox(pod)
        cpus = f"{2 + n % 6}" if not burstable else ""
        for cid, name, quota in ((f"fwd-{n}", "fwd", 2 * PERIOD), (f"side-{n}", "sidecar", PERIOD)):
            self.node.cgroup(f"{pod.linux.cgroup_parent}/{cid}")
            try:
                await self.sim.create_container(make_container(pod, cid, name, cpus, quota))
            except PluginFailed:
                continue  # refused: counted by the daemon
            await self.sim.start_container(cid)
            if name == "fwd":
                self.shared.append(cid)
        self.pods.append(pod)

    async def stop(self, cid: str) -> None:
        await self.sim.stop_container(cid)
        await self.sim.remove_container(cid)
        self.shared.remove(cid)

    def pod_vanishes(self, pod: api.PodSandbox) -> None:
        """The pod's cgroups go with no event (a runtime that lost it): the reconciler heals it."""
        for controller in ("cpu", "cpuset"):
            shutil.rmtree(self.node.root / "cgroup" / controller / pod.linux.cgroup_parent.lstrip("/"))

    def quota_rewritten(self, pod: api.PodSandbox) -> None:
        """Someone writes the pod's quota back to its own value: the reconciler raises it again."""
        self.node.cgroup(pod.linux.cgroup_parent, 3 * PERIOD)


async def play(scenario: Scenario, socket_path: str, address: tuple[str, int]) -> RuntimeSimulator:
    """The half minute the picture shows; returns the simulator then serving (after the restart)."""
    for n in range(1, 13):  # pods arrive; every fourth is Burstable, and refused
        await scenario.add_pod(n, burstable=n % 4 == 0)
        await asyncio.sleep(0.4)
    await asyncio.sleep(2)
    for cid in list(scenario.shared[:3]):  # some end
        await scenario.stop(cid)
        await asyncio.sleep(0.5)
    scenario.pod_vanishes(scenario.pods[4])
    scenario.quota_rewritten(scenario.pods[5])
    await asyncio.sleep(3)
    for n in range(13, 16):
        await scenario.add_pod(n)
        await asyncio.sleep(0.4)
    await flood(address, 14)  # one address holds the probe port's connections open
    await asyncio.sleep(2)
    # The runtime restarts, with a few hundred containers of other pods running: a bigger Synchronize.
    before = scenario.sim
    for n in range(300):
        pod = make_pod(f"9{n:03d}-bbbb", f"web-{n}")
        before.add_pod(pod)
        before.add_container(make_container(pod, f"web-{n}", "web", "", 50_000))
    await before.close()
    await asyncio.sleep(1.5)
    after = RuntimeSimulator(socket_path)
    after.restore(before)
    await after.start()
    await after.wait_for_plugins(1, GUARD)
    scenario.sim = after
    await asyncio.sleep(2)
    for n in range(16, 20):
        await scenario.add_pod(n, burstable=n == 18)
        await asyncio.sleep(0.4)
    await asyncio.sleep(3)
    return after


async def flood(address: tuple[str, int], count: int) -> None:
    """`count` idle connections from 127.0.0.2: past 8 from one address the oldest are evicted."""
    held = []
    for _ in range(count):
        held.append(await asyncio.open_connection(*address, local_addr=("127.0.0.2", 0)))
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    for _, writer in held:
        writer.close()


# -- scraping -------------------------------------------------------------------------------------


@dataclass
class Scrapes:
    """Every scrape: its time (seconds since the first) and its samples, `instance` added."""

    times: list[float] = field(default_factory=list)
    samples: list[dict[str, Vector]] = field(default_factory=list)

    def add(self, at: float, text: str) -> None:
        found: dict[str, Vector] = defaultdict(dict)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(sorted({**sample.labels, "instance": INSTANCE}.items()))
                found[sample.name][labels] = sample.value
        self.times.append(at)
        self.samples.append(found)


async def scrape(address: tuple[str, int]) -> str:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), GUARD)
    writer.write(f"GET /metrics HTTP/1.1\r\nHost: {address[0]}\r\nConnection: close\r\n\r\n".encode())
    data = await asyncio.wait_for(reader.read(), GUARD)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"/metrics answered {head.splitlines()[0]!r}")
    return body.decode()


async def scrape_every(address: tuple[str, int], scrapes: Scrapes, started: float) -> None:
    while True:
        scrapes.add(time.monotonic() - started, await scrape(address))
        await asyncio.sleep(STEP)


# -- the PromQL the dashboard uses --------------------------------------------------------------


class Query:
    """One expression, evaluated at each scrape. The forms: a selector ``name{l="v", l=~"re"}``;
    ``rate``/``increase`` of a selector over ``[$__rate_interval]``; ``sum``/``max`` with
    ``by (...)``; ``histogram_quantile(q, ...)``. Anything else raises ValueError."""

    TOKEN = re.compile(
        r'\s*(?:(\d+\.\d+|\d+)|([A-Za-z_:][A-Za-z0-9_:]*)|("(?:[^"\\]|\\.)*")|(=~|!=|!~|[(){}\[\],=])|(\$\w+))'
    )

    def __init__(self, expr: str, variables: dict[str, str]) -> None:
        for name, value in variables.items():  # as Grafana does, before the query is sent
            expr = expr.replace(name, value)
        self.tokens: list[str] = []
        pos = 0
        while pos < len(expr.rstrip()):
            match = self.TOKEN.match(expr, pos)
            if match is None:
                raise ValueError(f"cannot read {expr[pos:]!r}")
            token = next(g for g in match.groups() if g is not None)
            self.tokens.append(token)
            pos = match.end()
        self.at = 0

    def next(self, expected: str | None = None) -> str:
        token = self.tokens[self.at]
        if expected is not None and token != expected:
            raise ValueError(f"expected {expected!r}, found {token!r}")
        self.at += 1
        return token

    def peek(self) -> str:
        return self.tokens[self.at] if self.at < len(self.tokens) else ""

    def evaluate(self, scrapes: Scrapes) -> list[Vector]:
        self.at = 0
        compute = self.parse()
        if self.at != len(self.tokens):
            raise ValueError(f"unread: {self.tokens[self.at :]}")
        return [compute(scrapes, i) for i in range(len(scrapes.times))]

    def parse(self) -> Compute:
        word = self.next()
        if word in ("sum", "max"):
            by: tuple[str, ...] = ()
            if self.peek() == "by":
                self.next()
                by = self.names()
            self.next("(")
            inner = self.parse()
            self.next(")")
            pick = sum if word == "sum" else max
            return lambda s, i: aggregate(inner(s, i), by, pick)
        if word in ("rate", "increase"):
            self.next("(")
            name, matchers = self.next(), self.matchers()
            self.next("[")
            window = self.next()
            if window != "$__rate_interval":
                raise ValueError(f"range {window!r}")
            self.next("]")
            self.next(")")
            per_second = word == "rate"
            return lambda s, i: counter_rate(s, i, name, matchers, per_second)
        if word == "histogram_quantile":
            self.next("(")
            q = float(self.next())
            self.next(",")
            inner = self.parse()
            self.next(")")
            return lambda s, i: quantile(q, inner(s, i))
        name, matchers = word, self.matchers()
        return lambda s, i: select(s.samples[i].get(name, {}), matchers)

    def names(self) -> tuple[str, ...]:
        self.next("(")
        names = [self.next()]
        while self.peek() == ",":
            self.next()
            names.append(self.next())
        self.next(")")
        return tuple(names)

    def matchers(self) -> Matchers:
        found: Matchers = []
        if self.peek() != "{":
            return found
        self.next("{")
        while self.peek() != "}":
            label, op, value = self.next(), self.next(), json.loads(self.next())
            found.append((label, op, value))
            if self.peek() == ",":
                self.next()
        self.next("}")
        return found


def matches(labels: Labels, matchers: Matchers) -> bool:
    have = dict(labels)
    for label, op, value in matchers:
        got = have.get(label, "")
        ok = {"=": got == value, "!=": got != value}.get(op)
        if ok is None:
            ok = re.fullmatch(value, got) is not None
            ok = ok if op == "=~" else not ok
        if not ok:
            return False
    return True


def select(series: Vector, matchers: Matchers) -> Vector:
    return {labels: v for labels, v in series.items() if matches(labels, matchers)}


def counter_rate(s: Scrapes, i: int, name: str, matchers: Matchers, per_second: bool) -> Vector:
    """Prometheus's rate/increase, without its extrapolation: the counter's rise over the scrapes of
    the window ending at scrape `i` (a fall is a restart: counted from 0)."""
    first = i
    while first > 0 and s.times[i] - s.times[first - 1] <= RATE_INTERVAL:
        first -= 1
    out: Vector = {}
    if first == i:
        return out
    for labels in select(s.samples[i].get(name, {}), matchers):
        rise, previous = 0.0, None
        for j in range(first, i + 1):
            value = s.samples[j].get(name, {}).get(labels)
            if value is None:
                continue
            if previous is not None:
                rise += value - previous if value >= previous else value
            previous = value
        span = s.times[i] - s.times[first]
        out[labels] = rise / span if per_second else rise * RATE_INTERVAL / span
    return out


def aggregate(vector: Vector, by: tuple[str, ...], pick: Callable[[list[float]], float]) -> Vector:
    groups: dict[Labels, list[float]] = defaultdict(list)
    for labels, v in vector.items():
        groups[tuple((k, val) for k, val in labels if k in by)].append(v)
    return {labels: pick(values) for labels, values in groups.items()}


def quantile(q: float, vector: Vector) -> Vector:
    """histogram_quantile: linear within the bucket the rank falls in; NaN with no observation."""
    groups: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
    for labels, v in vector.items():
        le = dict(labels)["le"]
        groups[tuple(p for p in labels if p[0] != "le")].append((float(le), v))
    out: Vector = {}
    for labels, buckets in groups.items():
        buckets.sort()
        total = buckets[-1][1]
        if total <= 0:
            out[labels] = math.nan
            continue
        rank, lower, below = q * total, 0.0, 0.0
        for upper, count in buckets:
            if count >= rank:
                if math.isinf(upper):
                    out[labels] = lower
                else:
                    out[labels] = lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
                break
            lower, below = upper, count
    return out


# -- drawing -------------------------------------------------------------------------------------


def legend(template: str, labels: Labels) -> str:
    have = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: have.get(m.group(1), ""), template) or "value"


def series(values: list[Vector], template: str) -> Iterator[tuple[str, list[float]]]:
    keys = sorted({labels for vector in values for labels in vector})
    for labels in keys:
        yield legend(template, labels), [vector.get(labels, math.nan) for vector in values]


UNITS = {"bytes": (1 / 2**20, "MiB"), "s": (1000.0, "ms")}


def draw(panel: dict[str, Any], ax: Any, scrapes: Scrapes, variables: dict[str, str]) -> None:
    ax.set_title(panel["title"], fontsize=9, loc="left")
    ax.tick_params(labelsize=7)
    t = scrapes.times
    if panel["type"] == "heatmap":
        [target] = panel["targets"]
        values = Query(target["expr"], variables).evaluate(scrapes)
        bounds = sorted({float(dict(labels)["le"]) for vector in values for labels in vector})
        grid = []
        for vector in values:
            cumulative = {float(dict(labels)["le"]): v for labels, v in vector.items()}
            counts, below = [], 0.0
            for le in bounds:
                counts.append(max(cumulative.get(le, 0.0) - below, 0.0))
                below = cumulative.get(le, below)
            grid.append(counts)
        image = [list(row) for row in zip(*grid, strict=True)] if grid else [[0.0]]
        ax.imshow(
            image,
            aspect="auto",
            origin="lower",
            cmap="Oranges",
            interpolation="nearest",
            extent=(t[0], t[-1], -0.5, len(bounds) - 0.5),
        )
        ax.set_yticks(range(len(bounds)))
        ax.set_yticklabels(["+Inf" if math.isinf(b) else f"{b * 1000:g} ms" for b in bounds], fontsize=6)
        ax.set_xlabel("seconds", fontsize=7)
        return
    unit = panel["fieldConfig"]["defaults"].get("unit", "short")
    scale, shown = UNITS.get(unit, (1.0, ""))
    points = panel["fieldConfig"]["defaults"]["custom"].get("showPoints") == "always"
    bars = panel["fieldConfig"]["defaults"]["custom"].get("drawStyle") == "bars"
    drawn, highest = 0, 0.0
    for target in panel["targets"]:
        values = Query(target["expr"], variables).evaluate(scrapes)
        for name, ys in series(values, target.get("legendFormat", "")):
            ys = [y * scale for y in ys]
            highest = max([highest, *(y for y in ys if not math.isnan(y))])
            if bars:
                ax.bar(t, [0 if math.isnan(y) else y for y in ys], width=STEP * 0.9, label=name, alpha=0.7)
            else:
                ax.plot(t, ys, label=name, linewidth=1.2, marker="o" if points else None, markersize=3)
            drawn += 1
    ax.set_ylim(0, highest * 1.25 if highest > 0 else 1)
    ax.set_xlabel("seconds", fontsize=7)
    if shown:
        ax.set_ylabel(shown, fontsize=7)
    if drawn:
        ax.legend(fontsize=6, loc="upper left", ncol=2)


def render(scrapes: Scrapes, out: Path) -> None:
    """Each panel at its place on the dashboard's grid (24 columns; a grid row is `ROW_INCHES`)."""
    matplotlib.use("Agg")  # files only, no display
    board = json.loads(DASHBOARD.read_text())
    variables = {"$instance": INSTANCE}  # (no regex metacharacter in it)
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"])
    height = rows * ROW_INCHES + 0.6
    figure = plt.figure(figsize=(18, height))
    for panel in board["panels"]:
        g = panel["gridPos"]
        # The panel's cell, less room for its title above and the axis labels below and left.
        left = g["x"] / 24 + 0.035
        width = g["w"] / 24 - 0.045
        top = 1 - (0.6 + g["y"] * ROW_INCHES) / height - 0.3 / height
        bottom = 1 - (0.6 + (g["y"] + g["h"]) * ROW_INCHES) / height + 0.45 / height
        ax = figure.add_axes((left, bottom, width, top - bottom))
        draw(panel, ax, scrapes, variables)
        ax.set_xlim(scrapes.times[0], scrapes.times[-1])
    figure.suptitle(
        f"{board['title']}: the dashboard's panels, drawn from the daemon's /metrics scraped every "
        f"{STEP:g} s during a scripted simulator run (scripts/render_dashboard.py)",
        fontsize=11,
        y=1 - 0.15 / height,
    )
    figure.savefig(out, dpi=80)


# -- the run ---------------------------------------------------------------------------------------


async def metrics_address(proc: asyncio.subprocess.Process) -> tuple[str, int]:
    """The address the daemon logged it serves metrics on."""
    assert proc.stderr is not None
    while True:
        line = await asyncio.wait_for(proc.stderr.readline(), GUARD)
        if not line:
            raise RuntimeError("the daemon exited before serving its metrics")
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("msg") == "serving metrics and probes":
                host, _, port = record["address"].split()[0].rpartition(":")
                return host, int(port)


async def drain(proc: asyncio.subprocess.Process) -> None:
    assert proc.stderr is not None
    while await proc.stderr.readline():
        pass


async def main(out: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="mixed-cpu-dashboard-"))
    try:
        node = Node(root)
        socket_path = str(root / "nri.sock")
        sim = RuntimeSimulator(socket_path)
        await sim.start()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "nri_plugin.daemon.cli",
            "run",
            "--config",
            str(node.config),
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            address = await metrics_address(proc)
            draining = asyncio.ensure_future(drain(proc))
            await sim.wait_for_plugins(1, GUARD)
            scrapes = Scrapes()
            scraping = asyncio.ensure_future(scrape_every(address, scrapes, time.monotonic()))
            sim = await play(Scenario(node, sim), socket_path, address)
            scraping.cancel()
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), GUARD)
            await draining
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await sim.close()
        render(scrapes, out)
        print(f"{out}: {len(scrapes.times)} scrapes over {scrapes.times[-1]:.0f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "dashboard.png"))
