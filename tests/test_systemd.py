"""Pod quotas through systemd (`nri_plugin.systemd`, issue 12 item 3).

A pod cgroup that is a systemd slice (kubelet's systemd driver) gets its quota with
``SetUnitProperties`` on the system bus, so that systemd's re-applying (``daemon-reload``, any change
of the slice) keeps it; the cgroup file is the fallback when no bus is reachable, said once. Tested
against a real ``dbus-daemon`` with a fake systemd on it (`dbus_support`) writing a fake cgroup tree
as systemd does: the writer alone, then end to end through the runtime simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
import structlog
from dbus_support import FakeSystemd, fake_systemd
from hypothesis import given
from hypothesis import strategies as st
from mixedcpu_support import (
    GUARD,
    PERIOD,
    Daemon,
    FakeCgroups,
    Naming,
    make_container,
    make_plugin,
    make_pod,
    marker,
    plugin_running,
    start_daemon,
    write_daemon_config,
)
from wait_support import wait_until

from nri_plugin import cgroups
from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import Cgroup, CgroupWriteRejected, CpuQuota, read_cpu_quota
from nri_plugin.common.backoff import Backoff
from nri_plugin.common.clock import ManualClock
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin
from nri_plugin.nri.simulator import RuntimeSimulator, env_of
from nri_plugin.systemd.bus import bus_address
from nri_plugin.systemd.podquota import CALL_TIMEOUT, SystemdPodQuotaWriter
from nri_plugin.systemd.units import (
    PER_SEC,
    cpu_quota_properties,
    per_sec,
    pod_unit,
)
from nri_plugin.systemd.units import (
    PERIOD as PERIOD_PROPERTY,
)

SYSTEMD = Naming("containerd", "systemd")
CRIO_SYSTEMD = Naming("cri-o", "systemd")
CGROUPFS = Naming("containerd", "cgroupfs")
BASELINE = 2 * PERIOD  # the pod's own quota: its container's 2 exclusive CPUs
RAISED = BASELINE + 2 * PERIOD  # + the 2 shared CPUs
UID = "1234-abcd"
UNIT = "kubepods-pod1234_abcd.slice"


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for `condition` (a guard against hangs, never a measure)."""
    deadline = time.monotonic() + GUARD
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {GUARD} s: {what}")
        await asyncio.sleep(0.005)


async def settled(writer: SystemdPodQuotaWriter) -> None:
    """Until systemd has acknowledged every value written, and the files were read back."""
    await until(lambda: not writer.pending, "the writer settled")


def short_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="sd-", dir="/tmp"))  # unix socket paths are limited


@pytest.fixture
def root() -> Iterator[Path]:
    path = short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


# -- which pods are units, and the properties -------------------------------------------------------


@pytest.mark.parametrize(
    ("cgroup_parent", "unit"),
    [
        ("kubepods-pod1234_abcd.slice", UNIT),  # CRI-O, short
        ("/kubepods.slice/kubepods-pod1234_abcd.slice", UNIT),  # containerd, expanded
        ("kubepods-burstable-pod1234_abcd.slice", "kubepods-burstable-pod1234_abcd.slice"),
        ("/kubepods/pod1234-abcd", None),  # cgroupfs: not a unit
        ("/kubepods.slice/../etc", None),  # refused: never a unit name
        ("", None),
    ],
)
def test_the_unit_of_a_pod_is_its_slice(cgroup_parent: str, unit: str | None) -> None:
    assert pod_unit(cgroup_parent) == unit


