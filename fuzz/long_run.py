#!/usr/bin/env python3
"""Long fuzz run of the NRI plugin's input paths, in process, outside CI.

    python fuzz/long_run.py --inputs 1000000 [--seed N] [--report-every 50000] [--crash-dir DIR]

Each input goes to one of five targets, in turn:

* ``ttrpc``: mutated ttrpc messages (real ones: Go's captured vectors in tests/data/vectors, and
  what our encoder makes for every Plugin method) fed in random splits to `FrameDecoder`
  (the 4 MiB limit and a 64-byte one, so the oversized-frame path runs) and compared with a
  reference parser of the whole input, then to a `ServerSession` and a `ClientSession`;
* ``mux``: mutated mux wire bytes through `MuxDecoder`, compared with a reference parser, and each
  connection's stream through a `ServerSession`;
* ``handler``: a request for a random Plugin method, its payload random bytes, a byte-mutated real
  request, or a runtime-shaped request with hostile fields (path tricks, NUL, newlines, look-alike
  characters, int64 extremes, forged or (a quarter of the time) validly signed markers), sent as a
  ttrpc frame into the real ttrpc `Server` serving the real `Stub`'s methods for the real
  `MixedCpuPlugin` on a fake cgroup tree (no socket);
* ``config``: mutated TOML config files through `load_config`.

A crash is any exception other than the documented ones (ttrpc/mux `ProtocolError`, `ConfigError`),
a handler answering UNKNOWN (the ttrpc server's status for an exception the handler did not expect),
a status the plugin does not use, a reply that does not decode, or a decoder disagreeing with its
reference parser. Each is saved under --crash-dir with its input and traceback. Every
--report-every inputs, and at the end, the fuzz directory is checked: nothing may have been
written outside the fake cgroup tree and the state dir, and in the tree only the quota files of the
pods created at the start. Exit status 0 when no crash was found, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import random
import shutil
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The wire models and hostile values the hostile-input suite uses too.
sys.path.insert(0, str(ROOT / "tests" / "hostile"))

import hostile_models  # noqa: E402
import structlog  # noqa: E402
from hostile_models import (  # noqa: E402
    MUX_HEADER,
    REQUEST_TYPES,
    RESPONSE_TYPES,
    SMALL_LIMIT,
    TTRPC_HEADER,
    mux_incremental,
    mux_reference,
    ttrpc_incremental,
    ttrpc_reference,
)

from nri_plugin.api.nri import api_pb2 as api  # noqa: E402
from nri_plugin.api.ttrpc import request_pb2  # noqa: E402
from nri_plugin.cgroups import CgroupLayout, CgroupMode, Hierarchy  # noqa: E402
from nri_plugin.daemon.config import ConfigError, load_config  # noqa: E402
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key  # noqa: E402
from nri_plugin.deviceplugin.marker import ANNOTATION_KEY, HostKey  # noqa: E402
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin, TrustedSources  # noqa: E402
from nri_plugin.mixedcpu.store import StateStore  # noqa: E402
from nri_plugin.nri.identity import Identity  # noqa: E402
from nri_plugin.nri.mux import MAX_PAYLOAD  # noqa: E402
from nri_plugin.nri.stub import PLUGIN_SERVICE, Stub  # noqa: E402
from nri_plugin.ttrpc.aio import Server  # noqa: E402
from nri_plugin.ttrpc.errors import Code, ProtocolError  # noqa: E402
from nri_plugin.ttrpc.protocol import (  # noqa: E402
    ClientSession,
    MessageType,
    ServerSession,
    encode_frame,
)

VECTOR_DIR = ROOT / "tests" / "data" / "vectors"
PERIOD = 100_000
# Statuses the plugin and its ttrpc server send on purpose.
EXPECTED_CODES = {
    Code.OK,
    Code.INVALID_ARGUMENT,
    Code.RESOURCE_EXHAUSTED,
    Code.FAILED_PRECONDITION,
    Code.UNIMPLEMENTED,
    Code.INTERNAL,
}
TRICKS = [*hostile_models.TRICKS, "a" * 300, "\U0001f600"]
CPU_LISTS = [*hostile_models.CPU_LISTS, "2-3", "6-7", "0-8191", "8192"]
INT64 = [*hostile_models.INT64_EDGES, 1000, 1001]
PODS = [("1111-2222", 200_000), ("3333-4444", None), ("5555-6666", 50_000)]


# -- random values ---------------------------------------------------------------------------------------


class Gen:
    def __init__(self, rng: random.Random, key: HostKey) -> None:
        self.rng = rng
        self.key = key
        self.other_key = HostKey(b"\x01" * 32)

    def text(self) -> str:
        r = self.rng
        kind = r.random()
        if kind < 0.5:
            return "".join(r.choice(TRICKS) for _ in range(r.randint(1, 5)))
        if kind < 0.8:
            return "".join(
                chr(r.choice([r.randint(0, 0x7F), r.randint(0x80, 0xD7FF), r.randint(0xE000, 0x10FFFF)]))
                for _ in range(r.randint(0, 12))
            )
        return r.choice(["", "main", "c-1", "/kubepods/pod1111-2222"])

    def int64(self) -> int:
        return self.rng.choice(INT64) if self.rng.random() < 0.7 else self.rng.randint(-(2**63), 2**63 - 1)

    def marker(self) -> str:
        r = self.rng
        device = f"shared-cpus-{r.randint(0, 300)}"
        kind = r.random()
        if kind < 0.35:
            return self.key.sign(device)
        if kind < 0.5:
            return self.other_key.sign(device)
        if kind < 0.6:
            return self.key.sign(device).replace(device, f"shared-cpus-{r.randint(301, 400)}")
        if kind < 0.8:
            value = bytearray(self.key.sign(device).encode())
            value[r.randrange(len(value))] = r.randint(32, 126)
            return value.decode("latin-1")
        return self.text()

    def annotations(self, name: str) -> dict[str, str]:
        r = self.rng
        out: dict[str, str] = {}
        if r.random() < 0.6:
            out[ANNOTATION_KEY] = self.marker()
        if r.random() < 0.2:
            out[f"cpu-shared.crio.io/{name}"] = r.choice(["enable", "true", self.text()])
        if r.random() < 0.2:
            out[self.text()] = self.text()
        return out

    def env(self) -> list[str]:
        pool = [
            "OPENSHIFT_SHARED_CPUS=0-1",
            "OPENSHIFT_ISOLATED_CPUS=4-5",
            "OPENSHIFT_MUTUAL_CPUS=0-1",
            "PATH=/bin",
        ]
        return [
            self.rng.choice(pool) if self.rng.random() < 0.7 else self.text()
            for _ in range(self.rng.randint(0, 4))
        ]

    def spoil(self) -> set[str]:
        fields = [
            "uid",
            "parent",
            "cid",
            "name",
            "cpus",
            "quota",
            "period",
            "shares",
            "state",
            "pod_resources",
            "sandbox",
        ]
        return set(self.rng.sample(fields, self.rng.randint(0, 3)))

    def pod(self, spoiled: set[str]) -> api.PodSandbox:
        r = self.rng
        uid, _quota = r.choice(PODS)
        pod = api.PodSandbox(id=f"sandbox-{uid}", uid=uid, name="app", namespace="ns")
        pod.linux.cgroup_parent = f"/kubepods/pod{uid}"
        if "uid" in spoiled:
            pod.uid = self.text()
        if "sandbox" in spoiled:
            pod.id = self.text()
        if "parent" in spoiled:
            pod.linux.cgroup_parent = (
                r.choice(["", "/kubepods/", "kubepods-pod", "/kubepods/pod1111-2222/"]) + self.text()
            )
        if "pod_resources" in spoiled:
            cpu = pod.linux.pod_resources.cpu
            cpu.quota.value = self.int64()
            cpu.period.value = r.choice([100_000, 0, 2**64 - 1, r.randint(0, 2**64 - 1)])
        if r.random() < 0.1:
            pod.annotations["cpu-shared.crio.io/main"] = "enable"
        return pod

    def container(self, pod: api.PodSandbox, spoiled: set[str]) -> api.Container:
        r = self.rng
        name = self.text() if "name" in spoiled else r.choice(["main", "side", "fwd"])
        cid = self.text() if "cid" in spoiled else f"c-{r.randint(0, 50)}"
        container = api.Container(
            id=cid,
            pod_sandbox_id=pod.id,
            name=name,
            env=self.env(),
            annotations=self.annotations(name),
            state=api.ContainerState.ValueType(r.randint(-1, 6))
            if "state" in spoiled
            else api.CONTAINER_RUNNING,
            created_at=self.int64(),
        )
        container.linux.cgroups_path = f"{pod.linux.cgroup_parent}/{cid}"
        cpu = container.linux.resources.cpu
        cpu.cpus = r.choice(CPU_LISTS) if "cpus" in spoiled else r.choice(["4-5", "2-3", "6-7"])
        if "quota" not in spoiled or r.random() < 0.5:
            cpu.quota.value = self.int64() if "quota" in spoiled else 200_000
        if "period" not in spoiled or r.random() < 0.5:
            cpu.period.value = r.randint(0, 2**64 - 1) if "period" in spoiled else PERIOD
        if "shares" not in spoiled or r.random() < 0.5:
            cpu.shares.value = r.randint(0, 2**64 - 1) if "shares" in spoiled else 2048
        return container

    def request(self, method: str) -> Any:
        r = self.rng
        spoiled = self.spoil()
        pod = self.pod(spoiled)
        container = self.container(pod, spoiled)
        cls: type[Any] = REQUEST_TYPES[method]
        if method == "Synchronize":
            pods = [pod, *(self.pod(self.spoil()) for _ in range(r.randint(0, 2)))]
            containers = [
                container,
                *(self.container(r.choice(pods), self.spoil()) for _ in range(r.randint(0, 3))),
            ]
            return api.SynchronizeRequest(pods=pods, containers=containers, more=r.random() < 0.1)
        if method == "Configure":
            return api.ConfigureRequest(
                runtime_name=r.choice(["containerd", "cri-o", self.text()]),
                runtime_version=r.choice(["v2.3.4", "v1.33.0", self.text()]),
                NRI_version=r.choice(["v0.12.0", "", self.text()]),
                registration_timeout=self.int64(),
                request_timeout=self.int64(),
            )
        if method == "StateChange":
            event = api.Event.ValueType(r.randint(-1, 16))
            return api.StateChangeEvent(event=event, pod=pod, container=container)
        if method == "Shutdown":
            return api.Empty()
        request = cls()
        fields = cls.DESCRIPTOR.fields_by_name
        if "pod" in fields:
            request.pod.CopyFrom(pod)
        if "container" in fields:
            request.container.CopyFrom(container)
        if "linux_resources" in fields:
            request.linux_resources.cpu.cpus = r.choice(CPU_LISTS)
            if r.random() < 0.5:
                request.linux_resources.cpu.quota.value = self.int64()
        return request


def mutate(rng: random.Random, data: bytes, header: int = 0) -> bytes:
    """A few byte-level (and, with `header` = 10 or 8, header-field) mutations of `data`."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(7 if header else 5)
        if kind == 0 and out:
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        elif kind == 1 and out:
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif kind == 2:
            at = rng.randint(0, len(out))
            out = out[:at] if rng.random() < 0.5 else out[at:]
        elif kind == 3 and out:
            a = rng.randrange(len(out))
            b = rng.randint(a, min(len(out), a + 64))
            out[b:b] = out[a:b]
        elif kind == 4:
            at = rng.randint(0, len(out))
            out[at:at] = rng.randbytes(rng.randint(1, 16))
        elif kind == 5 and len(out) >= header:
            value = rng.choice(
                [0, 1, 2, 3, 64, 65, 4 << 20, (4 << 20) + 1, MAX_PAYLOAD + 1, 0xFFFFFFFF, rng.getrandbits(32)]
            )
            struct.pack_into(">I", out, rng.choice([0, 4]), value)
        elif kind == 6 and len(out) >= header and header == 10:
            out[rng.choice([8, 9])] = rng.randrange(256)
    return bytes(out)


