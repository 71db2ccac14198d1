"""Prometheus itself, for the tests and scripts/render_dashboard.py: Debian's ``prometheus`` (2.42)
run on a free port of 127.0.0.1 only, its data in a directory of the caller's, scraping one target
every second and evaluating the chart's alert rules; its HTTP API asked with blocking calls."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from promql_support import ALERT_RULES

__all__ = [
    "SCRAPE_SECONDS",
    "Prometheus",
    "PrometheusMissing",
    "expand_variables",
    "prometheus_binary",
    "prometheus_scraping",
    "until",
]

GUARD = 60.0  # against hangs only
SCRAPE_SECONDS = 1


class PrometheusMissing(Exception):
    """The prometheus binary is not installed (Debian's prometheus package has it)."""


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        raise PrometheusMissing(
            "prometheus is not installed (Debian's prometheus package; .ci/run installs it)"
        )
    return found


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


def expand_variables(expr: str, *, instance: str, range_seconds: int, rate_interval: str = "10s") -> str:
    """A dashboard query as Grafana would send it: `instance` picked, the dashboard's range, and
    $__rate_interval (Grafana's is four scrape intervals or more: 4 s at 1 s)."""
    text = (
        expr.replace("$__rate_interval", rate_interval)
        .replace("$__range", f"{range_seconds}s")
        .replace("$instance", re.escape(instance).replace("\\", "\\\\"))
    )
    if "$" in text:
        raise ValueError(f"a dashboard variable not known here, in {expr!r}")
    return text
