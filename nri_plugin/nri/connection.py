"""The states of the stub's connection to the runtime, and the moves allowed between them.

The stub's own steps::

    DISCONNECTED -> CONNECTING -> REGISTERING            (the socket is open, RegisterPlugin sent)
    CONNECTING -> DISCONNECTED -> BACKING_OFF -> CONNECTING    (the connect failed: wait, retry)
    any connected state -> DISCONNECTED -> BACKING_OFF         (the connection ended)
    anything -> STOPPED                                         (stop(): for good)

The runtime's steps, while connected::

    REGISTERING -> REGISTERED -> CONFIGURED -> SYNCHRONIZING -> READY

NRI does not fix their order: a Configure may be served before the reply to RegisterPlugin is read
(REGISTERING -> CONFIGURED), and a runtime may synchronize without configuring. So every connected
state may move to SYNCHRONIZING. SYNCHRONIZING lasts from a Synchronize's first chunk until the plugin
has answered the whole (unsolicited updates wait meanwhile); one that fails goes back where it began.

Pure: no asyncio, no I/O. The stub keeps its events (ready, stopped, idle) in step with the state.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

__all__ = ["CONNECTED", "TRANSITIONS", "ConnectionMachine", "ConnectionState", "IllegalTransition"]


class ConnectionState(enum.Enum):
    DISCONNECTED = "disconnected"  # not connected (before the first attempt, between attempts, at the end)
    CONNECTING = "connecting"  # opening the socket
    REGISTERING = "registering"  # connected; RegisterPlugin sent, its reply not seen yet
    REGISTERED = "registered"  # the runtime took the registration; Configure to come
    CONFIGURED = "configured"  # Configure answered; Synchronize to come
    SYNCHRONIZING = "synchronizing"  # a Synchronize under way (chunks coming, or the plugin on it)
    READY = "ready"  # synchronized: serving the runtime's events
    BACKING_OFF = "backing_off"  # waiting before the next connection attempt
    STOPPED = "stopped"  # stop() was called; nothing follows


S = ConnectionState

# The states with a live connection to the runtime.
CONNECTED: Final = frozenset({S.REGISTERING, S.REGISTERED, S.CONFIGURED, S.SYNCHRONIZING, S.READY})

_ENDS: Final = frozenset({S.DISCONNECTED, S.STOPPED})

TRANSITIONS: Final[Mapping[ConnectionState, frozenset[ConnectionState]]] = {
    S.DISCONNECTED: frozenset({S.CONNECTING, S.BACKING_OFF, S.STOPPED}),
    S.CONNECTING: frozenset({S.REGISTERING, *_ENDS}),
    S.REGISTERING: frozenset({S.REGISTERED, S.CONFIGURED, S.SYNCHRONIZING, *_ENDS}),
    S.REGISTERED: frozenset({S.CONFIGURED, S.SYNCHRONIZING, *_ENDS}),
    S.CONFIGURED: frozenset({S.SYNCHRONIZING, *_ENDS}),
    # READY when it succeeds; back where it started when it fails.
    S.SYNCHRONIZING: frozenset({S.READY, S.REGISTERING, S.REGISTERED, S.CONFIGURED, *_ENDS}),
    S.READY: frozenset({S.SYNCHRONIZING, *_ENDS}),
    S.BACKING_OFF: frozenset({S.CONNECTING, S.STOPPED}),
    S.STOPPED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A move the table does not allow: a bug in the stub, never the runtime's doing."""

    def __init__(self, source: ConnectionState, target: ConnectionState) -> None:
        super().__init__(f"stub connection cannot go from {source.name} to {target.name}")
        self.source = source
        self.target = target


class ConnectionMachine:
    """The current state; `move` changes it or refuses."""

    def __init__(self) -> None:
        self.state = S.DISCONNECTED

    @property
    def connected(self) -> bool:
        return self.state in CONNECTED

    def can_move(self, target: ConnectionState) -> bool:
        return target in TRANSITIONS[self.state]

    def move(self, target: ConnectionState) -> ConnectionState:
        """Enter `target`; the state left. Raises `IllegalTransition` for a move not in the table."""
        source = self.state
        if target not in TRANSITIONS[source]:
            raise IllegalTransition(source, target)
        self.state = target
        return source
