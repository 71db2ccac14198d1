"""The one HTTP layer (`nri_plugin.common.httpserve`) over real loopback sockets, for what its two
servers' own tests (tests/test_probes.py, tests/test_status_server.py) do not reach: a route that
fails, HEAD where only GET is served, a client that does not read its answer (kept, or evicted with
`evict_slow_readers`), newcomers waiting for room at the hard limit and those that get none,
generated requests good and bad."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from probe_support import GUARD, exchange, get
from wait_support import wait_until

from nri_plugin.common.httpserve import NO_ROOM, Answer, HttpServer, Limits, Route

HOST = "127.0.0.1"
# Limits under which nothing is evicted, waits or times out unless a test says otherwise.
ROOMY = Limits(
    request_timeout=3600.0,
    write_timeout=3600.0,
    max_head=8192,
    total=64,
    per_peer=64,
    hard_total=64,
    fair_time=0.0,
    heard_time=0.0,
    fair_turns=0,
)
LARGE = b"x" * (8 << 20)  # more than the kernel buffers on a loopback connection


@contextlib.asynccontextmanager
async def serving(
    routes: dict[str, Route], limits: Limits = ROOMY, **options: Any
) -> AsyncIterator[tuple[HttpServer, int]]:
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(128)
    listener.setblocking(False)
    server = HttpServer(routes, limits, **options)
    server.start([listener])
    try:
        yield server, listener.getsockname()[1]
    finally:
        server.close()


def ok() -> Answer:
    return Answer(200, b"ok\n")


def large() -> Answer:
    return Answer(200, LARGE, "application/octet-stream")


@contextlib.contextmanager
def loop_errors() -> Iterator[list[dict[str, Any]]]:
    """What reaches the running loop's exception handler meanwhile."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: seen.append(context))
    try:
        yield seen
    finally:
        loop.set_exception_handler(previous)


@pytest.mark.asyncio
async def test_a_failing_route_is_a_500_said_to_the_loop_and_the_server_goes_on() -> None:
    def broken() -> Answer:
        raise KeyError("bug")

    with loop_errors() as seen:
        async with serving({"/ok": ok, "/broken": broken}) as (_, port):
            reply = await get(HOST, port, "/broken")
            assert (reply.status, reply.text) == (
                500,
                "cannot answer /broken: KeyError; see the daemon's log\n",
            )
            assert (await get(HOST, port, "/ok")).status == 200
    assert [(context["message"], type(context["exception"])) for context in seen] == [
        ("HTTP route /broken failed", KeyError)
    ]


@pytest.mark.asyncio
async def test_head_where_only_get_is_served_is_a_405_without_a_body() -> None:
    async with serving({"/status": ok}, methods=("GET",)) as (_, port):
        reply = await get(HOST, port, "/status", method="HEAD")
        assert (reply.status, reply.body, reply.headers["allow"]) == (405, b"", "GET")
        assert reply.headers["content-length"] == str(len(b"HEAD not allowed: use GET\n"))
        missing = await get(HOST, port, "/other")
        assert (missing.status, missing.text) == (404, "no such path '/other'; try /status\n")