@given(st.integers(min_value=1000, max_value=10**9), st.integers(min_value=1000, max_value=1_000_000))
def test_systemd_writes_back_exactly_the_quota_asked(quota: int, period: int) -> None:
    """systemd writes max(per_sec * period / 1 s, 1 ms) (its cgroup.c): the quota comes back whole."""
    assert max(per_sec(quota, period) * period // 1_000_000, 1000) == quota


def test_the_period_is_sent_only_when_it_is_not_the_default() -> None:
    assert cpu_quota_properties(CpuQuota(400_000, 100_000)) == [(PER_SEC, 4_000_000)]
    assert cpu_quota_properties(CpuQuota(200_000, 50_000)) == [
        (PERIOD_PROPERTY, 50_000),
        (PER_SEC, 4_000_000),
    ]
    assert cpu_quota_properties(CpuQuota(None, 100_000)) == [(PER_SEC, (1 << 64) - 1)]


def test_bus_addresses_escape_what_dbus_would_misread() -> None:
    assert bus_address("/run/dbus/system_bus_socket") == "unix:path=/run/dbus/system_bus_socket"
    assert bus_address("/tmp/a b,c=d;é") == "unix:path=/tmp/a%20b%2cc%3dd%3b%c3%a9"


# -- the writer, against a real bus ----------------------------------------------------------------


class Pod:
    """A pod slice in a fake tree, made by kubelet through systemd (recorded there) when given one."""

    def __init__(self, tree: FakeCgroups, naming: Naming = SYSTEMD) -> None:
        self.sandbox = make_pod(naming, UID)
        self.dir: Cgroup = tree.add_pod(self.sandbox, BASELINE)

    @property
    def parent(self) -> str:
        return self.sandbox.linux.cgroup_parent

    def quota(self) -> CpuQuota:
        return read_cpu_quota(self.dir)


@pytest.fixture
def tree(root: Path) -> FakeCgroups:
    return FakeCgroups(root / "cgroup", 2)


@pytest_asyncio.fixture
async def bus(tree: FakeCgroups) -> AsyncIterator[tuple[str, FakeSystemd]]:
    async with fake_systemd(tree.layout) as found:
        yield found


@pytest_asyncio.fixture
async def writer(bus: tuple[str, FakeSystemd]) -> AsyncIterator[SystemdPodQuotaWriter]:
    made = SystemdPodQuotaWriter(bus[0])
    await made.start()
    yield made
    await made.close()


@pytest.mark.asyncio
async def test_a_slice_gets_its_quota_through_systemd_and_keeps_it_at_daemon_reload(
    tree: FakeCgroups, bus: tuple[str, FakeSystemd], writer: SystemdPodQuotaWriter
) -> None:
    _, systemd = bus
    pod = Pod(tree)
    systemd.record(UNIT, BASELINE)  # kubelet made the slice with the pod's own quota
    assert writer.connected
    await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(RAISED, PERIOD), current=pod.quota())
    assert pod.quota() == CpuQuota(RAISED, PERIOD), "the file at once"
    assert not writer.settled(pod.parent)
    await settled(writer)
    assert systemd.calls == [(UNIT, True, {PER_SEC: RAISED * 10})]  # runtime=true; per second
    assert pod.quota() == CpuQuota(RAISED, PERIOD)
    systemd.daemon_reload()
    assert pod.quota() == CpuQuota(RAISED, PERIOD), "what systemd re-applies is ours"
    # Written to the file behind systemd's back, the same value would not survive:
    cgroups.write_cpu_quota(pod.dir, 5 * PERIOD)
    systemd.daemon_reload()
    assert pod.quota() == CpuQuota(RAISED, PERIOD)


@pytest.mark.asyncio
async def test_a_cgroupfs_pod_is_written_to_its_file_and_systemd_is_never_called(
    tree: FakeCgroups, bus: tuple[str, FakeSystemd], writer: SystemdPodQuotaWriter
) -> None:
    pod = Pod(tree, CGROUPFS)
    await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(RAISED, PERIOD), current=pod.quota())
    assert pod.quota() == CpuQuota(RAISED, PERIOD)
    assert writer.settled(pod.parent)
    await asyncio.sleep(0.05)  # (a call would have gone by now)
    assert bus[1].calls == []


@pytest.mark.asyncio
async def test_without_a_bus_the_file_is_written_said_once_and_the_bus_is_tried_again(
    root: Path, tree: FakeCgroups, bus: tuple[str, FakeSystemd]
) -> None:
    path, systemd = bus
    clock = ManualClock()
    writer = SystemdPodQuotaWriter(
        str(root / "absent"), clock=clock, backoff=Backoff(1.0, 8.0, jitter=(1, 1))
    )
    pod = Pod(tree)
    systemd.record(UNIT, BASELINE)
    with structlog.testing.capture_logs() as logs:
        started = time.monotonic()
        await writer.start()
        for quota in (RAISED, BASELINE, RAISED):
            await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(quota, PERIOD), current=pod.quota())
        elapsed = time.monotonic() - started
    assert pod.quota() == CpuQuota(RAISED, PERIOD)
    assert elapsed < 0.5, "no bus costs no wait"
    assert not writer.connected
    assert "No such file or directory" in writer.problem
    warned = [entry for entry in logs if entry["log_level"] == "warning"]
    assert [entry["event"].split(":")[0] for entry in warned] == ["no system bus"], "said once"
    assert systemd.calls == []
    # The bus appears (mounted late, dbus restarted): the next attempt on the clock finds it.
    writer.bus_path = path
    with structlog.testing.capture_logs() as logs:
        await clock.advance(1.0)
        await wait_until(lambda: writer.connected, what="the writer connected to the bus")
    assert [entry["event"].split(":")[0] for entry in logs] == ["connected to the system bus"]
    await settled(writer)  # what was written meanwhile is told once the bus is back
    await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(RAISED + PERIOD, PERIOD), current=pod.quota())
    await settled(writer)
    assert systemd.calls == [
        (UNIT, True, {PER_SEC: RAISED * 10}),
        (UNIT, True, {PER_SEC: (RAISED + PERIOD) * 10}),
    ]
    assert systemd.limit(UNIT) == pod.quota() == CpuQuota(RAISED + PERIOD, PERIOD)
    await writer.close()


