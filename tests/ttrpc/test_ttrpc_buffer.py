"""The receive buffer and the sentinel both sans-I/O decoders share, and what importing them loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nri_plugin.nri import mux
from nri_plugin.ttrpc import protocol
from nri_plugin.ttrpc.buffer import HAND_OVER_MIN, NEED_DATA, NeedData, ReceiveBuffer
from nri_plugin.ttrpc.protocol import FrameDecoder, MessageType, encode_frame

ROOT = Path(__file__).resolve().parents[2]


def test_one_sentinel_for_both_decoders() -> None:
    assert protocol.NEED_DATA is mux.NEED_DATA is NEED_DATA
    assert protocol.NeedData is mux.NeedData is NeedData
    assert FrameDecoder().next_event() is NEED_DATA
    assert mux.MuxDecoder().next_event() is NEED_DATA
    assert mux.MuxDecoder().next_payload() is NEED_DATA


def test_buffer_cuts_from_the_bytes_and_keeps_only_the_rest() -> None:
    buffer = ReceiveBuffer()
    data = b"hdr-payload-rest"
    joined = buffer.join(data)
    assert joined is data  # nothing kept: the bytes received themselves, no copy
    assert buffer.cut(joined, 4, 11, data) == b"payload"
    buffer.keep(joined, 12, data)
    assert len(buffer) == buffer.held == 4
    more = b"-and-more"
    joined = buffer.join(more)
    assert bytes(joined) == b"rest-and-more"
    assert len(buffer) == 0  # given up while the frames are cut
    buffer.keep(joined, len(joined), more)
    assert len(buffer) == 0


def test_buffer_lets_go_of_its_memory_once_all_is_consumed() -> None:
    buffer = ReceiveBuffer()
    first = bytes(1 << 20)
    buffer.keep(first, 1, first)  # a frame not whole yet
    assert buffer.held == (1 << 20) - 1
    rest = b"x"
    joined = buffer.join(rest)
    buffer.cut(joined, 0, len(joined), rest)
    buffer.keep(joined, len(joined), rest)
    assert buffer.held == 0


def test_buffer_never_holds_consumed_bytes() -> None:
    buffer = ReceiveBuffer()
    data = bytes(3 * 65536)
    buffer.keep(data, 10, data)
    more = b"x"
    joined = buffer.join(more)
    buffer.keep(joined, 2 * 65536, more)  # frames cut up to there
    assert buffer.held == len(buffer) == 65536 - 10 + 1


def test_the_ttrpc_decoder_lets_go_of_a_large_frame_once_delivered() -> None:
    decoder = FrameDecoder()
    wire = encode_frame(1, MessageType.REQUEST, 0, bytes(3 << 20))
    for start in range(0, len(wire), 65536):
        decoder.receive_data(wire[start : start + 65536])
    assert decoder.next_event() is not NEED_DATA
    assert decoder.buffered == 0


def test_a_large_frame_that_ends_the_bytes_received_is_handed_over_not_copied() -> None:
    buffer = ReceiveBuffer()
    body = bytes(range(256)) * (HAND_OVER_MIN // 256)
    first = b"hdr-" + body[:-1]
    buffer.keep(first, 0, first)  # the first read: the frame not whole yet
    last = body[-1:]
    joined = buffer.join(last)
    taken = buffer.cut(joined, 4, len(joined), last)
    assert isinstance(taken, memoryview)  # the buffer's own memory, given up
    assert taken == body
    buffer.keep(joined, len(joined), last)
    assert buffer.held == len(buffer) == 0
    next_read = b"next"
    assert buffer.join(next_read) is next_read  # the buffer goes on afresh: the view stays as it was
    assert taken == body


@pytest.mark.parametrize(
    ("length", "after"),
    [(HAND_OVER_MIN - 1, b""), (HAND_OVER_MIN, b"more")],
    ids=["small", "followed-by-more"],
)
def test_other_frames_are_copied_out(length: int, after: bytes) -> None:
    buffer = ReceiveBuffer()
    first = bytes(length - 1)
    buffer.keep(first, 0, first)
    last = b"\0" + after
    joined = buffer.join(last)
    taken = buffer.cut(joined, 0, length, last)
    assert type(taken) is bytes
    assert taken == bytes(length)
    assert buffer.cut(joined, length, len(joined), last) == after


def test_a_large_request_through_the_mux_and_ttrpc_is_held_once() -> None:
    """A 4 MiB ttrpc message as a Go peer sends it (4096 bytes, then the rest): the mux's frame and
    then the ttrpc frame are views, the ttrpc one of the one copy the ttrpc decoder made."""
    message = encode_frame(1, MessageType.REQUEST, 0, bytes(4 << 20))
    muxed = b"".join(mux.encode(1, message))
    trunk, decoder = mux.MuxDecoder(), FrameDecoder()
    for start in range(0, len(muxed), 65536):
        trunk.receive_data(muxed[start : start + 65536])
        while (found := trunk.next_payload()) is not NEED_DATA:
            decoder.receive_data(found[1])
    frame = decoder.next_event()
    assert isinstance(frame, protocol.Frame)
    assert isinstance(frame.data, memoryview)
    assert frame.data == bytes(4 << 20)
    assert trunk.buffered == decoder.buffered == 0


def _modules_loaded_by(module: str) -> set[str]:
    script = f"import sys, {module}; import json; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    return set(json.loads(out))


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("nri_plugin.ttrpc.protocol", {"asyncio", "socket"}),
        ("nri_plugin.ttrpc.errors", {"asyncio", "socket"}),
        ("nri_plugin.nri.muxcodec", {"asyncio", "socket"}),
        ("nri_plugin.nri.events", {"asyncio", "socket", "structlog"}),
        ("nri_plugin.nri.handlers", {"asyncio", "socket", "structlog"}),
        ("nri_plugin.nri.identity", {"asyncio", "socket", "structlog"}),
    ],
)
def test_sans_io_modules_load_no_io(module: str, forbidden: set[str]) -> None:
    assert _modules_loaded_by(module) & forbidden == set()
