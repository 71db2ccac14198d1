"""Exact bytes against the vectors captured from the Go implementation (containerd/ttrpc v1.2.8).

Each vector file holds the mux frames of one ttrpc message; the decoded view in its `#` lines was
written by the capture tool, so it is an independent check of what our decoder reads.
"""

from __future__ import annotations

import re

import pytest
from google.protobuf import empty_pb2
from vectors import comment_lines, ttrpc_message, vector_names

from nri_plugin.api.ttrpc import request_pb2
from nri_plugin.ttrpc.aio import CallContext, Server, UnaryMethod
from nri_plugin.ttrpc.protocol import (
    ClientSession,
    MessageType,
    RequestReceived,
    ResponseReceived,
    ServerSession,
    encode_frame,
)

PLUGIN = "nri.pkg.api.v1alpha1.Plugin"


def load_message(name: str) -> bytes:
    """The ttrpc message of a vector: its mux frame payloads, concatenated."""
    return ttrpc_message(name)[1]


def header_note(name: str) -> tuple[int, int]:
    """(stream id, type) from the capture tool's `# ttrpc header:` line."""
    note = next(line for line in comment_lines(name) if line.startswith("ttrpc header:"))
    match = re.search(r"stream (\d+), type (\d+)", note)
    assert match
    return int(match[1]), int(match[2])


def envelope_note(name: str) -> str:
    envelopes = ("ttrpc.Request:", "ttrpc.Response:")
    return next(line for line in comment_lines(name) if line.startswith(envelopes))


def requests() -> list[str]:
    return [n for n in vector_names() if "ttrpc.Request:" in "".join(comment_lines(n))]


def responses() -> list[str]:
    return [n for n in vector_names() if "ttrpc.Response:" in "".join(comment_lines(n))]


def client_at(stream_id: int) -> ClientSession:
    """A client whose next call gets `stream_id`."""
    client = ClientSession()
    for _ in range(stream_id // 2):
        used, _ = client.send_request("s", "m", b"")
        client.abandon(used)
    return client


def server_waiting_on(stream_id: int) -> ServerSession:
    server = ServerSession()
    server.receive_data(client_at(stream_id).send_request("s", "m", b"")[1])
    assert server.active_streams == {stream_id}
    return server


@pytest.mark.parametrize("name", requests())
def test_request_vectors_decode(name: str) -> None:
    message = load_message(name)
    stream_id, type_ = header_note(name)
    assert type_ == MessageType.REQUEST
    for chunks in ([message], [message[i : i + 1] for i in range(len(message))]):
        server = ServerSession()
        events = [e for chunk in chunks for e in server.receive_data(chunk)]
        assert [type(e) for e in events] == [RequestReceived]
        assert events[0].stream_id == stream_id
        request = events[0].request
        note = envelope_note(name)
        assert f'service "{request.service}"' in note
        assert f'method "{request.method}"' in note
        assert f"payload {len(request.payload)} bytes" in note
        assert f"timeout_nano {request.timeout_nano} " in note
        assert server.messages_to_send() == []


@pytest.mark.parametrize("name", requests())
def test_client_encodes_requests_like_go(name: str) -> None:
    message = load_message(name)
    stream_id, _ = header_note(name)
    go = request_pb2.Request.FromString(message[10:])
    ours = client_at(stream_id).send_request(go.service, go.method, go.payload, timeout_nano=go.timeout_nano)
    assert ours == (stream_id, message)


@pytest.mark.parametrize("name", responses())
def test_response_vectors_decode(name: str) -> None:
    message = load_message(name)
    stream_id, type_ = header_note(name)
    assert type_ == MessageType.RESPONSE
    client = client_at(stream_id)
    client.send_request("s", "m", b"")
    [event] = client.receive_data(message)
    assert isinstance(event, ResponseReceived)
    assert event.stream_id == stream_id
    note = envelope_note(name)
    if event.code:
        assert f'{{code {event.code}, message "{event.message}"}}' in note
    else:
        assert "no status (OK)" in note
    assert f"payload {len(event.payload)} bytes" in note


@pytest.mark.parametrize("name", responses())
def test_server_encodes_responses_like_go(name: str) -> None:
    message = load_message(name)
    stream_id, _ = header_note(name)
    go = request_pb2.Response.FromString(message[10:])
    out = server_waiting_on(stream_id).send_response(
        stream_id, payload=go.payload, code=go.status.code, message=go.status.message
    )
    assert out == message


@pytest.mark.parametrize("name", ["02-register-reply-ok.hex", "22-dossier-v2-register-reply-ok.hex"])
def test_empty_ok_reply(name: str) -> None:
    assert (
        server_waiting_on(1).send_response(1) == load_message(name) == bytes.fromhex("00000000000000010200")
    )


def test_synchronize_more_reply() -> None:
    expected = load_message("27-dossier-v7-synchronize-more-response.hex")
    assert server_waiting_on(3).send_response(3, payload=bytes.fromhex("1001")) == expected


# --- the asyncio Server gives the same bytes as Go's server -------------------------------------


async def _empty(request: empty_pb2.Empty, ctx: CallContext) -> empty_pb2.Empty:
    return empty_pb2.Empty()


async def _fails(request: empty_pb2.Empty, ctx: CallContext) -> empty_pb2.Empty:
    raise RuntimeError("mixedcpu: cannot update container")


PLUGIN_SERVICE = {
    PLUGIN: {
        "Configure": UnaryMethod(empty_pb2.Empty, _empty),
        "UpdateContainer": UnaryMethod(empty_pb2.Empty, _fails),
    }
}


async def serve_one(request: bytes) -> list[bytes]:
    sent: list[bytes] = []
    server = Server(PLUGIN_SERVICE, sent.append)
    server.data_received(request)
    server.close()
    await server.wait_closed()
    return sent


def plugin_request(stream_id: int, method: str) -> bytes:
    data = request_pb2.Request(service=PLUGIN, method=method).SerializeToString()
    return encode_frame(stream_id, MessageType.REQUEST, 0, data)


@pytest.mark.asyncio
async def test_server_unknown_method_reply_matches_go() -> None:
    request = load_message("11-unknown-method-request.hex")
    assert await serve_one(request) == [load_message("12-unimplemented-reply.hex")]


@pytest.mark.asyncio
async def test_server_missing_newer_method_reply_matches_go() -> None:
    expected = load_message("24-dossier-v4-unimplemented-reply.hex")
    assert await serve_one(plugin_request(7, "RunPodSandbox")) == [expected]


@pytest.mark.asyncio
async def test_server_handler_error_reply_matches_go(caplog: pytest.LogCaptureFixture) -> None:
    expected = load_message("10-error-reply.hex")
    assert await serve_one(plugin_request(7, "UpdateContainer")) == [expected]
    assert "UpdateContainer failed" in caplog.text
