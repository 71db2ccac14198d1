"""Tests for nri_plugin.nri.mux: frame codec, Go-captured vectors, and the asyncio trunk over real sockets."""

from __future__ import annotations

import asyncio
import itertools
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import pytest_asyncio
from hypothesis import given
from hypothesis import strategies as st
from vectors import load_frames, vector_names
from wait_support import wait_until

from nri_plugin.common import heap
from nri_plugin.nri import mux
from nri_plugin.nri.mux import (
    FIRST_FRAME_MAX,
    HEADER_SIZE,
    MAX_PAYLOAD,
    NEED_DATA,
    PLUGIN_SERVICE_CONN,
    READ_BUFFER_SIZE,
    RUNTIME_SERVICE_CONN,
    WRITE_HIGH_WATER,
    LocalMuxError,
    MuxDecoder,
    MuxFrame,
    MuxProtocolError,
    Trunk,
    adopt_socket,
    encode,
    open_unix,
)
from nri_plugin.ttrpc.errors import LocalProtocolError, RemoteProtocolError

# Only a guard against a hung test; nothing here asserts on elapsed time.
HANG_GUARD = 60.0

T = TypeVar("T")


def raw_frame(conn_id: int, payload: bytes) -> bytes:
    """A mux frame built by hand, independently of the code under test."""
    return struct.pack(">II", conn_id, len(payload)) + payload


def drain(decoder: MuxDecoder) -> list[MuxFrame]:
    frames = []
    while (event := decoder.next_event()) is not NEED_DATA:
        assert isinstance(event, MuxFrame)
        frames.append(event)
    return frames


def decode_chunks(chunks: Iterable[bytes]) -> list[MuxFrame]:
    """Feed the chunks one by one, then EOF; the stream must end on a frame boundary."""
    decoder = MuxDecoder()
    frames = []
    for chunk in chunks:
        decoder.receive_data(chunk)
        frames += drain(decoder)
    decoder.receive_data(b"")
    frames += drain(decoder)
    assert decoder.eof
    return frames


def decode_until_error(chunks: Iterable[bytes]) -> tuple[list[MuxFrame], MuxProtocolError | None]:
    """Feed the chunks, then EOF; return the frames decoded before any protocol error, and it."""
    decoder = MuxDecoder()
    frames: list[MuxFrame] = []
    try:
        for chunk in [*chunks, b""]:
            decoder.receive_data(chunk)
            while (event := decoder.next_event()) is not NEED_DATA:
                assert isinstance(event, MuxFrame)
                frames.append(event)
    except MuxProtocolError as exc:
        return frames, exc
    return frames, None


