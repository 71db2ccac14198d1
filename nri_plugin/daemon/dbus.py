"""Just enough D-Bus to ask systemd to restart a unit: ``enable-nri`` restarts the container runtime
after turning NRI on in its config, from an init container that has no ``systemctl``.

One blocking connection to the system bus's unix socket: the EXTERNAL authentication (the kernel
vouches for our uid), ``Hello``, then method calls whose arguments are strings and whose replies
are read up to the first string (or object path). Nothing else of the protocol is needed: no
signals, no file descriptors, no introspection. Messages are written little-endian; replies are
read in whichever byte order the bus chose.

The wire format is the D-Bus specification's: a 12-byte fixed header (byte order, type, flags,
version, body length, serial), the header fields as an array of (code, variant) structs, padding to
8 bytes, then the body; every value aligned to its own size.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from typing import Final

__all__ = ["SYSTEM_BUS", "BusConnection", "BusError", "restart_unit"]

SYSTEM_BUS: Final = "/run/dbus/system_bus_socket"
_BUS_NAME: Final = "org.freedesktop.DBus"
_BUS_PATH: Final = "/org/freedesktop/DBus"
_SYSTEMD: Final = "org.freedesktop.systemd1"
_SYSTEMD_PATH: Final = "/org/freedesktop/systemd1"
_SYSTEMD_MANAGER: Final = "org.freedesktop.systemd1.Manager"
# Message types, and the header fields we write or read.
_METHOD_CALL, _METHOD_RETURN, _ERROR = 1, 2, 3
_PATH, _INTERFACE, _MEMBER, _ERROR_NAME, _REPLY_SERIAL, _DESTINATION, _SIGNATURE = 1, 2, 3, 4, 5, 6, 8
# A reply larger than this is not one of ours.
_MAX_MESSAGE: Final = 1 << 20
TIMEOUT: Final = 30.0


class BusError(Exception):
    """The bus, or the service called, refused; the message says which and why."""


class _Writer:
    """Little-endian marshalling, aligned as the specification wants."""

    def __init__(self) -> None:
        self.data = bytearray()

    def align(self, size: int) -> None:
        self.data += b"\0" * (-len(self.data) % size)

    def byte(self, value: int) -> None:
        self.data.append(value)

    def uint32(self, value: int) -> None:
        self.align(4)
        self.data += struct.pack("<I", value)

    def string(self, text: str) -> None:
        encoded = text.encode()
        self.uint32(len(encoded))
        self.data += encoded + b"\0"

    def signature(self, text: str) -> None:
        self.byte(len(text))
        self.data += text.encode("ascii") + b"\0"

    def field(self, code: int, kind: str, value: str) -> None:
        self.align(8)
        self.byte(code)
        self.signature(kind)
        if kind == "g":
            self.signature(value)
        else:  # "s" or "o"
            self.string(value)


@dataclass(frozen=True)
class _Call:
    destination: str
    path: str
    interface: str
    member: str
    args: tuple[str, ...] = ()

    def encode(self, serial: int) -> bytes:
        body = _Writer()
        for arg in self.args:
            body.string(arg)
        fields = _Writer()
        fields.field(_PATH, "o", self.path)
        fields.field(_INTERFACE, "s", self.interface)
        fields.field(_MEMBER, "s", self.member)
        fields.field(_DESTINATION, "s", self.destination)
        if self.args:
            fields.field(_SIGNATURE, "g", "s" * len(self.args))
        head = _Writer()
        head.data += b"l" + bytes((_METHOD_CALL, 0, 1))
        head.uint32(len(body.data))
        head.uint32(serial)
        head.uint32(len(fields.data))
        head.data += fields.data
        head.align(8)
        return bytes(head.data + body.data)


@dataclass(frozen=True)
class _Reply:
    kind: int
    reply_serial: int | None
    error_name: str
    first_string: str | None


class _Reader:
    """Unmarshalling of a received message, in its own byte order."""

    def __init__(self, data: bytes, order: str) -> None:
        self.data = data
        self.order = order
        self.at = 0

    def align(self, size: int) -> None:
        self.at += -self.at % size

    def byte(self) -> int:
        value = self.data[self.at]
        self.at += 1
        return value

    def uint32(self) -> int:
        self.align(4)
        (value,) = struct.unpack_from(f"{self.order}I", self.data, self.at)
        self.at += 4
        return int(value)

    def string(self) -> str:
        size = self.uint32()
        text = self.data[self.at : self.at + size].decode(errors="replace")
        self.at += size + 1
        return text

    def signature(self) -> str:
        size = self.byte()
        text = self.data[self.at : self.at + size].decode("ascii", errors="replace")
        self.at += size + 1
        return text

    def value(self, kind: str) -> str | int:
        if kind in ("s", "o"):
            return self.string()
        if kind == "g":
            return self.signature()
        if kind == "u":
            return self.uint32()
        if kind == "y":
            return self.byte()
        raise BusError(f"unexpected header field type {kind!r} in a reply")


def _parse(message: bytes) -> _Reply:
    order = "<" if message[:1] == b"l" else ">"
    fields_end = 16 + struct.unpack_from(f"{order}I", message, 12)[0]
    reader = _Reader(message, order)
    reader.at = 16
    values: dict[int, str | int] = {}
    while reader.at < fields_end:
        reader.align(8)
        code = reader.byte()
        values[code] = reader.value(reader.signature())
    reader.align(8)
    signature = str(values.get(_SIGNATURE, ""))
    first = reader.string() if signature[:1] in ("s", "o") else None
    serial = values.get(_REPLY_SERIAL)
    return _Reply(
        message[1], serial if isinstance(serial, int) else None, str(values.get(_ERROR_NAME, "")), first
    )


class BusConnection:
    """A connection to a message bus at `path`; `call` is a blocking method call."""

    def __init__(self, path: str = SYSTEM_BUS, *, timeout: float = TIMEOUT) -> None:
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.settimeout(timeout)
        self._serial = 0
        try:
            self._socket.connect(path)
            self._authenticate()
            self.unique_name = self.call(_Call(_BUS_NAME, _BUS_PATH, _BUS_NAME, "Hello"))
        except BaseException:
            self._socket.close()
            raise

    def close(self) -> None:
        self._socket.close()

    def __enter__(self) -> BusConnection:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _authenticate(self) -> None:
        uid = str(os.geteuid()).encode().hex()
        self._socket.sendall(b"\0AUTH EXTERNAL " + uid.encode() + b"\r\n")
        answer = self._line()
        if not answer.startswith(b"OK "):
            raise BusError(f"the bus refused our uid: {answer.decode(errors='replace')}")
        self._socket.sendall(b"BEGIN\r\n")

    def _line(self) -> bytes:
        line = b""
        while not line.endswith(b"\r\n"):
            chunk = self._socket.recv(1)
            if not chunk or len(line) > 4096:
                raise BusError("the bus closed the connection while authenticating")
            line += chunk
        return line

    def _exactly(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            chunk = self._socket.recv(size - len(data))
            if not chunk:
                raise BusError("the bus closed the connection")
            data += chunk
        return bytes(data)

    def _receive(self) -> bytes:
        head = self._exactly(16)
        order = "<" if head[:1] == b"l" else ">"
        body_size, _, fields_size = struct.unpack_from(f"{order}III", head, 4)
        size = 16 + fields_size + (-fields_size % 8) + body_size
        if size > _MAX_MESSAGE:
            raise BusError(f"a message of {size} bytes from the bus; expected a short reply")
        return head + self._exactly(size - 16)

    def call(self, call: _Call) -> str:
        """Send `call`; its reply's first string (or object path), "" if it has none. Raises
        `BusError` with the error's name and message."""
        self._serial += 1
        self._socket.sendall(call.encode(self._serial))
        while True:
            reply = _parse(self._receive())
            if reply.reply_serial != self._serial:
                continue  # a signal (NameAcquired), or someone else's business
            if reply.kind == _ERROR:
                raise BusError(f"{call.member}: {reply.error_name}: {reply.first_string or ''}".rstrip(": "))
            return reply.first_string or ""


def restart_unit(unit: str, *, bus: str = SYSTEM_BUS) -> str:
    """Ask systemd to restart `unit` ("replace" mode: as ``systemctl restart`` does); the job's path.
    Returns once systemd queued the job, not when the unit is back up. Raises `BusError`, OSError."""
    with BusConnection(bus) as connection:
        return connection.call(
            _Call(_SYSTEMD, _SYSTEMD_PATH, _SYSTEMD_MANAGER, "RestartUnit", (unit, "replace"))
        )


def call(bus: str, destination: str, path: str, interface: str, member: str, *args: str) -> str:
    """One method call on the bus at `bus` with string arguments; its reply's first string."""
    with BusConnection(bus) as connection:
        return connection.call(_Call(destination, path, interface, member, args))
