"""The device plugin's registration with kubelet as a named state machine: the states and the moves
allowed between them. Pure: `DevicePluginServer` (``server``) drives it and calls
:func:`check_transition` on every move, so a move the table does not list is a bug that fails loudly
instead of leaving the server in a state nobody designed.

::

    STOPPED ─start()─► WAITING_FOR_KUBELET ◄───────────────────────────────┐ a new round: the delay
                          │ kubelet.sock is there                          │ is over, kubelet
                          ▼                                                │ restarted, or the
                       SERVING ──our socket cannot be served──┐            │ configuration changed
                          │ socket up                         ▼            │
                       REGISTERING ──kubelet refuses──► BACKING_OFF ───────┤
                          │ kubelet accepts                   ▲            │
                          ▼                                   │ held less  │
                       REGISTERED ──sign of loss──► LOST ─────┘ than 1 s   │
                                                     └─────────────────────┘ held longer,
                                                                             or reconfigured

    A new round begins in DISABLED instead while the configuration says ``enabled = false``.
    Every running state ──close()──► CLOSING ──► STOPPED

A reconfiguration that changes the registration (name, socket, ``enabled``) ends a wait at once and
starts over from WAITING_FOR_KUBELET (or DISABLED) with the new configuration.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class RegistrationState(enum.Enum):
    """Where the device plugin stands with kubelet; the value is what logs show."""

    STOPPED = "stopped"  # not started, or closed
    DISABLED = "disabled"  # [device_plugin] enabled = false: no socket, nothing registered
    WAITING_FOR_KUBELET = "waiting for kubelet"  # kubelet.sock is not there yet
    SERVING = "serving"  # bringing our socket up (or checking that it still is ours)
    REGISTERING = "registering"  # our Register call is with kubelet
    REGISTERED = "registered"  # kubelet holds our registration; watching for signs of losing it
    LOST = "registration lost"  # kubelet no longer holds it; our socket is being taken down
    BACKING_OFF = "backing off"  # the attempt failed; waiting before the next one
    CLOSING = "closing"  # close() is stopping everything


_S = RegistrationState

# A restart (a new configuration, or a new try) may always go to DISABLED instead of
# WAITING_FOR_KUBELET: the configuration read at that moment decides.
_RESTART = frozenset({_S.WAITING_FOR_KUBELET, _S.DISABLED})
_RUNNING = frozenset(_S) - {_S.STOPPED, _S.CLOSING}

_NEXT: Mapping[RegistrationState, frozenset[RegistrationState]] = {
    _S.STOPPED: _RESTART,
    _S.DISABLED: _RESTART,
    _S.WAITING_FOR_KUBELET: _RESTART | {_S.SERVING},
    _S.SERVING: frozenset({_S.REGISTERING, _S.BACKING_OFF}),
    _S.REGISTERING: frozenset({_S.REGISTERED, _S.BACKING_OFF}),
    _S.REGISTERED: frozenset({_S.LOST}),
    _S.LOST: _RESTART | {_S.BACKING_OFF},
    _S.BACKING_OFF: _RESTART,
    _S.CLOSING: frozenset({_S.STOPPED}),
}
# close() may come at any moment the server runs.
TRANSITIONS: Mapping[RegistrationState, frozenset[RegistrationState]] = {
    state: targets | {_S.CLOSING} if state in _RUNNING else targets for state, targets in _NEXT.items()
}


class IllegalTransition(RuntimeError):
    """A move the table does not allow: a bug in the device plugin, not a condition of the node."""


def check_transition(current: RegistrationState, target: RegistrationState) -> None:
    """Raise :class:`IllegalTransition` unless the table allows moving from `current` to `target`."""
    if target not in TRANSITIONS[current]:
        raise IllegalTransition(f"device plugin registration: no move from {current.name} to {target.name}")
