"""cgroup v2 on a real kernel (a Debian kernel in a QEMU VM, busybox init): the kernel's rules, and the
real daemon on it end to end.

One VM for the module. Two commands run in it, once each: the kernel's rules through the `cgroups`
library (guest_kernel_v2.py), and the daemon's lifecycle against the runtime simulator with the pod
and container cgroups in the kernel's /sys/fs/cgroup (guest_daemon_v2.py). Each prints what the kernel
returned; the tests here assert on it. Without QEMU and a kernel the module skips, saying what is
missing (under CI=true it fails instead); scripts/vm-setup.sh installs them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from vm.vm_support import Vm, vm_session

pytestmark = pytest.mark.vm

PERIOD = 100_000
BASELINE = f"{PERIOD} {PERIOD}"  # kubelet's pod quota: 1 CPU
RAISED = f"{3 * PERIOD} {PERIOD}"  # + 2 shared CPUs
# The naming a pod's cgroups follow -> the container's exclusive CPU (the shared pool is 0-1).
NAMINGS = {"containerd-cgroupfs": "2", "containerd-systemd": "2", "cri-o-cgroupfs": "3", "cri-o-systemd": "3"}
WITH_SHARED = {"2": "0-2", "3": "0-1,3"}


@pytest.fixture(scope="module")
def vm() -> Iterator[Vm]:
    with vm_session("busybox") as booted:
        yield booted


@pytest.fixture(scope="module")
def kernel(vm: Vm) -> Any:
    return vm.python("tests/vm/guest_kernel_v2.py", timeout=300).json()


@pytest.fixture(scope="module")
def daemon(vm: Vm) -> Any:
    return vm.python("tests/vm/guest_daemon_v2.py", timeout=600).json()


def runs_on(cpus: str, quota: str = RAISED) -> dict[str, str]:
    """A running container's cgroup as the kernel reports it, its process's affinity included."""
    return {"cpu.max": quota, "cpuset.cpus": cpus, "cpuset.cpus.effective": cpus, "affinity": cpus}


# -- the kernel's rules ------------------------------------------------------------------------------


def test_the_vm_has_cgroup_v2_with_cpu_and_cpuset_for_children(vm: Vm, kernel: Any) -> None:
    assert vm.ready["mode"] == "busybox"
    assert kernel["layout"] == {"mode": "V2", "cpu": [2, "/sys/fs/cgroup"], "cpuset": [2, "/sys/fs/cgroup"]}
    assert set(kernel["root subtree_control"].split()) >= {"cpu", "cpuset"}
    assert kernel["online"] == "0-3"
    assert kernel["root has cpu.max"] is False


@pytest.mark.parametrize(
    ("value", "after"),
    [("50000 100000", "50000 100000"), ("200000", "200000 100000"), ("max 100000", "max 100000")],
)
def test_cpu_max_takes_quota_and_period_a_bare_quota_or_max(kernel: Any, value: str, after: str) -> None:
    assert kernel["cpu.max"][value] == {"ok": True, "after": after}


@pytest.mark.parametrize("value", ["999 100000", "1000 999", "1000 1000001", "junk"])
def test_cpu_max_refuses_a_quota_under_1ms_a_period_out_of_range_and_junk(kernel: Any, value: str) -> None:
    """The kernel's EINVAL comes back as the library's CgroupWriteRejected naming the rule; the file
    keeps its value."""
    outcome = kernel["cpu.max"][value]
    assert (outcome["ok"], outcome["error"], outcome["errno"]) == (False, "CgroupWriteRejected", "EINVAL")
    assert "quota >= 1000 us, period 1000 to 1000000 us" in outcome["message"]
    assert outcome["after"] == "100000 100000"


def test_a_quota_under_1ms_is_refused_before_anything_is_written(kernel: Any) -> None:
    outcome = kernel["cpu.max"]["typed quota 500"]
    assert (outcome["ok"], outcome["error"]) == (False, "CgroupValueError")
    assert "at least 1000 microseconds" in outcome["message"]
    assert outcome["after"] == "100000 100000"


def test_v2_takes_a_parent_quota_below_its_childs(kernel: Any) -> None:
    """v1 refuses this order (EINVAL); on v2 the child is throttled by its parent instead."""
    found = kernel["parent below child"]
    assert found["parent 1 cpu"] == found["child 3 cpus"] == found["parent 2 cpus below the child"]
    assert found["parent 1 cpu"] == {"ok": True}
    assert (found["parent"], found["child"], found["child quota"]) == (
        "200000 100000",
        "300000 100000",
        300_000,
    )


def test_nonexistent_cpus_and_junk_are_refused_with_the_cpuset_unchanged(kernel: Any) -> None:
    found = kernel["cpuset"]
    assert found["initial child"] == ""  # v2: empty means the parent's
    assert found["child 0-1"] == {"ok": True}
    nonexistent = found["nonexistent cpu 64"]
    assert (nonexistent["error"], nonexistent["errno"], nonexistent["after"]) == (
        "CgroupWriteRejected",
        "ERANGE",
        "0-1",
    )
    assert "the list names CPUs that do not exist on this machine" in nonexistent["message"]
    junk = found["junk"]
    assert (junk["error"], junk["errno"], junk["after"]) == ("CgroupWriteRejected", "EINVAL", "0-1")


def test_a_child_cpuset_outside_its_parents_is_taken_and_clipped(kernel: Any) -> None:
    """v1 refuses it; v2 keeps the written set and clips the effective one, which then follows the
    parent; the process's affinity is the effective set."""
    found = kernel["cpuset"]
    assert found["process moved in"]["ok"] is True
    assert found["parent 0, child 1"] == {"ok": True}
    assert (found["child cpus"], found["child effective"], found["process affinity"]) == ("1", "0", "0")
    assert found["after parent 1: child effective"] == found["after parent 1: process affinity"] == "1"
    assert found["child 2-3: process affinity"] == "2-3"


