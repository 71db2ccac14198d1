"""ServerSession and ClientSession: stream id rules, replies the session makes itself, envelopes."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nri_plugin.api.ttrpc import request_pb2
from nri_plugin.ttrpc import protocol
from nri_plugin.ttrpc.errors import Code, LocalProtocolError, OversizedMessage, ProtocolError, TtrpcError
from nri_plugin.ttrpc.protocol import (
    HEADER_SIZE,
    MAX_DATA,
    MAX_STREAM_ID,
    NEED_DATA,
    ClientSession,
    Frame,
    FrameDecoder,
    MessageType,
    RequestReceived,
    ResponseReceived,
    ServerSession,
    UnexpectedResponse,
    encode_frame,
)


def request_message(
    stream_id: int, *, service: str = "svc", method: str = "M", payload: bytes = b""
) -> bytes:
    data = request_pb2.Request(service=service, method=method, payload=payload).SerializeToString()
    return encode_frame(stream_id, MessageType.REQUEST, 0, data)


def response_message(
    stream_id: int, *, payload: bytes = b"", status: request_pb2.Status | None = None
) -> bytes:
    data = request_pb2.Response(payload=payload, status=status).SerializeToString()
    return encode_frame(stream_id, MessageType.RESPONSE, 0, data)


def decode_one(message: bytes) -> tuple[Frame, request_pb2.Response]:
    """A whole ttrpc message (as `messages_to_send` gives them) -> its frame and Response."""
    decoder = FrameDecoder()
    decoder.receive_data(message)
    frame = decoder.next_event()
    assert isinstance(frame, Frame)
    assert decoder.next_event() is NEED_DATA
    assert decoder.buffered == 0, "exactly one whole message"
    assert frame.type is MessageType.RESPONSE
    return frame, request_pb2.Response.FromString(bytes(frame.data))


def status_of(message: bytes) -> tuple[int, int, str]:
    frame, response = decode_one(message)
    return frame.stream_id, response.status.code, response.status.message


def client_with_pending(*stream_ids: int) -> ClientSession:
    session = ClientSession()
    for _ in range(max(stream_ids) // 2 + 1):
        session.send_request("svc", "M", b"")
    for stream_id in set(session.pending_streams) - set(stream_ids):
        session.abandon(stream_id)
    return session


# --- server --------------------------------------------------------------------------------------


def test_request_received() -> None:
    server = ServerSession()
    [event] = server.receive_data(request_message(1, service="a.B", method="C", payload=b"\x08\x01"))
    assert isinstance(event, RequestReceived)
    assert (event.stream_id, event.request.service, event.request.method) == (1, "a.B", "C")
    assert event.request.payload == b"\x08\x01"
    assert server.active_streams == {1}
    assert server.messages_to_send() == []


def test_request_fields_pass_through() -> None:
    _, wire = ClientSession().send_request(
        "s", "m", b"p", timeout_nano=2_000_000_000, metadata=[("k", "1"), ("k", "2"), ("traceparent", "x")]
    )
    [event] = ServerSession().receive_data(wire)
    assert event.request.timeout_nano == 2_000_000_000
    assert [(kv.key, kv.value) for kv in event.request.metadata] == [
        ("k", "1"),
        ("k", "2"),
        ("traceparent", "x"),
    ]


@pytest.mark.parametrize("stream_id", [0, 2, 4, 0xFFFF_FFFE])
def test_even_stream_id_is_refused(stream_id: int) -> None:
    server = ServerSession()
    assert server.receive_data(request_message(stream_id)) == []
    [reply] = server.messages_to_send()
    assert status_of(reply) == (stream_id, 3, "StreamID must be odd for client initiated streams")
    assert server.messages_to_send() == []
    # The refused id did not count: a lower odd id is still fresh.
    assert len(server.receive_data(request_message(1))) == 1


@pytest.mark.parametrize("second", [5, 3, 1])
def test_reused_or_lower_stream_id_is_refused(second: int) -> None:
    server = ServerSession()
    assert len(server.receive_data(request_message(5))) == 1
    assert server.receive_data(request_message(second)) == []
    [reply] = server.messages_to_send()
    assert status_of(reply) == (second, 3, "StreamID cannot be re-used and must increment")
    assert server.active_streams == {5}


def test_ids_may_skip_but_must_increase() -> None:
    server = ServerSession()
    events = server.receive_data(request_message(1) + request_message(7) + request_message(9))
    assert [e.stream_id for e in events] == [1, 7, 9]


def test_bad_envelope_gets_internal_and_uses_up_the_id() -> None:
    server = ServerSession()
    assert server.receive_data(encode_frame(3, MessageType.REQUEST, 0, b"\xff\xff")) == []
    [reply] = server.messages_to_send()
    stream_id, code, message = status_of(reply)
    assert (stream_id, code) == (3, Code.INTERNAL)
    assert message.startswith("ttrpc: error unmarshalling request: ")
    assert server.receive_data(request_message(3)) == []
    assert status_of(server.messages_to_send()[0])[1] == Code.INVALID_ARGUMENT
    assert len(server.receive_data(request_message(5))) == 1


def test_oversized_request_gets_resource_exhausted_and_connection_survives() -> None:
    server = ServerSession()
    announced = MAX_DATA + 1
    header = announced.to_bytes(4, "big") + (1).to_bytes(4, "big") + b"\x01\x00"
    assert server.receive_data(header) == []
    [reply] = server.messages_to_send()
    assert status_of(reply) == (1, 8, "message length 4194305 exceed maximum message size of 4194304")
    chunk = 1 << 16
    for start in range(0, announced, chunk):
        assert server.receive_data(bytes(min(chunk, announced - start))) == []
    # The next request starts right after the skipped data.
    [event] = server.receive_data(request_message(3))
    assert event.stream_id == 3
    assert server.messages_to_send() == []


def test_data_frame_is_refused() -> None:
    server = ServerSession()
    assert server.receive_data(encode_frame(1, MessageType.DATA, 0x01, b"x")) == []
    [reply] = server.messages_to_send()
    assert status_of(reply) == (1, 3, "StreamID is no longer active")


def test_response_frame_sent_to_a_server_is_ignored() -> None:
    server = ServerSession()
    assert server.receive_data(response_message(1)) == []
    assert server.messages_to_send() == []


def test_empty_ok_response_is_a_bare_header() -> None:
    server = ServerSession()
    server.receive_data(request_message(1))
    out = server.send_response(1)
    assert out == bytes.fromhex("00000000 00000001 02 00")
    assert len(out) == HEADER_SIZE


def test_ok_response_has_no_status_even_with_a_message() -> None:
    server = ServerSession()
    server.receive_data(request_message(1))
    _, response = decode_one(server.send_response(1, payload=b"\x10\x01", message="ignored"))
    assert not response.HasField("status")
    assert response.payload == b"\x10\x01"


def test_error_response_has_status_and_no_payload() -> None:
    server = ServerSession()
    server.receive_data(request_message(1))
    _, response = decode_one(server.send_response(1, code=Code.NOT_FOUND, message="gone"))
    assert (response.status.code, response.status.message, response.payload) == (5, "gone", b"")


def test_each_stream_is_answered_once() -> None:
    server = ServerSession()
    server.receive_data(request_message(1))
    server.send_response(1)
    with pytest.raises(LocalProtocolError):
        server.send_response(1)
    with pytest.raises(LocalProtocolError):
        server.send_response(3)


def test_oversized_response_leaves_the_stream_answerable() -> None:
    server = ServerSession()
    server.receive_data(request_message(1))
    with pytest.raises(OversizedMessage):
        server.send_response(1, payload=bytes(MAX_DATA))
    assert server.active_streams == {1}
    assert status_of(server.send_response(1, code=8, message="too big"))[1] == 8


@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=8), st.booleans())
def test_server_any_bytes_give_events_or_a_protocol_error(data: bytes, cuts: list[int], eof: bool) -> None:
    server = ServerSession(max_data=64)
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    chunks = [data[a:b] for a, b in itertools.pairwise(points) if b > a] + ([b""] if eof else [])
    try:
        for chunk in chunks:
            for event in server.receive_data(chunk):
                assert isinstance(event, RequestReceived)
                assert event.stream_id % 2 == 1
            for message in server.messages_to_send():
                decode_one(message)
    except ProtocolError:
        pass


# --- client --------------------------------------------------------------------------------------


def test_client_stream_ids_are_odd_and_increase() -> None:
    client = ClientSession()
    ids = [client.send_request("s", "m", b"")[0] for _ in range(4)]
    assert ids == [1, 3, 5, 7]
    assert client.pending_streams == {1, 3, 5, 7}


def test_oversized_request_raises_and_keeps_ids_increasing() -> None:
    client = ClientSession()
    assert client.send_request("s", "m", b"")[0] == 1
    with pytest.raises(OversizedMessage) as info:
        client.send_request("s", "m", bytes(MAX_DATA))
    assert info.value.code == Code.RESOURCE_EXHAUSTED
    assert client.pending_streams == {1}
    assert client.send_request("s", "m", b"")[0] == 3


def test_stream_ids_run_out() -> None:
    client = ClientSession()
    client._next_stream_id = MAX_STREAM_ID  # the last odd u32
    assert client.send_request("s", "m", b"")[0] == MAX_STREAM_ID
    with pytest.raises(LocalProtocolError):
        client.send_request("s", "m", b"")


def test_client_request_encoding() -> None:
    stream_id, wire = ClientSession().send_request("svc", "M", b"\x01", timeout_nano=5)
    decoder = FrameDecoder()
    decoder.receive_data(wire)
    frame = decoder.next_event()
    assert isinstance(frame, Frame)
    assert (frame.stream_id, frame.type, frame.flags) == (stream_id, MessageType.REQUEST, 0)
    request = request_pb2.Request.FromString(bytes(frame.data))
    assert (request.service, request.method, request.payload, request.timeout_nano) == (
        "svc",
        "M",
        b"\x01",
        5,
    )


def test_ok_response() -> None:
    client = client_with_pending(1)
    [event] = client.receive_data(response_message(1, payload=b"\x10\x01"))
    assert event == ResponseReceived(stream_id=1, code=0, message="", payload=b"\x10\x01")
    assert client.pending_streams == set()


@pytest.mark.parametrize(
    "wire",
    [
        pytest.param(bytes.fromhex("00000000 00000001 02 00"), id="zero-length-data"),
        pytest.param(
            response_message(1, status=request_pb2.Status(code=0, message="fine")), id="status-code-0"
        ),
    ],
)
def test_ok_responses_without_status_or_with_code_0(wire: bytes) -> None:
    [event] = client_with_pending(1).receive_data(wire)
    assert isinstance(event, ResponseReceived)
    assert event.code == 0


def test_error_response() -> None:
    client = client_with_pending(3)
    [event] = client.receive_data(response_message(3, status=request_pb2.Status(code=12, message="method X")))
    assert event == ResponseReceived(stream_id=3, code=12, message="method X", payload=b"")


def test_responses_matched_out_of_order() -> None:
    client = client_with_pending(1, 3, 5)
    wire = response_message(5, payload=b"5") + response_message(1, payload=b"1") + response_message(3)
    events = client.receive_data(wire)
    assert [(e.stream_id, getattr(e, "payload", None)) for e in events] == [(5, b"5"), (1, b"1"), (3, b"")]


@pytest.mark.parametrize("stream_id", [1, 2, 9])
def test_response_for_unknown_stream_is_unexpected(stream_id: int) -> None:
    client = client_with_pending(1)
    client.receive_data(response_message(1))
    assert client.receive_data(response_message(stream_id)) == [UnexpectedResponse(stream_id=stream_id)]


def test_response_for_abandoned_stream_is_unexpected() -> None:
    client = client_with_pending(1, 3)
    client.abandon(1)
    assert client.receive_data(response_message(1)) == [UnexpectedResponse(stream_id=1)]
    assert client.pending_streams == {3}


def test_oversized_response_fails_only_that_call() -> None:
    client = client_with_pending(1, 3)
    header = (MAX_DATA + 10).to_bytes(4, "big") + (1).to_bytes(4, "big") + b"\x02\x00"
    events = client.receive_data(header + bytes(MAX_DATA + 10) + response_message(3, payload=b"ok"))
    assert events == [
        ResponseReceived(
            stream_id=1,
            code=8,
            message="message length 4194314 exceed maximum message size of 4194304",
            payload=b"",
        ),
        ResponseReceived(stream_id=3, code=0, message="", payload=b"ok"),
    ]


def test_undecodable_response_fails_only_that_call() -> None:
    client = client_with_pending(1, 3)
    events = client.receive_data(encode_frame(1, MessageType.RESPONSE, 0, b"\xff") + response_message(3))
    assert isinstance(events[0], ResponseReceived)
    assert events[0].code == Code.INTERNAL
    assert events[0].message.startswith("ttrpc: error unmarshalling response: ")
    assert events[1] == ResponseReceived(stream_id=3, code=0, message="", payload=b"")


def test_requests_and_data_sent_to_a_client_are_dropped() -> None:
    client = client_with_pending(1)
    assert client.receive_data(request_message(2) + encode_frame(1, MessageType.DATA, 0, b"x")) == []
    assert client.pending_streams == {1}


@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=8), st.booleans())
def test_client_any_bytes_give_events_or_a_protocol_error(data: bytes, cuts: list[int], eof: bool) -> None:
    client = client_with_pending(1, 3, 5)
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    chunks = [data[a:b] for a, b in itertools.pairwise(points) if b > a] + ([b""] if eof else [])
    try:
        for chunk in chunks:
            for event in client.receive_data(chunk):
                assert isinstance(event, (ResponseReceived, UnexpectedResponse))
    except ProtocolError:
        pass


# --- both ends -----------------------------------------------------------------------------------

texts = st.text(max_size=40)
key_values = st.lists(st.tuples(texts, texts), max_size=4)


@given(texts, texts, st.binary(max_size=100), st.integers(0, 2**63 - 1), key_values)
def test_request_round_trip(
    service: str, method: str, payload: bytes, timeout_nano: int, metadata: list[tuple[str, str]]
) -> None:
    client, server = ClientSession(), ServerSession()
    stream_id, wire = client.send_request(
        service, method, payload, timeout_nano=timeout_nano, metadata=metadata
    )
    [event] = server.receive_data(wire)
    assert event.stream_id == stream_id
    request = event.request
    assert (request.service, request.method, request.payload) == (service, method, payload)
    assert request.timeout_nano == timeout_nano
    assert [(kv.key, kv.value) for kv in request.metadata] == metadata


@given(st.integers(0, 2**31 - 1), texts, st.binary(max_size=100), st.lists(st.integers(1, 50), max_size=5))
def test_response_round_trip_in_any_split(code: int, message: str, payload: bytes, sizes: list[int]) -> None:
    client, server = ClientSession(), ServerSession()
    server.receive_data(client.send_request("s", "m", b"")[1])
    wire = server.send_response(1, payload=payload, code=code, message=message)
    chunks, rest = [], wire
    for size in sizes:
        chunks.append(rest[:size])
        rest = rest[size:]
    chunks.append(rest)
    events = [e for chunk in chunks if chunk for e in client.receive_data(chunk)]
    expected_message = message if code else ""
    assert events == [ResponseReceived(stream_id=1, code=code, message=expected_message, payload=payload)]


# --- errors --------------------------------------------------------------------------------------


def test_codes_are_the_grpc_codes() -> None:
    assert [c.value for c in Code] == list(range(17))
    assert int(Code.UNIMPLEMENTED) == 12


def test_ttrpc_error_keeps_known_and_unknown_codes() -> None:
    known = TtrpcError(12, "method X")
    assert known.code is Code.UNIMPLEMENTED
    assert str(known) == "UNIMPLEMENTED: method X"
    odd = TtrpcError(99)
    assert odd.code == 99
    assert not isinstance(odd.code, Code)
    assert str(odd) == "99"


# -- large requests: the payload kept out of the envelope --------------------------------------------


@given(
    service=st.text(max_size=40),
    method=st.text(max_size=40),
    payload=st.binary(max_size=300),
    timeout=st.integers(min_value=-(2**63), max_value=2**63 - 1),
    metadata=st.lists(st.tuples(st.text(max_size=8), st.text(max_size=8)), max_size=3),
)
def test_a_split_envelope_decodes_to_the_same_request(
    service: str, method: str, payload: bytes, timeout: int, metadata: list[tuple[str, str]]
) -> None:
    request = request_pb2.Request(service=service, method=method, payload=payload, timeout_nano=timeout)
    for key, value in metadata:
        request.metadata.add(key=key, value=value)
    data = request.SerializeToString()
    rest, view = protocol._split_payload(data)
    if not payload:  # proto3 leaves an empty payload out: nothing to split
        assert (rest, view) == (data, None)
        return
    assert view is not None
    assert bytes(view) == payload
    assert request_pb2.Request.FromString(bytes(rest)) == request_pb2.Request(
        service=service, method=method, timeout_nano=timeout, metadata=request.metadata
    )


@given(st.binary(max_size=200))
def test_a_malformed_envelope_is_never_split_into_something_else(data: bytes) -> None:
    """Whatever the bytes, a split gives what the whole parse gives, or no split at all."""
    rest, view = protocol._split_payload(data)
    if view is None:
        assert rest == data
        return
    whole = request_pb2.Request.FromString(data)  # a split envelope is a valid one
    part = request_pb2.Request.FromString(bytes(rest))
    assert bytes(view) == whole.payload
    part.payload = whole.payload
    assert part == whole


def test_a_large_request_comes_with_its_payload_apart() -> None:
    payload = b"\x0a" * protocol.LARGE_REQUEST
    request = request_pb2.Request(service="a.B", method="C", payload=payload)
    session = ServerSession()
    [event] = session.receive_data(encode_frame(1, MessageType.REQUEST, 0, request.SerializeToString()))
    assert event.payload is not None
    assert bytes(event.payload) == payload
    assert event.request.payload == b""
    assert bytes(event.data) == payload
    assert event.size == request.ByteSize()
