"""A runtime socket the stub cannot connect to: the warning says why and what to check, at most once a
minute with the count of attempts, its numbers rounded."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import pytest
from structlog.testing import capture_logs

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.common.backoff import Backoff
from nri_plugin.common.clock import ManualClock
from nri_plugin.nri.connection import ConnectionState
from nri_plugin.nri.handlers import CreateContainer
from nri_plugin.nri.identity import Identity
from nri_plugin.nri.stub import Stub
from nri_plugin.nri.unreachable import WARN_EVERY, why_unreachable

# The name and index the stubs here register with.
TEST_IDENTITY = Identity(name="test", index="10")

T = TypeVar("T")
GUARD = 10.0


async def guarded(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, GUARD)


def connect_error(path: Path) -> OSError:
    """What a real connect to `path` raises."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError as exc:
            return exc
    raise AssertionError(f"{path} accepted a connection")


def test_a_missing_socket(tmp_path: Path) -> None:
    why = why_unreachable(str(tmp_path / "nri.sock"), connect_error(tmp_path / "nri.sock"))
    assert why.cause == "it does not exist"
    assert "NRI on" in why.check
    assert "/var/run/nri directory is mounted" in why.check


def test_a_regular_file_is_not_a_socket_though_connect_says_refused(tmp_path: Path) -> None:
    path = tmp_path / "nri.sock"
    path.write_text("")
    error = connect_error(path)
    assert error.errno == errno.ECONNREFUSED  # what the bare error would have said
    why = why_unreachable(str(path), error)
    assert why.cause == "it is not a socket: it is a regular file"
    assert why.check.startswith("nri_socket (or --socket): set it to the runtime's NRI socket")


def test_a_directory_and_a_path_through_a_file_are_not_sockets(tmp_path: Path) -> None:
    assert (
        why_unreachable(str(tmp_path), connect_error(tmp_path)).cause
        == "it is not a socket: it is a directory"
    )
    (tmp_path / "file").write_text("")
    through = tmp_path / "file" / "nri.sock"
    assert why_unreachable(str(through), connect_error(through)).cause == (
        "it is not a socket: a part of its path is a file, not a directory"
    )


def test_a_socket_nobody_listens_on_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nri.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as left_behind:
        left_behind.bind(str(path))  # bound, never listening: as a stopped runtime leaves it
        why = why_unreachable(str(path), connect_error(path))
    assert why.cause.startswith("nothing listens on it (connection refused)")
    assert "the runtime's log" in why.check


def test_permission_denied_says_what_to_look_at(tmp_path: Path) -> None:
    # Root (these tests' user) is not refused by the mode; the errno is what the stub is given.
    why = why_unreachable(str(tmp_path), PermissionError(errno.EACCES, "Permission denied"))
    assert why.cause.startswith("permission denied to uid ")
    assert "root" in why.check or "SELinux or AppArmor" in why.check


class Creating(CreateContainer):
    async def create_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> api.CreateContainerResponse | None:
        raise AssertionError("never connected")


async def next_backoff(stub: Stub, clock: ManualClock) -> float:
    """The wait the stub backs off for, once it waits (the clock has no other timer)."""
    await guarded(stub.wait_for_state(ConnectionState.BACKING_OFF))
    while (due := clock.next_due()) is None:
        await guarded(asyncio.sleep(0))
    return due - clock.monotonic()


@pytest.mark.asyncio
async def test_reconnect_warnings_come_once_a_minute_with_the_count_and_the_cause(tmp_path: Path) -> None:
    path = tmp_path / "nri.sock"
    clock = ManualClock()
    backoff = Backoff(initial=1.0, maximum=5.0)  # jittered: delays with many decimals
    stub = Stub(Creating(), identity=TEST_IDENTITY, socket_path=str(path), backoff=backoff, clock=clock)
    with capture_logs() as logs:
        running = asyncio.ensure_future(stub.run())
        try:
            while clock.monotonic() < 2.5 * WARN_EVERY:
                await clock.advance(await next_backoff(stub, clock))
            path.write_text("")  # a new cause: said at once
            await clock.advance(await next_backoff(stub, clock))
            await next_backoff(stub, clock)
        finally:
            stub.stop()
            await guarded(running)
    warnings = [line for line in logs if line["log_level"] == "warning"]
    assert [line["event"] for line in warnings] == ["nri connect failed, retrying"] * 4
    assert [line["cause"] for line in warnings] == ["it does not exist"] * 3 + [
        "it is not a socket: it is a regular file"
    ]
    assert all(line["check"] for line in warnings)
    attempts = [line["attempts"] for line in warnings]
    assert attempts[0] == 1
    assert attempts == sorted(attempts)
    assert attempts[1] > attempts[0] + 1  # the quiet attempts in between are counted too
    for line in warnings:
        assert line["retry_in"] == round(line["retry_in"], 2)
        assert len(repr(line["retry_in"])) <= 5  # "4.37", not 17 digits