def byte_by_byte(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def frame_sizes(frames: list[bytes]) -> list[tuple[int, int]]:
    return [struct.unpack(">II", frame[:HEADER_SIZE]) for frame in frames]


# --------------------------------------------------------------------------------------------
# encode


@pytest.mark.parametrize(
    ("size", "expected_payload_sizes"),
    [
        pytest.param(1, [1], id="1"),
        pytest.param(10, [10], id="ttrpc-header-only"),
        pytest.param(4096, [4096], id="4096-one-frame"),
        pytest.param(4097, [4096, 1], id="4097"),
        pytest.param(5000, [4096, 904], id="5000-as-V8"),
        pytest.param(9844, [4096, 5748], id="9844-rest-not-split-again"),
        pytest.param(4096 + MAX_PAYLOAD, [4096, MAX_PAYLOAD], id="rest-exactly-at-cap"),
        pytest.param(4096 + MAX_PAYLOAD + 1, [4096, MAX_PAYLOAD, 1], id="rest-one-over-cap"),
        pytest.param(4096 + 2 * MAX_PAYLOAD + 5, [4096, MAX_PAYLOAD, MAX_PAYLOAD, 5], id="rest-twice-cap"),
    ],
)
def test_encode_splits_like_go(size: int, expected_payload_sizes: list[int]) -> None:
    message = bytes(i % 251 for i in range(min(size, 1000))) * (size // 1000 + 1)
    message = message[:size]
    frames = encode(PLUGIN_SERVICE_CONN, message)
    assert frame_sizes(frames) == [(PLUGIN_SERVICE_CONN, n) for n in expected_payload_sizes]
    assert all(len(frame) == HEADER_SIZE + n for frame, n in zip(frames, expected_payload_sizes, strict=True))
    assert all(len(frame) - HEADER_SIZE <= MAX_PAYLOAD for frame in frames)
    assert b"".join(frame[HEADER_SIZE:] for frame in frames) == message


def test_encode_v8_exact_headers() -> None:
    message = bytes(range(256)) * 19 + bytes(136)  # 5000 bytes
    first, second = encode(1, message)
    assert first == bytes.fromhex("0000000100001000") + message[:4096]
    assert second == bytes.fromhex("0000000100000388") + message[4096:]


def test_encode_runtime_conn_header() -> None:
    assert encode(RUNTIME_SERVICE_CONN, b"\x00" * 10) == [bytes.fromhex("000000020000000a") + bytes(10)]


def test_encode_accepts_bytearray_and_memoryview() -> None:
    assert encode(1, bytearray(b"abc")) == encode(1, memoryview(b"abc")) == [raw_frame(1, b"abc")]


def test_encode_empty_message_gives_no_frames() -> None:
    assert encode(1, b"") == []


@pytest.mark.parametrize("conn_id", [0, -1, 1 << 32])
def test_encode_refuses_reserved_or_out_of_range_conn_id(conn_id: int) -> None:
    with pytest.raises(LocalMuxError):
        encode(conn_id, b"x")


def test_errors_join_the_ttrpc_taxonomy() -> None:
    assert issubclass(MuxProtocolError, RemoteProtocolError)
    assert issubclass(LocalMuxError, LocalProtocolError)


def test_encode_accepts_largest_conn_id() -> None:
    assert encode(0xFFFFFFFF, b"x") == [bytes.fromhex("ffffffff00000001") + b"x"]


@given(conn_id=st.integers(1, 0xFFFFFFFF), message=st.binary(min_size=1, max_size=3 * FIRST_FRAME_MAX))
def test_encode_round_trips_through_decoder(conn_id: int, message: bytes) -> None:
    frames = encode(conn_id, message)
    assert len(frames) == (1 if len(message) <= FIRST_FRAME_MAX else 2)
    decoded = decode_chunks([b"".join(frames)])
    assert [f.conn_id for f in decoded] == [conn_id] * len(frames)
    assert len(decoded[0].payload) == min(FIRST_FRAME_MAX, len(message))
    assert b"".join(f.payload for f in decoded) == message


# --------------------------------------------------------------------------------------------
# MuxDecoder

SAMPLE_FRAMES = [
    MuxFrame(conn_id=1, payload=b"hello"),
    MuxFrame(conn_id=2, payload=b""),
    MuxFrame(conn_id=2, payload=bytes(range(256)) * 20),
    MuxFrame(conn_id=7, payload=b"x"),
    MuxFrame(conn_id=0xFFFFFFFF, payload=b"last"),
]
SAMPLE_WIRE = b"".join(raw_frame(f.conn_id, f.payload) for f in SAMPLE_FRAMES)


def test_decode_whole() -> None:
    assert decode_chunks([SAMPLE_WIRE]) == SAMPLE_FRAMES


def test_decode_byte_by_byte() -> None:
    assert decode_chunks(byte_by_byte(SAMPLE_WIRE)) == SAMPLE_FRAMES


def test_decode_waits_for_the_rest_of_a_frame() -> None:
    decoder = MuxDecoder()
    decoder.receive_data(SAMPLE_WIRE[:-1])
    assert drain(decoder) == SAMPLE_FRAMES[:-1]
    assert decoder.next_event() is NEED_DATA
    decoder.receive_data(SAMPLE_WIRE[-1:])
    assert decoder.next_event() == SAMPLE_FRAMES[-1]
    assert decoder.next_event() is NEED_DATA


def test_decode_large_frame_in_chunks() -> None:
    payload = bytes(range(256)) * (MAX_PAYLOAD // 256) + bytes(MAX_PAYLOAD % 256)
    assert len(payload) == MAX_PAYLOAD
    wire = raw_frame(1, payload) + raw_frame(2, b"after") + raw_frame(1, payload[:5000])
    chunks = [wire[i : i + 65536] for i in range(0, len(wire), 65536)]
    frames = decode_chunks(chunks)
    assert [(f.conn_id, len(f.payload)) for f in frames] == [(1, MAX_PAYLOAD), (2, 5), (1, 5000)]
    assert frames[0].payload == payload
    assert frames[2].payload == payload[:5000]


@st.composite
def wire_and_splits(draw: st.DrawFn) -> tuple[list[MuxFrame], bytes, list[int]]:
    frames = draw(
        st.lists(
            st.builds(
                lambda conn_id, payload: MuxFrame(conn_id=conn_id, payload=payload),
                st.integers(1, 0xFFFFFFFF),
                st.binary(max_size=300),
            ),
            max_size=8,
        )
    )
    wire = b"".join(raw_frame(f.conn_id, f.payload) for f in frames)
    cuts = draw(st.lists(st.integers(0, len(wire)), max_size=20))
    return frames, wire, sorted(cuts)


@given(wire_and_splits())
def test_decode_any_split_gives_the_same_frames(case: tuple[list[MuxFrame], bytes, list[int]]) -> None:
    frames, wire, cuts = case
    bounds = [0, *cuts, len(wire)]
    chunks = [wire[a:b] for a, b in itertools.pairwise(bounds)]
    assert decode_chunks([chunk for chunk in chunks if chunk]) == frames  # b"" would mean EOF


# Byte strings that are often almost valid: frames with small payloads, then arbitrary bytes.
_nearly_valid = st.builds(
    lambda frames, tail: b"".join(frames) + tail,
    st.lists(
        st.builds(raw_frame, st.integers(0, 3), st.binary(max_size=40)),
        max_size=4,
    ),
    st.binary(max_size=40),
)


@given(st.one_of(st.binary(max_size=200), _nearly_valid))
def test_decode_any_bytes_gives_frames_or_protocol_error(data: bytes) -> None:
    # Any exception other than MuxProtocolError escapes and fails the test.
    whole = decode_until_error([data])
    split = decode_until_error(byte_by_byte(data))
    assert whole[0] == split[0]
    assert (whole[1] is None) == (split[1] is None)
    if whole[1] is None:
        assert b"".join(raw_frame(f.conn_id, f.payload) for f in whole[0]) == data


def test_decode_conn_id_zero_is_an_error() -> None:
    decoder = MuxDecoder()
    decoder.receive_data(raw_frame(1, b"ok") + raw_frame(0, b"bad"))
    assert decoder.next_event() == MuxFrame(conn_id=1, payload=b"ok")
    with pytest.raises(MuxProtocolError, match="reserved"):
        decoder.next_event()


def test_decode_oversized_header_is_an_error_before_its_payload() -> None:
    decoder = MuxDecoder()
    decoder.receive_data(struct.pack(">II", 1, MAX_PAYLOAD + 1))
    with pytest.raises(MuxProtocolError, match="cap"):
        decoder.next_event()


def test_decode_frame_at_the_cap_is_accepted() -> None:
    decoder = MuxDecoder()
    decoder.receive_data(struct.pack(">II", 1, MAX_PAYLOAD))
    assert decoder.next_event() is NEED_DATA
    decoder.receive_data(bytes(MAX_PAYLOAD))
    assert decoder.next_event() == MuxFrame(conn_id=1, payload=bytes(MAX_PAYLOAD))


def test_decode_stays_failed_after_an_error() -> None:
    decoder = MuxDecoder()
    decoder.receive_data(raw_frame(0, b""))
    with pytest.raises(MuxProtocolError):
        decoder.next_event()
    decoder.receive_data(raw_frame(1, b"fine"))
    with pytest.raises(MuxProtocolError):
        decoder.next_event()


@pytest.mark.parametrize(
    "wire",
    [
        pytest.param(raw_frame(1, b"abc")[:5], id="mid-header"),
        pytest.param(raw_frame(1, b"abc")[:HEADER_SIZE], id="after-header"),
        pytest.param(raw_frame(1, b"abc")[:-1], id="mid-payload"),
        pytest.param(raw_frame(1, b"ok") + raw_frame(2, b"abc")[:9], id="after-a-whole-frame"),
    ],
)
def test_decode_eof_inside_a_frame_is_an_error(wire: bytes) -> None:
    frames, error = decode_until_error([wire])
    assert isinstance(error, MuxProtocolError)
    assert frames == ([MuxFrame(conn_id=1, payload=b"ok")] if wire.startswith(raw_frame(1, b"ok")) else [])


def test_decode_eof_on_a_frame_boundary_is_clean() -> None:
    decoder = MuxDecoder()
    decoder.receive_data(raw_frame(1, b"x"))
    decoder.receive_data(b"")
    assert decoder.eof
    assert decoder.next_event() == MuxFrame(conn_id=1, payload=b"x")
    assert decoder.next_event() is NEED_DATA
    decoder.receive_data(b"")  # a second EOF is harmless
    assert decoder.next_event() is NEED_DATA


def test_decode_data_after_eof_is_a_local_error() -> None:
    decoder = MuxDecoder()
    decoder.receive_data(b"")
    with pytest.raises(LocalMuxError):
        decoder.receive_data(b"x")


# --------------------------------------------------------------------------------------------
# Vectors captured from the Go implementation


def vector_params() -> list[Any]:
    return [pytest.param(name, id=name.removesuffix(".hex")) for name in vector_names()]


@pytest.mark.parametrize("name", vector_params())
def test_vector_decodes_and_encodes_like_go(name: str) -> None:
    frames = load_frames(name)
    assert frames
    decoded = decode_chunks([b"".join(frames)])
    assert [raw_frame(f.conn_id, f.payload) for f in decoded] == frames
    (conn_id,) = {f.conn_id for f in decoded}
    message = b"".join(f.payload for f in decoded)
    assert encode(conn_id, message) == frames


def test_vectors_include_go_split_messages() -> None:
    split = {name[:2] for name in vector_names() if len(load_frames(name)) > 1}
    assert {"13", "14", "28"} <= split


# --------------------------------------------------------------------------------------------
# Trunk over real unix sockets


async def guarded(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, HANG_GUARD)


class Recorder:
    """A channel receiver that records what it gets."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.lost: list[Exception | None] = []
        self._changed = asyncio.Event()

    def data_received(self, data: bytes | memoryview) -> None:
        assert data, "receivers must never get b'' (it means EOF to sans-I/O code)"
        assert not self.lost, "data after connection_lost"
        self.data += data
        self._changed.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.append(exc)
        self._changed.set()

    async def _wait(self, condition: Any) -> None:
        while not condition():
            self._changed.clear()
            await self._changed.wait()

    async def wait_bytes(self, count: int) -> None:
        await guarded(self._wait(lambda: len(self.data) >= count))

    async def wait_lost(self) -> None:
        await guarded(self._wait(lambda: bool(self.lost)))


class RawPeer:
    """The other end of the socket, read and written as plain bytes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def read_frame(self) -> MuxFrame:
        header = await guarded(self.reader.readexactly(HEADER_SIZE))
        conn_id, length = struct.unpack(">II", header)
        payload = await guarded(self.reader.readexactly(length))
        return MuxFrame(conn_id=conn_id, payload=payload)

    async def read_to_eof(self) -> bytes:
        return await guarded(self.reader.read())


@pytest_asyncio.fixture
async def trunk_and_peer() -> AsyncIterator[tuple[Trunk, RawPeer]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    trunk = await adopt_socket(ours)
    reader, writer = await asyncio.open_unix_connection(sock=theirs)
    yield trunk, RawPeer(reader, writer)
    trunk.close()
    writer.close()
    await guarded(trunk.wait_closed())
    await guarded(writer.wait_closed())


@pytest_asyncio.fixture
async def trunk_pair() -> AsyncIterator[tuple[Trunk, Trunk]]:
    left_sock, right_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left = await adopt_socket(left_sock)
    right = await adopt_socket(right_sock)
    yield left, right
    left.close()
    right.close()
    await guarded(left.wait_closed())
    await guarded(right.wait_closed())


@pytest.mark.asyncio
async def test_two_channels_carry_independent_streams_both_ways(trunk_pair: tuple[Trunk, Trunk]) -> None:
    left, right = trunk_pair
    recorders = {(side, conn): Recorder() for side in ("left", "right") for conn in (1, 2)}
    trunks = {"left": left, "right": right}
    send = {key: trunks[key[0]].channel(key[1], recorder) for key, recorder in recorders.items()}

    sizes = [10, 4096, 4097, 9844, 1, 70000]
    expected: dict[tuple[str, int], bytes] = {}
    for i, size in enumerate(sizes):
        for side in ("left", "right"):
            for conn in (1, 2):
                message = bytes([(i * 16 + conn * 4 + len(side)) % 256]) * size
                send[side, conn](message)
                peer = "right" if side == "left" else "left"
                expected[peer, conn] = expected.get((peer, conn), b"") + message

    for key, recorder in recorders.items():
        await recorder.wait_bytes(len(expected[key]))
    for key, recorder in recorders.items():
        assert bytes(recorder.data) == expected[key], key
        assert recorder.lost == []


@pytest.mark.asyncio
async def test_five_megabyte_message_arrives_intact(trunk_pair: tuple[Trunk, Trunk]) -> None:
    left, right = trunk_pair
    received = Recorder()
    right.channel(RUNTIME_SERVICE_CONN, received)
    send = left.channel(RUNTIME_SERVICE_CONN, Recorder())
    message = bytes(range(251)) * (5_000_000 // 251 + 1)
    send(message)
    await received.wait_bytes(len(message))
    assert bytes(received.data) == message


@pytest.mark.asyncio
async def test_the_trunk_reads_into_one_small_buffer(trunk_pair: tuple[Trunk, Trunk]) -> None:
    left, right = trunk_pair
    received = Recorder()
    right.channel(RUNTIME_SERVICE_CONN, received)
    send = left.channel(RUNTIME_SERVICE_CONN, Recorder())
    buffer = right.get_buffer(-1)
    assert len(buffer) == READ_BUFFER_SIZE <= 64 * 1024
    message = bytes(range(256)) * (3 * READ_BUFFER_SIZE // 256) + b"tail"  # several reads' worth
    send(message)
    await received.wait_bytes(len(message))
    assert bytes(received.data) == message
    assert right.get_buffer(4 << 20) is buffer  # the same one, whatever size is hinted


@pytest.mark.asyncio
async def test_a_large_frame_gives_free_memory_back(
    trunk_pair: tuple[Trunk, Trunk], monkeypatch: pytest.MonkeyPatch
) -> None:
    released = asyncio.Event()
    calls: list[bool] = []

    def release() -> bool:
        calls.append(True)
        released.set()
        return True

    monkeypatch.setattr(heap, "release_free_memory", release)
    monkeypatch.setattr(mux, "_RELEASE_DELAY", 1.0)  # ample for the second frame to follow the first
    left, right = trunk_pair
    received = Recorder()
    right.channel(RUNTIME_SERVICE_CONN, received)
    send = left.channel(RUNTIME_SERVICE_CONN, Recorder())
    send(b"small" * 100)
    await received.wait_bytes(500)
    assert right._release is None  # a small message schedules nothing
    big = bytes(2 << 20)
    send(big)
    send(big)  # two in a row (a chunked Synchronize): one release, after the last
    await received.wait_bytes(500 + 2 * len(big))
    await guarded(released.wait())
    assert calls == [True]
    assert right._release is None
    # Smaller chunks count together: four of 300 KB are more than the 1 MiB that calls for a release.
    released.clear()
    chunk = bytes(300_000)
    for _ in range(4):
        send(chunk)
    await received.wait_bytes(500 + 2 * len(big) + 4 * len(chunk))
    await guarded(released.wait())
    assert calls == [True, True]


def test_the_decoder_lets_go_of_a_large_frame_once_delivered() -> None:
    decoder = MuxDecoder()
    payload = bytes(range(256)) * 8192  # 2 MiB
    wire = raw_frame(1, payload)
    for start in range(0, len(wire), 65536):
        decoder.receive_data(memoryview(wire)[start : start + 65536])
    assert drain(decoder) == [MuxFrame(conn_id=1, payload=payload)]
    assert decoder.buffered == 0  # released now, not at the next read


@pytest.mark.asyncio
async def test_five_megabyte_message_goes_out_as_go_frames(trunk_and_peer: tuple[Trunk, RawPeer]) -> None:
    trunk, peer = trunk_and_peer
    send_plugin = trunk.channel(PLUGIN_SERVICE_CONN, Recorder())
    send_runtime = trunk.channel(RUNTIME_SERVICE_CONN, Recorder())
    message = bytes(range(253)) * (5_000_000 // 253) + b"end"
    send_plugin(message)
    send_runtime(b"next message")

    frames = [await peer.read_frame() for _ in range(4)]
    rest = len(message) - FIRST_FRAME_MAX - MAX_PAYLOAD
    assert [(f.conn_id, len(f.payload)) for f in frames] == [
        (1, FIRST_FRAME_MAX),
        (1, MAX_PAYLOAD),
        (1, rest),
        (2, len(b"next message")),
    ]
    assert b"".join(f.payload for f in frames[:3]) == message
    assert frames[3].payload == b"next message"


@pytest.mark.asyncio
async def test_frames_for_unknown_ids_are_dropped(trunk_and_peer: tuple[Trunk, RawPeer]) -> None:
    trunk, peer = trunk_and_peer
    recorder = Recorder()
    send = trunk.channel(1, recorder)
    peer.writer.write(
        raw_frame(7, b"nobody") + raw_frame(1, b"hello") + raw_frame(3, b"x") + raw_frame(1, b"!")
    )
    await recorder.wait_bytes(6)
    assert bytes(recorder.data) == b"hello!"

    send(b"still works")
    assert await peer.read_frame() == MuxFrame(conn_id=1, payload=b"still works")
    assert not trunk.closed.is_set()
    assert recorder.lost == []


@pytest.mark.asyncio
async def test_empty_frames_are_not_delivered(trunk_and_peer: tuple[Trunk, RawPeer]) -> None:
    trunk, peer = trunk_and_peer
    recorder = Recorder()
    trunk.channel(1, recorder)
    peer.writer.write(raw_frame(1, b"") + raw_frame(1, b"a"))
    await recorder.wait_bytes(1)  # Recorder asserts it never gets b""
    assert bytes(recorder.data) == b"a"


@pytest.mark.asyncio
async def test_peer_close_tells_every_receiver_once(trunk_and_peer: tuple[Trunk, RawPeer]) -> None:
    trunk, peer = trunk_and_peer
    first, second = Recorder(), Recorder()
    trunk.channel(1, first)
    trunk.channel(2, second)
    peer.writer.write(raw_frame(2, b"bye"))
    peer.writer.close()
    await guarded(trunk.wait_closed())
    trunk.close()  # closing again changes nothing
    await asyncio.sleep(0)
    assert first.lost == [None]
    assert second.lost == [None]
    assert bytes(second.data) == b"bye"
    assert trunk.exception is None


@pytest.mark.asyncio
async def test_peer_protocol_error_closes_the_trunk(trunk_and_peer: tuple[Trunk, RawPeer]) -> None:
    trunk, peer = trunk_and_peer
    first, second = Recorder(), Recorder()
    trunk.channel(1, first)
    send = trunk.channel(2, second)
    peer.writer.write(raw_frame(1, b"ok") + raw_frame(0, b"bad") + raw_frame(1, b"never"))
    await guarded(trunk.wait_closed())
    assert bytes(first.data) == b"ok"
    assert len(first.lost) == len(second.lost) == 1
    assert isinstance(first.lost[0], MuxProtocolError)
    assert second.lost[0] is first.lost[0] is trunk.exception
    send(b"ignored after close")  # no error, nothing written
    assert await peer.read_to_eof() == b""


@pytest.mark.asyncio
async def test_peer_oversized_frame_closes_the_trunk(trunk_and_peer: tuple[Trunk, RawPeer]) -> None:
    trunk, peer = trunk_and_peer
    recorder = Recorder()
    trunk.channel(1, recorder)
    peer.writer.write(struct.pack(">II", 1, MAX_PAYLOAD + 1))
    await recorder.wait_lost()
    assert isinstance(recorder.lost[0], MuxProtocolError)
    await guarded(trunk.wait_closed())


@pytest.mark.asyncio
async def test_peer_eof_inside_a_frame_is_an_error(trunk_and_peer: tuple[Trunk, RawPeer]) -> None:
    trunk, peer = trunk_and_peer
    recorder = Recorder()
    trunk.channel(1, recorder)
    peer.writer.write(raw_frame(1, b"whole") + raw_frame(1, b"cut short")[:-3])
    peer.writer.write_eof()
    await guarded(trunk.wait_closed())
    assert bytes(recorder.data) == b"whole"
    assert len(recorder.lost) == 1
    assert isinstance(recorder.lost[0], MuxProtocolError)


@pytest.mark.asyncio
async def test_local_close_flushes_then_closes(trunk_and_peer: tuple[Trunk, RawPeer]) -> None:
    trunk, peer = trunk_and_peer
    recorder = Recorder()
    send = trunk.channel(2, recorder)
    message = bytes(6000)
    send(message)
    trunk.close()
    assert recorder.lost == [None]
    send(b"dropped")
    assert await peer.read_to_eof() == b"".join(encode(2, message))
    await guarded(trunk.wait_closed())
    assert recorder.lost == [None]


@pytest.mark.asyncio
async def test_local_close_does_not_wait_on_a_peer_that_does_not_read(
    trunk_and_peer: tuple[Trunk, RawPeer], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 29: a close flushed for ever what a peer that stopped reading never read, so the trunk
    never closed (and the stub never reconnected nor stopped). Now the flush is bounded
    (`Trunk.close_timeout`), then the socket is aborted: the trunk closes, the peer gets what the
    socket buffers held and then the end of file, the rest is dropped and logged."""
    trunk, peer = trunk_and_peer
    assert trunk.close_timeout == mux.CLOSE_FLUSH_TIMEOUT
    trunk.close_timeout = 0.1
    peer.writer.transport.pause_reading()  # type: ignore[attr-defined]
    recorder = Recorder()
    send = trunk.channel(2, recorder)
    message = bytes(4 << 20)  # far more than the socket buffers hold
    send(message)
    assert trunk._transport is not None
    assert trunk._transport.get_write_buffer_size() > 0
    trunk.close()
    assert trunk.closing
    assert recorder.lost == [None]
    await guarded(trunk.wait_closed())
    assert "did not read our last" in caplog.text
    peer.writer.transport.resume_reading()  # type: ignore[attr-defined]
    received = await peer.read_to_eof()
    assert 0 < len(received) < len(b"".join(encode(2, message)))


@pytest.mark.asyncio
async def test_a_close_with_nothing_left_to_flush_is_not_aborted(
    trunk_and_peer: tuple[Trunk, RawPeer], caplog: pytest.LogCaptureFixture
) -> None:
    """The bound only ever cuts a flush short: a peer that reads gets everything (above too), and a
    trunk closed with an empty write buffer closes at once, its timer gone with it."""
    trunk, peer = trunk_and_peer
    trunk.close_timeout = 0.05
    trunk.channel(1, Recorder())
    trunk.close()
    await guarded(trunk.wait_closed())
    assert trunk._flush_timer is None
    assert await peer.read_to_eof() == b""
    await asyncio.sleep(0.1)  # past the bound: nothing fires (no warning, no error)
    assert "did not read" not in caplog.text


@pytest.mark.asyncio
async def test_receiver_failure_closes_the_trunk(trunk_and_peer: tuple[Trunk, RawPeer]) -> None:
    class Broken(Recorder):
        def data_received(self, data: bytes | memoryview) -> None:
            raise ValueError("broken receiver")

    trunk, peer = trunk_and_peer
    broken, other = Broken(), Recorder()
    trunk.channel(1, broken)
    trunk.channel(2, other)
    peer.writer.write(raw_frame(1, b"boom"))
    await guarded(trunk.wait_closed())
    assert isinstance(trunk.exception, ValueError)
    assert broken.lost == other.lost == [trunk.exception]


@pytest.mark.asyncio
async def test_trunk_send_method_equals_channel_send(trunk_and_peer: tuple[Trunk, RawPeer]) -> None:
    trunk, peer = trunk_and_peer
    send = trunk.channel(2, Recorder())
    send(b"one")
    trunk.send(2, b"two")
    trunk.send(9, b"no receiver needed to send")
    assert [await peer.read_frame() for _ in range(3)] == [
        MuxFrame(conn_id=2, payload=b"one"),
        MuxFrame(conn_id=2, payload=b"two"),
        MuxFrame(conn_id=9, payload=b"no receiver needed to send"),
    ]
    with pytest.raises(LocalMuxError):
        trunk.send(0, b"x")


@pytest.mark.asyncio
async def test_channel_arguments_are_checked(trunk_and_peer: tuple[Trunk, RawPeer]) -> None:
    trunk, _ = trunk_and_peer
    trunk.channel(1, Recorder())
    with pytest.raises(LocalMuxError):
        trunk.channel(1, Recorder())
    with pytest.raises(LocalMuxError):
        trunk.channel(0, Recorder())
    with pytest.raises(LocalMuxError):
        trunk.channel(1 << 32, Recorder())


@pytest.mark.asyncio
async def test_channel_on_a_closed_trunk_is_told_soon(trunk_and_peer: tuple[Trunk, RawPeer]) -> None:
    trunk, _ = trunk_and_peer
    trunk.close()
    late = Recorder()
    send = trunk.channel(1, late)
    assert late.lost == []  # not from inside channel()
    await late.wait_lost()
    assert late.lost == [None]
    send(b"ignored")


@pytest.mark.asyncio
async def test_open_unix_talks_to_a_server(tmp_path: Path) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()
        await writer.wait_closed()

    path = tmp_path / "nri.sock"
    server = await asyncio.start_unix_server(echo, path=str(path))
    async with server:
        trunk = await open_unix(path)
        one, two = Recorder(), Recorder()
        send_one = trunk.channel(1, one)
        send_two = trunk.channel(2, two)
        send_one(b"a" * 5000)
        send_two(b"b" * 10)
        await one.wait_bytes(5000)
        await two.wait_bytes(10)
        assert bytes(one.data) == b"a" * 5000
        assert bytes(two.data) == b"b" * 10
        trunk.close()
        await guarded(trunk.wait_closed())
        assert one.lost == two.lost == [None]


@pytest.mark.asyncio
async def test_a_peer_that_does_not_read_stops_our_reading(trunk_and_peer: tuple[Trunk, RawPeer]) -> None:
    """Write backpressure: past WRITE_HIGH_WATER unread bytes the trunk reads no more requests (so it
    makes no more answers) until the peer has read the backlog down; `drain()` waits for that."""

    class Echo(Recorder):
        """Answers every piece with 256 KiB."""

        def data_received(self, data: bytes | memoryview) -> None:
            super().data_received(data)
            send(b"a" * (256 * 1024))

    trunk, peer = trunk_and_peer
    echo = Echo()
    send = trunk.channel(1, echo)
    for _ in range(40):  # 40 requests would make 10 MiB of answers
        peer.writer.write(raw_frame(1, b"q"))
    await peer.writer.drain()
    await wait_until(lambda: trunk.writing_paused, what="the trunk paused its reading")
    taken = len(echo.data)
    assert taken < 40
    assert trunk._transport is not None
    assert trunk._transport.get_write_buffer_size() <= WRITE_HIGH_WATER + 2 * 256 * 1024
    drained = asyncio.ensure_future(trunk.drain())
    await asyncio.sleep(0.05)  # (time passes, the peer reads nothing: drain() must not return)
    assert not drained.done()
    frames = [await peer.read_frame() for _ in range(2 * 40)]  # each answer: 4 KiB + the rest
    assert len(echo.data) == 40, "every request is taken once the peer reads"
    assert sum(len(frame.payload) for frame in frames) == 40 * 256 * 1024
    await guarded(drained)
    assert not trunk.writing_paused
