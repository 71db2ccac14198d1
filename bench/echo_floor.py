"""The floor under a CreateContainer round trip on this machine: a bare request/reply between two
processes over a unix socket, with no ttrpc, no mux and no NRI.

Usage: python bench/echo_floor.py [--calls N]

A client sends a 1,950-byte request (a CreateContainer's size on the wire) and waits for a 100-byte
reply; the server answers as soon as the whole request is in. Client and server are each a plain
blocking socket loop, an asyncio Protocol on the default event loop, or one on uvloop (when installed).
Printed: the round trip's p50 and p99, and the server process's CPU time per round trip (the plugin's
side; from /proc/<pid>/task/*/schedstat).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from workload import cpu_ns, percentile

REQUEST = 1950
REPLY = b"r" * 100


def serve_blocking(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    conn, _ = listener.accept()
    pending = 0
    while data := conn.recv(65536):
        pending += len(data)
        while pending >= REQUEST:
            pending -= REQUEST
            conn.sendall(REPLY)


class _Echo(asyncio.Protocol):
    def __init__(self) -> None:
        self.pending = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport

    def data_received(self, data: bytes) -> None:
        self.pending += len(data)
        while self.pending >= REQUEST:
            self.pending -= REQUEST
            assert self.transport is not None
            self.transport.write(REPLY)

    def connection_lost(self, exc: Exception | None) -> None:
        asyncio.get_running_loop().stop()


def serve_async(path: str, kind: str) -> None:
    loop: asyncio.AbstractEventLoop
    if kind == "uvloop":
        import uvloop

        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    loop.run_until_complete(loop.create_unix_server(_Echo, path))
    loop.run_forever()


WARMUP = 500


def client_blocking(path: str, calls: int, mark: Callable[[], None]) -> list[float]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    request = b"q" * REQUEST
    samples = []
    for n in range(WARMUP + calls):
        if n == WARMUP:
            mark()
        started = time.perf_counter()
        sock.sendall(request)
        got = 0
        while got < len(REPLY):
            got += len(sock.recv(65536))
        samples.append(time.perf_counter() - started)
    sock.close()
    return samples[WARMUP:]


class _Client(asyncio.Protocol):
    def __init__(self) -> None:
        self.got = 0
        self.waiter: asyncio.Future[None] | None = None

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        if self.got >= len(REPLY) and self.waiter is not None and not self.waiter.done():
            self.got -= len(REPLY)
            self.waiter.set_result(None)


async def _client_async(path: str, calls: int, mark: Callable[[], None]) -> list[float]:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_unix_connection(_Client, path)
    request = b"q" * REQUEST
    samples = []
    for n in range(WARMUP + calls):
        if n == WARMUP:
            mark()
        started = time.perf_counter()
        protocol.waiter = loop.create_future()
        transport.write(request)
        await protocol.waiter
        samples.append(time.perf_counter() - started)
    transport.close()
    return samples[WARMUP:]


def client(kind: str, path: str, calls: int, mark: Callable[[], None]) -> list[float]:
    if kind == "blocking":
        return client_blocking(path, calls, mark)
    if kind == "uvloop":
        import uvloop

        timings: list[float] = uvloop.run(_client_async(path, calls, mark))
        return timings
    return asyncio.run(_client_async(path, calls, mark))


def measure(client_kind: str, server_kind: str, calls: int) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory(prefix="nri-echo-") as tmp:
        path = str(Path(tmp) / "echo.sock")
        server = subprocess.Popen([sys.executable, __file__, "--serve", server_kind, path])
        try:
            while not os.path.exists(path):
                time.sleep(0.01)
            before = [0]

            def mark() -> None:
                before[0] = cpu_ns(server.pid)

            samples = client(client_kind, path, calls, mark)
            server_cpu = (cpu_ns(server.pid) - before[0]) / calls / 1e3
            server.wait(timeout=5)
        finally:
            if server.poll() is None:
                server.kill()
    us = [s * 1e6 for s in samples]
    return statistics.median(us), percentile(us, 0.99), server_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        kind, path = args.serve
        if kind == "blocking":
            serve_blocking(path)
        else:
            serve_async(path, kind)
        return
    try:
        import uvloop  # noqa: F401

        kinds = ["blocking", "asyncio", "uvloop"]
    except ImportError:
        kinds = ["blocking", "asyncio"]
    print("| client (runtime side) | server (plugin side) | p50 | p99 | server CPU per round trip |")
    print("|---|---|---|---|---|")
    for client_kind in kinds:
        for server_kind in kinds:
            p50, p99, cpu = measure(client_kind, server_kind, args.calls)
            print(f"| {client_kind} | {server_kind} | {p50:.0f} µs | {p99:.0f} µs | {cpu:.0f} µs |")


if __name__ == "__main__":
    main()
