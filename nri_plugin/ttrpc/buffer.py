"""The receive side shared by the sans-I/O decoders: one buffer type and one `NEED_DATA` sentinel.

Both the ttrpc frame decoder (`nri_plugin.ttrpc.protocol`) and the NRI mux decoder
(`nri_plugin.nri.muxcodec`, which sits on ttrpc) cut a byte stream into length-prefixed frames the
same way: bytes go in with ``receive_data``, whole frames come out of ``next_event`` until it
returns `NEED_DATA`. Both cut the frames out of the bytes as they arrive with one `FrameCutter`,
one loop over them (`ReceiveBuffer.join`, `cut`, `keep`); only a frame not whole yet is kept
between reads, in a `ReceiveBuffer`. The common case, a read of whole frames, then copies each
frame out once and keeps nothing.

Pure Python: nothing here reads, writes or knows about asyncio.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from typing import Any, Final

__all__ = ["HAND_OVER_MIN", "NEED_DATA", "FrameCutter", "NeedData", "ReceiveBuffer"]


class NeedData(enum.Enum):
    """Type of the `NEED_DATA` sentinel (an enum of one member, so ``is NEED_DATA`` narrows types)."""

    NEED_DATA = "NEED_DATA"


NEED_DATA: Final = NeedData.NEED_DATA
"""What a decoder's ``next_event`` returns when no whole frame is buffered (also after a clean EOF)."""

# A frame at least this large (only Synchronize chunks are) that ends where the bytes received end
# is handed over, not copied: `ReceiveBuffer.cut`.
HAND_OVER_MIN: Final = 64 * 1024

Bytes = bytes | bytearray | memoryview


class ReceiveBuffer:
    """The start of a frame not whole yet, kept from one read to the next.

    A decoder cuts frames from `join(data)` (`data` itself when nothing is kept: no copy), each with
    `cut`, and gives the rest back with `keep`. The buffer never holds a consumed byte: once a frame
    is cut, the memory it came in goes with the frame or at once, not at the next read (which may be
    long in coming after a multi-megabyte Synchronize).
    """

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data = bytearray()

    def __len__(self) -> int:
        """Bytes kept."""
        return len(self._data)

    @property
    def held(self) -> int:
        """Bytes of memory the buffer holds."""
        return len(self._data)

    def join(self, data: Bytes) -> Bytes:
        """The bytes to cut frames from: `data` when nothing is kept, else what is kept followed by
        `data` (in the buffer's own memory, which it then gives up until `keep`)."""
        if not self._data:
            return data
        joined, self._data = self._data, bytearray()
        joined += data
        return joined

    def cut(self, joined: Bytes, begin: int, end: int, data: Bytes) -> bytes | memoryview:
        """One frame's data, ``joined[begin:end]``, as bytes of its own (`joined` and `data` as
        given to and returned by `join`).

        A large frame (`HAND_OVER_MIN`) that ends where the buffer's own memory ends comes as a
        view of that memory, which the buffer gave up: a 4 MiB message is not copied at each layer
        (the mux's frame, then the ttrpc frame in it), so it is held once, not two or three times
        over. Any other frame is copied out as bytes."""
        if end - begin >= HAND_OVER_MIN and joined is not data and end == len(joined):
            return memoryview(joined)[begin:end]
        return bytes(joined[begin:end])

    def keep(self, joined: Bytes, pos: int, data: Bytes) -> None:
        """Keep ``joined[pos:]``, the start of a frame not whole yet, for the next read (a copy,
        unless `joined` is the buffer's own memory; `data` as given to `join`)."""
        if pos >= len(joined):
            return
        if joined is data:
            self._data = bytearray(joined[pos:])
            return
        assert isinstance(joined, bytearray)
        if pos:
            del joined[:pos]
        self._data = joined

    def unpack(self, header: struct.Struct) -> tuple[Any, ...]:
        """`header` read at the front of what is kept (the caller checks that enough is)."""
        return header.unpack_from(self._data)


Header = tuple[Any, ...]
"""A frame header's fields, as its `struct.Struct` unpacks them."""
Cut = tuple[Header, "bytes | memoryview | None"]
"""One frame cut from the stream: its header and its payload (None: dropped, see `FrameCutter`)."""


class FrameCutter:
    """Cuts frames of a fixed-size header and a payload out of a byte stream as it arrives.

    `header` unpacks a frame's header, whose field number `length_field` is the payload's length.
    `check` sees each header as soon as it is whole, before any of its payload is kept, and returns
    the error that ends the stream there, or None. With `max_length`, a payload longer than that is
    not kept: its frame is cut at once with the payload None, and its bytes are dropped as they
    arrive.
    """

    __slots__ = ("_buffer", "_check", "_discard", "_header", "_length_field", "_max_length")

    def __init__(
        self,
        header: struct.Struct,
        *,
        length_field: int,
        check: Callable[[Header], Exception | None],
        max_length: int | None = None,
    ) -> None:
        self._header = header
        self._length_field = length_field
        self._check = check
        self._max_length = max_length
        self._buffer = ReceiveBuffer()  # the start of a frame not whole yet
        self._discard = 0  # bytes of a dropped payload still to come

    @property
    def buffered(self) -> int:
        """Bytes kept of a frame not whole yet."""
        return len(self._buffer)

    @property
    def inside_frame(self) -> bool:
        """Whether the bytes so far end inside a frame (its start kept, or its payload being dropped)."""
        return bool(self._buffer) or self._discard > 0

    def kept_header(self) -> Header:
        """The header at the front of what is kept (the caller checks that it is whole)."""
        return self._buffer.unpack(self._header)

    def cut(self, data: Bytes) -> tuple[list[Cut], Exception | None]:
        """The frames `data` completes, in order, and the error `check` found after them (None: the
        stream is fine so far; once there is one, feed nothing more)."""
        if self._discard:
            dropped = min(self._discard, len(data))
            self._discard -= dropped
            data = data[dropped:]
        frames: list[Cut] = []
        failure: Exception | None = None
        buffer, size = self._buffer, self._header.size
        joined = buffer.join(data)
        pos, end = 0, len(joined)
        while end - pos >= size:
            fields = self._header.unpack_from(joined, pos)
            failure = self._check(fields)
            if failure is not None:
                break
            begin = pos + size
            length = fields[self._length_field]
            if self._max_length is not None and length > self._max_length:
                frames.append((fields, None))
                pos = min(begin + length, end)
                self._discard = begin + length - pos
            elif begin + length <= end:
                pos = begin + length
                frames.append((fields, buffer.cut(joined, begin, pos, data)))
            else:
                break
        if pos < end:
            buffer.keep(joined, pos, data)
        return frames, failure