def test_the_structure_rules_a_runtime_meets(kernel: Any) -> None:
    found = kernel["subtree"]
    # cpu and cpuset are threaded controllers: a cgroup enabling only them may still hold processes.
    assert found["process into a cgroup with threaded controllers for its children"]["ok"] is True
    memory = found["process into a cgroup with memory for its children"]
    assert (memory["ok"], memory["errno"]) == (False, "EBUSY")
    assert found["remove -cpu while a child uses it"]["errno"] == "EBUSY"
    assert found["enable a controller the parent lacks"]["errno"] == "ENOENT"
    # No cpu.max where the parent does not enable cpu: the plugin then has no pod quota to raise.
    assert found["cpu files where the parent enables no cpu"] == ["cpu.pressure", "cpu.stat"]


# -- the daemon on the kernel ------------------------------------------------------------------------


@pytest.mark.parametrize("naming", sorted(NAMINGS))
def test_creation_raises_the_pod_before_the_runtime_makes_the_container(daemon: Any, naming: str) -> None:
    exclusive = NAMINGS[naming]
    cpus = WITH_SHARED[exclusive]
    created = daemon["create"][naming]
    assert (created["adjusted cpus"], created["adjusted quota"]) == (cpus, 3 * PERIOD)
    assert created["env"] == {"OPENSHIFT_SHARED_CPUS": "0-1", "OPENSHIFT_ISOLATED_CPUS": exclusive}
    assert created["pod cpu.max at reply"] == RAISED
    assert created["container"] == runs_on(cpus)


def test_a_container_that_does_not_ask_is_untouched(daemon: Any) -> None:
    plain = daemon["create"]["plain"]
    assert (plain["adjusted cpus"], plain["adjusted quota"], plain["env"]) == ("", None, {})
    assert plain["pod cpu.max at reply"] == plain["pod cpu.max now"] == BASELINE
    assert plain["container"] == runs_on("3", BASELINE)


def test_an_unlimited_container_in_an_unlimited_pod_gets_the_cpus_and_stays_unlimited(daemon: Any) -> None:
    created = daemon["create"]["unlimited"]
    assert (created["adjusted cpus"], created["adjusted quota"]) == ("0-2", None)
    assert created["pod cpu.max at reply"] == f"max {PERIOD}"
    assert created["container"] == runs_on("0-2", f"max {PERIOD}")


def test_kubelets_cfs_period_is_kept_in_the_pod_and_the_container(daemon: Any) -> None:
    """kubelet's cpuCFSQuotaPeriod of 50 ms: v2 holds the period in the same file as the quota."""
    created = daemon["create"]["period 50 ms"]
    assert (created["adjusted cpus"], created["adjusted quota"]) == ("0-1,3", 150_000)
    assert created["pod cpu.max at reply"] == "150000 50000"
    assert created["container"] == runs_on("0-1,3", "150000 50000")


@pytest.mark.parametrize("naming", sorted(NAMINGS))
def test_an_update_to_the_exclusive_cpus_keeps_the_shared_ones(daemon: Any, naming: str) -> None:
    cpus = WITH_SHARED[NAMINGS[naming]]
    updated = daemon["update"][naming]
    assert (updated["answered cpus"], updated["answered quota"], updated["refused"]) == (
        cpus,
        3 * PERIOD,
        None,
    )
    assert updated["container"] == runs_on(cpus)


