"""`ttrpc.wire.each_field` (one field at a time) and `wire.fields` (the list, or None) agree, and a
consumer stopped by `Malformed` has only seen fields that lie within the bytes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.nri import api_pb2 as api
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