@pytest.mark.asyncio
async def test_a_refusal_from_systemd_writes_the_file_said_once_per_kind(
    tree: FakeCgroups, bus: tuple[str, FakeSystemd], writer: SystemdPodQuotaWriter
) -> None:
    _, systemd = bus
    pod = Pod(tree)
    systemd.record(UNIT, BASELINE)
    systemd.refusal = "org.freedesktop.DBus.Error.AccessDenied"
    with structlog.testing.capture_logs() as logs:
        for quota in (RAISED, BASELINE, RAISED):
            await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(quota, PERIOD), current=pod.quota())
            await settled(writer)  # (refused: the file alone holds it)
    assert pod.quota() == CpuQuota(RAISED, PERIOD)
    assert len(systemd.calls) == 3
    [warned] = [entry for entry in logs if entry["log_level"] == "warning"]
    assert warned["error"].startswith("SetUnitProperties: org.freedesktop.DBus.Error.AccessDenied: ")
    assert writer.connected, "a refusal is not a lost bus"


@pytest.mark.asyncio
async def test_a_slice_systemd_does_not_know_gets_the_file(
    tree: FakeCgroups, bus: tuple[str, FakeSystemd], writer: SystemdPodQuotaWriter
) -> None:
    """A slice-named pod cgroup that is no unit of systemd's (containerd under cgroupfs given a slice
    parent): NoSuchUnit, and the file."""
    pod = Pod(tree)  # never made through systemd
    with structlog.testing.capture_logs() as logs:
        await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(RAISED, PERIOD), current=pod.quota())
        await settled(writer)
    assert pod.quota() == CpuQuota(RAISED, PERIOD)
    [warned] = [entry for entry in logs if entry["log_level"] == "warning"]
    assert "org.freedesktop.systemd1.NoSuchUnit" in warned["error"]


@pytest.mark.asyncio
async def test_a_stalled_systemd_costs_a_write_nothing_and_rests_the_bus(
    tree: FakeCgroups, bus: tuple[str, FakeSystemd]
) -> None:
    path, systemd = bus
    writer = SystemdPodQuotaWriter(path, call_timeout=0.2)
    await writer.start()
    pod = Pod(tree)
    systemd.record(UNIT, BASELINE)
    systemd.delay = math.inf  # a daemon-reload that never ends
    started = time.monotonic()
    await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(RAISED, PERIOD), current=pod.quota())
    assert time.monotonic() - started < 0.1, "the file at once: systemd is told in the background"
    assert pod.quota() == CpuQuota(RAISED, PERIOD)
    await until(lambda: writer.resting, "the bus at rest after the call timeout")
    assert writer.connected, "a slow systemd is not a lost bus"
    await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(BASELINE, PERIOD), current=pod.quota())
    assert pod.quota() == CpuQuota(BASELINE, PERIOD)
    assert len(systemd.calls) == 1, "one call in flight per unit, and none while at rest"
    assert writer.pending == {UNIT}, "not settled while systemd has not answered"
    await writer.close()


@pytest.mark.asyncio
async def test_a_value_the_kernel_refuses_is_the_kernels_refusal(
    monkeypatch: pytest.MonkeyPatch, root: Path
) -> None:
    """cgroup v1 refuses a pod quota below a child's: systemd takes the value and logs the kernel's
    refusal; the writer then writes the file itself and raises what the kernel said."""
    v1 = FakeCgroups(root / "v1", 1)
    async with fake_systemd(v1.layout) as (v1_bus, systemd):
        writer = SystemdPodQuotaWriter(v1_bus)
        await writer.start()
        pod = Pod(v1)
        systemd.record(UNIT, RAISED)
        real = cgroups.files.write_value

        def einval_below_raised(cgroup: Cgroup, name: str, value: str) -> None:
            if name == "cpu.cfs_quota_us" and int(value) < RAISED:
                raise CgroupWriteRejected("refused", path=cgroup.fs_path, value=value, errno=errno.EINVAL)
            real(cgroup, name, value)

        monkeypatch.setattr(cgroups.files, "write_value", einval_below_raised)
        with pytest.raises(CgroupWriteRejected):
            await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(BASELINE, PERIOD), current=pod.quota())
        assert pod.quota() == CpuQuota(RAISED, PERIOD)
        assert writer.settled(pod.parent), "systemd is told only what the kernel took"
        await asyncio.sleep(0.05)  # (a call would have gone by now)
        assert systemd.calls == []
        await writer.close()


