"""The status socket (`nri_plugin.daemon.status.StatusServer`) over a real unix socket, in this process:
its mode, its one request, what it answers to anything else, a socket left by a previous daemon, a
path it cannot serve; and that clients holding connections idle, or not reading their answers, do not
keep `status` (`fetch_status`, in a thread) out, and are dropped at their deadlines."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
from wait_support import wait_until

from nri_plugin.daemon.status import HARD_MAX_CONNECTIONS, MAX_CONNECTIONS, StatusServer, status_socket_path
from nri_plugin.daemon.status_client import StatusError, fetch_status
from nri_plugin.mixedcpu.status import SCHEMA

GUARD = 10.0  # against hangs only


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path for long test ids is longer.
    path = Path(tempfile.mkdtemp(prefix="st-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _document() -> dict[str, Any]:
    return {"schema": SCHEMA, "containers": []}


async def _fetch(path: str) -> Any:
    """The JSON body of the answer to ``GET /status``."""
    head, _, body = (await _ask(path, b"GET /status HTTP/1.0\r\n\r\n")).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n"), head
    return json.loads(body)


async def _ask(path: str, request: bytes) -> bytes:
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), GUARD)
    writer.close()
    await writer.wait_closed()
    return answer


@pytest.mark.asyncio
async def test_the_socket_is_roots_alone_and_answers_the_document(state_dir: Path) -> None:
    path = status_socket_path(str(state_dir))
    server = StatusServer(path, _document)
    await server.start()
    try:
        mode = os.lstat(path).st_mode
        assert stat.S_ISSOCK(mode)
        assert stat.S_IMODE(mode) == 0o600
        assert os.listdir(state_dir) == ["status.sock"], "no temporary name left behind"
        assert await _fetch(path) == _document()
        answer = await _ask(path, b"GET /status HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"Content-Type: application/json" in head
        assert f"Content-Length: {len(body)}".encode() in head
    finally:
        await server.close()
    assert "status.sock" not in os.listdir(state_dir), "the socket goes with the daemon"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("request_bytes", "status_line"),
    [
        (b"GET /metrics HTTP/1.0\r\n\r\n", b"HTTP/1.1 404 Not Found"),
        (b"POST /status HTTP/1.0\r\n\r\n", b"HTTP/1.1 405 Method Not Allowed"),
        (b"hello\r\n\r\n", b"HTTP/1.1 400 Bad Request"),
        (b"GET /status SMTP\r\n\r\n", b"HTTP/1.1 400 Bad Request"),
        (b"GET /" + b"x" * 5000 + b" HTTP/1.0\r\n\r\n", b"HTTP/1.1 431 Request Header Fields Too Large"),
        (b"GET /status HTTP/1.1\r\n\r\n", b"HTTP/1.1 400 Bad Request"),  # HTTP/1.1 without a Host
        (b"GET /status", b"HTTP/1.1 400 Bad Request"),  # cut short: the client closed its side
    ],
    ids=["other-path", "other-method", "no-request", "not-http", "too-long", "no-host", "cut-short"],
)
async def test_anything_but_get_status_is_refused_in_one_line(
    state_dir: Path, request_bytes: bytes, status_line: bytes
) -> None:
    path = status_socket_path(str(state_dir))
    server = StatusServer(path, _document)
    await server.start()
    try:
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(request_bytes)
        if request_bytes.endswith(b"/status"):
            writer.write_eof()
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), GUARD)
        writer.close()
        assert answer.split(b"\r\n", 1)[0] == status_line
        assert await _fetch(path) == _document(), "still serving"
    finally:
        await server.close()


@pytest.mark.asyncio
async def test_a_socket_left_by_a_previous_daemon_is_replaced(state_dir: Path) -> None:
    path = status_socket_path(str(state_dir))
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(path)
    left.close()  # a socket file nobody listens on any more
    with pytest.raises(ConnectionRefusedError):
        await _fetch(path)
    server = StatusServer(path, _document)
    await server.start()
    try:
        assert await _fetch(path) == _document()
    finally:
        await server.close()


@pytest.mark.asyncio
async def test_closing_leaves_a_newer_daemons_socket_in_place(state_dir: Path) -> None:
    """An old daemon still closing when a newer one already serves at the path (its socket renamed
    over the old one's) must not remove the newer socket: `status` would then say the newer daemon is
    not running (issue 32: a close() removing whatever is at the path survived the tests)."""
    path = status_socket_path(str(state_dir))
    old = StatusServer(path, _document)
    newer = StatusServer(path, lambda: {**_document(), "daemon": "newer"})
    await old.start()
    try:
        await newer.start()
        try:
            await old.close()
            assert stat.S_ISSOCK(os.lstat(path).st_mode), "the newer daemon's socket is still there"
            assert (await _fetch(path))["daemon"] == "newer"
        finally:
            await newer.close()
        assert "status.sock" not in os.listdir(state_dir), "the newer daemon removes its own socket"
    finally:
        await old.close()


@pytest.mark.asyncio
async def test_a_path_that_cannot_be_served_is_a_warning_not_a_failed_start(state_dir: Path) -> None:
    path = status_socket_path(str(state_dir))
    os.mkdir(path)  # something else is there
    server = StatusServer(path, _document)
    with structlog.testing.capture_logs() as logs:
        await server.start()
    await server.close()
    assert [entry["event"] for entry in logs] == [
        "cannot serve the status socket: `mixed-cpu-nri-plugin status` will say the daemon is not running"
    ]
    assert "is not a socket" in logs[0]["error"]
    assert stat.S_ISDIR(os.lstat(path).st_mode), "left as it was"
    assert os.listdir(state_dir) == ["status.sock"], "no temporary socket left behind"
    long_dir = state_dir / ("d" * 100)
    long_dir.mkdir()
    with structlog.testing.capture_logs() as logs:
        await StatusServer(status_socket_path(str(long_dir)), _document).start()
    assert "over 107" in logs[0]["error"]


@pytest.mark.asyncio
async def test_a_document_that_cannot_be_made_is_a_500_and_a_logged_error(state_dir: Path) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("a bug")

    path = status_socket_path(str(state_dir))
    server = StatusServer(path, broken)
    await server.start()
    try:
        with structlog.testing.capture_logs() as logs:
            answer = await _ask(path, b"GET /status HTTP/1.0\r\n\r\n")
        assert answer.split(b"\r\n", 1)[0] == b"HTTP/1.1 500 Internal Server Error"
        assert [(entry["log_level"], entry["event"]) for entry in logs] == [
            ("error", "cannot make the status document")
        ]
    finally:
        await server.close()


# -- idle and slow clients ---------------------------------------------------------------------------

# A document larger than what the kernel buffers for a unix socket, so that a client not reading it
# keeps the daemon's write waiting.
_BIG = {"schema": SCHEMA, "containers": [], "padding": "x" * (2 << 20)}
# Deadlines long enough that none of them is what lets `status` in.
_NEVER = 3600.0


async def _status_answers(path: str, times: int) -> list[dict[str, Any]]:
    """What `status` reads, asked `times` times one after the other (each in a thread, as the command)."""
    return [await asyncio.wait_for(asyncio.to_thread(fetch_status, path), GUARD) for _ in range(times)]


@pytest.mark.asyncio
async def test_idle_connections_beyond_every_limit_do_not_keep_status_out(state_dir: Path) -> None:
    """More connections than the hard limit, opened and held without a word (the request deadline set
    far away, so it is not what frees them): each `status` is taken, an idle one closed for it when
    there is no more room."""
    path = status_socket_path(str(state_dir))
    server = StatusServer(path, _document, request_timeout=_NEVER)
    await server.start()
    idle = []
    try:
        for _ in range(HARD_MAX_CONNECTIONS + MAX_CONNECTIONS):
            idle.append(await asyncio.open_unix_connection(path))
        await wait_until(lambda: server.connections == HARD_MAX_CONNECTIONS, what="the hard limit reached")
        evicted = server.evicted
        assert await _status_answers(path, 5) == [_document()] * 5
        assert server.evicted > evicted, "at the hard limit, an idle connection made room for the first"
        assert server.connections <= HARD_MAX_CONNECTIONS
    finally:
        for _, writer in idle:
            writer.close()
        await server.close()


@pytest.mark.asyncio
async def test_idle_connections_renewed_at_the_limit_do_not_keep_status_out(state_dir: Path) -> None:
    """The attack that made `status` fail 6 times in 10 (issue 32): the limit's worth of idle
    connections, each renewed before its request deadline, all the while `status` asks."""
    path = status_socket_path(str(state_dir))
    server = StatusServer(path, _document)
    await server.start()
    idle: list[asyncio.StreamWriter] = []
    stop = asyncio.Event()

    async def renew() -> None:
        while not stop.is_set():
            _, writer = await asyncio.open_unix_connection(path)
            idle.append(writer)
            if len(idle) > MAX_CONNECTIONS:
                idle.pop(0).close()
            await asyncio.sleep(0.01)

    renewing = asyncio.ensure_future(renew())
    try:
        await wait_until(lambda: server.connections >= MAX_CONNECTIONS, what="the limit reached")
        assert await _status_answers(path, 10) == [_document()] * 10
    finally:
        stop.set()
        await renewing
        for writer in idle:
            writer.close()
        await server.close()


async def _not_reading(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client that asks for the status, reads the first line of the answer, and no more."""
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(b"GET /status HTTP/1.0\r\n\r\n")
    assert await asyncio.wait_for(reader.readline(), GUARD) == b"HTTP/1.1 200 OK\r\n"
    return reader, writer


@pytest.mark.asyncio
async def test_clients_that_do_not_read_their_answer_do_not_keep_status_out(state_dir: Path) -> None:
    """Twice the limit's worth of clients that ask and never read a document larger than the
    socket's buffers, held (the write deadline set far away): `status` reads the whole of it, each
    time."""
    path = status_socket_path(str(state_dir))
    server = StatusServer(path, lambda: _BIG, write_timeout=_NEVER)
    await server.start()
    stuck = []
    try:
        for _ in range(2 * MAX_CONNECTIONS):
            stuck.append(await _not_reading(path))
        assert server.connections == 2 * MAX_CONNECTIONS, "all of them still waiting for their readers"
        assert await _status_answers(path, 5) == [_BIG] * 5
    finally:
        for _, writer in stuck:
            writer.close()
        await server.close()


@pytest.mark.asyncio
async def test_a_burst_of_clients_not_reading_beyond_the_hard_limit_does_not_keep_status_out(
    state_dir: Path,
) -> None:
    """More than the hard limit's worth of clients that ask and do not read, all at once, so that
    none has had its chance when `status` comes: it waits for the oldest to have had theirs, and one
    of them goes for it."""
    path = status_socket_path(str(state_dir))
    server = StatusServer(path, lambda: _BIG, write_timeout=_NEVER)
    await server.start()
    burst = await asyncio.gather(
        *(asyncio.open_unix_connection(path) for _ in range(HARD_MAX_CONNECTIONS + MAX_CONNECTIONS))
    )
    try:
        for _, writer in burst:
            writer.write(b"GET /status HTTP/1.0\r\n\r\n")
        await wait_until(lambda: server.connections == HARD_MAX_CONNECTIONS, what="the hard limit reached")
        evicted = server.evicted
        assert await _status_answers(path, 5) == [_BIG] * 5
        assert server.evicted >= evicted + 5, "at the hard limit, a client not reading went for each"
        assert server.connections <= HARD_MAX_CONNECTIONS
    finally:
        for _, writer in burst:
            writer.close()
        await server.close()


@pytest.mark.asyncio
async def test_status_refuses_a_document_over_its_limit_by_the_length_the_server_says(
    state_dir: Path,
) -> None:
    """The server says the document's length; `status` refuses one over its limit before reading it,
    in so many words (it cut such an answer and called it "not JSON" before issue 32), and the
    server, its answer not taken, drops the connection at its write deadline."""
    path = status_socket_path(str(state_dir))
    server = StatusServer(path, lambda: _BIG, write_timeout=0.2)
    await server.start()
    try:
        with pytest.raises(StatusError, match=r"answered more than 1 MiB, far more than a status document"):
            await asyncio.wait_for(asyncio.to_thread(fetch_status, path, limit=1 << 20), GUARD)
        await wait_until(lambda: server.connections == 0, what="the connection closed")
        assert await _status_answers(path, 1) == [_BIG]
    finally:
        await server.close()


@pytest.mark.asyncio
async def test_a_client_is_dropped_at_its_deadlines(state_dir: Path) -> None:
    """One that sends no request is answered 408 at the request deadline; one that does not take its
    answer is dropped at the write deadline, its answer cut."""
    path = status_socket_path(str(state_dir))
    server = StatusServer(path, lambda: _BIG, request_timeout=0.2, write_timeout=0.2)
    await server.start()
    try:
        reader, writer = await asyncio.open_unix_connection(path)
        answer = await asyncio.wait_for(reader.read(), GUARD)
        writer.close()
        assert answer.split(b"\r\n", 1)[0] == b"HTTP/1.1 408 Request Timeout"
        reader, writer = await _not_reading(path)
        await wait_until(lambda: server.connections == 0, what="the slow reader dropped")
        rest = await asyncio.wait_for(reader.read(), GUARD)
        writer.close()
        assert len(rest) < len(json.dumps(_BIG)), "its answer was cut"
    finally:
        await server.close()
