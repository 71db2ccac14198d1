"""The registration state machine's table: the moves it allows, the ones it refuses, and that every
state can be reached and left as the design says."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Set

import pytest

from nri_plugin.deviceplugin.registration import (
    TRANSITIONS,
    IllegalTransition,
    RegistrationState,
    check_transition,
)

S = RegistrationState
RUNNING = set(S) - {S.STOPPED, S.CLOSING}
ALLOWED = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}


def test_every_state_has_a_row() -> None:
    assert set(TRANSITIONS) == set(S)


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (S.STOPPED, S.WAITING_FOR_KUBELET),
        (S.STOPPED, S.DISABLED),
        (S.WAITING_FOR_KUBELET, S.SERVING),
        (S.WAITING_FOR_KUBELET, S.WAITING_FOR_KUBELET),  # reconfigured while waiting
        (S.SERVING, S.REGISTERING),
        (S.SERVING, S.BACKING_OFF),
        (S.REGISTERING, S.REGISTERED),
        (S.REGISTERING, S.BACKING_OFF),
        (S.REGISTERED, S.LOST),
        (S.LOST, S.BACKING_OFF),
        (S.LOST, S.WAITING_FOR_KUBELET),
        (S.LOST, S.DISABLED),
        (S.BACKING_OFF, S.WAITING_FOR_KUBELET),
        (S.BACKING_OFF, S.DISABLED),
        (S.DISABLED, S.WAITING_FOR_KUBELET),
        (S.CLOSING, S.STOPPED),
    ],
)
def test_the_designed_moves_are_allowed(current: RegistrationState, target: RegistrationState) -> None:
    check_transition(current, target)


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (S.STOPPED, S.REGISTERED),
        (S.STOPPED, S.CLOSING),  # close() of a server never started is no move
        (S.WAITING_FOR_KUBELET, S.REGISTERING),  # no Register without our socket up
        (S.SERVING, S.REGISTERED),
        (S.REGISTERED, S.REGISTERING),  # a registration is lost (socket down) before the next one
        (S.REGISTERED, S.BACKING_OFF),
        (S.BACKING_OFF, S.REGISTERING),
        (S.DISABLED, S.SERVING),
        (S.CLOSING, S.WAITING_FOR_KUBELET),  # nothing runs on once close() began
        (S.CLOSING, S.CLOSING),
    ],
)
def test_other_moves_are_refused(current: RegistrationState, target: RegistrationState) -> None:
    with pytest.raises(IllegalTransition, match=f"no move from {current.name} to {target.name}"):
        check_transition(current, target)


def test_refuses_exactly_what_the_table_leaves_out() -> None:
    for current, target in itertools.product(S, S):
        if (current, target) in ALLOWED:
            check_transition(current, target)
        else:
            with pytest.raises(IllegalTransition):
                check_transition(current, target)


def test_close_may_come_in_every_running_state_and_ends_stopped() -> None:
    assert {a for a, b in ALLOWED if b is S.CLOSING} == RUNNING
    assert TRANSITIONS[S.CLOSING] == {S.STOPPED}
    assert {a for a, b in ALLOWED if b is S.STOPPED} == {S.CLOSING}


def test_only_registering_leads_to_registered_and_only_through_serving() -> None:
    assert {a for a, b in ALLOWED if b is S.REGISTERED} == {S.REGISTERING}
    assert {a for a, b in ALLOWED if b is S.REGISTERING} == {S.SERVING}


def _reachable(
    start: RegistrationState, table: Mapping[RegistrationState, Set[RegistrationState]] = TRANSITIONS
) -> set[RegistrationState]:
    seen, todo = {start}, [start]
    while todo:
        for target in table[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_every_state_is_reachable_from_stopped_and_can_get_back_to_it() -> None:
    assert _reachable(S.STOPPED) == set(S)
    for state in S:
        assert S.STOPPED in _reachable(state), state


def test_every_running_state_can_come_back_to_registered_without_closing() -> None:
    """No dead end short of close(): whatever happens, the server can register again."""
    open_table = {a: targets - {S.CLOSING} for a, targets in TRANSITIONS.items()}
    for state in RUNNING:
        assert S.REGISTERED in _reachable(state, open_table), state
