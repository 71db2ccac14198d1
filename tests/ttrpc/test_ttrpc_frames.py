"""FrameDecoder and encode_frame: the byte level of ttrpc, no sessions, no I/O."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nri_plugin.ttrpc import protocol
from nri_plugin.ttrpc.errors import Code, LocalProtocolError, OversizedMessage, RemoteProtocolError
from nri_plugin.ttrpc.protocol import (
    HEADER_SIZE,
    MAX_DATA,
    NEED_DATA,
    Frame,
    FrameDecoder,
    MessageType,
    OversizedFrame,
    encode_frame,
)

frames = st.builds(
    Frame,
    stream_id=st.integers(0, 0xFFFF_FFFF),
    type=st.sampled_from(MessageType),
    flags=st.integers(0, 0xFF),
    data=st.binary(max_size=300),
)


def encode(frame: Frame) -> bytes:
    return encode_frame(frame.stream_id, frame.type, frame.flags, bytes(frame.data))


def drain(decoder: FrameDecoder) -> list[Frame | OversizedFrame]:
    out: list[Frame | OversizedFrame] = []
    while (item := decoder.next_event()) is not NEED_DATA:
        out.append(item)
    return out


def feed(decoder: FrameDecoder, chunks: list[bytes]) -> list[Frame | OversizedFrame]:
    out: list[Frame | OversizedFrame] = []
    for chunk in chunks:
        decoder.receive_data(chunk)
        out += drain(decoder)
    return out


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


def one_byte_at_a_time(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def test_protocol_module_does_no_io() -> None:
    tree = ast.parse(Path(protocol.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"asyncio", "socket", "selectors", "trio"}


def test_header_layout_is_big_endian() -> None:
    assert (
        encode_frame(7, MessageType.RESPONSE, 0x05, b"ab") == bytes.fromhex("00000002 00000007 02 05") + b"ab"
    )


def test_empty_frame_is_header_only() -> None:
    assert encode_frame(1, MessageType.RESPONSE, 0, b"") == bytes.fromhex("00000000000000010200")


@given(frames)
def test_round_trip(frame: Frame) -> None:
    decoder = FrameDecoder()
    assert feed(decoder, [encode(frame)]) == [frame]
    assert decoder.buffered == 0


@given(st.lists(frames, max_size=5), st.lists(st.integers(0, 10_000), max_size=20))
def test_round_trip_in_any_split(sent: list[Frame], cuts: list[int]) -> None:
    wire = b"".join(encode(f) for f in sent)
    assert feed(FrameDecoder(), [wire]) == sent
    assert feed(FrameDecoder(), split(wire, cuts)) == sent


@given(st.lists(frames, max_size=3))
def test_round_trip_one_byte_at_a_time(sent: list[Frame]) -> None:
    wire = b"".join(encode(f) for f in sent)
    assert feed(FrameDecoder(), one_byte_at_a_time(wire)) == sent


def test_largest_frame_passes() -> None:
    data = bytes(MAX_DATA)
    decoder = FrameDecoder()
    [frame] = feed(decoder, [encode_frame(1, MessageType.REQUEST, 0, data)])
    assert isinstance(frame, Frame)
    assert len(frame.data) == MAX_DATA


def test_encode_refuses_oversized_data_like_go() -> None:
    with pytest.raises(OversizedMessage) as info:
        encode_frame(1, MessageType.REQUEST, 0, bytes(MAX_DATA + 1))
    assert info.value.code == Code.RESOURCE_EXHAUSTED
    assert info.value.message == "message length 4194305 exceed maximum message size of 4194304"
    assert (info.value.length, info.value.limit) == (MAX_DATA + 1, MAX_DATA)


@pytest.mark.parametrize(
    ("stream_id", "type_", "flags"),
    [(-1, 1, 0), (1 << 32, 1, 0), (1, 0, 0), (1, 4, 0), (1, 1, 256), (1, 1, -1)],
)
def test_encode_refuses_values_that_do_not_fit(stream_id: int, type_: int, flags: int) -> None:
    with pytest.raises(LocalProtocolError):
        encode_frame(stream_id, type_, flags, b"")


@pytest.mark.parametrize("bad_type", [0, 4, 0xFF])
def test_unknown_type_is_a_remote_error_and_sticks(bad_type: int) -> None:
    decoder = FrameDecoder()
    decoder.receive_data(bytes.fromhex("00000000 00000001") + bytes([bad_type, 0]))
    with pytest.raises(RemoteProtocolError, match="unknown message type"):
        decoder.next_event()
    with pytest.raises(RemoteProtocolError, match="already broken"):
        decoder.receive_data(encode_frame(3, MessageType.REQUEST, 0, b""))
    assert decoder.buffered == 10
    with pytest.raises(RemoteProtocolError, match="already broken"):
        decoder.next_event()


def test_clean_eof() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(encode_frame(1, MessageType.REQUEST, 0, b"x"))
    decoder.receive_data(b"")
    assert len(drain(decoder)) == 1
    assert decoder.next_event() is NEED_DATA


@pytest.mark.parametrize("keep", [1, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 2])
def test_eof_inside_a_frame_is_a_remote_error(keep: int) -> None:
    decoder = FrameDecoder()
    decoder.receive_data(encode_frame(1, MessageType.REQUEST, 0, b"abc")[:keep])
    assert decoder.next_event() is NEED_DATA
    decoder.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="middle of a frame"):
        decoder.next_event()


def test_data_after_eof_is_a_local_error() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(b"")
    with pytest.raises(LocalProtocolError):
        decoder.receive_data(b"x")


def test_oversized_frame_is_discarded_as_it_streams_in() -> None:
    announced = 5 << 20
    chunk = 64 << 10
    decoder = FrameDecoder()
    header = announced.to_bytes(4, "big") + (9).to_bytes(4, "big") + bytes([MessageType.REQUEST, 0])
    events = feed(decoder, [header])
    assert events == [OversizedFrame(stream_id=9, type=MessageType.REQUEST, flags=0, length=announced)]
    sent = 0
    while sent < announced:
        n = min(chunk, announced - sent)
        assert feed(decoder, [bytes(n)]) == []
        assert decoder.buffered == 0, "discarded data must not be buffered"
        sent += n
    follow_up = Frame(stream_id=11, type=MessageType.REQUEST, flags=0, data=b"next")
    assert feed(decoder, [encode(follow_up)]) == [follow_up]


def test_oversized_frame_arriving_with_its_data_and_the_next_frame() -> None:
    decoder = FrameDecoder(max_data=4)
    follow_up = Frame(stream_id=3, type=MessageType.RESPONSE, flags=0, data=b"ok")
    wire = (6).to_bytes(4, "big") + (1).to_bytes(4, "big") + b"\x02\x00" + b"123456" + encode(follow_up)
    for chunks in ([wire], one_byte_at_a_time(wire)):
        decoder = FrameDecoder(max_data=4)
        events = feed(decoder, chunks)
        assert events == [
            OversizedFrame(stream_id=1, type=MessageType.RESPONSE, flags=0, length=6),
            follow_up,
        ]
        assert decoder.buffered <= max(len(c) for c in chunks)


def test_eof_while_discarding_is_a_remote_error() -> None:
    decoder = FrameDecoder(max_data=4)
    decoder.receive_data((6).to_bytes(4, "big") + (1).to_bytes(4, "big") + b"\x01\x00" + b"12")
    assert isinstance(decoder.next_event(), OversizedFrame)
    decoder.receive_data(b"")
    with pytest.raises(RemoteProtocolError):
        decoder.next_event()


@given(st.binary(max_size=200), st.lists(st.integers(0, 200), max_size=10), st.booleans())
def test_any_bytes_give_frames_or_a_remote_error(data: bytes, cuts: list[int], eof: bool) -> None:
    decoder = FrameDecoder(max_data=64)
    chunks = split(data, cuts) + ([b""] if eof else [])
    try:
        for item in feed(decoder, chunks):
            assert isinstance(item, (Frame, OversizedFrame))
    except RemoteProtocolError:
        pass
