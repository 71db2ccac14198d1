"""A fake kubelet for DRA drivers: its plugin watcher and its DRA manager, as far as a driver sees them.

Independent of the code under test: it does not import our generated modules (api.dra,
api.pluginregistration, api.drahealth). Requests are encoded and answers decoded by hand, from the
field numbers of kubelet's own protos (k8s.io/kubelet pkg/apis/pluginregistration/v1, dra/v1,
dra-health/v1 and v1alpha1), with a small protobuf writer/reader below, and the calls go out through grpc with
identity (bytes) serializers on the upstream method paths. If our protos had a wrong number, name,
package or type, these calls would fail or decode to something else.

What it does, in kubelet's order: find ``*-reg.sock`` files in the registry directory, call GetInfo,
check the type and the versions, dial the announced endpoint, report with NotifyRegistrationStatus;
then NodePrepareResources / NodeUnprepareResources / NodeWatchResources on the endpoint. And what
its DRA plugin manager does to the API server: delete the node's ResourceSlices (DeleteCollection by
field selector) of every driver when kubelet starts, and of one driver once that driver has been
unusable for its wiping delay (30 s), see :meth:`FakeKubeletDra.wipe_resource_slices`.

Which health service it opens depends on the kubelet release it plays (`minor`): 1.34-1.36 have only
the v1alpha1 client and open ``/v1alpha1.DRAResourceHealth/NodeWatchResources`` on every plugin
(with their ResourceHealthStatus gate on), whatever it announced; later ones take v1 when the plugin
announces ``v1.DRAResourceHealth``, else v1alpha1 when it announces that, else none.
"""

from __future__ import annotations

import os
import stat
import urllib.parse
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx2

# Method paths: the upstream packages and services.
GET_INFO = "/pluginregistration.Registration/GetInfo"
NOTIFY = "/pluginregistration.Registration/NotifyRegistrationStatus"
PREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
UNPREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"
HEALTH_METHOD = "/{}/NodeWatchResources"  # the service as announced: "v1.DRAResourceHealth", ...

DRA_PLUGIN_TYPE = "DRAPlugin"
KUBELET_VERSIONS = ("v1.DRAPlugin",)  # what this kubelet speaks (1.34+)
HEALTH_VERSION = "v1.DRAResourceHealth"
HEALTH_VERSION_ALPHA = "v1alpha1.DRAResourceHealth"
HEALTHY = 1  # HealthStatus, the same in v1 and v1alpha1
CALL_TIMEOUT = 15.0  # against hangs only

VARINT, I64, LEN, I32 = 0, 1, 2, 5


# -- a tiny protobuf writer and reader -------------------------------------------------------------------


def varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tag(number: int, wire: int) -> bytes:
    return varint(number << 3 | wire)


def string_field(number: int, value: str) -> bytes:
    return length_delimited(number, value.encode())


def length_delimited(number: int, data: bytes) -> bytes:
    return tag(number, LEN) + varint(len(data)) + data


