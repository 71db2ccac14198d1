"""Runs in the test VM (systemd mode: systemd as PID 1, cgroup v2): the real daemon against the runtime
simulator, its pod quotas set through systemd on the system bus, and what a ``daemon-reload`` does to them.

This script plays kubelet and runc under the systemd cgroup driver: each pod is a slice made through
systemd (``StartTransientUnit`` of ``kubepods-pod<uid>.slice`` with the pod's CPU limit as unit
properties, as kubelet does), each container a transient scope in it (``systemd-run --scope``, delegated,
as runc's systemd driver makes ``cri-containerd-<id>.scope``) with its process; the container's own
cpuset and quota are written to its (delegated) files, as runc does. The daemon is ``python -m
nri_plugin.daemon.cli run`` from this checkout, ``cgroup_root = /sys/fs/cgroup``, its state on the
guest's tmpfs. Two runs of it:

* ``bus``: the default ``systemd_bus``: the pod quota raised at creation and lowered at stop/remove
  must be what systemd records (``CPUQuotaPerSecUSec``) and what ``cpu.max`` holds, through a
  ``daemon-reload`` and a ``set-property`` of the slice;
* ``file``: ``systemd_bus = ""`` (the fallback): the raise is written to the file, systemd knows
  nothing of it and a ``daemon-reload`` puts its own value back, until the reconciler
  (``reconcile_interval = 3``) writes the raise again. (Not 1: the reconciler's grace for a
  container's cgroup to appear is one interval (never under 2 s), and a scope's start under emulation
  may take longer.)

A control slice whose ``cpu.max`` is written by hand shows each reload's re-apply has happened before
the plugin's slice is read. It prints one JSON object (its last line) with every reading as systemd and
the kernel returned it; the host's tests (test_vm_systemd.py) assert on them.

    python tests/vm/guest_daemon_systemd.py
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mixedcpu_support import NAMINGS, PERIOD
from vm.guest_daemon_v2 import GUARD, WORK, Kernel, Node, Reading, Runtime, prepare_workdir, read_text

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import container_cgroup_path, pod_cgroup_path, read_layout

NAMING = NAMINGS[1]  # containerd, systemd driver: /kubepods.slice/kubepods-pod<uid>.slice
CONTROL = "kubepods-podcontrol.slice"
HAND_WRITTEN = f"{3 * PERIOD} {PERIOD}"
# How long a reload's effect, or the reconciler's write, is waited for (guards; under emulation on
# 2 shared cores a daemon-reload took 7-20 s, a set-property 0.4-0.9 s).
SETTLE = 30.0
# The daemon's log lines the host's tests look at: the bus, and what the reconciler healed.
BUS_WORDS = ("system bus", "systemd", "heal=")
# What is waited for more after a reload's visible effect, for units later in systemd's queue.
QUEUE = 0.5


def run(*argv: str) -> str:
    """A command that must succeed: its stdout, stripped."""
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=GUARD).stdout.strip()


def slice_dir(unit: str) -> str:
    """The cgroup directory of a pod slice (all ours are children of kubepods.slice)."""
    return f"/sys/fs/cgroup/kubepods.slice/{unit}"


def cpu_max(unit: str) -> str | None:
    return read_text(slice_dir(unit), "cpu.max")


def start_slice(unit: str, cpus: int | None) -> None:
    """kubelet's pod slice: a transient unit made over D-Bus, the pod's CPU limit (`cpus`; None: no
    limit) as its properties; returns once systemd has made its cgroup."""
    properties = ["CPUAccounting", "b", "true"]
    if cpus is not None:
        properties += ["CPUQuotaPerSecUSec", "t", str(cpus * 1_000_000)]
        properties += ["CPUQuotaPeriodUSec", "t", str(PERIOD)]
    run(
        "busctl", "call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
        "org.freedesktop.systemd1.Manager", "StartTransientUnit", "ssa(sv)a(sa(sv))", unit, "replace",
        str(len(properties) // 3), *properties, "0",
    )  # fmt: skip
    wait_for(lambda: os.path.exists(os.path.join(slice_dir(unit), "cpu.max")), f"{unit}'s cgroup")


def wait_for(condition: Any, what: str, timeout: float = SETTLE) -> float:
    """Seconds until `condition()` held; an error past `timeout`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise SystemExit(f"guest: {what} not there after {timeout} s")
        time.sleep(0.02)
    return round(time.monotonic() - started, 3)


