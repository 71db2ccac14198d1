"""Pod quotas through systemd (`nri_plugin.systemd`, issue 12 item 3).

A pod cgroup that is a systemd slice (kubelet's systemd driver) gets its quota with
``SetUnitProperties`` on the system bus, so that systemd's re-applying (``daemon-reload``, any change
of the slice) keeps it; the cgroup file is the fallback when no bus is reachable, said once. Tested
against a real ``dbus-daemon`` with a fake systemd on it (`dbus_support`) writing a fake cgroup tree
as systemd does: the writer alone, then end to end through the runtime simulator.
"""

from __future__ import annotations

import errno
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
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
    FakeCgroups,
    Naming,
    make_container,
    make_plugin,
    make_pod,
    marker,
    plugin_running,
)
from wait_support import wait_until

import cgroups.files
from api.nri import api_pb2 as api
from cgroups import Cgroup, CgroupWriteRejected, CpuQuota, read_cpu_quota
from nri_plugin.common.backoff import Backoff
from nri_plugin.common.clock import ManualClock
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin
from nri_plugin.nri.simulator import RuntimeSimulator
from nri_plugin.systemd.bus import bus_address
from nri_plugin.systemd.podquota import SystemdPodQuotaWriter
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
    await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(RAISED + PERIOD, PERIOD), current=pod.quota())
    assert systemd.calls == [(UNIT, True, {PER_SEC: (RAISED + PERIOD) * 10})]
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
    assert pod.quota() == CpuQuota(RAISED, PERIOD)
    [warned] = [entry for entry in logs if entry["log_level"] == "warning"]
    assert "org.freedesktop.systemd1.NoSuchUnit" in warned["error"]


@pytest.mark.asyncio
async def test_a_stalled_systemd_costs_one_call_timeout_then_the_file(
    tree: FakeCgroups, bus: tuple[str, FakeSystemd]
) -> None:
    path, systemd = bus
    writer = SystemdPodQuotaWriter(path, call_timeout=0.2, backoff=Backoff(30.0, 60.0))
    await writer.start()
    pod = Pod(tree)
    systemd.delay = 5.0  # a long daemon-reload
    started = time.monotonic()
    await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(RAISED, PERIOD), current=pod.quota())
    assert time.monotonic() - started < 1.5, "within the NRI handler's budget"
    assert pod.quota() == CpuQuota(RAISED, PERIOD)
    assert not writer.connected, "out of use until reconnected"
    assert "no reply within 0.2 s" in writer.problem
    started = time.monotonic()
    await writer.write_pod_quota(pod.dir, pod.parent, CpuQuota(BASELINE, PERIOD), current=pod.quota())
    assert time.monotonic() - started < 0.1, "the next write does not wait again"
    assert len(systemd.calls) == 1
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
        assert systemd.limit(UNIT) == CpuQuota(BASELINE, PERIOD), "systemd has it: re-applied once allowed"
        await writer.close()


# -- end to end: the runtime simulator, the plugin, systemd on a bus ------------------------------------


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

    def pod(self, systemd: FakeSystemd) -> api.PodSandbox:
        """kubelet makes the pod's slice through systemd, with the pod's own quota."""
        pod = make_pod(self.naming, UID)
        self.tree.add_pod(pod, BASELINE)
        systemd.record(UNIT, BASELINE)
        return pod

    async def create(self, pod: api.PodSandbox, cid: str) -> api.Container:
        container = make_container(self.naming, pod, cid, "fwd", annotations=marker(self.key))
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
            assert systemd.limit(UNIT) == CpuQuota(RAISED, PERIOD), "set on the unit"
            systemd.daemon_reload()  # every package install does one
            assert node.pod_quota(pod) == RAISED
            await node.sim.stop_container("fwd0")
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