def bool_field(number: int, value: bool) -> bytes:
    return tag(number, VARINT) + varint(int(value)) if value else b""


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("varint cut short")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def read_fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) for every field of a message: ints for varints and fixed, bytes for LEN."""
    fields: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == VARINT:
            value, pos = _read_varint(data, pos)
        elif wire == LEN:
            size, pos = _read_varint(data, pos)
            value, pos = data[pos : pos + size], pos + size
            if len(value) != size:
                raise ValueError("LEN field cut short")
        elif wire == I64:
            value, pos = int.from_bytes(data[pos : pos + 8], "little"), pos + 8
        elif wire == I32:
            value, pos = int.from_bytes(data[pos : pos + 4], "little"), pos + 4
        else:
            raise ValueError(f"wire type {wire} not expected")
        fields.append((number, value))
    return fields


def _strings(fields: list[tuple[int, int | bytes]], number: int) -> list[str]:
    return [v.decode() for n, v in fields if n == number and isinstance(v, bytes)]


def _string(fields: list[tuple[int, int | bytes]], number: int) -> str:
    values = _strings(fields, number)
    return values[-1] if values else ""


def _int(fields: list[tuple[int, int | bytes]], number: int) -> int:
    values = [v for n, v in fields if n == number and isinstance(v, int)]
    return values[-1] if values else 0


def _messages(fields: list[tuple[int, int | bytes]], number: int) -> list[list[tuple[int, int | bytes]]]:
    return [read_fields(v) for n, v in fields if n == number and isinstance(v, bytes)]


# -- the messages ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    namespace: str
    name: str
    uid: str

    def encode(self) -> bytes:  # dra.v1 Claim: namespace = 1, uid = 2, name = 3
        return string_field(1, self.namespace) + string_field(2, self.uid) + string_field(3, self.name)


@dataclass(frozen=True)
class Device:
    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]


@dataclass(frozen=True)
class Prepared:
    devices: tuple[Device, ...]
    error: str


@dataclass(frozen=True)
class PluginInfo:
    type: str
    name: str
    endpoint: str
    supported_versions: tuple[str, ...]


@dataclass(frozen=True)
class DeviceHealth:
    pool_name: str
    device_name: str
    health: int
    last_updated_time: int


def cdi_devices_for(prepared: Prepared, request: str) -> list[str]:
    """The CDI devices kubelet hands the runtime for a container whose ``resources.claims`` entry
    names this claim and `request` ("" for the whole claim): those of every prepared device whose
    request_names hold `request` (or that names none)."""
    return [
        cdi_id
        for device in prepared.devices
        if not request or not device.request_names or request in device.request_names
        for cdi_id in device.cdi_device_ids
    ]


def encode_claims(claims: list[Claim]) -> bytes:
    # Node(Un)PrepareResourcesRequest: repeated Claim claims = 1
    return b"".join(length_delimited(1, c.encode()) for c in claims)


def decode_plugin_info(data: bytes) -> PluginInfo:
    f = read_fields(data)
    return PluginInfo(_string(f, 1), _string(f, 2), _string(f, 3), tuple(_strings(f, 4)))


def _map_entries(data: bytes) -> dict[str, list[tuple[int, int | bytes]]]:
    """A map<string, Message> in field 1: each entry a message with key = 1, value = 2."""
    entries = {}
    for entry in _messages(read_fields(data), 1):
        value = _messages(entry, 2)
        entries[_string(entry, 1)] = value[0] if value else []
    return entries


def decode_prepare_response(data: bytes) -> dict[str, Prepared]:
    answers = {}
    for uid, value in _map_entries(data).items():
        devices = tuple(
            Device(tuple(_strings(d, 1)), _string(d, 2), _string(d, 3), tuple(_strings(d, 4)))
            for d in _messages(value, 1)
        )
        answers[uid] = Prepared(devices, _string(value, 2))
    return answers


def decode_unprepare_response(data: bytes) -> dict[str, str]:
    return {uid: _string(value, 1) for uid, value in _map_entries(data).items()}


def decode_health(data: bytes) -> list[DeviceHealth]:
    out = []
    for entry in _messages(read_fields(data), 1):
        ident = _messages(entry, 1)
        ident_fields = ident[0] if ident else []
        out.append(
            DeviceHealth(_string(ident_fields, 1), _string(ident_fields, 2), _int(entry, 2), _int(entry, 3))
        )
    return out


# -- kubelet ------------------------------------------------------------------------------------------


def _identity(data: bytes) -> bytes:
    return data


_BYTES: dict[str, Any] = {"request_serializer": _identity, "response_deserializer": _identity}


class RegistrationRefused(Exception):
    """What kubelet's DRA handler would refuse the plugin for (also sent in NotifyRegistrationStatus)."""


@dataclass
class Registered:
    """A plugin kubelet took: its info and the channel to its endpoint."""

    info: PluginInfo
    channel: grpc.aio.Channel


def health_service(minor: int, supported_versions: tuple[str, ...]) -> str | None:
    """The health service a kubelet 1.`minor` opens on a plugin announcing `supported_versions`."""
    if minor <= 36:
        return HEALTH_VERSION_ALPHA
    for service in (HEALTH_VERSION, HEALTH_VERSION_ALPHA):
        if service in supported_versions:
            return service
    return None


