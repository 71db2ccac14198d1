"""A connection to a D-Bus message bus and method calls on it, with every wait bounded.

Built on dbus-fast (asyncio; its wire code is compiled where a wheel exists, pure Python elsewhere).
Since its 5.0 the socket is connected in ``connect()``, never in the constructor, so nothing here
blocks the event loop: connecting, authenticating and each call are awaited with a timeout, and a
bus that does not answer in time is a `BusTimeout`, not a stalled loop.

Two users: the daemon (`nri_plugin.systemd.sender`, a long-lived connection to the system bus),
and ``enable-nri`` (`restart_unit`: one blocking call from a short-lived command, no loop of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus
from dbus_fast.errors import AuthError

from nri_plugin.common.clock import LOOP_CLOCK, Clock, within

__all__ = [
    "CALL_TIMEOUT",
    "CONNECT_TIMEOUT",
    "SYSTEMD",
    "SYSTEMD_MANAGER",
    "SYSTEMD_PATH",
    "SYSTEM_BUS",
    "BusError",
    "BusLost",
    "BusTimeout",
    "bus_address",
    "call",
    "call_method",
    "connect",
    "connected",
    "disconnect",
    "restart_unit",
]

SYSTEM_BUS: Final = "/run/dbus/system_bus_socket"
SYSTEMD: Final = "org.freedesktop.systemd1"
SYSTEMD_PATH: Final = "/org/freedesktop/systemd1"
SYSTEMD_MANAGER: Final = "org.freedesktop.systemd1.Manager"
# Connecting and authenticating take a few milliseconds on a healthy bus.
CONNECT_TIMEOUT: Final = 2.0
# What a one-off command (enable-nri) waits for a reply.
CALL_TIMEOUT: Final = 30.0
# The bytes a D-Bus address value may hold unescaped (the specification's "optionally escaped").
_PLAIN: Final = re.compile(rb"[-0-9A-Za-z_/.\\*]")


class BusError(Exception):
    """The bus, or the service called, refused. `name` is the D-Bus error name when the refusal
    came as an error reply (``org.freedesktop.systemd1.NoSuchUnit``), "" otherwise."""

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name


class BusTimeout(BusError):
    """The bus, or the service called, did not answer in time."""


class BusLost(BusError):
    """The connection to the bus failed or closed while a call was in flight."""


def bus_address(path: str) -> str:
    """The D-Bus address of a unix socket at `path` (bytes outside the plain set %-escaped)."""
    escaped = "".join(
        chr(byte) if _PLAIN.fullmatch(bytes((byte,))) else f"%{byte:02x}" for byte in path.encode()
    )
    return f"unix:path={escaped}"


async def connect(
    path: str = SYSTEM_BUS, *, timeout: float = CONNECT_TIMEOUT, clock: Clock = LOOP_CLOCK
) -> MessageBus:
    """A connection to the bus listening at `path`, authenticated (EXTERNAL: the kernel vouches for
    our uid) and registered (``Hello``), within `timeout` on `clock`. Raises OSError (no socket,
    refused), `BusTimeout`, `BusError` (authentication refused)."""
    bus = MessageBus(bus_address=bus_address(path))
    try:
        return await within(clock, timeout, bus.connect())
    except TimeoutError:  # (`within` raises the builtin, on 3.10 too)
        bus.disconnect()
        raise BusTimeout(f"the bus at {path} did not answer within {timeout:g} s") from None
    except AuthError as exc:
        bus.disconnect()
        raise BusError(f"the bus at {path} refused us: {exc}") from None


@contextlib.asynccontextmanager
async def connected(path: str = SYSTEM_BUS, *, timeout: float = CONNECT_TIMEOUT) -> AsyncIterator[MessageBus]:
    """`connect`, disconnected at the end of the block."""
    bus = await connect(path, timeout=timeout)
    try:
        yield bus
    finally:
        await disconnect(bus, timeout=timeout)


async def disconnect(bus: MessageBus, *, timeout: float = CONNECT_TIMEOUT, clock: Clock = LOOP_CLOCK) -> None:
    """Close the connection and wait (at most `timeout` on `clock`) until its socket is closed."""
    bus.disconnect()
    with contextlib.suppress(Exception):  # how it ended does not matter any more
        await within(clock, timeout, bus.wait_for_disconnect())  # type: ignore[no-untyped-call]


async def call_method(
    bus: MessageBus, message: Message, *, timeout: float, clock: Clock = LOOP_CLOCK
) -> list[Any]:
    """Send the method call `message`; the reply's body. Raises `BusError` with the error's name and
    text for an error reply, `BusTimeout` when none comes within `timeout` seconds on `clock`,
    `BusLost` when the connection fails meanwhile."""
    if not bus.connected:
        raise BusLost("not connected to the bus")
    try:
        reply = await within(clock, timeout, bus.call(message))
    except TimeoutError:  # (`within` raises the builtin, on 3.10 too)
        raise BusTimeout(f"{message.member}: no reply within {timeout:g} s") from None
    except Exception as exc:  # dbus-fast fails pending calls with whatever ended the connection
        raise BusLost(
            f"{message.member}: the connection to the bus failed: {exc or type(exc).__name__}"
        ) from exc
    if reply.message_type == MessageType.ERROR:
        text = str(reply.body[0]) if reply.body else ""
        name = reply.error_name or "unknown"
        raise BusError(f"{message.member}: {name}: {text}".rstrip(": "), name)
    return list(reply.body)


async def _call_once(path: str, message: Message, timeout: float) -> list[Any]:
    async with connected(path, timeout=timeout) as bus:
        return await call_method(bus, message, timeout=timeout)


def _first_string(body: Sequence[Any]) -> str:
    return str(body[0]) if body and isinstance(body[0], str) else ""


def call(
    path: str,
    destination: str,
    object_path: str,
    interface: str,
    member: str,
    *args: str,
    timeout: float = CALL_TIMEOUT,
) -> str:
    """One method call with string arguments on the bus at `path`, from code that runs no event
    loop; its reply's first string (or object path), "" if it has none. Raises `BusError`, OSError."""
    message = Message(
        destination=destination,
        path=object_path,
        interface=interface,
        member=member,
        signature="s" * len(args),
        body=list(args),
    )
    return _first_string(asyncio.run(_call_once(path, message, timeout)))


def restart_unit(unit: str, *, bus: str = SYSTEM_BUS) -> str:
    """Ask systemd to restart `unit` ("replace" mode: as ``systemctl restart`` does); the job's path.
    Returns once systemd queued the job, not when the unit is back up. Raises `BusError`, OSError."""
    return call(bus, SYSTEMD, SYSTEMD_PATH, SYSTEMD_MANAGER, "RestartUnit", unit, "replace")
