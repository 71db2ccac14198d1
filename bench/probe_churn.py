"""kubelet's liveness probe under a churn of new connections from many addresses (issue 25, break 7),
against the real daemon.

Usage: python bench/probe_churn.py [--rates 2000,5000] [--sources 80] [--duration 5] [--rounds 1]

For each rate, a daemon (``python -m nri_plugin.daemon.cli run``, fake cgroup v1 node, no runtime)
serves its probes on a free loopback port. A churn process opens new idle connections at that rate
from `--sources` loopback addresses (127.0.0.2 onwards), each held until `--hold` newer ones are
open, for `--duration` seconds; meanwhile a kubelet-like prober from 127.0.0.1 sends ``GET /healthz``
every `--every` seconds, each on a connection of its own, not waiting for the one before. A probe
still out when the churn ends gets `--guard` seconds more. Printed, per rate: connections opened,
evictions (``mixed_cpu_probe_connections_evicted_total``, all reasons), probes sent, closed by the
daemon unanswered (the bug the issue found), the fraction answered 200 within kubelet's 2 s
(target: at least 99 %), the probes' p50 and p99 from connect to the whole answer (a probe not
answered counts as slower than any), and the daemon's CPU seconds while the churn ran. The
machine's load average is printed first: the figures are as much the machine's as the daemon's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import re
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from workload import percentile

ROOT = Path(__file__).resolve().parent.parent
PROBE_TIMEOUT = 2.0  # kubelet's timeoutSeconds in the chart: the target's bound
TARGET = 0.99  # of the probes answered within PROBE_TIMEOUT
REQUEST = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: kube-probe/1.31\r\n\r\n"
WARNING = "are evicted to make room"  # the daemon's eviction warning, once a minute


@dataclass(frozen=True)
class Probe:
    """One probe: answered 200 or not, and the seconds from its connect to the whole answer (or to
    its end: closed unanswered, refused, or still out at the guard)."""

    ok: bool
    seconds: float
    closed: bool = False  # closed by the daemon before a whole answer (EOF or reset)


@dataclass(frozen=True)
class Round:
    rate: int
    opened: int
    evicted: float
    warnings: int
    probes: list[Probe]
    cpu: float  # the daemon's CPU seconds (user + system) from the churn's start to its end


# -- the churn (a process of its own) ---------------------------------------------------------------


def churn(host: str, port: int, sources: int, rate: float, duration: float, hold: int) -> int:
    """New idle connections at `rate` a second for `duration` seconds from 127.0.0.2 onwards (`sources`
    addresses in turn), each held until `hold` newer ones are open; how many were opened. Plain
    non-blocking sockets paced by the clock."""
    addresses = [f"127.0.0.{n + 2}" for n in range(sources)]
    held: collections.deque[socket.socket] = collections.deque()
    opened = 0
    start = time.monotonic()
    try:
        while (elapsed := time.monotonic() - start) < duration:
            due = min(int(elapsed * rate) + 1, int(duration * rate))
            while opened < due:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                sock.bind((addresses[opened % len(addresses)], 0))
                sock.connect_ex((host, port))  # EINPROGRESS when the daemon's backlog is full
                held.append(sock)
                opened += 1
                if len(held) > hold:
                    held.popleft().close()
            time.sleep(0.001)
    finally:
        for sock in held:
            sock.close()
    return opened


# -- the prober -------------------------------------------------------------------------------------


async def probe(host: str, port: int) -> Probe:
    begin = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection(host, port, local_addr=("127.0.0.1", 0))
    except OSError:
        return Probe(False, time.perf_counter() - begin)
    try:
        writer.write(REQUEST)
        await writer.drain()
        data = await reader.read()
    except ConnectionError:
        return Probe(False, time.perf_counter() - begin, closed=True)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    ok = data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"\r\n\r\nok\n")
    return Probe(ok, time.perf_counter() - begin, closed=not data)


async def probes_during(
    host: str, port: int, attack: asyncio.subprocess.Process, every: float, guard: float
) -> list[Probe]:
    """A probe every `every` seconds until `attack` exits; those still out `guard` seconds later are
    counted unanswered (at the guard)."""
    waiter = asyncio.ensure_future(attack.wait())
    sent: list[tuple[float, asyncio.Task[Probe]]] = []
    while not waiter.done():
        sent.append((time.perf_counter(), asyncio.ensure_future(probe(host, port))))
        await asyncio.wait([waiter], timeout=every)
    _, pending = await asyncio.wait([task for _, task in sent], timeout=guard)
    now = time.perf_counter()
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [Probe(False, now - begin) if task in pending else task.result() for begin, task in sent]


# -- the daemon -------------------------------------------------------------------------------------


def write_config(directory: Path, plugin_dir: Path) -> Path:
    """The daemon's config: shared CPUs 0-1 of 0-3 (a fake sysfs), a fake cgroup v1 tree, a state dir,
    kubelet's device-plugin directory (nobody there), probes on a free loopback port, no systemd."""
    online = directory / "sys" / "devices" / "system" / "cpu"
    online.mkdir(parents=True)
    (online / "online").write_text("0-3\n")
    for controller in ("cpu", "cpuset"):
        (directory / "cgroup" / controller).mkdir(parents=True)
    config = directory / "config.toml"
    config.write_text(
        f'shared_cpuset = "0-1"\nsysfs_root = "{directory}/sys"\nstate_dir = "{directory}/state"\n'
        f'cgroup_root = "{directory}/cgroup"\ncgroup_version = "v1"\n'
        f'metrics_address = "127.0.0.1:0"\nsystemd_bus = ""\nnri_socket = "{directory}/nri.sock"\n'
        f'[device_plugin]\nplugin_dir = "{plugin_dir}"\n'
    )
    return config


