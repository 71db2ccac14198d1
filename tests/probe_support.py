"""Helpers for the metrics and probe tests: raw HTTP over TCP, and Prometheus text parsed back."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from mixedcpu_support import ROOT, start_daemon, stream_lines
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from wait_support import wait_until

GUARD = 10.0  # a guard against hangs, never a measure
# kubelet gives up on a probe after timeoutSeconds, 2 in the chart and the manifests: the bound
# every probe answer under attack is held to (a generous one; the real latencies are far lower).
PROBE_TIMEOUT = 2.0


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()


async def exchange(
    host: str, port: int, raw: bytes, *, shut_write: bool = False, source: str | None = None
) -> Reply:
    """Send `raw` as is, read the whole answer until the server closes, parse it."""
    reader, writer = await asyncio.wait_for(connect(host, port, source), GUARD)
    try:
        writer.write(raw)
        await writer.drain()
        if shut_write:
            writer.write_eof()
        data = await asyncio.wait_for(reader.read(), GUARD)
    finally:
        writer.close()
        await writer.wait_closed()
    return parse_reply(data)


async def get(host: str, port: int, path: str, method: str = "GET", *, source: str | None = None) -> Reply:
    """One request; from the local address `source` when given (any 127.x.y.z on Linux: a peer of
    its own, to the server)."""
    request = f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: test\r\n\r\n"
    return await exchange(host, port, request.encode(), source=source)


async def connect(
    host: str, port: int, source: str | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    local = (source, 0) if source is not None else None
    return await asyncio.open_connection(host, port, local_addr=local)


def parse_reply(data: bytes) -> Reply:
    head, sep, body = data.partition(b"\r\n\r\n")
    assert sep, f"no complete response head in {data!r}"
    status_line, *lines = head.decode("latin-1").split("\r\n")
    match = re.fullmatch(r"HTTP/1\.1 (\d{3}) [A-Za-z ]+", status_line)
    assert match, status_line
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    assert int(headers["content-length"]) == len(body) or body == b"", (headers, body)
    return Reply(int(match.group(1)), headers, body)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    """Every sample of a Prometheus text exposition: (name, labels) -> value."""
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(found: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when the series is absent (a labelled counter not yet incremented)."""
    return found.get((name, frozenset(labels.items())), 0.0)


async def scrape(host: str, port: int) -> Samples:
    reply = await get(host, port, "/metrics")
    assert reply.status == 200, reply
    assert reply.headers["content-type"] == CONTENT_TYPE_LATEST, reply.headers
    return samples(reply.text)


async def bound_address(lines: AsyncIterator[str], seen: list[str]) -> tuple[str, int]:
    """The address the daemon logged for its probes (console or JSON lines), from its stderr `lines`
    (`stream_lines`); each line read goes to `seen`."""
    while True:
        try:
            line = await asyncio.wait_for(lines.__anext__(), GUARD)
        except StopAsyncIteration:
            raise AssertionError("the daemon ended before serving its probes:\n" + "\n".join(seen)) from None
        seen.append(line)
        if "serving metrics and probes" in line:
            match = re.search(r"(127\.0\.0\.1):(\d+)", line)
            assert match, line
            return match.group(1), int(match.group(2))


async def collect(lines: AsyncIterator[str], seen: list[str]) -> None:
    """Every further line of `lines` (`stream_lines`) into `seen` (so that the writer never blocks on
    a full pipe)."""
    async for line in lines:
        seen.append(line)


@contextlib.asynccontextmanager
async def daemon_with_probes(
    config: Path, socket_path: Path, lines: list[str]
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str, int]]:
    """``run`` as a subprocess (log level info), once it serves its probes: (process, host, port).
    Its stderr lines go to `lines` as they come. After the body, SIGTERM and the exit awaited;
    killed instead if the body failed or it did not exit."""
    proc = await start_daemon(
        "--log-level", "info", "run", "--config", str(config), "--socket", str(socket_path)
    )
    try:
        assert proc.stderr is not None
        stderr = stream_lines(proc.stderr)
        host, port = await bound_address(stderr, lines)
        rest = asyncio.ensure_future(collect(stderr, lines))  # keep the pipe from filling up
        yield proc, host, port
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), GUARD)
        await asyncio.wait_for(rest, GUARD)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        print("daemon stderr:", *lines, sep="\n")  # shown if the test fails


# -- strangers holding the probe port (issue 13) ------------------------------------------------------


def stranger_address(index: int) -> str:
    """A loopback address of its own for stranger `index` (127.1.x.y: never the prober's 127.0.0.1)."""
    return f"127.1.{index // 250}.{index % 250 + 1}"