async def not_reading(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client that asks for the large answer, reads its first line, and no more."""
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(f"GET /large HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
    assert await asyncio.wait_for(reader.readline(), GUARD) == b"HTTP/1.1 200 OK\r\n"
    return reader, writer


@pytest.mark.asyncio
@pytest.mark.parametrize("evict_slow_readers", [False, True])
async def test_a_client_not_reading_its_answer(evict_slow_readers: bool) -> None:
    """One connection allowed: a client that does not read a large answer is being answered, so a
    newcomer does not evict it (the probes: a scrape is never cut for a newcomer), and then has no
    room; with `evict_slow_readers` (the status socket) it goes for the newcomer."""
    limits = dataclasses.replace(
        ROOMY, total=1, per_peer=1, hard_total=1, evict_slow_readers=evict_slow_readers
    )
    async with serving({"/large": large, "/ok": ok}, limits) as (server, port):
        reader, writer = await not_reading(port)
        try:
            if evict_slow_readers:
                assert (await get(HOST, port, "/ok")).status == 200
                rest = await asyncio.wait_for(reader.read(), GUARD)
                assert len(rest) < len(LARGE), "its answer was cut"
                assert server.evicted == 1
            else:
                with pytest.raises((ConnectionError, AssertionError)):  # closed unanswered: no room
                    await get(HOST, port, "/ok")
                assert server.connections == 1, "still taking its answer"
                assert server.evicted == 1, "the newcomer, refused at the hard limit"
        finally:
            writer.close()


@pytest.mark.asyncio
async def test_a_client_not_reading_its_answer_is_dropped_at_the_write_deadline() -> None:
    limits = dataclasses.replace(ROOMY, write_timeout=0.2)
    async with serving({"/large": large}, limits) as (server, port):
        reader, writer = await not_reading(port)
        await wait_until(lambda: server.connections == 0, what="the slow reader dropped")
        with contextlib.suppress(ConnectionError):
            rest = await asyncio.wait_for(reader.read(), GUARD)
            assert len(rest) < len(LARGE), "its answer was cut"
        writer.close()


@pytest.mark.asyncio
async def test_newcomers_wait_for_room_and_those_that_get_none_are_counted() -> None:
    """Two connections at most, both sending their request slowly and not yet evictable (a long
    `heard_time`); with room for one waiting newcomer, the first waits, a second takes its place in
    the line (the first closed, `NO_ROOM`), and once the slow ones have had their chance the waiting
    one evicts one and is answered. The counts reach `warn` once."""
    limits = dataclasses.replace(
        ROOMY, total=2, per_peer=2, hard_total=2, fair_time=1.0, heard_time=1.0, waiting=1
    )
    warned: list[tuple[dict[str, int], str]] = []
    async with serving({"/ok": ok}, limits, warn=lambda counts, peer: warned.append((counts, peer))) as (
        server,
        port,
    ):
        slow = [await asyncio.open_connection(HOST, port) for _ in range(2)]
        try:
            for _, writer in slow:
                writer.write(b"GET /ok HTTP/1.1\r\n")
            await wait_until(
                lambda: server.connections == 2 and all(c.parser is not None for c in server.open),
                what="both slow ones taken, their requests begun",
            )
            first = asyncio.ensure_future(get(HOST, port, "/ok"))
            await wait_until(lambda: len(server._waiting) == 1, what="the first newcomer waiting")
            second = await get(HOST, port, "/ok")  # waits its turn, then evicts a slow one
            assert (second.status, second.text) == (200, "ok\n")
            with pytest.raises((ConnectionError, AssertionError)):  # closed unanswered
                await first
            assert (server.refused, server.evicted) == (1, 1)
            assert warned == [({NO_ROOM: 1}, "127.0.0.1")], "said once: the next within the period"
        finally:
            for _, writer in slow:
                writer.close()


@pytest.mark.asyncio
async def test_an_error_answer_reaches_a_client_still_sending_its_body() -> None:
    """A 405 for a request whose body is still coming: the server reads and drops what follows, so
    the client reads the answer instead of a reset."""
    async with serving({"/ok": ok}) as (_, port):
        body = b"b" * 50_000
        raw = b"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        reply = await exchange(HOST, port, raw)
        assert (reply.status, reply.text) == (405, "POST not allowed: use GET (or HEAD)\n")


# Pieces of requests, well and badly formed, for the generated ones below.
FRAGMENTS = [
    *(
        b"GET ",
        b"HEAD ",
        b"POST ",
        b"CONNECT ",
        b"PRI * HTTP/2.0",
        b"/ok",
        b"/ok?x=1",
        b"/other",
        b"*",
        b"x:443",
    ),
    *(
        b" HTTP/1.1",
        b" HTTP/1.0",
        b" HTTP/9.9",
        b"\r\n",
        b"\n",
        b"\r",
        b" ",
        b":",
        b"\t",
        b"\x00",
        b"\xff\xfe",
    ),
    *(b"Host: x", b"Content-Length: 5", b"Content-Length: -1", b"Transfer-Encoding: chunked", b"0\r\n\r\n"),
    *(b"Upgrade: h2c", b"Connection: Upgrade", b"Connection: keep-alive", b"Expect: 100-continue", b"hello"),
]
ANSWERS = {200, 400, 404, 405, 408, 431}


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(FRAGMENTS), max_size=24).map(b"".join) | st.binary(max_size=200),
        min_size=1,
        max_size=12,
    )
)
def test_whatever_a_client_sends_it_gets_one_answer_or_none_and_the_server_goes_on(
    requests: list[bytes],
) -> None:
    """Each request on a connection of its own, the client's side closed after it: the answer is one
    HTTP/1.1 status line with a known status (or nothing, for a client that said nothing), nothing
    reaches the loop's exception handler, and a plain request is still answered after them all."""

    async def scenario() -> None:
        limits = dataclasses.replace(ROOMY, request_timeout=0.2)
        with loop_errors() as seen:
            async with serving({"/ok": ok}, limits) as (server, port):
                for raw in requests:
                    reader, writer = await asyncio.open_connection(HOST, port)
                    writer.write(raw)
                    writer.write_eof()
                    with contextlib.suppress(ConnectionResetError):
                        answer = await asyncio.wait_for(reader.read(), GUARD)
                        if raw.strip(b"\r\n \t"):  # something was said: something is answered
                            status_line = answer.partition(b"\r\n")[0]
                            assert status_line[:9] == b"HTTP/1.1 ", (raw, answer)
                            assert int(status_line[9:12]) in ANSWERS, (raw, answer)
                    writer.close()
                assert (await get(HOST, port, "/ok")).status == 200
                await wait_until(lambda: server.connections == 0, what="every connection closed")
        assert seen == []

    asyncio.run(scenario())
