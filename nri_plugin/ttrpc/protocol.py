"""Sans-I/O ttrpc: frame codec and the per-connection rules of both roles.

Nothing here reads, writes, sleeps or knows about asyncio: bytes go in through `receive_data`,
events and bytes to write come out. The asyncio edge lives in `aio.py`.

Wire format (all integers big-endian)::

    length u32 | stream_id u32 | type u8 | flags u8 | data (length bytes)

`data` is a serialized `ttrpc.Request` (type 1) or `ttrpc.Response` (type 2). Only unary calls are
supported: Data frames (type 3, streaming) are refused.
"""

from __future__ import annotations

import enum
import struct
from collections import deque
from collections.abc import Callable, Iterable
from typing import Final, NamedTuple, cast

from google.protobuf.message import DecodeError

from nri_plugin.api.ttrpc import request_pb2
from nri_plugin.ttrpc import wire
from nri_plugin.ttrpc.buffer import NEED_DATA, FrameCutter, Header, NeedData
from nri_plugin.ttrpc.errors import (
    Code,
    LocalProtocolError,
    OversizedMessage,
    RemoteProtocolError,
)

__all__ = [
    "FLAG_NO_DATA",
    "FLAG_REMOTE_CLOSED",
    "FLAG_REMOTE_OPEN",
    "HEADER_SIZE",
    "LARGE_REQUEST",
    "MAX_DATA",
    "MAX_STREAM_ID",
    "NEED_DATA",
    "ClientEvent",
    "ClientSession",
    "Frame",
    "FrameDecoder",
    "MessageType",
    "NeedData",
    "OversizedFrame",
    "RequestReceived",
    "ResponseReceived",
    "ServerSession",
    "UnexpectedResponse",
    "encode_frame",
]

HEADER_SIZE: Final = 10
_HEADER = struct.Struct(">IIBB")

# Largest frame data either side accepts or sends (Go ttrpc's messageLengthMax). It also bounds the
# decoder's buffer: at most one header, one frame's data and one received chunk are ever held.
MAX_DATA: Final = 4 << 20

# Stream ids are u32 on the wire.
MAX_STREAM_ID: Final = 0xFFFF_FFFF

# Flags (meaning depends on the type). Unary calls, the only kind supported here, send 0.
FLAG_REMOTE_CLOSED: Final = 0x01  # Request/Data: sender sends nothing more on this stream
FLAG_REMOTE_OPEN: Final = 0x02  # Request: a streaming call, Data frames follow
FLAG_NO_DATA: Final = 0x04  # Data: the frame carries no payload


class MessageType(enum.IntEnum):
    REQUEST = 1
    RESPONSE = 2
    DATA = 3


_TYPES: Final = frozenset(MessageType)
# The type of a received header's raw byte: a dict lookup, where calling the enum costs a microsecond.
_TYPE_OF: Final = {member.value: member for member in MessageType}


# Status texts sent by the Go server for the same conditions; peers may log or compare them.
_MSG_EVEN_ID = "StreamID must be odd for client initiated streams"
_MSG_REUSED_ID = "StreamID cannot be re-used and must increment"
_MSG_DATA_FRAME = "StreamID is no longer active"


# The events and frames are named tuples: made once per message, where a frozen dataclass's
# generated __init__ costs four times the bytecodes.


class Frame(NamedTuple):
    """One whole ttrpc message."""

    stream_id: int
    type: MessageType
    flags: int
    data: bytes | memoryview  # a large frame: a view of the bytes received (`ReceiveBuffer.cut`)


class OversizedFrame(NamedTuple):
    """A header announced more than the decoder's limit; its data is being discarded unread."""

    stream_id: int
    type: MessageType
    flags: int
    length: int


def encode_frame(stream_id: int, type: MessageType | int, flags: int, data: bytes) -> bytes:
    """Header plus data; refuses data above `MAX_DATA`, like Go's sender, writing nothing."""
    if not 0 <= stream_id <= MAX_STREAM_ID:
        raise LocalProtocolError(f"stream id {stream_id} out of range")
    if type not in _TYPES or not 0 <= flags <= 0xFF:
        raise LocalProtocolError(f"bad frame type {type!r} or flags {flags!r}")
    return _frame(stream_id, type, flags, data)


def _frame(stream_id: int, type: MessageType | int, flags: int, data: bytes) -> bytes:
    """`encode_frame` for values known to fit (a stream id we numbered or received, a type and
    flags of our own): only the size is checked."""
    if len(data) > MAX_DATA:
        raise OversizedMessage(len(data), MAX_DATA)
    return _HEADER.pack(len(data), stream_id, type, flags) + data


