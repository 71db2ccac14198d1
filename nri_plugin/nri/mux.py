"""NRI connection multiplexer: several byte streams over one unix socket.

NRI runs two ttrpc connections over one socket (the "trunk"). Every piece of a
connection's byte stream travels in a mux frame::

    conn_id  u32 big-endian   1 = Plugin service, 2 = Runtime service, 0 reserved
    length   u32 big-endian   payload size
    payload  length bytes     a slice of that connection's stream (no message boundaries)

There is no open or close signalling: each side just uses ids 1 and 2, frames for
an id nobody uses are dropped, and closing the socket closes everything.

The module has two halves:

* a sans-I/O core (:func:`encode`, :class:`MuxDecoder`) that touches neither
  sockets nor asyncio: bytes in, frames out, in the style of h11
  (``receive_data`` / ``next_event`` / ``NEED_DATA``), with the buffer and the
  sentinel of the ttrpc decoder it sits under (`nri_plugin.ttrpc.buffer`);
* a thin asyncio edge (:class:`Trunk`, :func:`open_unix`, :func:`adopt_socket`)
  that feeds the socket's bytes to the decoder and hands each frame's payload to
  the receiver registered for its connection id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol, cast

from nri_plugin.common import heap
from nri_plugin.ttrpc.buffer import HAND_OVER_MIN, NEED_DATA, NeedData, ReceiveBuffer
from nri_plugin.ttrpc.errors import LocalProtocolError, RemoteProtocolError
from nri_plugin.ttrpc.logbudget import LogBudget, suppressed_note

__all__ = [
    "FIRST_FRAME_MAX",
    "HEADER_SIZE",
    "MAX_PAYLOAD",
    "NEED_DATA",
    "PLUGIN_SERVICE_CONN",
    "READ_BUFFER_SIZE",
    "RUNTIME_SERVICE_CONN",
    "WRITE_HIGH_WATER",
    "WRITE_LOW_WATER",
    "ChannelReceiver",
    "LocalMuxError",
    "MuxDecoder",
    "MuxFrame",
    "MuxProtocolError",
    "NeedData",
    "Trunk",
    "adopt_socket",
    "encode",
    "open_unix",
]

logger = logging.getLogger(__name__)

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

# The trunk reads the socket into one buffer of this size, the same for every read (asyncio's own
# reads allocate a fresh 256 KiB each time: above glibc's mmap threshold, so an mmap, mremap and
# munmap per small message). A 4 MiB Synchronize message takes 64 reads.
READ_BUFFER_SIZE: Final = 64 * 1024

# Once this many bytes arrived in large frames (at least _LARGE_FRAME: the bulk of a message of
# more than 4 KiB + 64 KiB; only Synchronize sends such messages, 4 MiB or smaller chunks), the C
# heap's free memory is given back to the system once they have been handled
# (`heap.release_free_memory`): without it the megabytes that held them stay in the process for good.
_RELEASE_AFTER: Final = 1 << 20
_LARGE_FRAME: Final = 64 * 1024
# How long after the last large frame: a chunked Synchronize's next message is on its way.
_RELEASE_DELAY: Final = 0.1

# The transport's write buffer, in bytes, above which the trunk stops reading (see `Trunk`) and
# below which it reads again. The high mark is above a Synchronize answer of a thousand updates.
WRITE_HIGH_WATER: Final = 1 << 20
WRITE_LOW_WATER: Final = 256 * 1024


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


def _check_conn_id(conn_id: int) -> None:
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
    if not _RESERVED_CONN < conn_id <= _MAX_CONN_ID:  # (`_check_conn_id`, without a call per message)
        raise LocalMuxError(f"mux connection id {conn_id} is reserved or out of range")
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

    The frames are cut from the bytes as they arrive, in one loop over them (a read of whole
    frames keeps nothing); :meth:`next_event` hands them out, and an error in the stream only
    once the frames before it are out.
    """

    def __init__(self) -> None:
        self._buffer = ReceiveBuffer()  # the start of a frame not whole yet
        self._ready: deque[tuple[int, bytes | memoryview]] = deque()  # cut, not handed out yet
        self._eof = False
        self._failure: MuxProtocolError | None = None  # found in the bytes, not raised yet
        self._error: MuxProtocolError | None = None  # raised

    @property
    def eof(self) -> bool:
        """True once end of file was fed."""
        return self._eof

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
        buffer, ready = self._buffer, self._ready
        joined = buffer.join(data)
        pos, end = 0, len(joined)
        while end - pos >= HEADER_SIZE:
            # The header is checked as soon as it is complete, before any of the payload is kept.
            conn_id, length = _HEADER.unpack_from(joined, pos)
            if conn_id == _RESERVED_CONN or length > MAX_PAYLOAD:
                self._failure = _header_error(conn_id, length)
                break
            begin = pos + HEADER_SIZE
            if begin + length > end:
                break
            pos = begin + length
            if length < HAND_OVER_MIN:  # (`ReceiveBuffer.cut`, without a call per frame)
                ready.append((conn_id, bytes(joined[begin:pos])))
            else:
                ready.append((conn_id, buffer.cut(joined, begin, pos, data)))
        if pos < end:
            buffer.keep(joined, pos, data)

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
        """:meth:`next_event` as a plain ``(conn_id, payload)`` pair (what :class:`Trunk` uses:
        one object fewer per frame)."""
        if self._error is not None:
            raise MuxProtocolError(f"mux stream already failed: {self._error}")
        if self._ready:
            return self._ready.popleft()
        if self._failure is None and self._eof and self._buffer:
            self._failure = self._cut_short()
        if self._failure is not None:
            self._error, self._failure = self._failure, None
            raise self._error
        return NEED_DATA

    def _cut_short(self) -> MuxProtocolError:
        """The error for a frame cut short by end of file."""
        available = len(self._buffer)
        if available < HEADER_SIZE:
            return MuxProtocolError(f"trunk closed inside a frame header ({available} of 8 bytes)")
        _, length = self._buffer.unpack(_HEADER)
        return MuxProtocolError(
            f"trunk closed inside a frame ({available - HEADER_SIZE} of {length} payload bytes)"
        )