def splits(rng: random.Random, data: bytes) -> list[bytes]:
    cuts = sorted(rng.randint(0, len(data)) for _ in range(rng.randint(0, 8)))
    return [c for c in (data[a:b] for a, b in itertools.pairwise([0, *cuts, len(data)])) if c]


def vector_frames() -> list[list[bytes]]:
    """The mux frames (as on the wire) of each captured Go vector."""
    return [
        [
            bytes.fromhex(line.strip())
            for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")
        ]
        for path in sorted(VECTOR_DIR.glob("*.hex"))
    ]


class Finding(Exception):
    """Not a crash of the code under test but a wrong result (a mismatch, a bad status)."""


def check_session_replies(replies: list[bytes]) -> None:
    for message in replies:
        type_ = TTRPC_HEADER.unpack_from(message)[2]
        response = request_pb2.Response.FromString(message[TTRPC_HEADER.size :])
        if type_ != MessageType.RESPONSE or response.status.code not in (3, 8, 13):
            raise Finding(f"session reply type {type_} code {response.status.code}")


# -- the fuzzer -------------------------------------------------------------------------------------------


class Fuzzer:
    def __init__(self, seed: int, work: Path, crash_dir: Path) -> None:
        self.rng = random.Random(seed)
        self.work = work
        self.crash_dir = crash_dir
        self.counts: Counter[str] = Counter()
        self.crashes: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.saved: set[str] = set()
        self.handler_errors: list[str] = []
        self.tree_root = work / "cgroup"
        self.state_dir = work / "state"
        self.key = load_or_create_host_key(self.state_dir)
        self.gen = Gen(self.rng, self.key)
        self.corpus = self._corpus()
        self.wires = self._wires()
        self.configs = self._configs()
        self._make_tree()
        self.allowed_changes = {
            str(self.tree_root / "cpu" / "kubepods" / f"pod{uid}" / "cpu.cfs_quota_us") for uid, _ in PODS
        }
        self.baseline = self._snapshot()
        self.server: Server | None = None
        self.current = b""
        self.outbox: list[bytes] = []
        self.stream_id = 1
        self._new_plugin()

    # setup

    def _make_tree(self) -> None:
        for sub in ("cpu", "cpuset"):
            (self.tree_root / sub).mkdir(parents=True, exist_ok=True)
        for uid, quota in PODS:
            pod = self.tree_root / "cpu" / "kubepods" / f"pod{uid}"
            pod.mkdir(parents=True, exist_ok=True)
            (pod / "cpu.cfs_quota_us").write_text(f"{-1 if quota is None else quota}\n")
            (pod / "cpu.cfs_period_us").write_text(f"{PERIOD}\n")
        decoy = self.work / "outside" / "kubepods" / "podvictim"
        decoy.mkdir(parents=True, exist_ok=True)
        (decoy / "cpu.cfs_quota_us").write_text("100000\n")
        (decoy / "cpu.cfs_period_us").write_text("100000\n")
        trap = self.tree_root / "cpu" / "kubepods" / "pod-trap"
        if not trap.is_symlink():
            os.symlink(decoy, trap)

    def _reset_tree(self) -> None:
        for uid, quota in PODS:
            pod = self.tree_root / "cpu" / "kubepods" / f"pod{uid}"
            (pod / "cpu.cfs_quota_us").write_text(f"{-1 if quota is None else quota}\n")

    def _new_plugin(self) -> None:
        """A fresh plugin (and stub and ttrpc server), as after a restart; the state file stays."""
        layout = CgroupLayout(
            CgroupMode.V1,
            Hierarchy(1, str(self.tree_root / "cpu")),
            Hierarchy(1, str(self.tree_root / "cpuset")),
        )
        self.plugin = MixedCpuPlugin(
            shared=frozenset({0, 1}),
            layout=layout,
            store=StateStore(self.state_dir),
            trusted=TrustedSources(self.key, pod_annotation=self.rng.random() < 0.3),
        )
        self.stub = Stub(
            self.plugin,
            identity=Identity(name="fuzz", index="10"),
            socket_path="/nonexistent",
            reconnect=False,
        )
        self._new_server()

    def _new_server(self) -> None:
        self.outbox = []
        self.server = Server({PLUGIN_SERVICE: self.stub._methods()}, self.outbox.append)
        self.stream_id = 1

    def _corpus(self) -> list[bytes]:
        out = [b"".join(frame[MUX_HEADER.size :] for frame in frames) for frames in vector_frames()]
        client = ClientSession()
        for method in sorted(REQUEST_TYPES):
            for _ in range(3):
                payload = self.gen.request(method).SerializeToString()
                out.append(client.send_request(PLUGIN_SERVICE, method, payload)[1])
        server = ServerSession()
        for stream_id in (1, 3):
            server.receive_data(encode_frame(stream_id, MessageType.REQUEST, 0, b""))
        out.append(server.send_response(1, payload=api.ConfigureResponse(events=0x7FF).SerializeToString()))
        out.append(server.send_response(3, code=Code.UNIMPLEMENTED, message="method X"))
        out.append(encode_frame(5, MessageType.DATA, 4, b""))
        return out

    def _wires(self) -> list[bytes]:
        return [MUX_HEADER.pack(1, len(m)) + m for m in self.corpus] + [
            b"".join(frames) for frames in vector_frames()
        ]

    def _configs(self) -> list[bytes]:
        return [
            b'shared_cpuset = "0-1"\n',
            b'shared_cpuset = "0-1"\nplugin_name = "mixed-cpu"\nplugin_index = "10"\nlog_level = "info"\n'
            b'log_format = "json"\nmetrics_address = "127.0.0.1:8891"\n[trusted_sources]\n'
            b"device_plugin_marker = true\npod_annotation = false\n[device_plugin]\nenabled = true\n"
            b'device_count = 256\nplugin_dir = "/var/lib/kubelet/device-plugins"\n',
            b'shared_cpuset = "0-1"\nx = [[1, 2], {a = 1}]\nt = 1979-05-27T07:32:00Z\n',
        ]

    # one input

    def one(self, index: int) -> None:
        target = ("ttrpc", "mux", "handler", "handler", "config")[index % 5]
        self.counts[target] += 1
        data: bytes = b""
        try:
            if target == "ttrpc":
                data = b"".join(
                    mutate(self.rng, self.rng.choice(self.corpus), 10) for _ in range(self.rng.randint(1, 3))
                )
                self.fuzz_ttrpc(data)
            elif target == "mux":
                data = b"".join(
                    mutate(self.rng, self.rng.choice(self.wires), 8) for _ in range(self.rng.randint(1, 3))
                )
                self.fuzz_mux(data)
            elif target == "handler":
                self.current = b""
                self.fuzz_handler()
                data = self.current
            else:
                data = mutate(self.rng, self.rng.choice(self.configs))
                self.fuzz_config(data)
        except Exception as exc:  # a crash: recorded, and the run goes on
            self.crash(target, self.current if target == "handler" else data, exc)

    def fuzz_ttrpc(self, data: bytes) -> None:
        limit = self.rng.choice([SMALL_LIMIT, 4 << 20])
        eof = self.rng.random() < 0.5
        chunks = splits(self.rng, data)
        got, want = ttrpc_incremental(chunks, limit, eof), ttrpc_reference(data, limit, eof)
        if got != want:
            raise Finding(f"FrameDecoder disagrees with the reference: {got!r:.200} != {want!r:.200}")
        session = ServerSession(limit)
        replies: list[bytes] = []
        try:
            for chunk in chunks:
                session.receive_data(chunk)
                replies += session.messages_to_send()
        except ProtocolError:
            self.outcomes["ttrpc protocol error"] += 1
        check_session_replies(replies)
        client = ClientSession(limit)
        for _ in range(3):
            client.send_request("s", "m", b"")
        with contextlib.suppress(ProtocolError):
            for chunk in chunks:
                client.receive_data(chunk)

    def fuzz_mux(self, data: bytes) -> None:
        eof = self.rng.random() < 0.5
        chunks = splits(self.rng, data)
        got, want = mux_incremental(chunks, eof), mux_reference(data, eof)
        if got != want:
            raise Finding(f"MuxDecoder disagrees with the reference: {got!r:.200} != {want!r:.200}")
        sessions: dict[int, ServerSession] = {}
        for frame in got[0]:
            session = sessions.setdefault(frame.conn_id, ServerSession())
            if frame.payload:
                try:
                    session.receive_data(frame.payload)
                except ProtocolError:
                    sessions[frame.conn_id] = ServerSession()
                    self.outcomes["mux+ttrpc protocol error"] += 1
                check_session_replies(session.messages_to_send())

    def fuzz_handler(self) -> None:
        r = self.rng
        method = r.choice(sorted(REQUEST_TYPES))
        kind = r.random()
        if kind < 0.15:
            payload = r.randbytes(r.randint(0, 300))
        elif kind < 0.35:
            payload = mutate(r, self.gen.request(method).SerializeToString())
        else:
            payload = self.gen.request(method).SerializeToString()
        assert self.server is not None
        self.current = method.encode() + b"\n" + payload  # saved with a crash
        envelope = request_pb2.Request(
            service=PLUGIN_SERVICE, method=method, payload=payload, timeout_nano=2_000_000_000
        )
        frame = encode_frame(self.stream_id, MessageType.REQUEST, 0, envelope.SerializeToString())
        self.stream_id += 2
        self.outbox.clear()
        self.handler_errors.clear()
        self.server.data_received(frame)
        if not self.outbox:
            raise Finding(f"{method}: no reply without suspending (a handler waited?)")
        (reply,) = self.outbox
        response = request_pb2.Response.FromString(reply[TTRPC_HEADER.size :])
        code = response.status.code
        self.outcomes[f"{method} {Code(code).name if code in set(Code) else code}"] += 1
        if code not in EXPECTED_CODES:
            detail = self.handler_errors[0] if self.handler_errors else response.status.message
            raise Finding(f"{method} answered code {code}: {detail}")
        if code == Code.OK:
            reply_message = RESPONSE_TYPES[method].FromString(response.payload)
            if method == "CreateContainer" and reply_message.HasField("adjust"):
                self.outcomes["CreateContainer granted"] += 1
            elif getattr(reply_message, "update", None):
                self.outcomes[f"{method} with updates"] += 1

    def fuzz_config(self, data: bytes) -> None:
        path = self.work / "config.toml"
        path.write_bytes(data)
        try:
            load_config(path, check=False)
            self.outcomes["config ok"] += 1
        except ConfigError as exc:
            if not str(exc).isprintable():
                raise Finding(f"config error is not one printable line: {str(exc)!r}") from None
            self.outcomes["config error"] += 1

    # bookkeeping

    def crash(self, target: str, data: bytes, exc: BaseException) -> None:
        kind = f"{target}: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        self.crashes[kind] += 1
        if kind in self.saved or len(self.saved) >= 50:
            return
        self.saved.add(kind)
        self.crash_dir.mkdir(parents=True, exist_ok=True)
        name = f"{target}-{hashlib.sha256(data).hexdigest()[:12]}"
        (self.crash_dir / f"{name}.bin").write_bytes(data)
        (self.crash_dir / f"{name}.txt").write_text(
            kind + "\n\n" + "".join(traceback.format_exception(exc)) + "\n".join(self.handler_errors)
        )

    def _snapshot(self) -> dict[str, bytes | str]:
        seen: dict[str, bytes | str] = {}
        for directory, dirnames, filenames in os.walk(self.work):
            for name in dirnames + filenames:
                path = Path(directory, name)
                if (
                    path == self.state_dir
                    or path.parent == self.state_dir
                    or path == self.work / "config.toml"
                ):
                    continue
                if path.is_symlink():
                    seen[str(path)] = "link:" + os.readlink(path)
                elif path.is_file():
                    seen[str(path)] = path.read_bytes()
                else:
                    seen[str(path)] = "dir"
        return seen

    def check_escapes(self) -> list[str]:
        now = self._snapshot()
        changed = {p for p in self.baseline.keys() | now.keys() if self.baseline.get(p) != now.get(p)}
        return sorted(changed - self.allowed_changes)


