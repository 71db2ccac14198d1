"""NRI connection multiplexer, the sans-I/O codec: several byte streams over one unix socket.

NRI runs two ttrpc connections over one socket (the "trunk"). Every piece of a
connection's byte stream travels in a mux frame::

    conn_id  u32 big-endian   1 = Plugin service, 2 = Runtime service, 0 reserved
    length   u32 big-endian   payload size
    payload  length bytes     a slice of that connection's stream (no message boundaries)

There is no open or close signalling: each side just uses ids 1 and 2, frames for
an id nobody uses are dropped, and closing the socket closes everything.

This module touches neither sockets nor asyncio: bytes in, frames out (:func:`encode`,
:class:`MuxDecoder`), in the style of h11 (``receive_data`` / ``next_event`` / ``NEED_DATA``),
with the frame cutter and the sentinel of the ttrpc decoder it sits under
(`nri_plugin.ttrpc.buffer`). The asyncio edge, the `Trunk` over the socket, is
`nri_plugin.nri.mux`.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass
from typing import Final, cast

from nri_plugin.ttrpc.buffer import NEED_DATA, FrameCutter, Header, NeedData
from nri_plugin.ttrpc.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "FIRST_FRAME_MAX",
    "HEADER_SIZE",
    "MAX_PAYLOAD",
    "NEED_DATA",
    "PLUGIN_SERVICE_CONN",
    "RUNTIME_SERVICE_CONN",
    "LocalMuxError",
    "MuxDecoder",
    "MuxFrame",
    "MuxProtocolError",
    "NeedData",
    "check_conn_id",
    "encode",
]

HEADER_SIZE: Final = 8
PLUGIN_SERVICE_CONN: Final = 1
RUNTIME_SERVICE_CONN: Final = 2

# Connection id 0 is reserved by the Go mux (Open(0) fails); it never appears on the wire.
_RESERVED_CONN: Final = 0
_MAX_CONN_ID: Final = 0xFFFF_FFFF

# The Go writer (NRI >= v0.7.0) splits any write longer than this into several frames. It is one
# whole ttrpc message: 10-byte ttrpc header + 4 MiB data. Go peers never send a longer frame, and
# since a frame is buffered whole before it is delivered, this is also our bound on the memory one
# incomplete frame may hold: a header announcing more is a protocol error, refused before any of
# its payload is buffered.
MAX_PAYLOAD: Final = 10 + (4 << 20)

# A Go peer reads each frame either into its 4096-byte bufio buffer or into the rest of the
# message it is assembling, and fails (ENOMEM, connection dropped) on a frame longer than the
# space it offers. Go's own writer goes through a 4096-byte bufio.Writer, so every message leaves
# as its first min(4096, len) bytes, then all the rest in one more frame. We copy that split
# exactly, which is always acceptable to a Go reader.
FIRST_FRAME_MAX: Final = 4096

_HEADER: Final = struct.Struct(">II")


# Both errors join the ttrpc package's two-sided taxonomy, so one `except ProtocolError` covers
# the whole stack.
class MuxProtocolError(RemoteProtocolError):
    """The peer broke the mux framing (reserved connection id, frame over the size cap,
    connection closed in the middle of a frame). The trunk cannot be used any more."""


class LocalMuxError(LocalProtocolError):
    """We asked for something the mux cannot do (connection id 0 or out of range, a channel
    registered twice, data fed to a decoder after end of file). A bug in the caller."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MuxFrame:
    """One mux frame, as received."""

    conn_id: int
    """Logical connection the payload belongs to (never 0)."""
    payload: bytes
    """A slice of that connection's byte stream; may be empty."""


def check_conn_id(conn_id: int) -> None:
    """Refuse (`LocalMuxError`) a connection id that is reserved (0) or does not fit in 32 bits."""
    if not _RESERVED_CONN < conn_id <= _MAX_CONN_ID:
        raise LocalMuxError(f"mux connection id {conn_id} is reserved or out of range")


def encode(conn_id: int, message: bytes | bytearray | memoryview) -> list[bytes]:
    """Frame one whole message (normally one ttrpc message) for *conn_id*, as Go sends it.

    The first ``min(FIRST_FRAME_MAX, len(message))`` bytes go in one frame and the whole
    rest, if any, in a second one; the rest is split again only where it exceeds
    :data:`MAX_PAYLOAD`. Write the returned frames in order and without bytes of any other
    message in between.

    An empty message gives no frames (Go's bufio.Writer writes nothing for it either). ttrpc
    messages always have a 10-byte header, so this never happens in practice.

    :raises LocalMuxError: *conn_id* is 0 or does not fit in 32 bits.
    """
    check_conn_id(conn_id)
    if len(message) <= FIRST_FRAME_MAX:  # most messages: one frame
        return [_HEADER.pack(conn_id, len(message)) + message] if message else []
    view = memoryview(message)
    chunks = [view[:FIRST_FRAME_MAX]] if len(view) else []
    for start in range(FIRST_FRAME_MAX, len(view), MAX_PAYLOAD):
        chunks.append(view[start : start + MAX_PAYLOAD])
    return [_HEADER.pack(conn_id, len(chunk)) + chunk for chunk in chunks]


