"""What the hostile-input suite and the long fuzz run (fuzz/long_run.py) share, without hypothesis.

The Plugin service's request and response types, the hostile values both draw from (path and name
tricks, cpu lists, int64 edges), and small reference parsers of ttrpc and mux traffic that read the
whole input at once, with the incremental decoders driven the same way for comparison. The fuzz run
imports this module by putting tests/hostile on sys.path, so it must need nothing but the project.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

from google.protobuf.message import Message

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.nri.mux import MAX_PAYLOAD, MuxDecoder, MuxFrame, MuxProtocolError
from nri_plugin.nri.mux import NEED_DATA as MUX_NEED_DATA
from nri_plugin.nri.routes import DEDICATED_METHODS
from nri_plugin.ttrpc.errors import ProtocolError
from nri_plugin.ttrpc.protocol import NEED_DATA, Frame, FrameDecoder, OversizedFrame

TTRPC_HEADER = struct.Struct(">IIBB")  # length, stream id, type, flags
MUX_HEADER = struct.Struct(">II")  # connection id, length
SMALL_LIMIT = 64  # a frame limit that small inputs can exceed

# Every method of the Plugin service and its request type (served or not by our plugin).
REQUEST_TYPES: dict[str, type[Message]] = {
    "Configure": api.ConfigureRequest,
    "Synchronize": api.SynchronizeRequest,
    "Shutdown": api.Empty,
    "StateChange": api.StateChangeEvent,
    "CreateContainer": api.CreateContainerRequest,
    "UpdateContainer": api.UpdateContainerRequest,
    "StopContainer": api.StopContainerRequest,
    "UpdatePodSandbox": api.UpdatePodSandboxRequest,
    "ValidateContainerAdjustment": api.ValidateContainerAdjustmentRequest,
    **{name: request for name, request, _response in DEDICATED_METHODS.values()},
}
RESPONSE_TYPES: dict[str, type[Message]] = {
    "Configure": api.ConfigureResponse,
    "Synchronize": api.SynchronizeResponse,
    "Shutdown": api.Empty,
    "StateChange": api.Empty,
    "CreateContainer": api.CreateContainerResponse,
    "UpdateContainer": api.UpdateContainerResponse,
    "StopContainer": api.StopContainerResponse,
    "UpdatePodSandbox": api.UpdatePodSandboxResponse,
    "ValidateContainerAdjustment": api.ValidateContainerAdjustmentResponse,
    **{name: response for name, _request, response in DEDICATED_METHODS.values()},
}

# Pieces that path, id and name parsers have to refuse, or at least not misread.
TRICKS = (
    "..",
    ".",
    "/",
    "//",
    "\0",
    "\n",
    "\r\n",
    "\t",
    " ",
    "\\",
    "\u2215",  # DIVISION SLASH
    "\u2044",  # FRACTION SLASH
    "\uff0f",  # FULLWIDTH SOLIDUS
    "\uff0e",  # FULLWIDTH FULL STOP
    "\u2024",  # ONE DOT LEADER
    "\u202e",  # RIGHT-TO-LEFT OVERRIDE
    "\u200b",  # ZERO WIDTH SPACE
    "\ufeff",  # BYTE ORDER MARK
    "\u0430",  # CYRILLIC SMALL LETTER A (looks like a)
    "%2e%2e",
    "%2f",
    "~",
    "*",
    "$(id)",
    "`id`",
    ";",
    "'",
    '"',
    ":",
    "@",
    ".slice",
    "-.slice",
    ".scope",
    "kubepods",
    "pod",
    "crio-",
    "proc",
    "sys",
    "etc",
)

# Cpu lists a pod spec cannot write but a confused runtime might send.
CPU_LISTS = (
    "",
    "0-999999999",
    "0-4294967296",
    "99999999999999999999",
    "4-5",
    "0-1,4-5",
    "5-4",
    "-1",
    "1-",
    "0,,1",
    "0-1\n",
    " 4-5",
    "\u0664-\u0665",  # Arabic-Indic digits
    "\uff14-\uff15",  # fullwidth digits
    "0x4",
    "4-5,",
)

INT64_EDGES = (0, -1, 1, -(2**63), 2**63 - 1, 2**31, -(2**31), 100_000, 1_000_000, 999_999_999_999)


# -- reference parsers, and the incremental decoders fed the same way ------------------------------------


def ttrpc_reference(data: bytes, limit: int, eof: bool) -> tuple[list[tuple[Any, ...]], bool]:
    """(events, failed) for the whole stream at once."""
    events: list[tuple[Any, ...]] = []
    at = 0
    while True:
        if len(data) - at < TTRPC_HEADER.size:
            return events, eof and at < len(data)
        length, stream_id, type_, flags = TTRPC_HEADER.unpack_from(data, at)
        if type_ not in (1, 2, 3):
            return events, True
        end = at + TTRPC_HEADER.size + length
        if length > limit:
            events.append(("oversized", stream_id, type_, flags, length))
        elif end <= len(data):
            events.append(("frame", stream_id, type_, flags, data[at + TTRPC_HEADER.size : end]))
        if end > len(data):
            return events, eof
        at = end


def ttrpc_incremental(chunks: Iterable[bytes], limit: int, eof: bool) -> tuple[list[tuple[Any, ...]], bool]:
    """(events, failed) of a `FrameDecoder` fed `chunks` (then EOF when `eof`).

    Raises AssertionError (also under ``python -O``) when the decoder gives something other than a
    frame or holds more than one frame's data and one chunk."""
    decoder = FrameDecoder(limit)
    events: list[tuple[Any, ...]] = []
    try:
        for chunk in [*chunks, *([b""] if eof else [])]:
            decoder.receive_data(chunk)
            while (item := decoder.next_event()) is not NEED_DATA:
                if isinstance(item, OversizedFrame):
                    events.append(("oversized", item.stream_id, item.type, item.flags, item.length))
                elif isinstance(item, Frame):
                    events.append(("frame", item.stream_id, item.type, item.flags, item.data))
                else:
                    raise AssertionError(f"decoder gave {item!r}")
                # Never more than one frame's data and one chunk held.
                if decoder.buffered > TTRPC_HEADER.size + limit + len(chunk):
                    raise AssertionError(f"decoder holds {decoder.buffered} bytes")
    except ProtocolError:
        return events, True
    return events, False


def mux_reference(data: bytes, eof: bool) -> tuple[list[MuxFrame], bool]:
    """(frames, failed) for the whole wire at once."""
    frames: list[MuxFrame] = []
    at = 0
    while True:
        if len(data) - at < MUX_HEADER.size:
            return frames, eof and at < len(data)
        conn_id, length = MUX_HEADER.unpack_from(data, at)
        if conn_id == 0 or length > MAX_PAYLOAD:
            return frames, True
        end = at + MUX_HEADER.size + length
        if end > len(data):
            return frames, eof
        frames.append(MuxFrame(conn_id=conn_id, payload=data[at + MUX_HEADER.size : end]))
        at = end


def mux_incremental(chunks: Iterable[bytes], eof: bool) -> tuple[list[MuxFrame], bool]:
    """(frames, failed) of a `MuxDecoder` fed `chunks` (then EOF when `eof`)."""
    decoder = MuxDecoder()
    frames: list[MuxFrame] = []
    try:
        for chunk in [*chunks, *([b""] if eof else [])]:
            decoder.receive_data(chunk)
            while (event := decoder.next_event()) is not MUX_NEED_DATA:
                if not isinstance(event, MuxFrame):
                    raise AssertionError(f"decoder gave {event!r}")
                frames.append(event)
    except MuxProtocolError:
        return frames, True
    return frames, False
