"""The device plugin's states and retry pacing on virtual time: a `ManualClock` drives every wait
(socket checks, backoff, the Register deadline) while gRPC talks to the fake kubelet over real unix
sockets. So the assertions are exact: a retry comes when its delay has passed on the clock, not a
moment before."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from deviceplugin_time import EPSILON, GUARD, advance, exact_backoff, settle
from fake_kubelet import FakeKubelet

from nri_plugin.common.backoff import Backoff
from nri_plugin.common.clock import ManualClock
from nri_plugin.deviceplugin.config import DevicePluginConfig
from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.deviceplugin.registration import RegistrationState
from nri_plugin.deviceplugin.server import (
    BACKOFF_INITIAL,
    BACKOFF_JITTER,
    BACKOFF_MAX,
    CHECK_INTERVAL,
    REGISTER_TIMEOUT,
    STABLE_REGISTRATION,
    DevicePluginServer,
)

S = RegistrationState
RESOURCE = "workload.openshift.io/enable-shared-cpus"


class Outcomes:
    """A registration observer that keeps what it is told."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def registration_done(self, outcome: str) -> None:
        self.seen.append(outcome)


async def advance_to(plugin: DevicePluginServer, clock: ManualClock, when: float) -> None:
    await advance(plugin, clock, when - clock.monotonic())


def exists(path: os.PathLike[str] | str) -> bool:
    return os.path.lexists(path)


async def until(predicate: Callable[[], bool]) -> None:
    """Until `predicate()` holds (what the fake kubelet sees arrives over real sockets)."""

    async def poll() -> None:
        while not predicate():  # noqa: ASYNC110 (state of the fake kubelet, which has no event for it)
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), GUARD)


def test_default_pacing_is_the_documented_one(config: DevicePluginConfig, key: HostKey) -> None:
    one, two = DevicePluginServer(config, key), DevicePluginServer(config, key)
    assert (one.backoff.initial, one.backoff.maximum, one.backoff.jitter) == (0.1, 5.0, (0.5, 1.0))
    assert (BACKOFF_INITIAL, BACKOFF_MAX, BACKOFF_JITTER) == (0.1, 5.0, (0.5, 1.0))
    assert one.backoff is not two.backoff, "each server paces its own retries"
    assert (one.check_interval, one.register_timeout) == (CHECK_INTERVAL, REGISTER_TIMEOUT)


@pytest.mark.asyncio
async def test_state_follows_the_registration(
    plugin_dir: Path, config: DevicePluginConfig, key: HostKey
) -> None:
    clock = ManualClock()
    plugin = DevicePluginServer(config, key, clock=clock)
    assert plugin.state is S.STOPPED
    await plugin.start()
    kubelet = FakeKubelet(plugin_dir)
    try:
        assert await settle(plugin, clock) is S.WAITING_FOR_KUBELET
        assert not plugin.registered
        await kubelet.start()
        await advance(plugin, clock, CHECK_INTERVAL)
        assert await settle(plugin, clock, {S.REGISTERED}) is S.REGISTERED
        assert plugin.registered

        plugin.reconfigure(dataclasses.replace(config, enabled=False))
        assert await settle(plugin, clock, {S.DISABLED}) is S.DISABLED
        assert not plugin.registered
        assert not exists(config.socket_path)

        plugin.reconfigure(dataclasses.replace(config, enabled=True))
        assert await settle(plugin, clock, {S.REGISTERED}) is S.REGISTERED
        assert plugin.registrations == 2
    finally:
        await plugin.close()
        await kubelet.stop()
    assert plugin.state is S.STOPPED
    assert not plugin.registered


@pytest.mark.asyncio
async def test_retries_come_after_the_backoff_delay_not_before(
    plugin_dir: Path, config: DevicePluginConfig, key: HostKey
) -> None:
    """After N refusals the next attempt comes exactly when the backoff's Nth delay has passed."""
    kubelet = await FakeKubelet(plugin_dir, reject="not now").start()
    clock = ManualClock()
    outcomes = Outcomes()
    backoff = Backoff(BACKOFF_INITIAL, BACKOFF_MAX, jitter=BACKOFF_JITTER, rng=random.Random(7))
    # The same draws, to know the delays in advance.
    twin = Backoff(BACKOFF_INITIAL, BACKOFF_MAX, jitter=BACKOFF_JITTER, rng=random.Random(7))
    try:
        async with DevicePluginServer(config, key, clock=clock, backoff=backoff, observer=outcomes) as plugin:
            await settle(plugin, clock)
            assert kubelet.attempts == 1
            refused_at = 0.0
            delays = []
            for attempt in range(2, 12):  # past the 5 s cap
                delay = twin.next()
                delays.append(delay)
                await advance_to(plugin, clock, refused_at + delay - EPSILON)
                assert kubelet.attempts == attempt - 1, f"attempt {attempt} came early"
                await advance_to(plugin, clock, refused_at + delay + EPSILON)
                assert kubelet.attempts == attempt, f"attempt {attempt} did not come"
                assert plugin.state is S.BACKING_OFF
                refused_at += delay
            assert outcomes.seen == ["failed"] * 11
            assert plugin.failures == 11
            assert not plugin.registered
    finally:
        await kubelet.stop()
    assert 0.05 <= delays[0] <= 0.1
    assert delays[-1] <= BACKOFF_MAX
    assert delays[-1] >= BACKOFF_MAX / 2, "the delay grew to the cap"


