"""systemd as PID 1 on cgroup v2 (a Debian kernel in a QEMU VM, the host's systemd): the slices kubelet
makes through systemd, systemd putting back a slice's ``cpu.max`` written behind its back, and the real
daemon's pod quotas set through systemd (issue #12).

The first tests document the problem: when the pod cgroup is a systemd slice (the systemd cgroup
driver) a ``systemctl daemon-reload`` or a property change of the slice puts systemd's value back over
a hand-written ``cpu.max``; a value set through systemd survives. Each makes its own slice, the way
kubelet does (``StartTransientUnit`` on the system bus). The last ones read what the real daemon did
(guest_daemon_systemd.py, run once): with the system bus, the raise, an in-place resize and the
lowering are what systemd records and survive reloads and property changes; without it, the raise is
reverted by systemd and written again by the reconciler. One VM for the module.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from typing import Any

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


# -- the real daemon: pod quotas through systemd (issue #12) ----------------------------------------

BASELINE = f"{PERIOD} {PERIOD}"  # kubelet's pod quota: 1 CPU
RAISED = HAND_WRITTEN  # + the 2 shared CPUs of the container asking for them
RESIZED = f"{2 * PERIOD} {PERIOD}"  # the pod resized in place to 2 CPUs
RESIZED_RAISED = f"{4 * PERIOD} {PERIOD}"  # + the 2 shared CPUs


@pytest.fixture(scope="module")
def daemon(vm: Vm) -> Any:
    """The daemon's run against the simulator, the pods as systemd slices (guest_daemon_systemd.py)."""
    result = vm.python("tests/vm/guest_daemon_systemd.py", timeout=600).json()
    print(json.dumps({key: value for key, value in result.items() if key != "daemon"}, indent=1))
    print("\n".join(result["daemon"]["bus lines"]))
    return result


def test_the_daemon_ran_cleanly_and_used_the_system_bus(daemon: Any) -> None:
    assert daemon["daemon"]["exit statuses"] == [0, 0]
    assert daemon["daemon"]["tracebacks"] == 0
    assert [e for e in daemon["simulator errors"] if not e.startswith("drop ")] == []  # drop: a restart
    assert any("connected to the system bus" in line for line in daemon["daemon"]["bus lines"])


def test_the_raised_pod_quota_is_systemds_and_survives_daemon_reload_and_set_property(daemon: Any) -> None:
    steps = daemon["bus"]
    assert steps["made"] == {"systemd": "1s", "cpu.max": BASELINE}
    created = steps["created"]
    assert created["reply"]["adjusted cpus"] == "0-2"
    assert created["reply"]["pod cpu.max at reply"] == RAISED
    assert created["reply"]["container"]["cpu.max"] == RAISED
    assert (created["systemd"], created["cpu.max"]) == ("3s", RAISED)
    for step in ("daemon-reload", "set-property CPUWeight=50"):
        assert (steps[step]["systemd"], steps[step]["cpu.max"]) == ("3s", RAISED), step


def test_an_in_place_resize_of_the_slice_is_followed_through_systemd_and_survives(daemon: Any) -> None:
    """kubelet sets the resized pod's limit (2 CPUs) on its slice, dropping the shares; at
    UpdatePodSandbox the plugin raises it to 2 + the 2 shared CPUs, through systemd again."""
    steps = daemon["bus"]
    assert steps["resized by kubelet"] == {"systemd": "2s", "cpu.max": RESIZED}
    assert steps["UpdatePodSandbox"] == {"systemd": "4s", "cpu.max": RESIZED_RAISED}
    resized = steps["resized, set-property CPUWeight=40"]
    assert (resized["systemd"], resized["cpu.max"]) == ("4s", RESIZED_RAISED)


def test_the_lowered_pod_quota_at_stop_and_remove_is_systemds_and_survives_too(daemon: Any) -> None:
    steps = daemon["bus"]
    assert steps["stopped"] == {"systemd": "2s", "cpu.max": RESIZED}
    assert steps["removed"] == {"systemd": "2s", "cpu.max": RESIZED}
    for step in ("removed, daemon-reload", "removed, set-property CPUWeight=60"):
        assert (steps[step]["systemd"], steps[step]["cpu.max"]) == ("2s", RESIZED), step


def test_without_the_bus_systemd_reverts_the_raise_and_the_reconciler_writes_it_again(daemon: Any) -> None:
    """With the file only: systemd never records the raise, and puts its own value back whenever it
    re-applies the slice (the container's scope starting in it, a daemon-reload); the reconciler
    (every 3 s here) writes the raise again each time."""
    steps = daemon["file"]
    assert steps["made"] == {"systemd": "1s", "cpu.max": BASELINE}
    assert steps["reply"]["pod cpu.max at reply"] == RAISED
    seen = steps["cpu.max seen"]
    at_creation, at_reload = seen[: steps["reload from"]], seen[steps["reload from"] :]
    created = [value for _, value in at_creation]
    assert created[:2] == [BASELINE, RAISED]
    # The container's scope starting in the slice has systemd re-apply it, which puts BASELINE back;
    # the reconciler raises it again. A heal that lands within one sample of the revert (the creation
    # watch runs a pass as soon as the scope's cgroup shows) leaves no trace here, so the revert at
    # creation is seen in most runs, not all (CI saw one without).
    assert created[2:] in ([], [BASELINE, RAISED]), created
    assert [value for _, value in at_reload] == [BASELINE, RAISED]  # put back by systemd, then healed
    (reverted, _), (healed, _) = at_reload
    assert healed - reverted < 6.0
    heals = [line for line in daemon["daemon"]["bus lines"] if "heal=" in line]
    assert 1 + len(created[2:]) // 2 <= len(heals) <= 2, heals  # the reload's, and the creation's if any
    assert all("heal=pod_quota" in line and "kubepods-podfile.slice" in line for line in heals)
    assert steps["at the end"] == {"systemd": "1s", "cpu.max": RAISED}  # systemd still knows nothing of it
    assert steps["removed"] == {"systemd": "1s", "cpu.max": BASELINE}
