"""The receive side shared by the sans-I/O decoders: one buffer type and one `NEED_DATA` sentinel.

Both the ttrpc frame decoder (`nri_plugin.ttrpc.protocol`) and the NRI mux decoder
(`nri_plugin.nri.mux`, which sits on ttrpc) cut a byte stream into length-prefixed frames the same
way: bytes go in with ``receive_data``, whole frames come out of ``next_event`` until it returns
`NEED_DATA`. They keep what they received in a `ReceiveBuffer`.

Pure Python: nothing here reads, writes or knows about asyncio.
"""

from __future__ import annotations

import enum
import struct
from typing import Any, Final

__all__ = ["NEED_DATA", "NeedData", "ReceiveBuffer"]


class NeedData(enum.Enum):
    """Type of the `NEED_DATA` sentinel (an enum of one member, so ``is NEED_DATA`` narrows types)."""

    NEED_DATA = "NEED_DATA"


NEED_DATA: Final = NeedData.NEED_DATA
"""What a decoder's ``next_event`` returns when no whole frame is buffered (also after a clean EOF)."""

# Consumed bytes are cut from the front of the buffer only once they are at least this many and at
# least half of it, so that dropping them costs O(1) amortised per byte and small frames do not each
# cause a memmove.
_COMPACT_MIN: Final = 64 * 1024

# A frame at least this large (only Synchronize chunks are) that ends where the bytes received end
# is handed over, not copied: `ReceiveBuffer.take`.
HAND_OVER_MIN: Final = 64 * 1024


class ReceiveBuffer:
    """Bytes received and not yet consumed.

    Consuming moves an offset instead of cutting the front off at once (see `_COMPACT_MIN`), and the
    moment everything is consumed the memory is let go: a multi-megabyte message does not stay in the
    process until the next read, which may be long in coming.
    """

    __slots__ = ("_data", "_start")

    def __init__(self) -> None:
        self._data = bytearray()
        self._start = 0  # offset of the first unconsumed byte

    def __len__(self) -> int:
        """Bytes received and not consumed yet."""
        return len(self._data) - self._start

    @property
    def held(self) -> int:
        """Bytes of memory the buffer holds, consumed ones not yet dropped included."""
        return len(self._data)

    def append(self, data: bytes | bytearray | memoryview) -> None:
        """Keep a copy of `data` (the caller may reuse it once this returns)."""
        if self._start >= _COMPACT_MIN and 2 * self._start >= len(self._data):
            del self._data[: self._start]
            self._start = 0
        self._data += data

    def header(self, header: struct.Struct) -> tuple[Any, ...] | None:
        """`header` read at the front, consuming nothing; None while fewer bytes than it are held."""
        if len(self._data) - self._start < header.size:
            return None
        return header.unpack_from(self._data, self._start)

    def take(self, skip: int, length: int) -> bytes | memoryview | None:
        """Consume `skip` bytes (a header already read) and then `length` bytes, returned; None,
        consuming nothing, while fewer than `skip + length` bytes are held.

        A large frame (`HAND_OVER_MIN`) that is all the buffer holds past its header comes as a view
        of the buffer's own memory, which the buffer gives up (it starts afresh): a 4 MiB message
        is not copied at each layer (the mux's frame, then the ttrpc frame in it), so it is held
        once, not two or three times over. Any other frame is copied out as bytes."""
        data = self._data
        begin = self._start + skip
        end = begin + length
        if end > len(data):
            return None
        if end < len(data):
            self._start = end
        else:  # all consumed: the memory goes now, not at the next read
            self._data, self._start = bytearray(), 0
            if length >= HAND_OVER_MIN:
                return memoryview(data)[begin:end]
        return memoryview(data)[begin:end].tobytes()

    def discard(self, count: int) -> int:
        """Consume up to `count` bytes unread; how many there were."""
        dropped = min(count, len(self))
        self._consume_to(self._start + dropped)
        return dropped

    def _consume_to(self, offset: int) -> None:
        if offset >= len(self._data):
            self._data.clear()
            self._start = 0
        else:
            self._start = offset
