"""`ttrpc.wire.each_field` (one field at a time) and `wire.fields` (the list, or None) agree, and a
consumer stopped by `Malformed` has only seen fields that lie within the bytes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.ttrpc import wire


def _walk(data: bytes) -> tuple[list[wire.Field], bool]:
    """The fields `each_field` yields, and whether it ended with `Malformed`."""
    seen: list[wire.Field] = []
    try:
        for field in wire.each_field(data):
            seen.append(field)
    except wire.Malformed:
        return seen, True
    return seen, False


@given(st.binary(max_size=200))
def test_one_at_a_time_or_all_at_once_the_same_fields(data: bytes) -> None:
    seen, malformed = _walk(data)
    assert all(field.end <= len(data) for field in seen)
    assert wire.fields(data) == (None if malformed else seen)


def test_a_request_is_taken_apart_into_its_fields() -> None:
    request = api.SynchronizeRequest(more=True)
    request.pods.add(id="p")
    request.containers.add(id="c", pod_sandbox_id="p")
    data = request.SerializeToString()
    numbers = [field.number for field in wire.each_field(data)]
    assert sorted(numbers) == [1, 2, 3]


@pytest.mark.parametrize(
    "data",
    [
        b"\x0a\x05abc",  # a LEN field cut short
        b"\x0d\x01\x02",  # a fixed32 field cut short
        b"\x08\xff",  # a varint cut short
        b"\x08" + b"\xff" * 10 + b"\x01",  # a varint longer than 10 bytes
        b"\x0b",  # a group
        b"\x00\x01",  # field number 0
    ],
)
def test_malformed_bytes_stop_the_walk_with_nothing_beyond_them(data: bytes) -> None:
    seen, malformed = _walk(b"\x08\x01" + data)
    assert malformed
    assert seen == [wire.Field(1, wire.VARINT, 0, 1, 2)]


@pytest.mark.parametrize("size", [0, 1, 126, 127, 128, 129, 1500, 16382, 16383, 16384, 16385, 2_097_152])
def test_each_length_is_read_as_protobuf_wrote_it(size: int) -> None:
    """A LEN field's length takes one, two, three or four bytes by its size: each is read as
    protobuf wrote it, so that every field is cut where protobuf parses it back."""
    container = api.Container(id="c", name="x" * size)
    request = api.SynchronizeRequest(containers=[container, container], more=True)
    data = request.SerializeToString()
    seen = list(wire.each_field(data))
    assert [(field.number, field.wire) for field in seen] == [(2, wire.LEN), (2, wire.LEN), (3, wire.VARINT)]
    assert [field.start for field in seen[1:]] == [field.end for field in seen[:2]]
    assert seen[2].end == len(data)
    for field in seen[:2]:
        assert api.Container.FromString(data[field.begin : field.end]) == container


@pytest.mark.parametrize("length", [b"\x80\x00", b"\xff\x00", b"\x80\x80\x00"])
def test_a_length_written_longer_than_it_needs_is_still_its_value(length: bytes) -> None:
    """Varints padded with high zero groups (`\\x80\\x00` is 0) are valid: the length is their value."""
    data = b"\x12" + length + b"\x18\x01"
    value = 0x7F if length.startswith(b"\xff") else 0
    if value:
        data += b"y" * (value - 2)
    seen, malformed = _walk(data)
    assert not malformed
    assert seen[0].end - seen[0].begin == value