@dataclass
class Strangers:
    """What the strangers did while a test probed: connections opened, and answers they got. Their
    loops end once `stopped` is set (cancelling alone is not enough on Python 3.11, whose
    asyncio.wait_for can swallow a cancellation that comes as the awaited call completes)."""

    stopped: bool = False
    idle: list[asyncio.StreamWriter] = field(default_factory=list)
    loris_connections: int = 0
    loris_answers: list[int] = field(default_factory=list)
    flood_connections: int = 0


async def open_idle(host: str, port: int, count: int, sources: list[str], strangers: Strangers) -> None:
    """`count` connections that never send a byte, spread over `sources` in turn."""
    for index in range(count):
        _, writer = await asyncio.wait_for(connect(host, port, sources[index % len(sources)]), GUARD)
        strangers.idle.append(writer)


async def slow_loris(host: str, port: int, source: str, strangers: Strangers, *, pause: float = 0.05) -> None:
    """A request head sent one byte every `pause` seconds, never finished; again when the server ends
    it (408 or evicted). Runs until `strangers.stopped`."""
    while not strangers.stopped:
        reader, writer = await asyncio.wait_for(connect(host, port, source), GUARD)
        strangers.loris_connections += 1
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\n")
            while not strangers.stopped:
                writer.write(b"X")
                await writer.drain()
                try:
                    answer = await asyncio.wait_for(reader.read(64), pause)
                except asyncio.TimeoutError:
                    continue
                if answer.startswith(b"HTTP/1.1 "):
                    strangers.loris_answers.append(int(answer[9:12]))
                break  # answered, or closed (evicted)
        except ConnectionError:
            pass  # evicted: reset by the server
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def flood(host: str, port: int, source: str, strangers: Strangers, *, keep: int = 200) -> None:
    """New idle connections as fast as the loop allows, each held until `keep` newer ones are open
    (the attack of issue 13, which needed 7 a second). Runs until `strangers.stopped`."""
    held: list[asyncio.StreamWriter] = []
    try:
        while not strangers.stopped:
            _, writer = await asyncio.wait_for(connect(host, port, source), GUARD)
            strangers.flood_connections += 1
            held.append(writer)
            if len(held) > keep:
                held.pop(0).close()
            await asyncio.sleep(0)
    finally:
        for writer in held:
            writer.close()


async def close_all(writers: list[asyncio.StreamWriter]) -> None:
    for writer in writers:
        writer.close()
    for writer in writers:
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def timed_probes(host: str, port: int, count: int, *, path: str = "/healthz") -> list[float]:
    """`count` probes from 127.0.0.1, one after another: each answer's status must be 200; the
    seconds each took, connection included."""
    took = []
    for _ in range(count):
        start = time.perf_counter()
        reply = await asyncio.wait_for(get(host, port, path, source="127.0.0.1"), GUARD)
        took.append(time.perf_counter() - start)
        assert (reply.status, reply.text) == (200, "ok\n"), reply
        await asyncio.sleep(0.01)
    return took


@contextlib.asynccontextmanager
async def under_attack(
    host: str, port: int, *, idle: int = 200, peers: int = 25, same_peer: bool = False
) -> AsyncIterator[Strangers]:
    """`idle` idle connections from `peers` stranger addresses (or all from the prober's own
    127.0.0.1, `same_peer`), a slow-loris client and a connection flood from two more, for the
    body of the `with`; all stopped and closed after it."""
    strangers = Strangers()
    sources = ["127.0.0.1"] if same_peer else [stranger_address(i) for i in range(peers)]
    await open_idle(host, port, idle, sources, strangers)
    loris_source = "127.0.0.1" if same_peer else stranger_address(peers)
    attackers = [asyncio.ensure_future(slow_loris(host, port, loris_source, strangers))]
    if not same_peer:  # one address flooding the prober's own is what the NetworkPolicy is for
        attackers.append(asyncio.ensure_future(flood(host, port, stranger_address(peers + 1), strangers)))
    try:
        # The slow client is mid-head, the flood under way.
        await wait_until(
            lambda: strangers.loris_connections >= 1 and (same_peer or strangers.flood_connections >= 20),
            what="the slow client and the flood started",
        )
        yield strangers
    finally:
        strangers.stopped = True
        _, pending = await asyncio.wait(attackers, timeout=GUARD)
        assert not pending, "a stranger did not stop"
        await close_all(strangers.idle)
    for attacker in attackers:
        attacker.result()  # a stranger that failed (other than by being evicted) fails the test


# -- a churn of new connections from many addresses (issue 25, item 7) --------------------------------