@pytest.mark.asyncio
async def test_a_failed_read_back_is_a_warning_once_a_minute_and_the_unit_stays_pending(
    tree: FakeCgroups, bus: tuple[str, FakeSystemd]
) -> None:
    """After systemd's answer the file is read back; a file that cannot be read (here: garbage in
    cpu.max) is warned of, at most once a minute per unit with a count, and the unit stays pending
    until a write settles it (the reconciler's next pass)."""
    path, systemd = bus
    clock = ManualClock()
    writer = SystemdPodQuotaWriter(path, clock=clock)
    await writer.start()
    pod = Pod(tree)
    cpu_max = Path(pod.dir.fs_path) / "cpu.max"
    systemd.refusal = "org.freedesktop.DBus.Error.AccessDenied"  # systemd leaves the file alone
    systemd.delay = 0.05  # (the file spoiled before the answer)

    async def spoiled_write(quota: int) -> None:
        await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(quota, PERIOD), current=pod.quota())
        cpu_max.write_text("garbage\n")
        answered = systemd.answered
        await until(lambda: systemd.answered > answered and not writer.sender.busy(UNIT), "answered")
        cpu_max.write_text(f"{quota} {PERIOD}\n")

    with structlog.testing.capture_logs() as logs:
        await spoiled_write(RAISED)
        assert writer.pending == {UNIT}, "not settled: the file was not read back"
        await spoiled_write(BASELINE)
        await clock.advance(60.0)
        await spoiled_write(RAISED)
    failed = [entry for entry in logs if entry["event"].startswith("cannot read back")]
    assert [entry["log_level"] for entry in failed] == ["warning", "warning"], "once a minute per unit"
    assert [entry["times_since_last_said"] for entry in failed] == [0, 1]
    assert "garbage" in failed[0]["error"]
    assert writer.pending == {UNIT}
    await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(RAISED, PERIOD), current=pod.quota())
    assert not writer.pending, "the next write settles it: systemd's refusal stands, the file holds it"
    await writer.close()


@pytest.mark.asyncio
async def test_calls_are_timed_and_rested_on_the_one_clock_given(
    tree: FakeCgroups, bus: tuple[str, FakeSystemd]
) -> None:
    """The sender's wait for an answer, its measure of how long the answer took and the rest after it
    are all on the writer's clock: on a clock that stands still, a stalled systemd rests the bus
    only once the clock has moved past the call timeout, and the rest ends when the clock says."""
    path, systemd = bus
    clock = ManualClock()
    writer = SystemdPodQuotaWriter(path, clock=clock, rest=Backoff(5.0, 5.0, jitter=(1, 1)))
    await writer.start()
    pod = Pod(tree)
    systemd.record(UNIT, BASELINE)
    systemd.delay = math.inf
    with structlog.testing.capture_logs() as logs:
        await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(RAISED, PERIOD), current=pod.quota())
        await until(lambda: len(systemd.calls) == 1, "the call made")
        await asyncio.sleep(0.05)  # real time passes: nothing happens on a clock that stands still
        assert not writer.resting
        await clock.advance(CALL_TIMEOUT)
        assert writer.resting
        await clock.advance(4.9)
        assert writer.resting
        await clock.advance(0.1)
        assert not writer.resting
    [slow] = [entry for entry in logs if entry["event"].startswith("systemd answers slowly")]
    assert slow["answer"] == f"no answer within {CALL_TIMEOUT:.2f} s", "measured on the clock"
    assert slow["rest_seconds"] == 5.0
    await writer.close()


# -- end to end: the runtime simulator, the plugin, systemd on a bus ------------------------------------


def unit_of(pod: api.PodSandbox) -> str:
    unit = pod_unit(pod.linux.cgroup_parent)
    assert unit is not None
    return unit


