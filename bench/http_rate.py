"""How fast the daemon's two HTTP servers answer: the probes' ``/healthz`` and ``/metrics`` (TCP) and
the status socket's ``GET /status`` (unix), one request per connection as their clients ask.

Usage: python bench/http_rate.py [--seconds 5] [--connections 4] [--status 300] [--pods 200]

A child process serves both on one event loop as the daemon does (`ProbeServer` with the daemon's
metrics, `StatusServer` with a document of `--pods` shared containers). Measured from outside:

* with ``wrk`` (Debian's package) on the PATH: ``/healthz`` and ``/metrics`` for `--seconds` each over
  `--connections` connections (each answer closes its connection: a new connection per request, as
  kubelet and Prometheus make): requests a second and wrk's p50 / p99 latency;
* without it, and always for the status socket: `--status` requests one after the other, by the
  standard library's ``http.client`` for the probes and by ``fetch_status`` (the ``status`` command's
  client) for the status: p50 / p99 per request;
* for every row, the server's CPU per request (its process's user + system time over the row,
  divided by the requests it answered), the least noisy figure on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from probe_churn import cpu_seconds  # noqa: E402
from workload import percentile  # noqa: E402


def serve(socket_path: str, pods: int) -> None:
    """The child: both servers on one loop; prints the probe port, runs until SIGTERM."""
    import logging

    import structlog

    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    from nri_plugin.daemon.metrics import Metrics
    from nri_plugin.daemon.probes import ProbeServer
    from nri_plugin.daemon.status import StatusServer
    from nri_plugin.mixedcpu.status import SCHEMA

    row = {"namespace": "ns", "pod": "pod", "container": "app", "exclusive_cpus": "2-3", "shared_cpus": "0-1"}
    document = {"schema": SCHEMA, "containers": [dict(row, pod=f"pod-{n}") for n in range(pods)]}

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        status = StatusServer(socket_path, lambda: document)
        await status.start()
        async with ProbeServer("127.0.0.1:0", metrics=Metrics().render, readiness=lambda: None) as probes:
            print(probes.bound[0].rpartition(":")[2], flush=True)
            await stop.wait()
        await status.close()

    asyncio.run(main())


def with_wrk(port: int, path: str, seconds: float, connections: int) -> tuple[int, float, str, str]:
    """(requests, requests a second, p50, p99) of `wrk` on `path`."""
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency", f"http://127.0.0.1:{port}{path}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    requests = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = re.search(r"^\s+50%\s+(\S+)", out, re.MULTILINE).group(1)  # type: ignore[union-attr]
    p99 = re.search(r"^\s+99%\s+(\S+)", out, re.MULTILINE).group(1)  # type: ignore[union-attr]
    return requests, rate, p50, p99


def one_by_one(ask: object, count: int) -> list[float]:
    took = []
    for _ in range(count):
        begin = time.perf_counter()
        ask()  # type: ignore[operator]
        took.append(time.perf_counter() - begin)
    return took


def probe_asker(port: int, path: str) -> object:
    def ask() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        connection.close()
        assert response.status == 200, response.status

    return ask


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of wrk per path (5)")
    parser.add_argument("--connections", type=int, default=4, help="wrk's connections (4)")
    parser.add_argument("--status", type=int, default=1000, help="requests one by one per row (1000)")
    parser.add_argument("--pods", type=int, default=200, help="containers in the status document (200)")
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    from nri_plugin.daemon.status_client import fetch_status

    load = " ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"load average {load} on {os.cpu_count()} CPUs; {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory(prefix="http-rate-") as tmp:
        socket_path = os.path.join(tmp, "status.sock")
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve", socket_path, str(args.pods)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            assert child.stdout is not None
            port = int(child.stdout.readline())
            print("| what | requests | rate /s | p50 | p99 | server CPU per request |")
            print("|---|---|---|---|---|---|")
            rows: list[tuple[str, object, str]] = [
                ("/healthz", probe_asker(port, "/healthz"), "http.client"),
                ("/metrics", probe_asker(port, "/metrics"), "http.client"),
                ("status", lambda: fetch_status(socket_path), "fetch_status"),
            ]
            for name, ask, client in rows:
                if name != "status" and shutil.which("wrk"):
                    before = cpu_seconds(child.pid)
                    count, rate, p50, p99 = with_wrk(port, name, args.seconds, args.connections)
                    cpu = (cpu_seconds(child.pid) - before) / count
                    print(
                        f"| {name} (wrk, {args.connections} conn.) | {count:,} | {rate:,.0f} | {p50} | {p99} "
                        f"| {cpu * 1e6:,.0f} µs |"
                    )
                before = cpu_seconds(child.pid)
                took = one_by_one(ask, args.status)
                cpu = (cpu_seconds(child.pid) - before) / args.status
                print(
                    f"| {name} ({client}, one by one) | {args.status:,} | {args.status / sum(took):,.0f} "
                    f"| {percentile(took, 0.5) * 1e3:.2f} ms | {percentile(took, 0.99) * 1e3:.2f} ms "
                    f"| {cpu * 1e6:,.0f} µs |",
                    flush=True,
                )
        finally:
            child.send_signal(signal.SIGTERM)
            child.wait(30)
    load = " ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"load average after: {load}")


if __name__ == "__main__":
    main()