def test_a_container_restart_keeps_one_share_in_the_pod_quota(daemon: Any) -> None:
    restart = daemon["container restart"]
    assert restart["create"]["pod cpu.max at reply"] == RAISED
    assert restart["create"]["container"] == runs_on("0-2")
    assert restart["pod cpu.max after the old one stopped"] == RAISED
    assert restart["pod cpu.max after the old one removed"] == RAISED


def test_a_daemon_restart_synchronizes_without_growth_and_adopts_a_new_container(daemon: Any) -> None:
    restart = daemon["daemon restart"]
    before, after = restart["pod quotas before"], restart["pod quotas after"]
    assert {uid: after[uid] for uid in before} == before  # nothing grew
    raised = {f"life-{index}": RAISED for index in range(4)}
    assert before == {**raised, "plain": BASELINE, "free": f"max {PERIOD}", "short": "150000 50000"}
    # Started while the daemon was away (CRI-O, systemd naming): widened and raised at Synchronize.
    assert restart["late container while away"] == runs_on("3", BASELINE)
    assert after["late"] == RAISED
    assert restart["updates at sync"] == ["late-c"]
    assert restart["late container after sync"] == runs_on("0-1,3")
    assert restart["runtime refused"] == []


@pytest.mark.parametrize(
    ("cid", "pod", "container"),
    [
        *((cid, BASELINE, BASELINE) for cid in ("c0-again", "c1", "c2", "c3", "late-c")),
        ("free-c", f"max {PERIOD}", f"max {PERIOD}"),
        ("short-c", "50000 50000", "50000 50000"),
    ],
)
def test_stop_lowers_the_pod_quota_at_once_on_v2(daemon: Any, cid: str, pod: str, container: str) -> None:
    """At StopContainer the plugin puts the stopped container's own quota back (n(exclusive) x its
    period: one CPU here; unlimited stays unlimited), then lowers the pod's, and the kernel keeps
    both while the stopped container's cgroup lingers."""
    ended = daemon["stop and remove"][cid]
    assert ended["after stop"]["pod cpu.max"] == pod
    assert ended["after stop"]["container cpu.max"]["cpu.max"] == container
    assert ended["pod cpu.max after remove"] == pod


def test_nonexistent_cpus_refused_by_the_kernel_leave_the_pod_quota_as_it_was(daemon: Any) -> None:
    """kubelet's cpuset names CPU 9 (the VM has 0-3): runc's write is refused (ERANGE), the runtime
    undoes the creation (StopContainer, RemoveContainer), and the pod quota is its own again."""
    found = daemon["refusals"]["nonexistent cpu"]
    assert (found["adjusted cpus"], found["pod cpu.max at reply"]) == ("0-1,3,9", f"{4 * PERIOD} {PERIOD}")
    assert "(ERANGE); the list names CPUs that do not exist on this machine" in found["runtime refused"]
    assert found["pod cpu.max after undo"] == f"{2 * PERIOD} {PERIOD}"


def test_a_pod_without_the_cpu_controller_is_refused_clearly_and_left_out_of_the_books(daemon: Any) -> None:
    found = daemon["refusals"]["pod without cpu controller"]
    assert found["code"] == 9  # FAILED_PRECONDITION: the runtime fails the creation
    assert found["refused"].startswith("cannot raise the CPU quota of pod ns/app: cannot open ")
    assert "podnocpu/cpu.max: No such file or directory (ENOENT)" in found["refused"]
    assert "the controller is not enabled for this cgroup" in found["refused"]
    assert found["pod cpu.max"] is None
    assert "nocpu" not in found["books"]["pods"]
    assert "dev-nocpu" not in found["books"]["devices"]


def test_a_shared_cpu_that_does_not_exist_stops_the_daemon_before_it_touches_anything(daemon: Any) -> None:
    found = daemon["refusals"]["nonexistent shared cpu in the config"]
    assert found["exit status"] == 2
    assert (
        "shared_cpuset: CPUs 7 are not online (online: 0-3, from /sys/devices/system/cpu/online)"
        in (found["stderr"])
    )
    assert found["pod quotas unchanged"] is True
    assert found["state unchanged"] is True


def test_the_daemon_ran_and_stopped_cleanly(daemon: Any) -> None:
    assert daemon["daemon"]["exit statuses"] == [0, 0]
    assert daemon["daemon"]["tracebacks"] == 0
    errors = [e for e in daemon["simulator errors"] if not e.startswith("drop ")]  # the daemon's restart
    assert len(errors) == 1
    assert errors[0].startswith("CreateContainer nocpu-c: cannot raise the CPU quota")
