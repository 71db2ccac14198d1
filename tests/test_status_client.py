"""``mixed-cpu-nri-plugin status`` against servers that are not a well-behaved daemon, over real unix
sockets: one that drips its answer a byte at a time (one deadline for the whole answer, not for each
read), one whose answer is too large or shorter than it said, one that is no HTTP server. (What a
document's escape sequences become on the terminal: tests/test_status_cli.py.)"""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from mixedcpu_support import run_cli

from nri_plugin.daemon.status_client import MAX_ANSWER, TIMEOUT, StatusError, fetch_status, run_status
from nri_plugin.mixedcpu.status import SCHEMA

GUARD = 30.0  # against hangs only
DRIP = 0.2  # seconds between two bytes of a dripping answer: each read is far within any deadline

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path for long test ids is longer.
    path = Path(tempfile.mkdtemp(prefix="sk-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@asynccontextmanager
async def _serving(path: Path, answer: Handler) -> AsyncIterator[None]:
    """A server on the unix socket at `path` that reads a request head and lets `answer` reply."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await answer(reader, writer)
        except (OSError, asyncio.IncompleteReadError):
            pass  # the client gave up: that is what these tests expect of it
        finally:
            writer.transport.abort()

    server = await asyncio.start_unix_server(handle, path=str(path))
    try:
        yield
    finally:
        server.close()
        await server.wait_closed()


async def _drip(writer: asyncio.StreamWriter, data: bytes) -> None:
    for byte in data:
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(DRIP)


def _head(length: int | None = None) -> bytes:
    said = f"Content-Length: {length}\r\n" if length is not None else ""
    return f"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n{said}\r\n".encode()


async def _drip_head(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _drip(writer, b"HTTP/1.0 200 OK\r\n" + b"X-Padding: " + b"x" * 100_000)


async def _drip_body(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(_head(100_000))
    await _drip(writer, json.dumps({"schema": SCHEMA, "padding": "x" * 100_000}).encode())


async def _in_thread(call: Callable[[], Any]) -> Any:
    """`call()` in a thread (as the command blocks), the server answering meanwhile on this loop."""
    return await asyncio.wait_for(asyncio.to_thread(call), GUARD)


@pytest.mark.asyncio
@pytest.mark.parametrize("answer", [_drip_head, _drip_body], ids=["head", "body"])
async def test_a_dripping_answer_fails_at_the_one_deadline(short_dir: Path, answer: Handler) -> None:
    """Before issue 32's fix each read had the deadline, and a byte every 3 s hung `status` until it was
    killed. Now the whole answer has one; the command says so and exits 1."""
    path = short_dir / "status.sock"
    out, err = io.StringIO(), io.StringIO()
    async with _serving(path, answer):
        code = await _in_thread(lambda: run_status(socket=str(path), out=out, err=err, timeout=1.0))
    assert code == 1
    assert out.getvalue() == ""
    assert err.getvalue().splitlines() == [
        f"error: the daemon did not answer on {path} within 1 s (the whole answer): it is stuck or "
        "overloaded, or something else serves that socket; look at its log, and its /healthz"
    ]


@pytest.mark.asyncio
async def test_the_command_keeps_the_5_s_the_docs_promise(short_dir: Path) -> None:
    """The command itself (its own process, its default deadline) against a dripping answer."""
    path = short_dir / "status.sock"
    async with _serving(path, _drip_body):
        result = await _in_thread(lambda: run_cli("status", "--socket", str(path), timeout=GUARD))
    assert result.returncode == 1
    assert f"did not answer on {path} within {TIMEOUT:g} s (the whole answer)" in result.stderr


@pytest.mark.asyncio
async def test_an_answer_too_large_is_said_to_be_so(short_dir: Path) -> None:
    """An answer saying it is over the limit is refused before a byte of it is read; one that does not
    say its length, when it goes over (it was cut at the limit and called "not JSON" before)."""
    path = short_dir / "status.sock"

    async def said_too_large(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_head(MAX_ANSWER + 1))
        await reader.read()  # and nothing more until the client leaves: reading, it would time out

    async def unsaid_too_large(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_head() + b'{"padding": "' + b"x" * (2 << 20))
        await writer.drain()

    too_large = (
        f"{path} answered more than {{}} MiB, far more than a status document: is it the daemon's socket? "
        "point --config at the daemon's own config; if it is the daemon's, report it"
    )
    async with _serving(path, said_too_large):
        with pytest.raises(StatusError) as refused:
            await _in_thread(lambda: fetch_status(str(path)))
    assert str(refused.value) == too_large.format(64)
    path.unlink(missing_ok=True)  # 3.13 removes a unix server's socket at close
    async with _serving(path, unsaid_too_large):
        with pytest.raises(StatusError) as refused:
            await _in_thread(lambda: fetch_status(str(path), limit=1 << 20))
    assert str(refused.value) == too_large.format(1)


@pytest.mark.asyncio
async def test_an_answer_shorter_than_it_said_or_no_http_is_said_to_be_so(short_dir: Path) -> None:
    path = short_dir / "status.sock"

    async def short(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_head(1000) + b'{"schema"')
        await writer.drain()

    async def not_http(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 mail.example ESMTP \x1b[2J ready\r\n")
        await writer.drain()

    async with _serving(path, short):
        with pytest.raises(StatusError) as refused:
            await _in_thread(lambda: fetch_status(str(path)))
    assert str(refused.value) == (
        f"the answer on {path} ended after 9 of its 1000 bytes: the daemon closed the connection early "
        "(shutting down?); ask again"
    )
    path.unlink(missing_ok=True)  # 3.13 removes a unix server's socket at close
    async with _serving(path, not_http):
        with pytest.raises(StatusError) as refused:
            await _in_thread(lambda: fetch_status(str(path)))
    message = str(refused.value)
    assert message.startswith(f"{path} answered something that is not HTTP (")
    assert message.endswith("): is it the daemon's socket? point --config at the daemon's own config")
    assert "\x1b" not in message
