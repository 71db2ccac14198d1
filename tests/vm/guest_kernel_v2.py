"""Runs in the test VM (busybox mode, cgroup v2): what the kernel accepts and refuses in ``cpu.max``,
``cpuset.cpus`` and ``cgroup.subtree_control``, through the project's `cgroups` library.

Prints one JSON object (its last line): every observation by name, as the kernel returned it. The host's
tests (test_vm_cgroup_v2.py) assert on them. Everything is done in a scratch subtree of
/sys/fs/cgroup, removed at the end (its processes killed first).

    python tests/vm/guest_kernel_v2.py
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nri_plugin.cgroups import (
    CgroupDir,
    CgroupError,
    CgroupPath,
    Hierarchy,
    read_cpu_quota,
    read_layout,
    read_value,
    write_cpu_quota,
    write_cpuset,
    write_value,
)

TOP = "vm-kernel-checks"
Outcome = dict[str, Any]

# Raw cpu.max values and whether the kernel should take them (the host's tests hold the expectation;
# this list only says what to try).
CPU_MAX_VALUES = (
    "50000 100000",
    "200000",
    "max 100000",
    "999 100000",
    "1000 999",
    "1000 1000001",
    "junk",
)


def attempt(action: Callable[[], object]) -> Outcome:
    """What `action` did: ``{"ok": True}``, or the error's class, errno name and message."""
    try:
        action()
    except CgroupError as exc:
        code = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno is not None else None
        return {"ok": False, "error": type(exc).__name__, "errno": code, "message": str(exc)}
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        return {"ok": False, "error": "OSError", "errno": name, "message": str(exc)}
    return {"ok": True}


class Scratch:
    """Cgroups below /sys/fs/cgroup/<TOP>, made with `make` and all removed by `cleanup`."""

    def __init__(self, hierarchy: Hierarchy) -> None:
        self.hierarchy = hierarchy
        self.made: list[CgroupDir] = []
        self.processes: list[subprocess.Popen[bytes]] = []

    def make(self, *parts: str, controllers: str = "") -> CgroupDir:
        """A cgroup (its parents must exist); `controllers` enabled for its children."""
        cgroup = self.hierarchy.dir(CgroupPath((TOP, *parts)))
        os.mkdir(cgroup.fs_path)
        self.made.append(cgroup)
        if controllers:
            write_value(cgroup, "cgroup.subtree_control", controllers)
        return cgroup

    def spawn_into(self, cgroup: CgroupDir) -> Outcome:
        """A sleeping process moved into `cgroup` (the outcome of the move)."""
        proc = subprocess.Popen(["sleep", "600"])
        self.processes.append(proc)
        outcome = attempt(lambda: write_value(cgroup, "cgroup.procs", str(proc.pid)))
        outcome["pid"] = proc.pid
        return outcome

    def cleanup(self) -> None:
        for proc in self.processes:
            proc.kill()
            proc.wait()
        for cgroup in reversed(self.made):
            with contextlib.suppress(OSError):
                os.rmdir(cgroup.fs_path)


def text(cgroup: CgroupDir, name: str) -> str:
    return read_value(cgroup, name).strip()


def allowed_cpus(pid: int) -> str:
    """The CPUs the kernel lets the process run on (its affinity, which the cpuset bounds)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    return ""


def cpu_max_checks(scratch: Scratch) -> dict[str, Any]:
    """Each raw cpu.max value: accepted or not, and what the file holds afterwards."""
    cgroup = scratch.make("quota")
    write_value(cgroup, "cpu.max", "100000 100000")
    results: dict[str, Any] = {}
    for value in CPU_MAX_VALUES:
        write_value(cgroup, "cpu.max", "100000 100000")
        outcome = attempt(lambda value=value: write_value(cgroup, "cpu.max", value))  # type: ignore[misc]
        outcome["after"] = text(cgroup, "cpu.max")
        results[value] = outcome
    write_value(cgroup, "cpu.max", "100000 100000")
    typed = attempt(lambda: write_cpu_quota(cgroup, 500))
    typed["after"] = text(cgroup, "cpu.max")
    results["typed quota 500"] = typed
    return results


def parent_below_child(scratch: Scratch) -> dict[str, Any]:
    """v1 refuses a parent quota below a child's; v2 takes both orders."""
    parent = scratch.make("pod", controllers="+cpu +cpuset")
    child = scratch.make("pod", "ctr")
    results: dict[str, Any] = {
        "parent 1 cpu": attempt(lambda: write_cpu_quota(parent, 100_000)),
        "child 3 cpus": attempt(lambda: write_cpu_quota(child, 300_000)),
        "parent 2 cpus below the child": attempt(lambda: write_cpu_quota(parent, 200_000)),
    }
    results["parent"] = text(parent, "cpu.max")
    results["child"] = text(child, "cpu.max")
    results["child quota"] = read_cpu_quota(child).quota
    return results