class _Collect(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.ERROR)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info))
        self.sink.append(text)


async def run(args: argparse.Namespace) -> int:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    work = Path(tempfile.mkdtemp(prefix="nri-fuzz-"))
    fuzzer = Fuzzer(args.seed, work, Path(args.crash_dir))
    logging.getLogger().addHandler(_Collect(fuzzer.handler_errors))
    logging.getLogger().setLevel(logging.ERROR)
    loop_errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: loop_errors.append(context))
    escapes: list[str] = []
    start = time.monotonic()
    print(f"fuzzing {args.inputs} inputs, seed {args.seed}, work dir {work}", flush=True)
    try:
        for index in range(args.inputs):
            fuzzer.one(index)
            if index % 64 == 63:
                await asyncio.sleep(0)  # let timers (deferred state flushes, lowering retries) run
            if index % 20_000 == 19_999:
                fuzzer._new_plugin()  # as after a restart: the books come back from the state file
                fuzzer._reset_tree()
            if (index + 1) % args.report_every == 0 or index + 1 == args.inputs:
                escapes = fuzzer.check_escapes()
                elapsed = time.monotonic() - start
                print(
                    f"{index + 1:>9} inputs  {elapsed:8.1f} s  {(index + 1) / elapsed:7.0f}/s  "
                    f"crashes {sum(fuzzer.crashes.values())}  escapes {len(escapes)}",
                    flush=True,
                )
                if escapes:
                    break
    finally:
        fuzzer.plugin.flush()
        fuzzer.plugin.quotas.cancel_retries()
    elapsed = time.monotonic() - start
    total = sum(fuzzer.counts.values())
    crashes = sum(fuzzer.crashes.values()) + len(loop_errors)
    print()
    print(f"inputs: {total} in {elapsed:.1f} s ({total / elapsed:.0f}/s), seed {args.seed}")
    print("by target: " + ", ".join(f"{k} {v}" for k, v in sorted(fuzzer.counts.items())))
    print(f"crashes: {crashes}" + (f" (saved in {args.crash_dir})" if crashes else ""))
    for kind, count in fuzzer.crashes.most_common():
        print(f"  {count:>7}  {kind}")
    for context in loop_errors[:5]:
        print(f"  loop error: {context.get('message')} {context.get('exception')!r}")
    print(f"escapes (writes outside the pods' quota files): {len(escapes)}")
    for path in escapes[:20]:
        print(f"  {path}")
    if args.verbose:
        print("outcomes:")
        for kind, count in sorted(fuzzer.outcomes.items()):
            print(f"  {count:>8}  {kind}")
    shutil.rmtree(work, ignore_errors=True)
    return 1 if crashes or escapes else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--report-every", type=int, default=50_000)
    parser.add_argument("--crash-dir", default=str(Path(__file__).resolve().parent / "crashes"))
    parser.add_argument("-v", "--verbose", action="store_true", help="also print every outcome's count")
    args = parser.parse_args(argv)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
