"""Bad frames on the real socket: exact ttrpc errors, oversized frames, mux violations and garbage.

Against the real stub and plugin over a real unix socket (see `hostile_support`): what the ttrpc
layer refuses by itself gets Go's status codes and texts and leaves the connection usable; a mux
violation (a frame over the cap, connection id 0) closes the trunk and the stub reconnects and
registers again with its books intact; arbitrary garbage on the socket never crashes or hangs the
plugin.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hostile_corpus import mutated_wire
from hostile_models import MUX_HEADER
from hostile_support import PERIOD, Node, granted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.api.ttrpc import request_pb2
from nri_plugin.nri.mux import MAX_PAYLOAD, PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN
from nri_plugin.nri.stub import PLUGIN_SERVICE, RUNTIME_SERVICE
from nri_plugin.ttrpc.errors import Code
from nri_plugin.ttrpc.protocol import MAX_DATA, MessageType, encode_frame


def _envelope(method: str, payload: bytes = b"", service: str = PLUGIN_SERVICE) -> bytes:
    return request_pb2.Request(service=service, method=method, payload=payload).SerializeToString()


def _legit(node: Node) -> api.PodSandbox:
    pod = node.pod("0000-1111", "legit")
    container = node.container(pod, "legit-c", "fwd", annotations=node.marker("shared-cpus-0"))
    reply = node.run(node.create(pod, container))
    assert granted("CreateContainer", reply)
    node.running(pod, container, reply)
    return pod


def test_exact_errors_for_what_the_ttrpc_layer_refuses(tmp_path: Path) -> None:
    with Node(tmp_path) as node:
        channel = node.channel

        async def refused(stream_id: int, frame: bytes) -> tuple[int, str]:
            channel.send_raw(frame)
            reply = await channel.response(stream_id)
            await node.healthy()
            return reply.code, reply.message

        async def scenario() -> None:
            nope = "nri.pkg.api.v1alpha1.Nope"
            assert (await channel.call("Configure", b"", service=nope)).code == Code.UNIMPLEMENTED
            cases = {
                ("service", nope): (Code.UNIMPLEMENTED, f"service {nope}"),
                ("service", RUNTIME_SERVICE): (Code.UNIMPLEMENTED, f"service {RUNTIME_SERVICE}"),
                ("method", "Frobnicate"): (Code.UNIMPLEMENTED, "method Frobnicate"),
                ("method", ""): (Code.UNIMPLEMENTED, "method "),
                ("method", "configure"): (Code.UNIMPLEMENTED, "method configure"),  # names are exact
                ("method", "Configure\0"): (Code.UNIMPLEMENTED, "method Configure\0"),
            }
            for (kind, name), expected in cases.items():
                service, method = (name, "Configure") if kind == "service" else (PLUGIN_SERVICE, name)
                reply = await channel.call(method, b"", service=service)
                assert (reply.code, reply.message) == expected
                await node.healthy()
            # Stream ids: even, reused or lower; a Data frame; a Response frame sent to the server.
            even = channel.allocate() + 1
            frame = encode_frame(even, MessageType.REQUEST, 0, _envelope("Shutdown"))
            assert await refused(even, frame) == (
                Code.INVALID_ARGUMENT,
                "StreamID must be odd for client initiated streams",
            )
            used = channel.next_id
            frame = encode_frame(used, MessageType.REQUEST, 0, _envelope("Shutdown"))
            assert await refused(used, frame) == (
                Code.INVALID_ARGUMENT,
                "StreamID cannot be re-used and must increment",
            )
            data = channel.allocate()
            frame = encode_frame(data, MessageType.DATA, 0, b"x")
            assert await refused(data, frame) == (Code.INVALID_ARGUMENT, "StreamID is no longer active")
            channel.send_raw(encode_frame(channel.allocate(), MessageType.RESPONSE, 0, b""))  # ignored
            await node.healthy()
            # Envelope and payload that do not decode.
            bad = channel.allocate()
            code, message = await refused(bad, encode_frame(bad, MessageType.REQUEST, 0, b"\xff\xff"))
            assert code == Code.INTERNAL
            assert message.startswith("ttrpc: error unmarshalling request: ")
            bad = channel.allocate()
            frame = encode_frame(bad, MessageType.REQUEST, 0, _envelope("CreateContainer", b"\x0a\xff"))
            code, message = await refused(bad, frame)
            assert code == Code.INTERNAL
            assert message.startswith("ttrpc: error unmarshalling payload: ")
            assert not channel.stray

        node.run(scenario(), 30)


def test_oversized_ttrpc_message_is_refused_and_the_connection_goes_on(tmp_path: Path) -> None:
    with Node(tmp_path, reconnect=True) as node:
        legit = _legit(node)

        async def scenario() -> None:
            assert node.connection is not None
            trunk, channel = node.connection.trunk, node.channel
            # One byte over the limit, sent in full through the mux (as 1 MiB mux messages).
            stream_id = channel.allocate()
            header = encode_frame(stream_id, MessageType.REQUEST, 0, b"")[:10]
            size = MAX_DATA + 1
            trunk.send(PLUGIN_SERVICE_CONN, (size).to_bytes(4, "big") + header[4:])
            for start in range(0, size, 1 << 20):
                trunk.send(PLUGIN_SERVICE_CONN, b"\0" * min(1 << 20, size - start))
            reply = await channel.response(stream_id)
            assert (reply.code, reply.message) == (
                Code.RESOURCE_EXHAUSTED,
                f"message length {size} exceed maximum message size of {MAX_DATA}",
            )
            await node.healthy()
            # A header announcing 4 GiB is answered at once, before any of its data: the connection
            # then belongs to that frame's data, so the runtime side gives up on it.
            stream_id = channel.allocate()
            header = encode_frame(stream_id, MessageType.REQUEST, 0, b"")[:10]
            trunk.send(PLUGIN_SERVICE_CONN, b"\xff\xff\xff\xff" + header[4:])
            reply = await channel.response(stream_id)
            assert reply.code == Code.RESOURCE_EXHAUSTED
            assert reply.message == f"message length {0xFFFFFFFF} exceed maximum message size of {MAX_DATA}"
            trunk.close()
            await node.next_connection()
            await node.healthy()

        node.run(scenario(), 30)
        assert node.tree.pod_quota(legit) == 4 * PERIOD


def test_mux_violations_close_the_trunk_and_the_plugin_comes_back(tmp_path: Path) -> None:
    with Node(tmp_path, reconnect=True) as node:
        legit = _legit(node)
        books = node.plugin.books.copy()
        violations = [
            MUX_HEADER.pack(PLUGIN_SERVICE_CONN, MAX_PAYLOAD + 1),  # over the cap, refused unread
            MUX_HEADER.pack(RUNTIME_SERVICE_CONN, 0xFFFFFFFF),
            MUX_HEADER.pack(0, 4) + b"abcd",  # the reserved connection id
        ]

        async def scenario() -> None:
            for violation in violations:
                assert node.connection is not None
                first = node.connection
                first.trunk.write_raw(violation)
                await first.trunk.wait_closed()
                await node.next_connection()
                await node.healthy()
                assert node.plugin.books == books

        node.run(scenario(), 30)
        assert node.tree.pod_quota(legit) == 4 * PERIOD
        assert node.stub is not None
        assert node.stub.connections == 1 + len(violations)


def test_garbage_on_the_socket_never_crashes_or_hangs_the_plugin(tmp_path: Path) -> None:
    with Node(tmp_path, reconnect=True) as node:
        legit = _legit(node)
        expected = {"books": node.plugin.books.copy()}
        assert node.stub is not None
        stub = node.stub

        @settings(max_examples=20, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
        @given(
            st.one_of(
                st.binary(max_size=200),
                mutated_wire(),
                st.builds(
                    lambda conn, data: MUX_HEADER.pack(conn, len(data)) + data,
                    st.sampled_from([1, 2, 7]),
                    st.binary(max_size=100),
                ),
            )
        )
        def check(garbage: bytes) -> None:
            synchronizations = stub.synchronizations

            async def scenario() -> None:
                assert node.connection is not None
                node.connection.trunk.write_raw(garbage)
                # Whatever the plugin made of it, this runtime hangs up and lets the plugin come back.
                node.connection.trunk.close()
                await node.next_connection()
                await node.healthy()

            node.run(scenario(), 10)
            books = expected["books"]
            if stub.synchronizations > synchronizations + 1:
                # Besides the reconnection's, the garbage held a well-formed Synchronize (the corpus
                # has some, without the legit pod): the runtime said the pod was gone, so the plugin
                # forgot it and, synchronized with it again, rebuilt its record from the pod quota
                # (same baseline, containers and device bindings; only the provenance says so).
                books = books.copy()
                books.pods[legit.uid] = replace(books.pods[legit.uid], baseline_source="rebuilt")
                expected["books"] = books
            assert node.plugin.books == books

        check()
        assert node.tree.pod_quota(legit) == 4 * PERIOD