class FrameDecoder:
    """Cuts a byte stream into `Frame`s.

    `receive_data(b"")` means EOF: a frame cut short by it is a `RemoteProtocolError`. After any
    `RemoteProtocolError` the decoder stays broken and raises the same error again. The frames are
    cut as the bytes arrive (`receive_frames`); `next_event` hands them out one at a time, and a
    break in the stream only once the frames before it are out.
    """

    def __init__(self, max_data: int = MAX_DATA) -> None:
        self._cutter = FrameCutter(_HEADER, length_field=0, check=_check_header, max_length=max_data)
        self._ready: deque[Frame | OversizedFrame] = deque()  # cut, not handed out yet
        self._eof = False
        self._failure: RemoteProtocolError | None = None  # found in the bytes, not raised yet
        self._error: RemoteProtocolError | None = None  # raised

    @property
    def buffered(self) -> int:
        """Bytes held while waiting for the rest of a frame."""
        return self._cutter.buffered

    def receive_data(self, data: bytes | memoryview) -> None:
        self._ready.extend(self._cut(data))

    def receive_frames(self, data: bytes | memoryview) -> list[Frame | OversizedFrame]:
        """`receive_data` and then `next_event` until `NEED_DATA`, in one call: every frame `data`
        completes, in order. A break in the stream raises at once (the frames before it are of no
        use: the connection is done for)."""
        frames = self._cut(data)
        if self._failure is not None:
            raise self._raise_failure()
        return frames

    def next_event(self) -> Frame | OversizedFrame | NeedData:
        if self._error is not None:
            raise self._broken()
        if self._ready:
            return self._ready.popleft()
        if self._failure is not None:
            raise self._raise_failure()
        if self._eof and self._cutter.inside_frame:
            self._failure = RemoteProtocolError("connection closed in the middle of a frame")
            raise self._raise_failure()
        return NEED_DATA

    def _cut(self, data: bytes | memoryview) -> list[Frame | OversizedFrame]:
        """The frames `data` completes; a break in the stream is kept in `_failure`, and nothing
        more is cut once there is one. An oversized frame is answered, and its data dropped unread
        as it arrives: the connection goes on."""
        if self._error is not None:
            raise self._broken()
        if self._eof:
            raise LocalProtocolError("receive_data after EOF")
        if not data:
            self._eof = True
            return []
        if self._failure is not None:  # broken for good: keep nothing more of the stream
            return []
        cut, failure = self._cutter.cut(data)
        if failure is not None:
            self._failure = cast(RemoteProtocolError, failure)
        frames: list[Frame | OversizedFrame] = []
        for (length, stream_id, raw_type, flags), payload in cut:
            if payload is None:
                frames.append(OversizedFrame(stream_id, _TYPE_OF[raw_type], flags, length))
            else:
                frames.append(Frame(stream_id, _TYPE_OF[raw_type], flags, payload))
        return frames

    def _raise_failure(self) -> RemoteProtocolError:
        """The break found in the stream, now raised: the decoder is broken from here on."""
        assert self._failure is not None
        self._error, self._failure = self._failure, None
        self._ready.clear()
        return self._error

    def _broken(self) -> RemoteProtocolError:
        return RemoteProtocolError(f"stream already broken: {self._error}")


def _check_header(header: Header) -> RemoteProtocolError | None:
    """A frame header's error, if any: a message type ttrpc does not have."""
    _, stream_id, raw_type, _ = header
    if raw_type not in _TYPE_OF:
        return RemoteProtocolError(f"unknown message type {raw_type} on stream {stream_id}")
    return None


# --- events --------------------------------------------------------------------------------------


class RequestReceived(NamedTuple):
    """A well-formed request on a fresh stream; answer it with `ServerSession.send_response`.
    `size`: the bytes of its ttrpc message data (the envelope and the payload in it). `payload`: for a
    large request (`LARGE_REQUEST` bytes or more), its payload, a view of the bytes received, kept out
    of `request` (whose ``payload`` is then empty); None: it is ``request.payload``."""

    stream_id: int
    request: request_pb2.Request
    size: int = 0
    payload: memoryview | None = None

    @property
    def data(self) -> bytes | memoryview:
        """The request's payload, wherever it is."""
        return self.payload if self.payload is not None else self.request.payload