def churn_sources(count: int) -> list[str]:
    """`count` loopback addresses for the churn, 127.0.0.2 onwards (127.0.0.1 is the prober's)."""
    assert 0 < count <= 250, count
    return [f"127.0.0.{index + 2}" for index in range(count)]


def churn(host: str, port: int, sources: list[str], rate: float, duration: float, hold: int) -> int:
    """New idle connections at `rate` a second for `duration` seconds, from `sources` in turn, each
    held until `hold` newer ones are open; how many were opened. Plain non-blocking sockets, paced
    by the clock: meant for a process of its own (`start_churn`), away from the prober's loop."""
    held: collections.deque[socket.socket] = collections.deque()
    opened = 0
    start = time.monotonic()
    try:
        while (elapsed := time.monotonic() - start) < duration:
            due = min(int(elapsed * rate) + 1, int(duration * rate))
            while opened < due:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                sock.bind((sources[opened % len(sources)], 0))
                sock.connect_ex((host, port))  # EINPROGRESS when the backlog is full: as good
                held.append(sock)
                opened += 1
                if len(held) > hold:
                    held.popleft().close()
            time.sleep(0.001)
    finally:
        for sock in held:
            sock.close()
    return opened


async def start_churn(
    host: str, port: int, *, sources: int, rate: float, duration: float, hold: int = 2000
) -> asyncio.subprocess.Process:
    """`churn` in a process of its own; it prints how many connections it opened, and exits."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "from probe_support import churn_main; churn_main()",
        host,
        str(port),
        str(sources),
        str(rate),
        str(duration),
        str(hold),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


# What became of one probe (`ProbeOutcome.kind`): answered (any status), closed by the daemon before
# a whole answer (EOF or reset: evicted unread), its connection refused, or no answer by the guard.
ANSWERED, CLOSED, REFUSED, WAITING = "answered", "closed", "refused", "waiting"


@dataclass(frozen=True)
class ProbeOutcome:
    """One probe: its `kind` (above), the seconds from its connect until then (until the guard when
    still waiting), the answer's status when answered, and what the client saw otherwise."""

    kind: str
    seconds: float
    status: int = 0
    detail: str = ""


async def probe_once(host: str, port: int, *, path: str = "/healthz") -> ProbeOutcome:
    """kubelet's probe: a connection of its own from 127.0.0.1, the request sent with it, the answer
    read until the server closes. No guard of its own: the caller bounds it (`probes_during`)."""
    request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: kube-probe/1.31\r\n\r\n"
    begin = time.perf_counter()
    try:
        reader, writer = await connect(host, port, "127.0.0.1")
    except OSError as exc:
        return ProbeOutcome(REFUSED, time.perf_counter() - begin, detail=repr(exc))
    try:
        writer.write(request.encode())
        await writer.drain()
        data = await reader.read()
    except ConnectionError as exc:  # reset: the daemon closed it with the request unread
        return ProbeOutcome(CLOSED, time.perf_counter() - begin, detail=repr(exc))
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    seconds = time.perf_counter() - begin
    try:
        reply = parse_reply(data)
    except AssertionError:  # the end of the stream before a whole answer
        return ProbeOutcome(CLOSED, seconds, detail=f"{len(data)} bytes, then the end: {data[:80]!r}")
    return ProbeOutcome(ANSWERED, seconds, status=reply.status, detail=reply.text)


async def probes_during(
    host: str, port: int, attack: asyncio.subprocess.Process, *, every: float = 0.05, guard: float = 30.0
) -> list[ProbeOutcome]:
    """kubelet's probes of ``/healthz`` (`probe_once`), one every `every` seconds, each on its own
    connection and without waiting for the one before, until `attack` exits; then each probe still
    out gets up to `guard` seconds more (a bound against a hang, far above any answer's time). What
    became of each, in the order they were sent; those out at the guard are `WAITING`."""
    waiter = asyncio.ensure_future(attack.wait())
    sent: list[tuple[float, asyncio.Task[ProbeOutcome]]] = []
    while not waiter.done():
        sent.append((time.perf_counter(), asyncio.ensure_future(probe_once(host, port))))
        await asyncio.wait([waiter], timeout=every)
    tasks = [task for _, task in sent]
    _, pending = await asyncio.wait(tasks, timeout=guard)
    now = time.perf_counter()
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [
        ProbeOutcome(WAITING, now - begin, detail=f"no answer {guard:g} s after the attack")
        if task in pending
        else task.result()
        for begin, task in sent
    ]


def churn_main() -> None:
    """`churn` with its arguments from the command line (`start_churn`)."""
    _, host, port, sources, rate, duration, hold = sys.argv
    print(churn(host, int(port), churn_sources(int(sources)), float(rate), float(duration), int(hold)))