class Node:
    """The simulator, a fake tree (v1 or v2) whose pod slices a fake systemd manages, and the plugin
    writing pod quotas through a `SystemdPodQuotaWriter` on `bus_path`."""

    def __init__(self, root: Path, naming: Naming, version: int, clock: ManualClock | None = None) -> None:
        self.root = root
        self.naming = naming
        self.tree = FakeCgroups(root / "cgroup", version)
        self.socket = root / "nri.sock"
        self.state = root / "state"
        self.sim = RuntimeSimulator(self.socket, runtime_name=naming.runtime)
        self.key = load_or_create_host_key(self.state)
        self.clock = clock

    def plugin(self, writer: SystemdPodQuotaWriter) -> MixedCpuPlugin:
        options = {"clock": self.clock, "reconcile_interval": 30.0} if self.clock is not None else {}
        plugin, _ = make_plugin(self.state, self.tree.layout, frozenset({0, 1}), **options)  # type: ignore[arg-type]
        plugin.quotas.writer = writer
        return plugin

    def pod(self, systemd: FakeSystemd, uid: str = UID) -> api.PodSandbox:
        """kubelet makes the pod's slice through systemd, with the pod's own quota."""
        pod = make_pod(self.naming, uid)
        self.tree.add_pod(pod, BASELINE)
        systemd.record(unit_of(pod), BASELINE)
        return pod

    async def create(self, pod: api.PodSandbox, cid: str) -> api.Container:
        """A container proving a request with a device of its own (named for its pod)."""
        device = "shared-cpus-0" if pod.uid == UID else f"shared-cpus-{pod.uid}"
        container = make_container(self.naming, pod, cid, "fwd", annotations=marker(self.key, device))
        result = await self.sim.create_container(container)
        self.tree.run_container(result.container)
        return result.container

    def pod_quota(self, pod: api.PodSandbox) -> int | None:
        return self.tree.pod_quota(pod)


@pytest.mark.asyncio
@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
@pytest.mark.parametrize("naming", [SYSTEMD, CRIO_SYSTEMD], ids=lambda n: n.id)
async def test_raise_and_lower_go_through_systemd_and_outlive_daemon_reload(
    root: Path, naming: Naming, version: int
) -> None:
    node = Node(root, naming, version)
    async with fake_systemd(node.tree.layout) as (path, systemd), node.sim:
        writer = SystemdPodQuotaWriter(path)
        await writer.start()
        async with plugin_running(node.plugin(writer), node.socket):
            await node.sim.wait_for_plugins(1, GUARD)
            pod = node.pod(systemd)
            await node.sim.run_pod_sandbox(pod)
            await node.create(pod, "fwd0")
            assert node.pod_quota(pod) == RAISED
            await settled(writer)
            assert systemd.limit(UNIT) == CpuQuota(RAISED, PERIOD), "set on the unit"
            systemd.daemon_reload()  # every package install does one
            assert node.pod_quota(pod) == RAISED
            await node.sim.stop_container("fwd0")
            await settled(writer)
            assert systemd.limit(UNIT) == CpuQuota(BASELINE, PERIOD), "lowered through systemd too"
            await node.sim.remove_container("fwd0")
            systemd.daemon_reload()
            assert node.pod_quota(pod) == BASELINE
            assert [unit for unit, _, _ in systemd.calls] == [UNIT, UNIT]
        await writer.close()


@pytest.mark.asyncio
async def test_without_a_bus_the_file_is_the_fallback_and_the_reconciler_mends_a_reload(root: Path) -> None:
    """No bus mounted: said once; the pod quota is written to the file, which systemd puts back at its
    next daemon-reload (kubelet's value); the reconciler's next pass writes it again."""
    clock = ManualClock()
    node = Node(root, SYSTEMD, 2, clock)
    systemd = FakeSystemd(node.tree.layout)  # systemd's bookkeeping only: nobody can reach it
    writer = SystemdPodQuotaWriter(str(root / "no-bus"), clock=clock)
    with structlog.testing.capture_logs() as logs:
        await writer.start()
        async with node.sim:
            plugin = node.plugin(writer)
            async with plugin_running(plugin, node.socket):
                await node.sim.wait_for_plugins(1, GUARD)
                pod = node.pod(systemd)
                await node.sim.run_pod_sandbox(pod)
                await node.create(pod, "fwd0")
                assert node.pod_quota(pod) == RAISED
                systemd.daemon_reload()
                assert node.pod_quota(pod) == BASELINE, "systemd put kubelet's value back"
                await clock.advance(30.0)
                assert node.pod_quota(pod) == RAISED, "the reconciler's pass wrote it again"
                plugin.healer.stop()
        await writer.close()
    warnings = [entry["event"] for entry in logs if entry["log_level"] == "warning"]
    assert len(warnings) == 1
    assert warnings[0].startswith(
        "no system bus: pod quotas of systemd slices are written to their cgroup files"
    )


# -- a slow systemd is never waited for (issue 25, break 10) ---------------------------------------------

NRI_DEADLINE = 2.0  # the runtime drops a plugin that has not answered an event by then
# Answered within half of it: a correctness bound with room for a loaded test machine, not a measure.
ANSWERED_WITHIN = NRI_DEADLINE / 2


