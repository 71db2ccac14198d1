"""The sans-I/O decoders against structured mutations of real traffic, checked against reference models.

What the existing suites already show (tests/ttrpc, tests/test_mux.py): arbitrary bytes give frames
or a protocol error; valid frames survive any split. Here the inputs are *nearly valid*: messages
captured from the Go implementation (tests/data/vectors) and messages our
own encoder makes for every Plugin method, with headers rewritten (length, type, stream id, flags,
connection id), bits flipped, bytes cut, duplicated or inserted. Every decoder is compared with a
small reference model that parses the whole input at once; the incremental decoder fed in any split
(and with a small frame limit, so that the oversized-frame path runs on small inputs) must give
exactly the model's events and fail exactly when the model does. The mux and ttrpc decoders are
also stacked as on the wire, with each connection's stream cut into arbitrary mux frames and
interleaved with other connections: the ttrpc layer must see the same thing whatever the framing.
"""

from __future__ import annotations

import itertools
from typing import Any

from hostile_corpus import mutated_wire, streams
from hostile_models import (
    MUX_HEADER,
    SMALL_LIMIT,
    TTRPC_HEADER,
    mux_incremental,
    mux_reference,
    ttrpc_incremental,
    ttrpc_reference,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nri_plugin.api.ttrpc import request_pb2
from nri_plugin.ttrpc.errors import Code, ProtocolError
from nri_plugin.ttrpc.protocol import (
    ClientSession,
    MessageType,
    RequestReceived,
    ResponseReceived,
    ServerSession,
    UnexpectedResponse,
)

SETTINGS = settings(
    max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def splits(draw: st.DrawFn, data: bytes) -> list[bytes]:
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=12)))
    chunks = [data[a:b] for a, b in itertools.pairwise([0, *cuts, len(data)])]
    return [chunk for chunk in chunks if chunk]  # b"" would mean EOF


# -- ttrpc ---------------------------------------------------------------------------------------------


@SETTINGS
@given(st.data(), streams, st.sampled_from([SMALL_LIMIT, 4 << 20]), st.booleans())
def test_ttrpc_decoder_matches_the_model_in_any_split(
    data: st.DataObject, stream: bytes, limit: int, eof: bool
) -> None:
    chunks = data.draw(splits(stream))
    assert ttrpc_incremental(chunks, limit, eof) == ttrpc_reference(stream, limit, eof)


def _response_status(message: bytes) -> tuple[int, int]:
    stream_id, type_ = TTRPC_HEADER.unpack_from(message)[1:3]
    assert type_ == MessageType.RESPONSE
    response = request_pb2.Response.FromString(message[TTRPC_HEADER.size :])
    return stream_id, response.status.code


@SETTINGS
@given(st.data(), streams, st.sampled_from([SMALL_LIMIT, 4 << 20]))
def test_server_session_answers_mutated_traffic_with_statuses_only(
    data: st.DataObject, stream: bytes, limit: int
) -> None:
    session = ServerSession(limit)
    requests: list[RequestReceived] = []
    replies: list[bytes] = []
    failed = False
    for chunk in data.draw(splits(stream)):
        try:
            requests += session.receive_data(chunk)
        except ProtocolError:
            failed = True
            break
        finally:
            replies += session.messages_to_send()
    if failed:  # broken for good: it keeps refusing
        try:
            session.receive_data(b"x")
        except ProtocolError:
            pass
        else:
            raise AssertionError("a broken session took more data")
    ids = [r.stream_id for r in requests]
    assert ids == sorted(set(ids)), "accepted ids increase"
    assert all(i % 2 for i in ids), "accepted ids are odd"
    for message in replies:
        _, code = _response_status(message)
        assert code in (Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED, Code.INTERNAL)
    for request in requests:  # each accepted stream can be answered exactly once
        session.send_response(request.stream_id, code=Code.UNIMPLEMENTED, message="x")
    if not failed:
        assert session.active_streams == frozenset()