async def daemon_lines(stderr: asyncio.StreamReader, lines: list[str], bound: asyncio.Future[int]) -> None:
    """Every line the daemon logs, into `lines`; `bound` gets the probe port once it is said."""
    while raw := await stderr.readline():
        line = raw.decode(errors="replace")
        lines.append(line)
        match = re.search(r"serving metrics and probes.*?127\.0\.0\.1:(\d+)", line)
        if match and not bound.done():
            bound.set_result(int(match.group(1)))
    if not bound.done():
        bound.set_exception(RuntimeError("the daemon ended before serving its probes:\n" + "".join(lines)))


async def evictions(port: int) -> float:
    """``mixed_cpu_probe_connections_evicted_total``, all reasons, from the daemon's /metrics."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    text = data.partition(b"\r\n\r\n")[2].decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "mixed_cpu_probe_connections_evicted_total"
    )


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_round(args: argparse.Namespace, rate: int) -> Round:
    with tempfile.TemporaryDirectory(prefix="probe-churn-") as tmp:  # short: the device plugin's socket
        directory = Path(tmp)
        (directory / "dp").mkdir()
        config = write_config(directory, directory / "dp")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        daemon = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "nri_plugin.daemon.cli", "--log-level", "info", "run"),
            *("--config", str(config), "--socket", str(directory / "nri.sock")),
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        lines: list[str] = []
        try:
            assert daemon.stderr is not None
            bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            reading = asyncio.ensure_future(daemon_lines(daemon.stderr, lines, bound))
            port = await asyncio.wait_for(bound, 30)
            cpu = cpu_seconds(daemon.pid)
            attack = await asyncio.create_subprocess_exec(
                *(sys.executable, __file__, "--churn", "127.0.0.1", str(port)),
                *(str(args.sources), str(rate), str(args.duration), str(args.hold)),
                stdout=asyncio.subprocess.PIPE,
            )
            probes = await probes_during("127.0.0.1", port, attack, args.every, args.guard)
            out, _ = await attack.communicate()
            cpu = cpu_seconds(daemon.pid) - cpu
            if attack.returncode != 0:
                raise RuntimeError(f"the churn process failed (exit {attack.returncode})")
            evicted = await evictions(port)
            daemon.send_signal(signal.SIGTERM)
            await asyncio.wait_for(daemon.wait(), 30)
            await asyncio.wait_for(reading, 30)
        finally:
            if daemon.returncode is None:
                daemon.kill()
                await daemon.wait()
    warnings = sum(WARNING in line for line in lines)
    return Round(rate, int(out), evicted, warnings, probes, cpu)


def row(result: Round) -> str:
    probes = result.probes
    within = sum(p.ok and p.seconds <= PROBE_TIMEOUT for p in probes) / len(probes) if probes else 0.0
    # A probe not answered is slower than any answered one.
    seconds = [p.seconds if p.ok else float("inf") for p in probes]

    def shown(value: float) -> str:
        return "unanswered" if value == float("inf") else f"{value * 1e3:,.0f} ms"

    p50, p99 = (shown(percentile(seconds, q)) for q in (0.5, 0.99)) if probes else ("—", "—")
    met = "yes" if within >= TARGET else "**no**"
    return (
        f"| {result.rate:,} | {result.opened:,} | {result.evicted:,.0f} | {result.warnings} | {len(probes)} "
        f"| {sum(p.closed for p in probes)} | {within:.1%} | {p50} | {p99} | {result.cpu:.2f} s "
        f"| ≥ {TARGET:.0%} | {met} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rates", default="2000,5000", help="new connections a second, each a round")
    parser.add_argument("--sources", type=int, default=80, help="churn source addresses (80)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of churn per round (5)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds at each rate (1)")
    parser.add_argument("--hold", type=int, default=2000, help="churn connections held open at most")
    parser.add_argument("--every", type=float, default=0.05, help="seconds between probes (0.05)")
    parser.add_argument("--guard", type=float, default=30.0, help="seconds a probe may take after the churn")
    parser.add_argument("--churn", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.churn:
        host, port, sources, rate, duration, hold = args.churn
        print(churn(host, int(port), int(sources), float(rate), float(duration), int(hold)))
        return
    if not 0 < args.sources <= 250:
        parser.error(f"--sources {args.sources}: the churn's addresses are 127.0.0.2 to .251; use 1 to 250")
    rates = [int(rate) for rate in args.rates.split(",")]
    load = " ".join(f"{value:.1f}" for value in os.getloadavg())
    print(
        f"load average {load} on {os.cpu_count()} CPUs; churn from {args.sources} addresses for "
        f"{args.duration:g} s, a probe every {args.every:g} s"
    )
    print(
        "| new connections/s | opened | evicted | eviction warnings | probes | closed unanswered "
        "| answered 200 within 2 s | probe p50 | probe p99 | daemon CPU | target | met? |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rate in rates:
        for _ in range(args.rounds):
            print(row(asyncio.run(one_round(args, rate))), flush=True)
    load = " ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"load average after: {load}")


if __name__ == "__main__":
    main()
