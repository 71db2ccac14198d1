"""systemd as PID 1 on cgroup v2 (a Debian kernel in a QEMU VM, the host's systemd): the slices kubelet
makes through systemd, and systemd putting back a slice's ``cpu.max`` written behind its back.

The last tests document the problem issue #12 item 3 fixes: the plugin raises a pod's quota by
writing the pod cgroup's file, and when the pod cgroup is a systemd slice (the systemd cgroup driver)
a ``systemctl daemon-reload`` or a property change of the slice puts systemd's value back; a value set
through systemd survives. One VM for the module; each test makes its own slice, the way kubelet does
(``StartTransientUnit`` on the system bus).
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator

import pytest
from vm.vm_support import Vm, vm_session

pytestmark = pytest.mark.vm

PERIOD = 100_000
HAND_WRITTEN = f"{3 * PERIOD} {PERIOD}"  # what the plugin writes: the pod's 1 CPU + 2 shared


@pytest.fixture(scope="module")
def vm() -> Iterator[Vm]:
    with vm_session("systemd") as booted:
        yield booted


def sh(vm: Vm, script: str) -> str:
    """A shell script in the guest, which must succeed; its stdout, stripped."""
    return vm.sh(script, timeout=60).check().stdout.strip()


def make_pod_slice(vm: Vm, uid: str, cpus: int) -> str:
    """kubelet's pod slice (systemd driver): a transient unit made over D-Bus, with the pod's CPU
    limit as systemd properties. Its cgroup directory, once systemd has made it."""
    name = f"kubepods-pod{uid}.slice"
    call = [
        "busctl", "call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
        "org.freedesktop.systemd1.Manager", "StartTransientUnit", "ssa(sv)a(sa(sv))", name, "replace",
        "4", "Description", "s", f"kubelet-like pod slice {uid}", "CPUAccounting", "b", "true",
        "CPUQuotaPerSecUSec", "t", str(cpus * 1_000_000), "CPUQuotaPeriodUSec", "t", str(PERIOD), "0",
    ]  # fmt: skip
    path = f"/sys/fs/cgroup/kubepods.slice/{name}"
    sh(
        vm,
        f"{shlex.join(call)} >/dev/null && "
        f"for i in $(seq 300); do [ -e {path}/cpu.max ] && exit 0; sleep 0.1; done; exit 1",
    )
    return path


def cpu_max(vm: Vm, path: str) -> str:
    return sh(vm, f"cat {path}/cpu.max")


def eventually(vm: Vm, path: str, expected: str) -> str:
    """The slice's cpu.max once it reads `expected`, or after 30 s (systemd re-applies a unit's
    settings from its queue, maybe a moment after the command that caused it has returned)."""
    return sh(
        vm,
        f"for i in $(seq 300); do [ \"$(cat {path}/cpu.max)\" = '{expected}' ] && break; sleep 0.1; done; "
        f"cat {path}/cpu.max",
    )


def write_behind_systemds_back(vm: Vm, path: str) -> str:
    """What the plugin does today: write the slice's cpu.max directly. What the kernel then holds."""
    return sh(vm, f"echo '{HAND_WRITTEN}' > {path}/cpu.max && cat {path}/cpu.max")


def test_systemd_is_pid_1_on_cgroup_v2_with_the_system_bus(vm: Vm) -> None:
    assert vm.ready["mode"] == "systemd"
    assert sh(vm, "cat /proc/1/comm") == "systemd"
    assert sh(vm, "stat -fc %T /sys/fs/cgroup") == "cgroup2fs"
    assert sh(vm, "cut -d: -f1,2 /proc/self/cgroup") == "0:"  # the unified hierarchy alone
    state = vm.sh("systemctl is-system-running", timeout=60).stdout.strip()
    assert state in {"running", "degraded"}, sh(vm, "systemctl --failed --no-pager")
    assert "org.freedesktop.systemd1" in sh(vm, "busctl --system --no-pager --no-legend list")


def test_a_pod_slice_made_through_systemd_has_its_cpu_max(vm: Vm) -> None:
    path = make_pod_slice(vm, "smoke", cpus=1)
    assert cpu_max(vm, path) == f"{PERIOD} {PERIOD}"
    unit = "kubepods-podsmoke.slice"
    assert sh(vm, f"systemctl show -P CPUQuotaPerSecUSec {unit}") == "1s"
    assert sh(vm, f"systemctl show -P ControlGroup {unit}") == f"/kubepods.slice/{unit}"
    assert sh(vm, f"systemctl is-active {unit}") == "active"


def test_daemon_reload_puts_back_a_hand_written_cpu_max_and_keeps_one_set_through_systemd(vm: Vm) -> None:
    """`hand`: the pod quota raised the way the plugin does it now, by writing the file; `through`:
    the same value given to systemd (SetUnitProperties, here through systemctl), what the fix relies
    on. After the reload has put `hand` back, `through` must still hold its value."""
    hand = make_pod_slice(vm, "hand", cpus=1)
    through = make_pod_slice(vm, "through", cpus=1)
    assert write_behind_systemds_back(vm, hand) == HAND_WRITTEN
    sh(vm, "systemctl set-property --runtime kubepods-podthrough.slice CPUQuota=300%")
    assert cpu_max(vm, through) == HAND_WRITTEN
    sh(vm, "systemctl daemon-reload")
    assert eventually(vm, hand, f"{PERIOD} {PERIOD}") == f"{PERIOD} {PERIOD}"  # the raised quota is gone
    assert cpu_max(vm, through) == HAND_WRITTEN


def test_a_property_change_of_the_slice_puts_back_a_hand_written_cpu_max(vm: Vm) -> None:
    """As when kubelet updates the pod's slice: any property of that unit re-applies all of them."""
    path = make_pod_slice(vm, "property", cpus=1)
    assert write_behind_systemds_back(vm, path) == HAND_WRITTEN
    sh(vm, "systemctl set-property --runtime kubepods-podproperty.slice CPUWeight=50")
    assert eventually(vm, path, f"{PERIOD} {PERIOD}") == f"{PERIOD} {PERIOD}"