class SystemdKernel(Kernel):
    """kubelet's and runc's part under the systemd cgroup driver: slices and scopes made by systemd."""

    def make_pod(self, pod: api.PodSandbox, baseline: int | None, period: int = PERIOD) -> None:
        assert period == PERIOD
        cpus = None if baseline is None else baseline // PERIOD
        start_slice(pod_cgroup_path(pod.linux.cgroup_parent).parts[-1], cpus)

    def run_container(self, container: api.Container) -> str | None:
        """runc (systemd driver): the container's process in a delegated transient scope of the pod's
        slice, then the container's CPU resources written to the scope's own files."""
        path = container_cgroup_path(container.linux.cgroups_path)
        scope, pod_slice = path.parts[-1], path.parts[-2]
        proc = subprocess.Popen(
            ["systemd-run", "--scope", "--quiet", f"--unit={scope}", f"--slice={pod_slice}",
             "-p", "Delegate=yes", "sleep", "3600"],
        )  # fmt: skip
        self.processes[container.id] = proc
        cgroup_of = Path(f"/proc/{proc.pid}/cgroup")
        wait_for(lambda: scope in cgroup_of.read_text(), f"{scope} holding the process")
        return self.apply(container, container.linux.resources)

    def delete(self, container: api.Container) -> None:
        """The scope ended with its last process (systemd removed its cgroup); runc deletes nothing."""
        directory = self.fs(container_cgroup_path(container.linux.cgroups_path))
        wait_for(lambda: not os.path.exists(directory), f"{directory} removed by systemd")

    def cleanup(self) -> None:
        for container_id in list(self.processes):
            self.stop(container_id)


def cpu_limit(cpus: int) -> api.LinuxResources:
    """A pod's CPU limit as kubelet sends it for an in-place resize."""
    resources = api.LinuxResources()
    resources.cpu.quota.value = cpus * PERIOD
    resources.cpu.period.value = PERIOD
    resources.cpu.shares.value = cpus * 1024
    return resources


def systemd_quota(unit: str) -> str:
    return run("systemctl", "show", "-P", "CPUQuotaPerSecUSec", unit)


def observe(unit: str) -> Reading:
    """The pod slice's CFS limit as systemd records it and as the kernel holds it."""
    return {"systemd": systemd_quota(unit), "cpu.max": cpu_max(unit)}


def reload() -> float:
    """``systemctl daemon-reload``; return once the control slice's hand-written ``cpu.max`` is back at
    systemd's value (systemd has re-applied its units), and a moment more: the seconds that took."""
    with open(os.path.join(slice_dir(CONTROL), "cpu.max"), "w") as handle:
        handle.write(HAND_WRITTEN)
    assert cpu_max(CONTROL) == HAND_WRITTEN
    started = time.monotonic()
    run("systemctl", "daemon-reload")
    wait_for(lambda: cpu_max(CONTROL) == f"{PERIOD} {PERIOD}", "the control slice put back by daemon-reload")
    took = round(time.monotonic() - started, 3)
    time.sleep(QUEUE)
    return took


def set_weight(unit: str, weight: int) -> float:
    """kubelet's kind of update of the slice (``set-property``): systemd re-applies all the unit's cgroup
    settings at once; return once its ``cpu.weight`` shows the new value, and a moment more."""
    started = time.monotonic()
    run("systemctl", "set-property", "--runtime", unit, f"CPUWeight={weight}")
    wait_for(lambda: read_text(slice_dir(unit), "cpu.weight") == str(weight), f"{unit}'s cpu.weight {weight}")
    took = round(time.monotonic() - started, 3)
    time.sleep(QUEUE)
    return took


