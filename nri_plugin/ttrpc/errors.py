"""Errors of the ttrpc package.

Two families, kept apart on purpose:

* *Expected* RPC outcomes: `TtrpcError(code, message)` is what a call returns when the peer answered
  with a non-OK status, and what a handler raises to answer with one. It maps one to one onto
  `google.rpc.Status`. `OversizedMessage` is the ResourceExhausted case raised before anything is
  written; `ConnectionClosed` means the channel went away under a pending call.
* *Protocol violations*: `ProtocolError` and its two sides. `LocalProtocolError` means our own code
  asked for something the protocol does not allow (fix the caller); `RemoteProtocolError` means the
  peer sent bytes that break the protocol (drop the connection).
"""

from __future__ import annotations

import enum

__all__ = [
    "Code",
    "ConnectionClosed",
    "LocalProtocolError",
    "OversizedMessage",
    "ProtocolError",
    "RemoteProtocolError",
    "TtrpcError",
]


@enum.unique
class Code(enum.IntEnum):
    """gRPC status codes, as carried in `google.rpc.Status.code`."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


def _as_code(code: int) -> int:
    """A `Code` member when the number is a known code; peers may send others, kept as plain ints."""
    try:
        return Code(code)
    except ValueError:
        return code


class TtrpcError(Exception):
    """A call ended with a non-OK status; raise it from a handler to answer with that status."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(code, message)
        self.code: int = _as_code(code)
        self.message = message

    def __str__(self) -> str:
        name = self.code.name if isinstance(self.code, Code) else str(self.code)
        return f"{name}: {self.message}" if self.message else name


class OversizedMessage(TtrpcError):
    """A message is above the size limit; it was not sent (or not accepted)."""

    def __init__(self, length: int, limit: int) -> None:
        # Same text as Go's ttrpc, so logs and statuses look alike on both sides.
        super().__init__(
            Code.RESOURCE_EXHAUSTED, f"message length {length} exceed maximum message size of {limit}"
        )
        self.length = length
        self.limit = limit


class ConnectionClosed(Exception):
    """The channel was closed or lost; pending and later calls fail with this."""

    def __init__(self, message: str = "ttrpc: closed") -> None:
        super().__init__(message)


class ProtocolError(Exception):
    """Base of the protocol violations; see the two subclasses."""


class LocalProtocolError(ProtocolError):
    """Our side tried something the protocol forbids (a bug in the caller)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that break the protocol; the connection cannot go on."""
