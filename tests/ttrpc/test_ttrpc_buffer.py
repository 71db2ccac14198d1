"""The receive buffer and the sentinel both sans-I/O decoders share, and what importing them loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nri_plugin.nri import mux
from nri_plugin.ttrpc import protocol
from nri_plugin.ttrpc.buffer import _COMPACT_MIN, HAND_OVER_MIN, NEED_DATA, NeedData, ReceiveBuffer
from nri_plugin.ttrpc.protocol import FrameDecoder, MessageType, encode_frame

ROOT = Path(__file__).resolve().parents[2]


def test_one_sentinel_for_both_decoders() -> None:
    assert protocol.NEED_DATA is mux.NEED_DATA is NEED_DATA
    assert protocol.NeedData is mux.NeedData is NeedData
    assert FrameDecoder().next_event() is NEED_DATA
    assert mux.MuxDecoder().next_event() is NEED_DATA
    assert mux.MuxDecoder().next_payload() is NEED_DATA


def test_buffer_takes_and_discards_from_the_front() -> None:
    buffer = ReceiveBuffer()
    buffer.append(b"hdr-payload-rest")
    assert buffer.take(4, 7) == b"payload"
    assert len(buffer) == 5
    assert buffer.discard(100) == 5
    assert len(buffer) == 0


def test_buffer_lets_go_of_its_memory_once_all_is_consumed() -> None:
    buffer = ReceiveBuffer()
    buffer.append(bytes(1 << 20))
    buffer.take(0, (1 << 20) - 1)
    assert buffer.held == 1 << 20  # one byte left: nothing is moved yet
    buffer.discard(1)
    assert buffer.held == 0


def test_buffer_drops_consumed_bytes_only_when_they_are_many() -> None:
    buffer = ReceiveBuffer()
    buffer.append(bytes(3 * _COMPACT_MIN))
    buffer.discard(10)
    buffer.append(b"x")
    assert buffer.held == 3 * _COMPACT_MIN + 1  # a few consumed bytes stay: no memmove per frame
    buffer.discard(2 * _COMPACT_MIN)
    buffer.append(b"y")
    assert buffer.held == len(buffer) == _COMPACT_MIN - 10 + 2


def test_the_ttrpc_decoder_lets_go_of_a_large_frame_once_delivered() -> None:
    decoder = FrameDecoder()
    wire = encode_frame(1, MessageType.REQUEST, 0, bytes(3 << 20))
    for start in range(0, len(wire), 65536):
        decoder.receive_data(wire[start : start + 65536])
    assert decoder.next_event() is not NEED_DATA
    assert decoder._buffer.held == 0


def test_a_large_frame_that_ends_the_bytes_received_is_handed_over_not_copied() -> None:
    buffer = ReceiveBuffer()
    body = bytes(range(256)) * (HAND_OVER_MIN // 256)
    buffer.append(b"hdr-" + body)
    taken = buffer.take(4, len(body))
    assert isinstance(taken, memoryview)  # the buffer's own memory, given up
    assert taken == body
    assert buffer.held == len(buffer) == 0
    buffer.append(b"next")  # the buffer goes on with fresh memory: the view stays as it was
    assert taken == body
    assert buffer.take(0, 4) == b"next"


@pytest.mark.parametrize(
    ("length", "after"),
    [(HAND_OVER_MIN - 1, b""), (HAND_OVER_MIN, b"more")],
    ids=["small", "followed-by-more"],
)
def test_other_frames_are_copied_out(length: int, after: bytes) -> None:
    buffer = ReceiveBuffer()
    buffer.append(bytes(length) + after)
    taken = buffer.take(0, length)
    assert type(taken) is bytes
    assert taken == bytes(length)
    assert buffer.take(0, len(after)) == after


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
    assert trunk._buffer.held == decoder._buffer.held == 0


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
        ("nri_plugin.nri.events", {"asyncio", "socket", "structlog"}),
        ("nri_plugin.nri.handlers", {"asyncio", "socket", "structlog"}),
        ("nri_plugin.nri.identity", {"asyncio", "socket", "structlog"}),
    ],
)
def test_sans_io_modules_load_no_io(module: str, forbidden: set[str]) -> None:
    assert _modules_loaded_by(module) & forbidden == set()