@pytest.mark.asyncio
@pytest.mark.parametrize("pods", [1, 8, 50])
@pytest.mark.parametrize("delay", [0.1, 0.45, 1.0, 3.0, 30.0, math.inf], ids=lambda d: f"systemd-{d:g}s")
async def test_slow_systemd_during_a_reconcile_pass_never_delays_a_creation(
    root: Path, delay: float, pods: int
) -> None:
    """systemd answers each call in `delay` seconds (or never) while a reconcile pass brings `pods`
    pod slices back to their targets (systemd had put kubelet's values back): a CreateContainer
    made meanwhile is answered well within NRI's deadline, with its pod raised (cgroup v1), and
    before systemd's first slow answer comes; the pass brings every pod back through the files."""
    clock = ManualClock()
    node = Node(root, SYSTEMD, 1, clock)
    async with fake_systemd(node.tree.layout) as (path, systemd), node.sim:
        writer = SystemdPodQuotaWriter(path)
        await writer.start()
        plugin = node.plugin(writer)
        async with plugin_running(plugin, node.socket):
            await node.sim.wait_for_plugins(1, GUARD)
            off = [node.pod(systemd, f"{n}-off") for n in range(pods)]
            for n, pod in enumerate(off):
                await node.sim.run_pod_sandbox(pod)
                await node.create(pod, f"fwd{n}")
            await settled(writer)
            for pod in off:  # systemd lost our values and applied kubelet's again
                systemd.record(unit_of(pod), BASELINE)
            assert {node.pod_quota(pod) for pod in off} == {BASELINE}
            systemd.delay = delay
            answered = systemd.answered
            newcomer = node.pod(systemd, "new-pod")
            await node.sim.run_pod_sandbox(newcomer)
            passing = asyncio.ensure_future(clock.advance(30.0))  # the reconciler's pass
            started = time.monotonic()
            await node.create(newcomer, "fwd-new")
            took = time.monotonic() - started
            assert took < ANSWERED_WITHIN, f"CreateContainer answered in {took:.3f} s"
            assert node.pod_quota(newcomer) == RAISED, "raised before the reply"
            if delay >= 1.0:
                assert systemd.answered == answered, "answered before systemd's first slow answer"
            await passing
            await until(lambda: all(node.pod_quota(pod) == RAISED for pod in off), "every pod back")
            plugin.healer.stop()
        await writer.close()


@pytest.mark.asyncio
async def test_slow_answers_rest_the_bus_and_a_new_connection_does_not_end_the_rest(
    tree: FakeCgroups, bus: tuple[str, FakeSystemd]
) -> None:
    path, systemd = bus
    writer = SystemdPodQuotaWriter(path, call_timeout=2.0, rest=Backoff(30.0, 60.0, jitter=(1, 1)))
    await writer.start()
    pod = Pod(tree)
    systemd.record(UNIT, BASELINE)
    systemd.delay = 0.3  # answered, within the call timeout, but slowly
    with structlog.testing.capture_logs() as logs:
        await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(RAISED, PERIOD), current=pod.quota())
        await until(lambda: systemd.answered == 1 and writer.resting, "the slow answer rests the bus")
    [warned] = [entry for entry in logs if entry["log_level"] == "warning"]
    assert warned["event"].startswith("systemd answers slowly")
    systemd.delay = 0.0
    await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(BASELINE, PERIOD), current=pod.quota())
    assert pod.quota() == CpuQuota(BASELINE, PERIOD)
    await asyncio.sleep(0.1)  # (a call would have gone by now)
    assert len(systemd.calls) == 1, "no call while at rest"
    assert writer.pending == {UNIT}
    await writer.close()
    await writer.start()
    assert writer.connected
    assert writer.resting, "a new connection does not end the rest: systemd is as slow as it was"
    await writer.close()


@contextlib.asynccontextmanager
async def systemd_daemon(root: Path) -> AsyncIterator[tuple[Node, FakeSystemd, Daemon]]:
    """The real daemon process (``run``) against the simulator, on a fake cgroup v1 tree whose pod
    slices a fake systemd on a private bus manages, reconciling every second."""
    node = Node(root, SYSTEMD, 1)
    config = write_daemon_config(root, root / "dp")
    async with fake_systemd(node.tree.layout) as (path, systemd), node.sim:
        text = config.read_text().replace(
            'systemd_bus = ""', f'systemd_bus = "{path}"\nreconcile_interval = 1'
        )
        config.write_text(text)
        (root / "dp").mkdir()
        proc = await start_daemon("run", "--config", str(config), "--socket", str(node.socket))
        daemon = Daemon(proc, GUARD)
        try:
            await node.sim.wait_for_plugins(1, GUARD)
            await daemon.wait_log("connected to the system bus")
            node.key = load_or_create_host_key(node.state)
            yield node, systemd, daemon
        finally:
            status = await daemon.stop()
            print(f"daemon stderr (exit status {status}):\n{daemon.stderr}")  # shown if the test fails
    assert status == 0, daemon.stderr
    assert "Traceback" not in daemon.stderr, daemon.stderr


