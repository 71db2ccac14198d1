"""The protobuf wire format at the top level of a message: where each field is, nothing decoded.

What lets a large message be taken apart without parsing it whole: a ttrpc request's payload kept
out of its envelope (`nri_plugin.ttrpc.protocol`), a Synchronize chunk parsed one object at a time
(`nri_plugin.nri.stub`). Only plainly well-formed bytes are taken apart; anything else is left to
the protobuf decoder, which parses (or refuses) it as it always does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final, NamedTuple

__all__ = ["LEN", "VARINT", "Field", "Malformed", "each_field", "fields", "varint"]

# Wire types (what follows a field's key).
VARINT: Final = 0
_FIXED64: Final = 1
LEN: Final = 2
_FIXED32: Final = 5


class Field(NamedTuple):
    """One top-level field: its number and wire type, where it starts (its key) and where its value
    starts and ends (a LEN field's bytes, a varint's bytes, a fixed field's bytes)."""

    number: int
    wire: int
    start: int
    begin: int
    end: int


# The most bytes a varint takes (64 bits, 7 per byte), and the largest field number.
_VARINT_MAX: Final = 10
_NUMBER_MAX: Final = (1 << 29) - 1


def varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The base-128 varint at `pos` and the position after it; IndexError when cut short,
    ValueError when longer than 10 bytes."""
    value = shift = 0
    for _ in range(_VARINT_MAX):
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise ValueError("varint longer than 10 bytes")


class Malformed(Exception):
    """The bytes are not a plainly well-formed message (see `each_field`)."""


def each_field(data: bytes | memoryview) -> Iterator[Field]:
    """Every top-level field of the message in `data`, in order, one at a time (no list of them all:
    a 4 MiB Synchronize chunk has thousands); `Malformed` as soon as the bytes are not plainly well
    formed (a field cut short, an overlong varint, a field number out of range, a group or an
    unknown wire type). A field is only yielded once it is whole: a consumer stopped by `Malformed`
    has seen only fields that lie within `data`."""
    # Kept inline, measured: a one-byte key and a LEN length of one or two bytes read here rather
    # than through `varint` save 456k of a 1,000-pod Synchronize's bytecodes (7.8 % first start,
    # 12 % restart; bench/sync_inprocess.py --count).
    pos, end = 0, len(data)
    start = 0
    try:
        while pos < end:
            start = pos
            key = data[pos]
            pos += 1
            if key >= 0x80:
                key, pos = varint(data, start)
                if key >> 3 > _NUMBER_MAX:
                    raise Malformed(f"field number {key >> 3} at byte {start}")
            if key < 8:
                raise Malformed(f"field number 0 at byte {start}")
            number, wire = key >> 3, key & 7
            if wire == LEN:
                length = data[pos]
                if length < 0x80:
                    begin = pos + 1
                elif data[pos + 1] < 0x80:  # 128 B to 16 KiB: most pods and containers
                    length = (length & 0x7F) | (data[pos + 1] << 7)
                    begin = pos + 2
                else:
                    length, begin = varint(data, pos)
                pos = begin + length
            else:
                begin = pos
                pos = _skip_value(data, pos, wire, start)
            if pos > end:
                raise Malformed(f"the field at byte {start} is cut short")
            yield Field(number, wire, start, begin, pos)
    except (IndexError, ValueError) as exc:  # a varint cut short, or longer than 10 bytes
        raise Malformed(f"at byte {start}: {exc}") from exc


def _skip_value(data: bytes | memoryview, pos: int, wire: int, start: int) -> int:
    """Where the value at `pos` of a field of wire type `wire` (not LEN) ends."""
    if wire == VARINT:
        return varint(data, pos)[1]
    if wire == _FIXED64:
        return pos + 8
    if wire == _FIXED32:
        return pos + 4
    raise Malformed(f"wire type {wire} at byte {start}")


def fields(data: bytes | memoryview) -> list[Field] | None:
    """Every top-level field of the message in `data`, in order (`each_field`); None when it is not
    plainly well formed."""
    try:
        return list(each_field(data))
    except Malformed:
        return None