class MuxDecoder:
    """Sans-I/O mux frame reader.

    Feed bytes with :meth:`receive_data` (``b""`` means end of file), then call
    :meth:`next_event` until it returns :data:`NEED_DATA`. Any error is a
    :class:`MuxProtocolError`; once one was raised, every later :meth:`next_event` raises
    again. After end of file with every frame consumed, :meth:`next_event` keeps returning
    :data:`NEED_DATA` and :attr:`eof` is true.

    The frames are cut from the bytes as they arrive (a `FrameCutter`: a read of whole frames
    keeps nothing); :meth:`next_event` hands them out, and an error in the stream only once the
    frames before it are out.
    """

    def __init__(self) -> None:
        self._cutter = FrameCutter(_HEADER, length_field=1, check=_check_header)
        self._ready: deque[tuple[int, bytes | memoryview]] = deque()  # cut, not handed out yet
        self._eof = False
        self._failure: MuxProtocolError | None = None  # found in the bytes, not raised yet
        self._error: MuxProtocolError | None = None  # raised

    @property
    def eof(self) -> bool:
        """True once end of file was fed."""
        return self._eof

    @property
    def buffered(self) -> int:
        """Bytes held while waiting for the rest of a frame."""
        return self._cutter.buffered

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Cut the frames `data` completes (copied: `data` may be reused once this returns);
        ``b""`` marks end of file.

        :raises LocalMuxError: non-empty data after end of file.
        """
        if not data:
            self._eof = True
            return
        if self._eof:
            raise LocalMuxError("data received after end of file")
        if self._failure is not None or self._error is not None:
            return  # broken for good: keep nothing more of the stream
        cut, failure = self._cutter.cut(data)
        for (conn_id, _), payload in cut:
            assert payload is not None  # (no frame is dropped: `_check_header` refuses a long one)
            self._ready.append((conn_id, payload))
        if failure is not None:
            self._failure = cast(MuxProtocolError, failure)

    def next_event(self) -> MuxFrame | NeedData:
        """Return the next whole frame, or :data:`NEED_DATA`.

        :raises MuxProtocolError: the peer sent a frame on connection 0 or longer than
            :data:`MAX_PAYLOAD`, or closed the trunk in the middle of a frame.
        """
        found = self.next_payload()
        if found is NEED_DATA:
            return NEED_DATA
        return MuxFrame(conn_id=found[0], payload=bytes(found[1]))

    def next_payload(self) -> tuple[int, bytes | memoryview] | NeedData:
        """:meth:`next_event` as a plain ``(conn_id, payload)`` pair (what the `Trunk` uses:
        one object fewer per frame)."""
        if self._error is not None:
            raise MuxProtocolError(f"mux stream already failed: {self._error}")
        if self._ready:
            return self._ready.popleft()
        if self._failure is None and self._eof and self._cutter.inside_frame:
            self._failure = self._cut_short()
        if self._failure is not None:
            self._error, self._failure = self._failure, None
            raise self._error
        return NEED_DATA

    def _cut_short(self) -> MuxProtocolError:
        """The error for a frame cut short by end of file."""
        available = self._cutter.buffered
        if available < HEADER_SIZE:
            return MuxProtocolError(f"trunk closed inside a frame header ({available} of 8 bytes)")
        _, length = self._cutter.kept_header()
        return MuxProtocolError(
            f"trunk closed inside a frame ({available - HEADER_SIZE} of {length} payload bytes)"
        )


def _check_header(header: Header) -> MuxProtocolError | None:
    """A frame header's error, if any: the reserved connection id, or a length over the cap (known
    before any of the payload is kept)."""
    conn_id, length = header
    if conn_id == _RESERVED_CONN or length > MAX_PAYLOAD:
        return _header_error(conn_id, length)
    return None


def _header_error(conn_id: int, length: int) -> MuxProtocolError:
    if conn_id == _RESERVED_CONN:
        return MuxProtocolError("frame on reserved mux connection id 0")
    return MuxProtocolError(f"mux frame of {length} bytes is over the {MAX_PAYLOAD}-byte cap")