@pytest.mark.asyncio
async def test_a_registration_lost_at_once_counts_as_failed_and_a_stable_one_starts_over(
    plugin_dir: Path, config: DevicePluginConfig, key: HostKey
) -> None:
    kubelet = await FakeKubelet(plugin_dir, reject="not yet").start()
    clock = ManualClock()
    try:
        async with DevicePluginServer(config, key, clock=clock, backoff=exact_backoff()) as plugin:
            await advance_to(plugin, clock, 0.7 + EPSILON)  # refused at 0, 0.1, 0.3, 0.7 s
            assert plugin.failures == 4
            kubelet.reject = None
            await advance_to(plugin, clock, 1.5 + EPSILON)  # the next try, 0.8 s later, is taken
            assert await settle(plugin, clock, {S.REGISTERED}) is S.REGISTERED
            assert plugin.failures == 4, "a registration is no success until it has held"

            # Held for STABLE_REGISTRATION, then dropped: registered again at once, backoff from scratch.
            await advance_to(plugin, clock, 1.5 + STABLE_REGISTRATION + EPSILON)
            await kubelet.drop_stream(RESOURCE)
            await asyncio.wait_for(kubelet.registered.wait(), GUARD)
            assert await settle(plugin, clock, {S.REGISTERED}) is S.REGISTERED
            assert clock.monotonic() == pytest.approx(2.5 + EPSILON), "no delay after a stable one"
            assert plugin.failures == 0
            assert len(kubelet.registrations) == 2

            # Dropped at once: a failure, retried after the first delay of a fresh backoff.
            await kubelet.drop_stream(RESOURCE)
            assert await settle(plugin, clock, {S.BACKING_OFF}) is S.BACKING_OFF
            assert plugin.failures == 1
            dropped_at = clock.monotonic()
            await advance_to(plugin, clock, dropped_at + BACKOFF_INITIAL - EPSILON)
            assert len(kubelet.registrations) == 2
            await advance_to(plugin, clock, dropped_at + BACKOFF_INITIAL + EPSILON)
            await until(lambda: len(kubelet.registrations) == 3)
    finally:
        await kubelet.stop()


@pytest.mark.asyncio
async def test_register_deadline_is_on_the_clock(
    plugin_dir: Path, config: DevicePluginConfig, key: HostKey
) -> None:
    """A kubelet that never answers Register: the attempt fails after REGISTER_TIMEOUT on the clock."""
    kubelet = await FakeKubelet(plugin_dir, hang=True).start()
    clock = ManualClock()
    outcomes = Outcomes()
    try:
        async with DevicePluginServer(
            config, key, clock=clock, backoff=exact_backoff(), observer=outcomes
        ) as plugin:
            await until(lambda: kubelet.attempts == 1)
            assert await settle(plugin, clock, {S.REGISTERING}) is S.REGISTERING
            await clock.advance(REGISTER_TIMEOUT - EPSILON)
            assert plugin.state is S.REGISTERING
            assert outcomes.seen == []
            await clock.advance(2 * EPSILON)
            assert await settle(plugin, clock, {S.BACKING_OFF}) is S.BACKING_OFF
            assert outcomes.seen == ["failed"]
            # and the next try comes after the backoff, as for any failure
            await advance(plugin, clock, BACKOFF_INITIAL, {S.BACKING_OFF, S.REGISTERING})
            await until(lambda: kubelet.attempts == 2)
    finally:
        await kubelet.stop()


@pytest.mark.asyncio
async def test_close_while_kubelet_holds_our_register_call(
    plugin_dir: Path, config: DevicePluginConfig, key: HostKey
) -> None:
    kubelet = await FakeKubelet(plugin_dir, hang=True).start()
    clock = ManualClock()
    plugin = DevicePluginServer(config, key, clock=clock)
    try:
        await plugin.start()
        assert await settle(plugin, clock, {S.REGISTERING}) is S.REGISTERING
        await asyncio.wait_for(plugin.close(), GUARD)
        assert plugin.state is S.STOPPED
        assert not exists(config.socket_path)
        assert clock.pending == 0, "no timer left behind"
    finally:
        await kubelet.stop()


@pytest.mark.asyncio
async def test_reconfiguration_cuts_the_backoff_short(
    plugin_dir: Path, config: DevicePluginConfig, key: HostKey
) -> None:
    kubelet = await FakeKubelet(plugin_dir, reject="no").start()
    clock = ManualClock()
    try:
        async with DevicePluginServer(config, key, clock=clock, backoff=exact_backoff()) as plugin:
            await advance_to(plugin, clock, 0.7 + EPSILON)  # refused 4 times; next try due at 1.5 s
            kubelet.reject = None
            plugin.reconfigure(dataclasses.replace(config, resource_name="example.com/shared"))
            await asyncio.wait_for(kubelet.registered.wait(), GUARD)
            assert await settle(plugin, clock, {S.REGISTERED}) is S.REGISTERED
            assert clock.monotonic() < 1.5
            assert [r.resource_name for r in kubelet.registrations] == ["example.com/shared"]
    finally:
        await kubelet.stop()