def cpuset_checks(scratch: Scratch) -> dict[str, Any]:
    """Nonexistent CPUs and junk refused with the file unchanged; a child outside its parent's set
    accepted, its effective set clipped, then following the parent; a process's affinity with it."""
    parent = scratch.make("cpus", controllers="+cpuset")
    child = scratch.make("cpus", "ctr")
    results: dict[str, Any] = {"initial child": text(child, "cpuset.cpus")}
    results["child 0-1"] = attempt(lambda: write_cpuset(child, {0, 1}))
    results["nonexistent cpu 64"] = attempt(lambda: write_cpuset(child, {0, 64}))
    results["nonexistent cpu 64"]["after"] = text(child, "cpuset.cpus")
    results["junk"] = attempt(lambda: write_value(child, "cpuset.cpus", "zero-one"))
    results["junk"]["after"] = text(child, "cpuset.cpus")
    moved = scratch.spawn_into(child)
    results["process moved in"] = moved
    write_cpuset(parent, {0})
    results["parent 0, child 1"] = attempt(lambda: write_cpuset(child, {1}))
    results["child cpus"] = text(child, "cpuset.cpus")
    results["child effective"] = text(child, "cpuset.cpus.effective")
    results["process affinity"] = allowed_cpus(moved["pid"])
    write_cpuset(parent, {1})
    results["after parent 1: child effective"] = text(child, "cpuset.cpus.effective")
    results["after parent 1: process affinity"] = allowed_cpus(moved["pid"])
    write_cpuset(parent, {0, 1, 2, 3})
    write_cpuset(child, {2, 3})
    results["child 2-3: process affinity"] = allowed_cpus(moved["pid"])
    return results


def subtree_checks(scratch: Scratch) -> dict[str, Any]:
    """The v2 structure rules a runtime meets when it makes cgroups."""
    parent = scratch.make("tree", controllers="+cpu")
    scratch.make("tree", "ctr", controllers="+cpu")
    leaf = scratch.make("tree", "ctr", "sub")
    scratch.make("plain")
    bare = scratch.make("plain", "bare")  # its parent enables no controller for it
    return {
        "process into a cgroup with threaded controllers for its children": scratch.spawn_into(parent),
        "process into a cgroup with memory for its children": domain_rule(scratch),
        "process into a leaf": scratch.spawn_into(leaf),
        "remove -cpu while a child uses it": attempt(
            lambda: write_value(parent, "cgroup.subtree_control", "-cpu")
        ),
        "enable a controller the parent lacks": attempt(
            lambda: write_value(bare, "cgroup.subtree_control", "+cpuset")
        ),
        "cpu files where the parent enables no cpu": sorted(
            name for name in os.listdir(bare.fs_path) if name.startswith("cpu.")
        ),
    }


def domain_rule(scratch: Scratch) -> Outcome:
    """The no-internal-process rule, which applies once a domain controller (memory) is enabled
    for the children; cpu and cpuset are threaded controllers and do not trigger it."""
    root = scratch.hierarchy.dir(CgroupPath())
    if "memory" not in text(root, "cgroup.controllers").split():
        return {"ok": None, "message": "no memory controller"}
    top = scratch.hierarchy.dir(CgroupPath((TOP,)))
    write_value(top, "cgroup.subtree_control", "+memory")
    domain = scratch.make("domain", controllers="+memory")
    scratch.make("domain", "ctr")
    return scratch.spawn_into(domain)


@contextlib.contextmanager
def scratch_tree(hierarchy: Hierarchy) -> Iterator[Scratch]:
    root = hierarchy.dir(CgroupPath())
    enabled = text(root, "cgroup.subtree_control").split()
    top = hierarchy.dir(CgroupPath((TOP,)))
    os.mkdir(top.fs_path)
    add_memory = "memory" in text(root, "cgroup.controllers").split() and "memory" not in enabled
    if add_memory:  # for `domain_rule`
        write_value(root, "cgroup.subtree_control", "+memory")
    write_value(top, "cgroup.subtree_control", "+cpu +cpuset")
    scratch = Scratch(hierarchy)
    try:
        yield scratch
    finally:
        scratch.cleanup()
        os.rmdir(top.fs_path)
        if add_memory:  # the root as it was
            write_value(root, "cgroup.subtree_control", "-memory")


def main() -> dict[str, Any]:
    layout = read_layout()
    root = layout.cpu.dir(CgroupPath())
    observed: dict[str, Any] = {
        "layout": {
            "mode": layout.mode.name,
            "cpu": [layout.cpu.version, layout.cpu.mount_point],
            "cpuset": [layout.cpuset.version, layout.cpuset.mount_point],
        },
        "root subtree_control": text(root, "cgroup.subtree_control"),
        "root has cpu.max": os.path.exists(os.path.join(root.fs_path, "cpu.max")),
        "online": Path("/sys/devices/system/cpu/online").read_text().strip(),
    }
    with scratch_tree(layout.cpu) as scratch:
        observed["cpu.max"] = cpu_max_checks(scratch)
        observed["parent below child"] = parent_below_child(scratch)
        observed["cpuset"] = cpuset_checks(scratch)
        observed["subtree"] = subtree_checks(scratch)
    return observed


if __name__ == "__main__":
    result = main()
    sys.stdout.write(json.dumps(result) + "\n")