@dataclass
class FakeKubeletDra:
    registry_dir: Path
    minor: int = 37  # the kubelet release played: 1.<minor>
    plugins: dict[str, Registered] = field(default_factory=dict)  # by driver name
    get_info_calls: int = 0

    def registration_sockets(self) -> list[Path]:
        """The ``*-reg.sock`` sockets in the registry directory, as the plugin watcher sees them."""
        found = []
        for path in sorted(self.registry_dir.glob("*-reg.sock")):
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    found.append(path)
            except FileNotFoundError:
                continue
        return found

    async def get_info(self, socket: Path) -> PluginInfo:
        async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
            call = channel.unary_unary(GET_INFO, **_BYTES)
            data = await call(b"", timeout=CALL_TIMEOUT)
        self.get_info_calls += 1
        return decode_plugin_info(data)

    async def notify(self, socket: Path, registered: bool, error: str = "") -> None:
        async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
            call = channel.unary_unary(NOTIFY, **_BYTES)
            await call(bool_field(1, registered) + string_field(2, error), timeout=CALL_TIMEOUT)

    async def register(self, socket: Path) -> Registered:
        """What the plugin watcher and the DRA handler do with a new registration socket."""
        info = await self.get_info(socket)
        try:
            if info.type != DRA_PLUGIN_TYPE:
                raise RegistrationRefused(f"plugin type {info.type!r} is not {DRA_PLUGIN_TYPE!r}")
            if not set(info.supported_versions) & set(KUBELET_VERSIONS):
                raise RegistrationRefused(f"none of {info.supported_versions} is supported")
            if not info.name:
                raise RegistrationRefused("empty driver name")
            endpoint = Path(info.endpoint)
            if not endpoint.is_absolute() or not stat.S_ISSOCK(os.lstat(endpoint).st_mode):
                raise RegistrationRefused(f"endpoint {info.endpoint!r} is not a socket")
            channel = grpc.aio.insecure_channel(f"unix:{endpoint}")
            await channel.channel_ready()
        except (RegistrationRefused, OSError) as exc:
            await self.notify(socket, False, str(exc))
            raise
        old = self.plugins.pop(info.name, None)
        if old is not None:
            await old.channel.close()
        self.plugins[info.name] = Registered(info, channel)
        await self.notify(socket, True)
        return self.plugins[info.name]

    def _channel(self, driver: str) -> grpc.aio.Channel:
        return self.plugins[driver].channel

    async def prepare(self, driver: str, claims: list[Claim]) -> dict[str, Prepared]:
        call = self._channel(driver).unary_unary(PREPARE, **_BYTES)
        return decode_prepare_response(await call(encode_claims(claims), timeout=CALL_TIMEOUT))

    async def unprepare(self, driver: str, claims: list[Claim]) -> dict[str, str]:
        call = self._channel(driver).unary_unary(UNPREPARE, **_BYTES)
        return decode_unprepare_response(await call(encode_claims(claims), timeout=CALL_TIMEOUT))

    async def watch_health(self, driver: str) -> AsyncGenerator[list[DeviceHealth], None]:
        """The health stream this kubelet release opens, one decoded message at a time (kubelet keeps
        it open). Raises LookupError when it would open none."""
        service = health_service(self.minor, self.plugins[driver].info.supported_versions)
        if service is None:
            raise LookupError(f"kubelet 1.{self.minor} opens no health stream on {driver}")
        call = self._channel(driver).unary_stream(HEALTH_METHOD.format(service), **_BYTES)
        stream: Any = call(b"")
        try:
            async for message in stream:
                yield decode_health(message)
        finally:
            stream.cancel()

    @staticmethod
    async def wipe_resource_slices(api_url: str, token: str, node: str, driver: str = "") -> None:
        """kubelet's wipe: DeleteCollection of the node's ResourceSlices (of `driver` only, if given),
        as kubelet sends it at its start (all drivers) and when a driver's wiping delay ran out."""
        selector = f"spec.nodeName={node}" + (f",spec.driver={driver}" if driver else "")
        url = f"{api_url}/apis/resource.k8s.io/v1/resourceslices?" + urllib.parse.urlencode(
            {"fieldSelector": selector}
        )
        async with httpx2.AsyncClient(timeout=CALL_TIMEOUT) as client:
            response = await client.delete(url, headers={"Authorization": f"Bearer {token}"})
        response.raise_for_status()

    async def close(self) -> None:
        for plugin in self.plugins.values():
            await plugin.channel.close()
        self.plugins.clear()
