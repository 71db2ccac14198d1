"""Nearly valid NRI wire traffic: a corpus of real messages and hypothesis strategies that mutate it.

The corpus: the messages captured from the Go implementation (tests/data/vectors) and the
messages our own encoder makes for every Plugin method, responses and a Data
frame. `mutated_message` rewrites a message's ttrpc header (length, type, stream id, flags), flips
bits, cuts, duplicates and inserts bytes; `streams` concatenates a few; `mutated_wire` does the same
one layer down, with mux headers (connection id, length).
"""

from __future__ import annotations

import struct

from hostile_models import MUX_HEADER, REQUEST_TYPES, SMALL_LIMIT, TTRPC_HEADER
from hypothesis import strategies as st
from vectors import load_frames, vector_names

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.nri.mux import MAX_PAYLOAD
from nri_plugin.ttrpc.errors import Code
from nri_plugin.ttrpc.protocol import ClientSession, MessageType, ServerSession, encode_frame

# -- corpus ------------------------------------------------------------------------------------------


def _vector_messages() -> tuple[list[bytes], list[bytes]]:
    """(ttrpc messages, mux wire bytes) of the captured Go vectors; empty lists without them."""
    messages, wires = [], []
    for name in vector_names():
        frames = load_frames(name)
        wires.append(b"".join(frames))
        messages.append(b"".join(frame[MUX_HEADER.size :] for frame in frames))
    return messages, wires


def _own_messages() -> list[bytes]:
    pod = api.PodSandbox(id="s1", uid="u1", name="app", namespace="ns")
    pod.linux.cgroup_parent = "/kubepods/podu1"
    container = api.Container(id="c1", pod_sandbox_id="s1", name="main", env=["A=1"])
    container.linux.resources.cpu.cpus = "4-5"
    client = ClientSession()
    out = []
    for method in sorted(REQUEST_TYPES):
        request = REQUEST_TYPES[method]()
        for name, value in (("pod", pod), ("container", container)):
            if name in request.DESCRIPTOR.fields_by_name:
                getattr(request, name).CopyFrom(value)
        out.append(client.send_request("nri.pkg.api.v1alpha1.Plugin", method, request.SerializeToString())[1])
    server = ServerSession()
    for stream_id in (1, 3, 5):
        server.receive_data(encode_frame(stream_id, MessageType.REQUEST, 0, b""))
    out.append(server.send_response(1, payload=api.ConfigureResponse(events=0x7FF).SerializeToString()))
    out.append(server.send_response(3, code=Code.UNIMPLEMENTED, message="method X"))
    out.append(server.send_response(5))
    out.append(encode_frame(7, MessageType.DATA, 0x04, b""))
    return out


VECTOR_MESSAGES, VECTOR_WIRES = _vector_messages()
CORPUS = VECTOR_MESSAGES + _own_messages()


# -- mutations -----------------------------------------------------------------------------------------


@st.composite
def mutated_message(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(CORPUS)))
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(
            st.sampled_from(["length", "stream", "type", "flags", "flip", "set", "cut", "dup", "insert"])
        )
        if kind in ("length", "stream", "type", "flags") and len(data) < TTRPC_HEADER.size:
            continue  # a cut left no whole header to rewrite
        if kind == "length":
            length = max(0, len(data) - TTRPC_HEADER.size)
            new = draw(
                st.one_of(
                    st.integers(max(0, length - 8), length + 8),
                    st.sampled_from([0, SMALL_LIMIT, SMALL_LIMIT + 1, 4 << 20, (4 << 20) + 1, 0xFFFFFFFF]),
                )
            )
            struct.pack_into(">I", data, 0, new)
        elif kind == "stream":
            struct.pack_into(">I", data, 4, draw(st.sampled_from([0, 1, 2, 3, 0xFFFFFFFF, 0xFFFFFFFE])))
        elif kind == "type":
            data[8] = draw(st.integers(0, 255))
        elif kind == "flags":
            data[9] = draw(st.integers(0, 255))
        elif kind == "flip" and data:
            at = draw(st.integers(0, len(data) - 1))
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        elif kind == "cut":
            at = draw(st.integers(0, len(data)))
            data = data[:at] if draw(st.booleans()) else data[at:]
        elif kind == "dup" and data:
            a = draw(st.integers(0, len(data) - 1))
            b = draw(st.integers(a, len(data)))
            data[b:b] = data[a:b]
        elif kind == "insert":
            at = draw(st.integers(0, len(data)))
            data[at:at] = draw(st.binary(max_size=16))
    return bytes(data)


streams = st.lists(mutated_message(), min_size=1, max_size=4).map(b"".join)


@st.composite
def mutated_wire(draw: st.DrawFn) -> bytes:
    """Mux wire bytes: Go's captured frames or our encoding of the corpus, headers rewritten."""
    wires = VECTOR_WIRES + [MUX_HEADER.pack(1, len(m)) + m for m in CORPUS]
    data = bytearray(b"".join(draw(st.lists(st.sampled_from(wires), min_size=1, max_size=3))))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, max(0, len(data) - MUX_HEADER.size)))
        field = draw(st.sampled_from(["conn", "length", "byte"]))
        if field == "conn" and len(data) >= at + 4:
            struct.pack_into(">I", data, at, draw(st.sampled_from([0, 1, 2, 3, 0xFFFFFFFF])))
        elif field == "length" and len(data) >= at + 8:
            struct.pack_into(
                ">I",
                data,
                at + 4,
                draw(st.sampled_from([0, 1, 4096, MAX_PAYLOAD, MAX_PAYLOAD + 1, 0xFFFFFFFF])),
            )
        elif data:
            data[draw(st.integers(0, len(data) - 1))] ^= 0xFF
    return bytes(data)