class ResponseReceived(NamedTuple):
    """The outcome of a pending call. `code` 0 is OK and then `payload` is the reply message."""

    stream_id: int
    code: int
    message: str
    payload: bytes


class UnexpectedResponse(NamedTuple):
    """A response for a stream with no pending call (finished, abandoned, never sent)."""

    stream_id: int


ClientEvent = ResponseReceived | UnexpectedResponse


# upb parses any buffer, a view in place (the stubs say bytes): the parsers, typed once as they are.
_parse_request = cast(Callable[[bytes | memoryview], request_pb2.Request], request_pb2.Request.FromString)
_parse_response = cast(Callable[[bytes | memoryview], request_pb2.Response], request_pb2.Response.FromString)


def _response_message(stream_id: int, payload: bytes, code: int, message: str) -> bytes:
    """A response frame to a stream the peer opened (a valid id: it came in a header)."""
    # Like Go, success leaves the status out: an empty OK response is 0 bytes of data.
    if code == Code.OK:
        data = request_pb2.Response(payload=payload).SerializeToString()
    else:
        status = request_pb2.Status(code=code, message=message)
        data = request_pb2.Response(status=status, payload=payload).SerializeToString()
    return _frame(stream_id, MessageType.RESPONSE, 0, data)


# Requests at least this large (only Synchronize chunks are) keep their payload out of the envelope.
LARGE_REQUEST: Final = 64 * 1024

_PAYLOAD_FIELD: Final = 3  # ttrpc.Request.payload


def _split_payload(data: bytes | memoryview) -> tuple[bytes | memoryview, memoryview | None]:
    """A ttrpc.Request's bytes without its payload field, and the payload as a view of `data` (no
    copy of its megabytes: parsing the envelope would copy it once, and reading ``payload`` once
    more). Only a plainly well-formed envelope with one payload is split; any other comes back whole,
    with None, for the protobuf decoder to parse (or refuse) as it always does."""
    found = wire.fields(data)
    if found is None:
        return data, None
    payloads = [field for field in found if field.number == _PAYLOAD_FIELD]
    if len(payloads) != 1 or payloads[0].wire != wire.LEN:
        return data, None
    payload = payloads[0]
    envelope = b"".join((data[: payload.start], data[payload.end :]))
    return envelope, memoryview(data)[payload.begin : payload.end]


# --- server --------------------------------------------------------------------------------------


class ServerSession:
    """The server side of one ttrpc connection.

    Enforces the client's stream id rules and answers what it refuses by itself (queued for
    `messages_to_send`); requests that pass come out as `RequestReceived`, to be answered exactly
    once with `send_response`.
    """

    def __init__(self, max_data: int = MAX_DATA) -> None:
        self._decoder = FrameDecoder(max_data)
        self._max_data = max_data
        self._last_stream_id = 0
        self._active: set[int] = set()
        self._outbox: list[bytes] = []

    @property
    def active_streams(self) -> frozenset[int]:
        """Streams received and not yet answered."""
        return frozenset(self._active)

    def receive_data(self, data: bytes | memoryview) -> list[RequestReceived]:
        events: list[RequestReceived] = []
        for frame in self._decoder.receive_frames(data):
            event = self._handle(frame)
            if event is not None:
                events.append(event)
        return events

    def messages_to_send(self) -> list[bytes]:
        """Replies the session made itself, each one whole ttrpc message; clears the queue."""
        out, self._outbox = self._outbox, []
        return out

    def send_response(
        self, stream_id: int, *, payload: bytes = b"", code: int = Code.OK, message: str = ""
    ) -> bytes:
        """Encode the single response of an active stream.

        Raises `OversizedMessage` (the stream stays active, so it can still be answered with an
        error) or `LocalProtocolError` for a stream that is not waiting for an answer.
        """
        if stream_id not in self._active:
            raise LocalProtocolError(f"stream {stream_id} has no request waiting for a response")
        out = _response_message(stream_id, payload, code, message)
        self._active.discard(stream_id)
        return out

    def _reply(self, stream_id: int, code: Code, message: str) -> None:
        self._outbox.append(_response_message(stream_id, b"", code, message))

    def _handle(self, item: Frame | OversizedFrame) -> RequestReceived | None:
        # A client never sends responses; Go's server skips them, so do we.
        if item.type is MessageType.RESPONSE:
            return None
        if item.stream_id % 2 == 0:
            self._reply(item.stream_id, Code.INVALID_ARGUMENT, _MSG_EVEN_ID)
            return None
        if isinstance(item, OversizedFrame):
            # Answered on its stream; the connection stays usable (the data is skipped unread).
            status = OversizedMessage(item.length, self._max_data)
            self._reply(item.stream_id, Code.RESOURCE_EXHAUSTED, status.message)
            return None
        if item.type is MessageType.DATA:
            # No streaming calls here, so no stream is ever open for Data frames.
            self._reply(item.stream_id, Code.INVALID_ARGUMENT, _MSG_DATA_FRAME)
            return None
        return self._handle_request(item)

    def _handle_request(self, frame: Frame) -> RequestReceived | None:
        stream_id, data = frame.stream_id, frame.data
        if stream_id <= self._last_stream_id:
            self._reply(stream_id, Code.INVALID_ARGUMENT, _MSG_REUSED_ID)
            return None
        self._last_stream_id = stream_id
        size, payload = len(data), None
        if size >= LARGE_REQUEST:
            data, payload = _split_payload(data)
        try:
            request = _parse_request(data)
        except DecodeError as exc:
            self._reply(stream_id, Code.INTERNAL, f"ttrpc: error unmarshalling request: {exc}")
            return None
        self._active.add(stream_id)
        return RequestReceived(stream_id, request, size, payload)