async def timed_create(node: Node, pod: api.PodSandbox, cid: str) -> tuple[float, bool]:
    """CreateContainer of a container proving a request, through the simulator: the seconds it
    took the plugin to answer, and whether it got the shared CPUs."""
    device = f"shared-cpus-{pod.uid}"
    container = make_container(node.naming, pod, cid, "fwd", annotations=marker(node.key, device))
    started = time.monotonic()
    result = await node.sim.create_container(container)
    took = time.monotonic() - started
    node.tree.run_container(result.container)
    return took, "OPENSHIFT_SHARED_CPUS" in env_of(result.container)


@pytest.mark.asyncio
async def test_slow_systemd_and_pods_put_back_by_daemon_reload_do_not_make_the_runtime_drop_the_plugin(
    root: Path,
) -> None:
    """Break 10 through the real daemon: systemd answering each call in 0.45 s (under the old
    per-call timeout) with 8 pod slices put back by a daemon-reload at each reconcile pass; every
    creation meanwhile is answered well within NRI's deadline and gets its shared CPUs."""
    async with systemd_daemon(root) as (node, systemd, daemon):
        off = [node.pod(systemd, f"{n}-off") for n in range(8)]
        for n, pod in enumerate(off):
            await node.sim.run_pod_sandbox(pod)
            took, shared = await timed_create(node, pod, f"fwd{n}")
            assert shared
        await until(lambda: all(systemd.limit(unit_of(pod)).quota == RAISED for pod in off), "told")
        systemd.delay = 0.45
        for round_ in range(4):
            for pod in off:  # a daemon-reload puts kubelet's values back
                systemd.record(unit_of(pod), BASELINE)
            newcomer = node.pod(systemd, f"{round_}-new")
            await node.sim.run_pod_sandbox(newcomer)
            took, shared = await timed_create(node, newcomer, f"new{round_}")
            assert took < ANSWERED_WITHIN, f"CreateContainer answered in {took:.3f} s"
            assert shared, "the plugin is still there and raised the pod"
            assert node.pod_quota(newcomer) == RAISED
            await asyncio.sleep(0.5)  # (half a reconcile interval: the creations meet the passes)
        await until(lambda: all(node.pod_quota(pod) == RAISED for pod in off), "the pass brought them back")
        assert not daemon.logged("plugin", "closed")
        assert daemon.logged("pod quota was off its target"), "the passes met the put-back pods"
        assert daemon.logged("systemd answers slowly")


@pytest.mark.asyncio
async def test_a_slow_spell_is_said_once_and_its_end_too(
    tree: FakeCgroups, bus: tuple[str, FakeSystemd]
) -> None:
    path, systemd = bus
    writer = SystemdPodQuotaWriter(path, call_timeout=0.1, rest=Backoff(0.05, 0.2, jitter=(1, 1)))
    await writer.start()
    pod = Pod(tree)
    systemd.record(UNIT, BASELINE)
    systemd.delay = 0.3
    with structlog.testing.capture_logs() as logs:
        for quota in (RAISED, BASELINE, RAISED):  # each call slow: the rest grows, said once
            await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(quota, PERIOD), current=pod.quota())
            await settled(writer)
        systemd.delay = 0.0
        await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(BASELINE, PERIOD), current=pod.quota())
        await settled(writer)
    said = [entry["event"].split(":")[0] for entry in logs if entry["log_level"] in ("warning", "info")]
    assert said == ["systemd answers slowly", "systemd answers quickly again"]
    assert systemd.limit(UNIT) == pod.quota() == CpuQuota(BASELINE, PERIOD)
    await writer.close()


# -- a late answer cannot leave a value behind (issue 25, break 11) -------------------------------------

LATE = 1.5  # seconds systemd takes to answer the raise: three times the call timeout