async def through_the_bus(node: Node, out: dict[str, Any]) -> None:
    """Default `systemd_bus`: creation raises the slice's limit through systemd, stop/remove lowers it."""
    pod = node.pod(NAMING, "bus", PERIOD)
    unit = pod_cgroup_path(pod.linux.cgroup_parent).parts[-1]
    steps: dict[str, Reading] = {"made": observe(unit)}
    container = node.container(NAMING, pod, "bus-c", "2", device="dev-bus")
    reply = await node.create(container)
    steps["created"] = {**observe(unit), "reply": reply}
    steps["daemon-reload"] = {"reapplied in": reload(), **observe(unit)}
    steps["set-property CPUWeight=50"] = {"reapplied in": set_weight(unit, 50), **observe(unit)}
    # kubelet resizes the pod in place to 2 CPUs: the slice's limit through systemd, then the
    # runtime's UpdatePodSandbox with the pod's new resources.
    run("systemctl", "set-property", "--runtime", unit, "CPUQuota=200%")
    steps["resized by kubelet"] = observe(unit)
    await node.runtime.update_pod_sandbox(pod.id, cpu_limit(2))
    steps["UpdatePodSandbox"] = observe(unit)
    steps["resized, set-property CPUWeight=40"] = {"reapplied in": set_weight(unit, 40), **observe(unit)}
    await node.stop("bus-c")
    steps["stopped"] = observe(unit)
    await node.remove("bus-c")
    steps["removed"] = observe(unit)
    steps["removed, daemon-reload"] = {"reapplied in": reload(), **observe(unit)}
    steps["removed, set-property CPUWeight=60"] = {"reapplied in": set_weight(unit, 60), **observe(unit)}
    await node.runtime.stop_pod_sandbox(pod.id)
    await node.runtime.remove_pod_sandbox(pod.id)
    out["bus"] = steps


async def watch_quota(unit: str, seen: list[tuple[float, str | None]], stop: asyncio.Event) -> None:
    """Every change of the slice's cpu.max, with the seconds since the watch began."""
    started = time.monotonic()
    while not stop.is_set():
        value = cpu_max(unit)
        if not seen or seen[-1][1] != value:
            seen.append((round(time.monotonic() - started, 3), value))
        await asyncio.sleep(0.005)


async def until_healed(seen: list[tuple[float, str | None]], changes: int) -> None:
    """Until the watch has seen `changes` values, the last one the raise again (or past a guard)."""
    deadline = time.monotonic() + SETTLE
    while time.monotonic() < deadline and not (len(seen) >= changes and seen[-1][1] == HAND_WRITTEN):  # noqa: ASYNC110
        await asyncio.sleep(0.05)


async def through_the_file(node: Node, out: dict[str, Any]) -> None:
    """``systemd_bus = ""``: the raise goes to the file, a reload reverts it, the reconciler restores it."""
    config = WORK / "fallback.toml"
    config.write_text((WORK / "config.toml").read_text().replace(
        'metrics_address = ""\n', 'metrics_address = ""\nsystemd_bus = ""\nreconcile_interval = 3\n'
    ))  # fmt: skip
    await node.start_daemon(config)
    pod = node.pod(NAMING, "file", PERIOD)
    unit = pod_cgroup_path(pod.linux.cgroup_parent).parts[-1]
    steps: dict[str, Any] = {"made": observe(unit)}
    seen: list[tuple[float, str | None]] = []
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(watch_quota(unit, seen, stop))
    container = node.container(NAMING, pod, "file-c", "2", device="dev-file")
    steps["reply"] = await node.create(container)
    # The container's scope, started in the slice, had systemd re-apply the slice: the reconciler's
    # next pass puts the raise back.
    await until_healed(seen, 3)
    steps["reload from"] = len(seen)
    reload = await asyncio.create_subprocess_exec("systemctl", "daemon-reload")
    await asyncio.wait_for(reload.wait(), GUARD)
    await until_healed(seen, steps["reload from"] + 2)
    await asyncio.sleep(2.5)  # and it stays: the reconciler's next passes find it right
    stop.set()
    await watcher
    steps["cpu.max seen"] = seen
    steps["at the end"] = observe(unit)
    await node.stop("file-c")
    await node.remove("file-c")
    steps["removed"] = observe(unit)
    out["file"] = steps


async def main() -> dict[str, Any]:
    out: dict[str, Any] = {}
    prepare_workdir()
    kernel = SystemdKernel(read_layout())
    start_slice(CONTROL, 1)
    try:
        async with Runtime(WORK / "nri.sock", kernel) as runtime:
            node = Node(kernel, runtime)
            await node.start_daemon()
            try:
                await through_the_bus(node, out)
                await node.stop_daemon()
                await through_the_file(node, out)
            finally:
                if node.daemon is not None:
                    await node.stop_daemon()
            out["simulator errors"] = [
                f"{r.event} {r.container}: {r.detail}" for r in runtime.records if r.outcome != "ok"
            ]
    finally:
        kernel.cleanup()
    out["daemon"] = {
        "exit statuses": node.exits,
        "tracebacks": sum("Traceback" in line for line in node.logs),
        "bus lines": [line for line in node.logs if any(word in line for word in BUS_WORDS)],
        "log": node.logs[-200:],
    }
    out["systemd"] = run("systemctl", "--version").splitlines()[0]
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(asyncio.run(main())) + "\n")