# --- client --------------------------------------------------------------------------------------


class ClientSession:
    """The client side of one ttrpc connection: numbers calls and matches responses to them."""

    def __init__(self, max_data: int = MAX_DATA) -> None:
        self._decoder = FrameDecoder(max_data)
        self._max_data = max_data
        # Go's client starts at 1 and steps by 2: client streams are odd and must increase.
        self._next_stream_id = 1
        self._pending: set[int] = set()

    @property
    def pending_streams(self) -> frozenset[int]:
        return frozenset(self._pending)

    def send_request(
        self,
        service: str,
        method: str,
        payload: bytes,
        *,
        timeout_nano: int = 0,
        metadata: Iterable[tuple[str, str]] = (),
    ) -> tuple[int, bytes]:
        """Allocate the next stream id and encode the request; the caller must write it right away.

        An `OversizedMessage` does not use up the id, so ids on the wire still increase by 2.
        """
        stream_id = self._next_stream_id
        if stream_id > MAX_STREAM_ID:
            raise LocalProtocolError("stream ids exhausted on this connection")
        request = request_pb2.Request(
            service=service,
            method=method,
            payload=payload,
            timeout_nano=timeout_nano,
        )
        for key, value in metadata:
            request.metadata.add(key=key, value=value)
        out = _frame(stream_id, MessageType.REQUEST, 0, request.SerializeToString())
        self._next_stream_id += 2
        self._pending.add(stream_id)
        return stream_id, out

    def abandon(self, stream_id: int) -> None:
        """Stop waiting for a call (timed out, cancelled); its response, if any, becomes unexpected."""
        self._pending.discard(stream_id)

    def receive_data(self, data: bytes | memoryview) -> list[ClientEvent]:
        events: list[ClientEvent] = []
        for frame in self._decoder.receive_frames(data):
            event = self._handle(frame)
            if event is not None:
                events.append(event)
        return events

    def _handle(self, item: Frame | OversizedFrame) -> ClientEvent | None:
        # Server-initiated streams do not exist in ttrpc today; like Go, drop what is not a response.
        if item.type is not MessageType.RESPONSE:
            return None
        if item.stream_id not in self._pending:
            return UnexpectedResponse(stream_id=item.stream_id)
        self._pending.discard(item.stream_id)
        if isinstance(item, OversizedFrame):
            status = OversizedMessage(item.length, self._max_data)
            return ResponseReceived(
                stream_id=item.stream_id, code=status.code, message=status.message, payload=b""
            )
        return _decode_response(item)


def _decode_response(frame: Frame) -> ResponseReceived:
    try:
        response = _parse_response(frame.data)
    except DecodeError as exc:
        # Only this call fails: the framing is intact, so the connection can go on.
        return ResponseReceived(
            stream_id=frame.stream_id,
            code=Code.INTERNAL,
            message=f"ttrpc: error unmarshalling response: {exc}",
            payload=b"",
        )
    # An absent status, and a status with code 0, both mean OK (Go checks the code only if present).
    code: int = Code.OK
    message = ""
    if response.HasField("status"):
        code, message = response.status.code, response.status.message
    return ResponseReceived(stream_id=frame.stream_id, code=code, message=message, payload=response.payload)
