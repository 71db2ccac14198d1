"""A private D-Bus bus (a real ``dbus-daemon``) and a fake systemd on it, for the tests of the one
D-Bus client (`nri_plugin.systemd`).

`private_bus()` starts ``dbus-daemon`` with a config of its own on a socket in a fresh directory and
ends it; where ``dbus-daemon`` is missing the test skips with the reason, except under ``CI=true``
(``.ci/run`` installs Debian's ``dbus``), where it fails: there these tests must run.

`FakeSystemd` owns ``org.freedesktop.systemd1`` on such a bus and serves the one Manager method the
plugin calls, ``SetUnitProperties``, for the properties the plugin sends, as systemd does for a
slice: it records the values on the unit, then writes the unit's cgroup files in a fake tree
(``max(per_sec * period / 1 s, 1 ms)``; an error writing is logged by systemd, not returned).
`daemon_reload()` writes every unit's recorded values again, as ``systemctl daemon-reload`` does. A
unit is known once `record()`ed (kubelet made the slice through systemd); any other is ``NoSuchUnit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import select
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Annotated, Any

import pytest
from dbus_fast import Variant
from dbus_fast.aio import MessageBus
from dbus_fast.annotations import DBusBool, DBusSignature, DBusStr
from dbus_fast.errors import DBusError
from dbus_fast.service import ServiceInterface, dbus_method

from nri_plugin.cgroups import CgroupError, CgroupLayout, CpuQuota, expand_slice, restore_cpu_quota
from nri_plugin.systemd import bus as dbus
from nri_plugin.systemd.units import PER_SEC, PERIOD, USEC_INFINITY

BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>custom</type>
  <listen>unix:path={path}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""

Properties = Annotated[list[list[Any]], DBusSignature("a(sv)")]
Nothing = Annotated[None, DBusSignature("")]  # a method that returns no value


def need_dbus_daemon() -> str:
    """The path of dbus-daemon; skips without it, but fails under CI=true (.ci/run installs it)."""
    daemon = shutil.which("dbus-daemon")
    if daemon is not None:
        return daemon
    reason = "dbus-daemon is not installed (Debian's dbus): the D-Bus client is tested against a real bus"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; under CI=true these tests must run")
    pytest.skip(reason)


@contextlib.contextmanager
def private_bus() -> Iterator[str]:
    """A dbus-daemon of our own with no services; the path of its socket."""
    daemon = need_dbus_daemon()
    directory = Path(tempfile.mkdtemp(prefix="bus-", dir="/tmp"))  # short: unix socket paths are limited
    path = directory / "bus"
    (directory / "bus.conf").write_text(BUS_CONFIG.format(path=path))
    # dbus-daemon prints its address once it listens: the socket file alone appears at bind(), a
    # moment before listen(), and a client connecting in between is refused.
    proc = subprocess.Popen(
        [daemon, f"--config-file={directory / 'bus.conf'}", "--nofork", "--nopidfile", "--print-address=1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 10)
        if not ready or not proc.stdout.readline():
            pytest.fail(f"dbus-daemon did not start listening within 10 s (status {proc.poll()})")
        yield str(path)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
        shutil.rmtree(directory, ignore_errors=True)


class _Manager(ServiceInterface):
    """``org.freedesktop.systemd1.Manager``, as much of it as the plugin uses."""

    def __init__(self, systemd: FakeSystemd) -> None:
        super().__init__(dbus.SYSTEMD_MANAGER)
        self.systemd = systemd

    @dbus_method()
    async def SetUnitProperties(self, name: DBusStr, runtime: DBusBool, properties: Properties) -> Nothing:
        await self.systemd.set_unit_properties(name, runtime, {str(key): value for key, value in properties})


class FakeSystemd:
    """systemd's part for pod slices in the fake tree of `layout`; see the module docstring.

    `units`: unit -> property -> value as recorded; `calls`: (unit, runtime, properties) received.
    `delay`: seconds each call takes (a stalled systemd; ``math.inf``: never answered), each call on
    its own (systemd's answers then come in the order of their delays); `refusal`: a D-Bus error
    name to answer; `stale`: answer OK and record the value, but write the unit's previous value to
    its cgroup (a systemd whose write does not take); `answered`: the calls answered so far. A call
    still waiting when the fake stops is never answered.
    """

    def __init__(self, layout: CgroupLayout) -> None:
        self.layout = layout
        self.units: dict[str, dict[str, int]] = {}
        self.calls: list[tuple[str, bool, dict[str, int]]] = []
        self.delay = 0.0
        self.refusal = ""
        self.stale = False
        self.answered = 0
        self._bus: MessageBus | None = None
        self._waiting: set[asyncio.Task[Any]] = set()

    async def serve(self, path: str) -> None:
        self._bus = await dbus.connect(path)
        self._bus.export(dbus.SYSTEMD_PATH, _Manager(self))
        await self._bus.request_name(dbus.SYSTEMD)

    async def stop(self) -> None:
        for task in self._waiting:
            task.cancel()
        if self._bus is not None:
            await dbus.disconnect(self._bus)
            self._bus = None

    async def set_unit_properties(self, unit: str, runtime: bool, properties: dict[str, Variant]) -> None:
        values = {key: int(variant.value) for key, variant in properties.items()}
        self.calls.append((unit, runtime, values))
        if self.delay:
            task = asyncio.current_task()
            assert task is not None
            self._waiting.add(task)
            try:
                await (asyncio.Event().wait() if math.isinf(self.delay) else asyncio.sleep(self.delay))
            finally:
                self._waiting.discard(task)
        self.answered += 1
        if self.refusal:
            raise DBusError(self.refusal, f"refused for {unit}")
        unknown = set(values) - {PER_SEC, PERIOD}
        if unknown:
            raise DBusError(
                "org.freedesktop.DBus.Error.InvalidArgs", f"cannot set property {sorted(unknown)}"
            )
        self._set(unit, values)

    def _set(self, unit: str, values: dict[str, int]) -> None:
        if unit not in self.units:
            raise DBusError("org.freedesktop.systemd1.NoSuchUnit", f"Unit {unit} not loaded.")
        previous = self.limit(unit)
        self.units[unit].update(values)
        if self.stale:
            with contextlib.suppress(CgroupError):
                restore_cpu_quota(self.layout.cpu.dir(expand_slice(unit)), previous)
            return
        self._apply(unit)

    def record(self, unit: str, quota: int | None, period: int = 100_000) -> None:
        """What kubelet set on the slice when it made it (through systemd): recorded, and written."""
        per_sec = USEC_INFINITY if quota is None else quota * 1_000_000 // period
        self.units[unit] = {PER_SEC: per_sec, PERIOD: period}
        self._apply(unit)

    def daemon_reload(self) -> None:
        """``systemctl daemon-reload``: every unit's recorded cgroup settings written again."""
        for unit in self.units:
            self._apply(unit)

    def limit(self, unit: str) -> CpuQuota:
        """The limit systemd would write for the unit now."""
        values = self.units[unit]
        period = values.get(PERIOD, 100_000)
        per_sec = values[PER_SEC]
        quota = None if per_sec == USEC_INFINITY else max(per_sec * period // 1_000_000, 1000)
        return CpuQuota(quota, period)

    def _apply(self, unit: str) -> None:
        with contextlib.suppress(CgroupError):  # systemd logs a refused write and goes on
            restore_cpu_quota(self.layout.cpu.dir(expand_slice(unit)), self.limit(unit))


@contextlib.asynccontextmanager
async def fake_systemd(layout: CgroupLayout) -> AsyncIterator[tuple[str, FakeSystemd]]:
    """A private bus with a `FakeSystemd` on it serving the fake tree of `layout`: (bus, systemd)."""
    with private_bus() as path:
        systemd = FakeSystemd(layout)
        await systemd.serve(path)
        try:
            yield path, systemd
        finally:
            await systemd.stop()