def _header_error(conn_id: int, length: int) -> MuxProtocolError:
    if conn_id == _RESERVED_CONN:
        return MuxProtocolError("frame on reserved mux connection id 0")
    return MuxProtocolError(f"mux frame of {length} bytes is over the {MAX_PAYLOAD}-byte cap")


# --------------------------------------------------------------------------------------------
# asyncio edge


class ChannelReceiver(Protocol):
    """What :meth:`Trunk.channel` delivers one connection's bytes to (e.g. a ttrpc endpoint)."""

    def data_received(self, data: bytes | memoryview) -> None:
        """Next piece of the connection's byte stream (never empty)."""

    def connection_lost(self, exc: Exception | None) -> None:
        """The trunk closed: ``None`` after a clean end of file or a local close."""


class Trunk(asyncio.BufferedProtocol):
    """The asyncio side of the mux: one unix stream socket carrying several connections.

    Register a receiver per connection id with :meth:`channel`, which returns that
    connection's ``send(message)`` function (the same as ``trunk.send(conn_id, message)``).
    Frames for ids nobody registered are dropped, as the Go mux does, so register the
    channels before anything can arrive for them: right after :func:`open_unix` /
    :func:`adopt_socket` return, before the next ``await``.

    End of file, a transport error, a :class:`MuxProtocolError` from the peer, an exception
    out of a receiver's ``data_received`` or :meth:`close` all close the whole trunk: the
    transport is closed and every receiver's ``connection_lost`` is called exactly once
    (with ``None`` for end of file and :meth:`close`, with the error otherwise; see
    :attr:`exception`). Messages sent from then on are dropped silently, since the receivers
    have already been told. :attr:`closed` is set once the socket itself is closed.

    Write backpressure: a peer that sends requests but stops reading our answers would have them
    pile up in the transport's write buffer without end. Once that buffer holds more than
    `WRITE_HIGH_WATER` bytes (asyncio calls ``pause_writing``) the trunk stops reading the socket
    and stops delivering the frames it has already read, so no new request is taken and no new
    answer made, until the peer has read it down to `WRITE_LOW_WATER` (``resume_writing``);
    :meth:`drain` waits for that, for writers of our own (unsolicited updates). The peer's unread
    requests then wait in its own socket buffer.

    The socket is read into one reusable buffer of `READ_BUFFER_SIZE` bytes (an
    `asyncio.BufferedProtocol`); :meth:`data_received` takes bytes fed by hand.
    """

    def __init__(self) -> None:
        self._decoder = MuxDecoder()
        self._read_view = memoryview(bytearray(READ_BUFFER_SIZE))
        self._large_bytes = 0  # received in large frames since the last release of memory
        self._release: asyncio.TimerHandle | None = None
        self._receivers: dict[int, ChannelReceiver] = {}
        self._transport: asyncio.Transport | None = None
        self._shutting_down = False
        self._exception: Exception | None = None
        self._unheard_log = LogBudget()  # frames for connections nobody opened: a few lines, then a count
        self._writable = asyncio.Event()  # clear while the peer lets our answers pile up unread
        self._writable.set()
        self._paused = False  # `_writable` cleared: a plain flag for the loop of every read
        self.closed = asyncio.Event()
        """Set when the trunk is closed for good; do not set it yourself."""

    @property
    def exception(self) -> Exception | None:
        """The error that closed the trunk, or ``None`` (still open, end of file, or closed)."""
        return self._exception

    def channel(self, conn_id: int, receiver: ChannelReceiver) -> Callable[[bytes], None]:
        """Deliver *conn_id*'s bytes to *receiver*; return the function sending on *conn_id*.

        ``send(message)`` frames one whole message with :func:`encode` and writes all its
        frames in one go, so frames of two messages never interleave.

        If the trunk is already closed, *receiver*'s ``connection_lost`` is called soon
        (from the event loop, not from inside this call).

        :raises LocalMuxError: *conn_id* is 0, out of range, or already registered.
        """
        _check_conn_id(conn_id)
        if conn_id in self._receivers:
            raise LocalMuxError(f"mux connection {conn_id} already has a receiver")
        if self._shutting_down:
            asyncio.get_running_loop().call_soon(_tell_lost, receiver, self._exception)
        else:
            self._receivers[conn_id] = receiver

        def send(message: bytes) -> None:
            self.send(conn_id, message)

        return send

    def send(self, conn_id: int, message: bytes) -> None:
        """Send one whole message on *conn_id*: all of :func:`encode`'s frames in one write.

        Dropped silently once the trunk is closed.

        :raises LocalMuxError: *conn_id* is 0 or out of range.
        :raises RuntimeError: the transport is not connected yet (only possible for a
            :class:`Trunk` built by hand, not for one from :func:`open_unix` / :func:`adopt_socket`).
        """
        if not _RESERVED_CONN < conn_id <= _MAX_CONN_ID:  # (`_check_conn_id`, without a call per message)
            raise LocalMuxError(f"mux connection id {conn_id} is reserved or out of range")
        if self._shutting_down:
            logger.debug("mux conn %d: trunk closed, dropping a %d-byte message", conn_id, len(message))
            return
        if self._transport is None:
            raise RuntimeError("trunk is not connected yet")
        if 0 < len(message) <= FIRST_FRAME_MAX:
            # Most messages: one frame, as `encode` makes it, written without a list of one (the
            # transport's writelines would join it: one more copy and call).
            self._transport.write(_HEADER.pack(conn_id, len(message)) + message)
        elif message:
            # A write per frame, not writelines: on Python 3.12.0 to 3.13.0 a socket transport's
            # writelines never pauses its protocol past the high-water mark, and a peer that stopped
            # reading would make our write buffer grow without bound.
            for frame in encode(conn_id, message):
                self._transport.write(frame)

    def close(self) -> None:
        """Close the trunk (idempotent). Receivers get ``connection_lost(None)``."""
        self._shut_down(None)

    async def wait_closed(self) -> None:
        """Wait until the trunk is closed."""
        await self.closed.wait()

    @property
    def writing_paused(self) -> bool:
        """True while the write buffer is over `WRITE_HIGH_WATER` (reading is paused meanwhile)."""
        return self._paused

    async def drain(self) -> None:
        """Wait until the peer has read our backlog down to `WRITE_LOW_WATER` (at once when it has,
        or when the trunk is closed)."""
        if self._writable.is_set() or self._shutting_down:
            return
        closed = asyncio.ensure_future(self.closed.wait())
        writable = asyncio.ensure_future(self._writable.wait())
        try:
            await asyncio.wait((closed, writable), return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            writable.cancel()

    # asyncio.Protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        if self._shutting_down:
            self._transport.close()
            return
        with contextlib.suppress(NotImplementedError):  # a transport without flow control (a test's)
            self._transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=WRITE_LOW_WATER)

    def pause_writing(self) -> None:
        """The peer is not reading what we write: stop reading its requests until it does."""
        self._writable.clear()
        self._paused = True
        if self._transport is not None and not self._shutting_down:
            logger.warning(
                "NRI peer is not reading our answers (%d bytes unread): its requests wait until it does",
                self._transport.get_write_buffer_size(),
            )
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._writable.set()
        self._paused = False
        if self._transport is not None and not self._shutting_down:
            logger.info("NRI peer reads our answers again: reading its requests again")
            self._transport.resume_reading()
            self._dispatch()  # what was read before the pause first

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read_view

    def buffer_updated(self, nbytes: int) -> None:
        if self._shutting_down or not nbytes:
            return
        self._decoder.receive_data(self._read_view[:nbytes])
        self._dispatch()

    def data_received(self, data: bytes | memoryview) -> None:
        """Feed bytes as if read from the socket (the transport itself uses `buffer_updated`)."""
        if self._shutting_down:
            return
        self._decoder.receive_data(data)
        self._dispatch()

    def eof_received(self) -> bool | None:
        if not self._shutting_down:
            self._decoder.receive_data(b"")
            self._dispatch()  # a frame cut short by end of file closes the trunk with an error
            self._shut_down(None)
        return None  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._shut_down(exc)
        self._writable.set()  # nothing more to wait for: drain() returns
        self._paused = False
        if self._release is not None or self._large_bytes:
            # Large messages came (a Synchronize, cut short or not): once the receivers have let go
            # of them, the heap's free memory goes back to the system, trunk or no trunk.
            if self._release is not None:
                self._release.cancel()
                self._release = None
            self._large_bytes = 0
            try:
                asyncio.get_running_loop().call_later(_RELEASE_DELAY, heap.release_free_memory)
            except RuntimeError:  # called by hand, outside a loop
                heap.release_free_memory()
        self.closed.set()

    # internals

    def _dispatch(self) -> None:
        # While writing is paused, frames already read wait in the decoder too (`resume_writing`
        # delivers them): a single read of many small requests must not make answers past the mark.
        decoder = self._decoder
        while not self._shutting_down and not self._paused:
            try:
                found = decoder.next_payload()
            except MuxProtocolError as exc:
                logger.warning("NRI mux protocol error, closing the trunk: %s", exc)
                self._shut_down(exc)
                return
            if found is NEED_DATA:
                return
            self._deliver(found[0], found[1])

    def _deliver(self, conn_id: int, payload: bytes | memoryview) -> None:
        receiver = self._receivers.get(conn_id)
        if receiver is None:
            suppressed = self._unheard_log.take()
            if suppressed is not None:
                logger.debug(
                    "mux conn %d: nobody listens, dropping %d bytes%s",
                    conn_id,
                    len(payload),
                    suppressed_note(suppressed),
                )
            return
        if not payload:
            # An empty frame carries nothing, and b"" means end of file to a sans-I/O receiver.
            return
        try:
            receiver.data_received(payload)
        except Exception as exc:
            logger.exception("mux conn %d: receiver failed, closing the trunk", conn_id)
            self._shut_down(exc)
        if len(payload) >= _LARGE_FRAME:
            self._large_bytes += len(payload)
            if self._large_bytes >= _RELEASE_AFTER or self._release is not None:
                self._release_memory_soon()

    def _release_memory_soon(self) -> None:
        """Give the heap's free memory back a moment after the last large frame was handled (a
        handler that never waits has already answered; one that waits is done well within that)."""
        if self._release is not None:
            self._release.cancel()
        self._release = asyncio.get_running_loop().call_later(_RELEASE_DELAY, self._release_memory)

    def _release_memory(self) -> None:
        self._release = None
        self._large_bytes = 0
        heap.release_free_memory()

    def _shut_down(self, exc: Exception | None) -> None:
        if self._shutting_down:
            return
        self._shutting_down = True
        self._exception = exc
        transport = self._transport
        if transport is None:
            self.closed.set()
        elif exc is None:
            transport.close()  # flush what we already wrote, then close
        else:
            transport.abort()
        receivers = list(self._receivers.values())
        self._receivers.clear()
        for receiver in receivers:
            _tell_lost(receiver, exc)


def _tell_lost(receiver: ChannelReceiver, exc: Exception | None) -> None:
    try:
        receiver.connection_lost(exc)
    except Exception:
        logger.exception("mux receiver %r failed in connection_lost", receiver)


async def open_unix(path: str | os.PathLike[str]) -> Trunk:
    """Connect to the runtime's NRI socket (e.g. ``/var/run/nri/nri.sock``)."""
    loop = asyncio.get_running_loop()
    _, trunk = await loop.create_unix_connection(Trunk, os.fspath(path))
    return trunk


async def adopt_socket(sock: socket.socket) -> Trunk:
    """Run a trunk over an already connected unix stream socket, such as the one a runtime
    passes to a plugin it launched (``socket.socket(fileno=int(os.environ["NRI_PLUGIN_SOCKET"]))``).
    The trunk owns the socket from then on."""
    loop = asyncio.get_running_loop()
    _, trunk = await loop.create_unix_connection(Trunk, sock=sock)
    return trunk
