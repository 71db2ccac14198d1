"""Helpers for the metrics and probe tests: raw HTTP over TCP, and Prometheus text parsed back."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from mixedcpu_support import start_daemon
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

GUARD = 10.0  # a guard against hangs, never a measure


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()


async def exchange(host: str, port: int, raw: bytes, *, shut_write: bool = False) -> Reply:
    """Send `raw` as is, read the whole answer until the server closes, parse it."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), GUARD)
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


async def get(host: str, port: int, path: str, method: str = "GET") -> Reply:
    request = f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: test\r\n\r\n"
    return await exchange(host, port, request.encode())


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


async def bound_address(stderr: asyncio.StreamReader, seen: list[str]) -> tuple[str, int]:
    """The address the daemon logged for its probes (console or JSON lines)."""
    while True:
        raw = await asyncio.wait_for(stderr.readline(), GUARD)
        assert raw, "the daemon ended before serving its probes:\n" + "\n".join(seen)
        line = raw.decode(errors="replace").rstrip("\n")
        seen.append(line)
        if "serving metrics and probes" in line:
            match = re.search(r"(127\.0\.0\.1):(\d+)", line)
            assert match, line
            return match.group(1), int(match.group(2))


async def collect(stream: asyncio.StreamReader, lines: list[str]) -> None:
    """Every further line of `stream` into `lines` (so that the writer never blocks on a full pipe)."""
    async for raw in stream:
        lines.append(raw.decode(errors="replace").rstrip("\n"))


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
        host, port = await bound_address(proc.stderr, lines)
        rest = asyncio.ensure_future(collect(proc.stderr, lines))  # keep the pipe from filling up
        yield proc, host, port
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), GUARD)
        await asyncio.wait_for(rest, GUARD)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