@SETTINGS
@given(st.data(), streams)
def test_client_session_turns_mutated_replies_into_results_or_a_protocol_error(
    data: st.DataObject, stream: bytes
) -> None:
    session = ClientSession(SMALL_LIMIT)
    pending = {session.send_request("s", "m", b"")[0] for _ in range(4)}
    try:
        for chunk in data.draw(splits(stream)):
            for event in session.receive_data(chunk):
                if isinstance(event, ResponseReceived):
                    assert event.stream_id in pending
                    pending.discard(event.stream_id)
                else:
                    assert isinstance(event, UnexpectedResponse)
    except ProtocolError:
        return
    assert session.pending_streams == frozenset(pending)


# -- mux, and mux + ttrpc stacked -------------------------------------------------------------------------


@SETTINGS
@given(st.data(), mutated_wire(), st.booleans())
def test_mux_decoder_matches_the_model_in_any_split(data: st.DataObject, wire: bytes, eof: bool) -> None:
    assert mux_incremental(data.draw(splits(wire)), eof) == mux_reference(wire, eof)


@st.composite
def interleaved(draw: st.DrawFn) -> tuple[dict[int, bytes], bytes]:
    """Per-connection byte streams (1 and 2 carry ttrpc, others junk), each cut into pieces of any
    size, the pieces interleaved into one mux wire (each connection's pieces in order)."""
    by_conn = {
        1: draw(streams),
        2: draw(streams),
        draw(st.integers(3, 0xFFFFFFFF)): draw(st.binary(max_size=64)),
    }
    pieces: dict[int, list[bytes]] = {}
    for conn_id, stream in by_conn.items():
        cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=6)))
        pieces[conn_id] = [stream[a:b] for a, b in itertools.pairwise([0, *cuts, len(stream)])]
    order = [conn_id for conn_id, parts in pieces.items() for _ in parts]
    order = draw(st.permutations(order))
    taken = {conn_id: iter(parts) for conn_id, parts in pieces.items()}
    wire = b"".join(
        MUX_HEADER.pack(conn_id, len(piece)) + piece for conn_id in order for piece in [next(taken[conn_id])]
    )
    return by_conn, wire


@SETTINGS
@given(st.data(), interleaved())
def test_ttrpc_over_mux_sees_the_same_stream_whatever_the_framing(
    data: st.DataObject, case: tuple[dict[int, bytes], bytes]
) -> None:
    streams_by_conn, wire = case
    frames, failed = mux_incremental(data.draw(splits(wire)), eof=True)
    assert not failed
    received: dict[int, bytes] = {}
    for frame in frames:
        received[frame.conn_id] = received.get(frame.conn_id, b"") + frame.payload
    assert {c: s for c, s in received.items() if s} == {c: s for c, s in streams_by_conn.items() if s}
    # The ttrpc layer of each connection: the same events as the stream fed whole.
    for conn_id in (1, 2):
        pieces = [frame.payload for frame in frames if frame.conn_id == conn_id and frame.payload]
        stream = streams_by_conn[conn_id]
        assert ttrpc_incremental(pieces, SMALL_LIMIT, True) == ttrpc_reference(stream, SMALL_LIMIT, True)
        whole = _session_outcome(ServerSession(SMALL_LIMIT), [stream])
        split = _session_outcome(ServerSession(SMALL_LIMIT), pieces)
        # A protocol error ends the connection, and what the same call decoded before it is dropped
        # with it: only the error itself must agree then.
        assert whole == split if whole is not None else split is None


def _session_outcome(session: ServerSession, chunks: list[bytes]) -> tuple[list[Any], list[bytes]] | None:
    """(requests, session replies), or None after a protocol error."""
    events: list[Any] = []
    replies: list[bytes] = []
    try:
        for chunk in chunks:
            events += [(e.stream_id, e.request.SerializeToString()) for e in session.receive_data(chunk)]
            replies += session.messages_to_send()
    except ProtocolError:
        return None
    return events, replies
