"""A bus call's timeout holds whatever awaits it (`nri_plugin.systemd.bus`, issue 24).

From Python 3.12, `asyncio.wait_for` raises "Timeout should be used inside a task" when no task
runs the coroutine; a bus call that relied on it was then taken for a lost bus. The bus module bounds
its waits without needing a task: checked here from inside a task and from a coroutine driven by
plain event-loop callbacks, against a real dbus-daemon with the fake systemd on it.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import pytest_asyncio
from dbus_fast import Message, Variant
from dbus_support import FakeSystemd, fake_systemd
from mixedcpu_support import GUARD, FakeCgroups

from nri_plugin.systemd import bus as dbus
from nri_plugin.systemd.units import PER_SEC

T = TypeVar("T")
UNIT = "kubepods-pod1234_abcd.slice"


def run_outside_any_task(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """Drive `coro` step by step from event-loop callbacks, never inside an asyncio task (as a
    protocol callback that starts a coroutine by hand would): what it returns or raises lands in
    the future returned."""
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[T] = loop.create_future()

    def step(value: Any = None, error: BaseException | None = None) -> None:
        assert asyncio.current_task() is None
        try:
            waited = coro.send(value) if error is None else coro.throw(error)
        except StopIteration as stop:
            outcome.set_result(stop.value)
            return
        except BaseException as exc:  # the coroutine's own failure, handed on
            outcome.set_exception(exc)
            return
        if waited is None:  # a bare yield (asyncio.sleep(0)): go on at the next turn
            loop.call_soon(step)
            return
        waited._asyncio_future_blocking = False  # taken over, as a task would
        waited.add_done_callback(resume)

    def resume(done: asyncio.Future[Any]) -> None:
        try:
            value = done.result()
        except BaseException as exc:
            step(error=exc)
        else:
            step(value)

    loop.call_soon(step)
    return outcome


@pytest.fixture
def tree() -> Iterator[FakeCgroups]:
    root = Path(tempfile.mkdtemp(prefix="sdb-", dir="/tmp"))  # unix socket paths are limited
    yield FakeCgroups(root / "cgroup", 2)
    shutil.rmtree(root, ignore_errors=True)


@pytest_asyncio.fixture
async def systemd(tree: FakeCgroups) -> AsyncIterator[tuple[str, FakeSystemd]]:
    async with fake_systemd(tree.layout) as found:
        found[1].record(UNIT, 200_000)
        yield found


def set_quota(per_sec: int) -> Message:
    return Message(
        destination=dbus.SYSTEMD,
        path=dbus.SYSTEMD_PATH,
        interface=dbus.SYSTEMD_MANAGER,
        member="SetUnitProperties",
        signature="sba(sv)",
        body=[UNIT, True, [[PER_SEC, Variant("t", per_sec)]]],
    )


async def connect_and_call(path: str, message: Message, timeout: float) -> list[Any]:
    bus = await dbus.connect(path, timeout=timeout)
    try:
        return await dbus.call_method(bus, message, timeout=timeout)
    finally:
        await dbus.disconnect(bus, timeout=timeout)


@pytest.mark.asyncio
@pytest.mark.parametrize("inside_a_task", [True, False])
async def test_a_call_answered_in_time_is_its_reply(
    systemd: tuple[str, FakeSystemd], inside_a_task: bool
) -> None:
    path, fake = systemd
    call = connect_and_call(path, set_quota(4_000_000), GUARD)
    reply = await asyncio.wait_for(call if inside_a_task else run_outside_any_task(call), GUARD)
    assert reply == []
    assert fake.units[UNIT][PER_SEC] == 4_000_000


@pytest.mark.asyncio
@pytest.mark.parametrize("inside_a_task", [True, False])
async def test_a_call_not_answered_in_time_is_a_timeout_not_a_lost_bus(
    systemd: tuple[str, FakeSystemd], inside_a_task: bool
) -> None:
    path, fake = systemd
    fake.delay = GUARD  # a systemd busy with a long daemon-reload
    call = connect_and_call(path, set_quota(4_000_000), 0.2)
    with pytest.raises(dbus.BusTimeout, match=r"SetUnitProperties: no reply within 0\.2 s"):
        await asyncio.wait_for(call if inside_a_task else run_outside_any_task(call), GUARD)
    assert len(fake.calls) == 1
