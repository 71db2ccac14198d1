"""NRI connection multiplexer, the asyncio edge: the `Trunk` over the runtime's unix socket.

The trunk feeds the socket's bytes to the sans-I/O decoder (`nri_plugin.nri.muxcodec`, which
describes the mux frames) and hands each frame's payload to the receiver registered for its
connection id (:class:`Trunk`, :func:`open_unix`, :func:`adopt_socket`). The codec's names a user
of the trunk needs (the connection ids, the errors, :func:`encode`) are re-exported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from typing import Final, Protocol, cast

from nri_plugin.common import heap
from nri_plugin.nri.muxcodec import (
    FIRST_FRAME_MAX,
    HEADER_SIZE,
    MAX_PAYLOAD,
    NEED_DATA,
    PLUGIN_SERVICE_CONN,
    RUNTIME_SERVICE_CONN,
    LocalMuxError,
    MuxDecoder,
    MuxFrame,
    MuxProtocolError,
    NeedData,
    check_conn_id,
    encode,
)
from nri_plugin.ttrpc.logbudget import LogBudget, suppressed_note

__all__ = [
    "CLOSE_FLUSH_TIMEOUT",
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

# How long a local close may wait for the peer to read what we already wrote before the socket is
# aborted (what is still unread then is lost). A peer that reads takes milliseconds for the largest
# backlog the high-water mark allows; a runtime waits at most its request timeout (NRI's default is
# 2 s) for an answer, so answers it has not read by then are of no use to it.
CLOSE_FLUSH_TIMEOUT: Final = 2.0


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

    A close never waits on a peer that does not read: what we wrote is flushed for at most
    `close_timeout` seconds (`CLOSE_FLUSH_TIMEOUT`), then the socket is aborted and the unread
    rest dropped (logged at warning), so :attr:`closed` is always set within that time.

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
        self._flush_timer: asyncio.TimerHandle | None = None  # a close's bound on flushing
        self.close_timeout: float = CLOSE_FLUSH_TIMEOUT
        """Seconds a close waits for the peer to read what we wrote before aborting the socket."""
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
        check_conn_id(conn_id)
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
        """Send one whole message on *conn_id*: :func:`encode`'s frames, one write each.

        Dropped silently once the trunk is closed.

        :raises LocalMuxError: *conn_id* is 0 or out of range.
        :raises RuntimeError: the transport is not connected yet (only possible for a
            :class:`Trunk` built by hand, not for one from :func:`open_unix` / :func:`adopt_socket`).
        """
        frames = encode(conn_id, message)
        if self._shutting_down:
            logger.debug("mux conn %d: trunk closed, dropping a %d-byte message", conn_id, len(message))
            return
        if self._transport is None:
            raise RuntimeError("trunk is not connected yet")
        # A write per frame, never writelines: on Python 3.12.0 to 3.13.0 a socket transport's
        # writelines never pauses its protocol past the high-water mark, and a peer that stopped
        # reading would make our write buffer grow without bound.
        for frame in frames:
            self._transport.write(frame)

    def close(self) -> None:
        """Close the trunk (idempotent). Receivers get ``connection_lost(None)`` at once; what was
        written is flushed for at most `close_timeout` seconds, then the socket is aborted."""
        self._shut_down(None)

    @property
    def closing(self) -> bool:
        """True once the trunk began to close (the receivers were told), whether or not the socket
        itself is closed yet (:attr:`closed`)."""
        return self._shutting_down

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
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
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

    def _abort_unflushed(self, transport: asyncio.Transport) -> None:
        """A close's flush took longer than `close_timeout`: the peer is not reading. Drop the rest."""
        self._flush_timer = None
        if self._transport is not transport:
            return
        logger.warning(
            "NRI peer did not read our last %d bytes within %g s of closing the connection: aborting it",
            transport.get_write_buffer_size(),
            self.close_timeout,
        )
        transport.abort()

    def _shut_down(self, exc: Exception | None) -> None:
        if self._shutting_down:
            return
        self._shutting_down = True
        self._exception = exc
        transport = self._transport
        if transport is None:
            self.closed.set()
        elif exc is None:
            transport.close()  # flush what we already wrote, then close...
            with contextlib.suppress(RuntimeError):  # (closed by hand, outside a loop)
                # ...unless the peer does not read it in time (cancelled once the socket is closed)
                self._flush_timer = asyncio.get_running_loop().call_later(
                    self.close_timeout, self._abort_unflushed, transport
                )
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