@pytest.mark.asyncio
@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
async def test_a_raise_answered_late_after_the_release_is_undone_and_the_pod_kept_until_then(
    root: Path, version: int
) -> None:
    """systemd answers the raise late, after the container was removed and the pod lowered through
    the file: the pod's record is kept while the raise is unanswered; when the raise lands (systemd
    writes it), the file is written back at once and systemd told the pod's own quota; only then
    does a reconcile pass drop the record."""
    clock = ManualClock()
    node = Node(root, SYSTEMD, version, clock)
    async with fake_systemd(node.tree.layout) as (path, systemd), node.sim:
        writer = SystemdPodQuotaWriter(path, rest=Backoff(0.1, 0.1, jitter=(1, 1)))
        await writer.start()
        plugin = node.plugin(writer)
        async with plugin_running(plugin, node.socket):
            await node.sim.wait_for_plugins(1, GUARD)
            pod = node.pod(systemd)
            await node.sim.run_pod_sandbox(pod)
            systemd.delay = LATE
            with structlog.testing.capture_logs() as logs:
                await node.create(pod, "fwd0")
                assert node.pod_quota(pod) == RAISED
                await until(lambda: len(systemd.calls) == 1, "systemd has the raise")
                systemd.delay = 0.0
                await node.sim.stop_container("fwd0")
                await node.sim.remove_container("fwd0")
                assert node.pod_quota(pod) == BASELINE, "lowered through the file at once"
                assert UID in plugin.books.pods, "kept while systemd's answer to the raise is outstanding"
                await clock.advance(30.0)  # a pass meanwhile keeps it too
                assert UID in plugin.books.pods
                await until(lambda: systemd.answered >= 1, "the late raise landed")
                await settled(writer)
            assert node.pod_quota(pod) == BASELINE
            assert systemd.limit(UNIT) == CpuQuota(BASELINE, PERIOD), "systemd re-applies the right value"
            assert [call[2][PER_SEC] for call in systemd.calls] == [RAISED * 10, BASELINE * 10]
            assert any(entry["event"].startswith("systemd answered late") for entry in logs)
            await clock.advance(30.0)
            assert UID not in plugin.books.pods, "dropped once systemd and the file agree"
            systemd.daemon_reload()
            assert node.pod_quota(pod) == BASELINE
            plugin.healer.stop()
        await writer.close()


@pytest.mark.asyncio
async def test_a_raise_answered_late_after_the_release_leaves_no_value_behind_in_the_daemon(
    root: Path,
) -> None:
    """Break 11 through the real daemon: the raise answered late (three call timeouts), the share
    released and lowered meanwhile; systemd's view and the file end at the pod's own quota."""
    async with systemd_daemon(root) as (node, systemd, daemon):
        pod = node.pod(systemd)
        await node.sim.run_pod_sandbox(pod)
        systemd.delay = LATE
        _, shared = await timed_create(node, pod, "fwd0")
        assert shared
        await until(lambda: len(systemd.calls) == 1, "systemd has the raise")
        systemd.delay = 0.0
        await node.sim.stop_container("fwd0")
        await node.sim.remove_container("fwd0")
        await until(lambda: systemd.answered == len(systemd.calls) == 2, "the late raise and the lowering")
        await until(lambda: node.pod_quota(pod) == BASELINE, "the file back at the pod's own quota")
        assert systemd.limit(UNIT) == CpuQuota(BASELINE, PERIOD)
        systemd.daemon_reload()
        assert node.pod_quota(pod) == BASELINE
        await daemon.wait_log("systemd answered late")


# -- systemd accepting a value the file does not show (issue 25, break 12) -----------------------------


@pytest.mark.asyncio
async def test_systemd_accepting_a_value_the_file_does_not_show_is_warned_of_once_a_minute(
    tree: FakeCgroups, bus: tuple[str, FakeSystemd]
) -> None:
    path, systemd = bus
    clock = ManualClock()
    writer = SystemdPodQuotaWriter(path, clock=clock)
    await writer.start()
    pod = Pod(tree)
    systemd.record(UNIT, BASELINE)
    systemd.stale = True  # answers OK, and leaves the cgroup at the unit's previous value
    with structlog.testing.capture_logs() as logs:
        for quota in (RAISED, BASELINE, RAISED):
            await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(quota, PERIOD), current=pod.quota())
            await settled(writer)
            assert pod.quota() == CpuQuota(quota, PERIOD), "the file written again"
        await clock.advance(60.0)
        await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(BASELINE, PERIOD), current=pod.quota())
        await settled(writer)
    warned = [entry for entry in logs if entry["log_level"] == "warning"]
    assert [entry["event"].split(":")[0] for entry in warned] == [
        "systemd accepted a pod quota and the cgroup file does not show it"
    ] * 2, "once a minute per unit"
    assert (warned[0]["accepted"], warned[0]["holds"]) == (f"{RAISED} {PERIOD}", f"{BASELINE} {PERIOD}")
    assert [entry["times_since_last_said"] for entry in warned] == [0, 2]
    await writer.close()


@pytest.mark.asyncio
async def test_systemd_answering_ok_and_leaving_cpu_max_alone_is_a_warning_in_the_daemon(root: Path) -> None:
    """Break 12 through the real daemon: systemd accepts the raise and its write does not take;
    the daemon warns (not at debug), and the pod is raised through the file all the same."""
    async with systemd_daemon(root) as (node, systemd, daemon):
        pod = node.pod(systemd)
        await node.sim.run_pod_sandbox(pod)
        systemd.stale = True
        _, shared = await timed_create(node, pod, "fwd0")
        assert shared
        line = await daemon.wait_log("systemd accepted a pod quota and the cgroup file does not show it")
        assert '"level": "warning"' in line
        await until(lambda: node.pod_quota(pod) == RAISED, "the file written again")
