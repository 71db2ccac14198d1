"""What the benchmarks feed the plugin, and how they watch its process.

Realistic pod and container objects (labels, annotations, mounts, env as kubelet and containerd fill
them), a fake cgroup v1 node holding their pod cgroups, the plugin child process, and readings of its
resident memory and CPU time from /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nri_plugin.api.nri import api_pb2 as api

HERE = Path(__file__).resolve().parent

# The pod annotation that proves a request (trusted by the benchmark plugin, see plugin_child.py):
# in every pod the container named app-0 asks, so one container in five gets shared CPUs.
SHARED_ANNOTATION = "cpu-shared.crio.io/app-0"
CONTAINERS_PER_POD = 5


def realistic_pod(n: int, *, shared: bool = True, asking: tuple[str, ...] = ("app-0",)) -> api.PodSandbox:
    """Pod `n`; with `shared`, the containers named in `asking` ask for shared CPUs."""
    uid = f"{n:08x}-1b2c-4d5e-8f90-{n:012x}"
    pod = api.PodSandbox(
        id=f"{n:064x}", uid=uid, name=f"workload-{n}-7d9f8c6b5-x2x4q", namespace=f"team-{n % 40}"
    )
    pod.labels.update({"app": f"workload-{n}", "pod-template-hash": "7d9f8c6b5", "tier": "backend"})
    pod.annotations.update(
        {
            "kubernetes.io/config.seen": "2026-11-21T04:00:00.000000000Z",
            "kubernetes.io/config.source": "api",
            "workload.openshift.io/management": '{"effect": "PreferredDuringScheduling"}',
        }
    )
    if shared:
        for name in asking:
            pod.annotations[f"cpu-shared.crio.io/{name}"] = "enable"
    pod.runtime_handler = "runc"
    pod.linux.cgroup_parent = f"/kubepods/pod{uid}"
    pod.linux.cgroups_path = f"/kubepods/pod{uid}/{pod.id}"
    pod.ips.append(f"10.128.{n // 250}.{n % 250}")
    return pod


def realistic_container(
    pod: api.PodSandbox, n: int, *, state: api.ContainerState.ValueType = api.CONTAINER_RUNNING
) -> api.Container:
    cid = f"{n:064x}"[::-1]
    container = api.Container(
        id=cid, pod_sandbox_id=pod.id, name=f"app-{n % CONTAINERS_PER_POD}", state=state, pid=10000 + n
    )
    container.labels.update(
        {
            "io.kubernetes.container.name": container.name,
            "io.kubernetes.pod.name": pod.name,
            "io.kubernetes.pod.namespace": pod.namespace,
            "io.kubernetes.pod.uid": pod.uid,
        }
    )
    container.annotations.update(
        {
            "io.kubernetes.container.hash": "9f2c4e1a",
            "io.kubernetes.container.restartCount": "0",
            "io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
        }
    )
    container.args.extend(["/usr/bin/app", "--config=/etc/app/config.yaml", "--log-level=info"])
    container.env.extend(
        [
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            f"HOSTNAME={pod.name}",
            "KUBERNETES_SERVICE_HOST=172.30.0.1",
            "KUBERNETES_SERVICE_PORT=443",
        ]
    )
    for dest in ("/etc/hosts", "/dev/termination-log", "/var/run/secrets/kubernetes.io/serviceaccount"):
        container.mounts.add(
            destination=dest,
            type="bind",
            source=f"/var/lib/kubelet/pods/{pod.uid}{dest}",
            options=["rbind", "rprivate", "ro"],
        )
    container.linux.cgroups_path = f"{pod.linux.cgroup_parent}/{cid}"
    _resources(container, n)
    return container


def lean_pod(n: int) -> api.PodSandbox:
    """A pod with only what the plugin reads: ids, names, the request annotation, the cgroup parent."""
    full = realistic_pod(n)
    pod = api.PodSandbox(id=full.id, uid=full.uid, name=full.name, namespace=full.namespace)
    pod.annotations[SHARED_ANNOTATION] = "enable"
    pod.linux.cgroup_parent = full.linux.cgroup_parent
    return pod


def lean_container(pod: api.PodSandbox, n: int) -> api.Container:
    cid = f"{n:064x}"[::-1]
    container = api.Container(
        id=cid,
        pod_sandbox_id=pod.id,
        name=f"app-{n % CONTAINERS_PER_POD}",
        state=api.CONTAINER_RUNNING,
        pid=10000 + n,
    )
    container.linux.cgroups_path = f"{pod.linux.cgroup_parent}/{cid}"
    _resources(container, n)
    return container


def already_shared(container: api.Container) -> api.Container:
    """The container as it runs once the plugin gave it the shared CPUs (0-1), if it asks for them:
    its cpuset, quota and environment as after its creation."""
    if container.name != "app-0":
        return container
    cpu = container.linux.resources.cpu
    exclusive = cpu.cpus
    cpu.cpus = f"0-1,{exclusive}"
    cpu.quota.value = 4 * cpu.period.value
    container.env.extend(["OPENSHIFT_SHARED_CPUS=0-1", f"OPENSHIFT_ISOLATED_CPUS={exclusive}"])
    return container


def _resources(container: api.Container, n: int) -> None:
    cpu = container.linux.resources.cpu
    cpu.shares.value = 2048
    cpu.quota.value = 200000
    cpu.period.value = 100000
    cpu.cpus = f"{2 + n % 60}-{3 + n % 60}"
    cpu.mems = "0"
    container.linux.resources.memory.limit.value = 1 << 30


def fake_node(root: Path, pods: int) -> tuple[str, str]:
    """A cgroup v1 tree holding the first `pods` benchmark pods' cgroups (quota: 5 containers x 2
    CPUs, written afresh) and an empty state dir; returns both paths."""
    for n in range(pods):
        pod_dir = root / "cgroup" / "cpu" / "kubepods" / f"pod{realistic_pod(n).uid}"
        pod_dir.mkdir(parents=True, exist_ok=True)
        (pod_dir / "cpu.cfs_quota_us").write_text("1000000\n")
        (pod_dir / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cgroup" / "cpuset").mkdir(parents=True, exist_ok=True)
    state = root / "state"
    state.mkdir(exist_ok=True)
    for old in state.iterdir():
        old.unlink()
    return str(root / "cgroup"), str(state)


class PluginProcess:
    """The plugin (bench/plugin_child.py: the stub and the real mixed-CPU plugin) in a child process.

    `started` is taken just before the process is spawned: interpreter start-up and imports count.
    Environment knobs for experiments: BENCH_CHILD (another child script, e.g. a profiling wrapper),
    BENCH_UVLOOP=1, BENCH_LOG=info (see plugin_child.py).
    """

    def __init__(self, socket_path: str, cgroup_root: str, state_dir: str, **extra_env: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(HERE.parent), **extra_env}
        child = env.get("BENCH_CHILD", str(HERE / "plugin_child.py"))
        quiet = env.get("BENCH_LOG", "error") != "error"  # production-like logs: rendered, then dropped
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, child, socket_path, cgroup_root, state_dir],
            env=env,
            stderr=subprocess.DEVNULL if quiet else None,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_mib(self) -> float:
        return rss_mib(self.proc.pid)

    def peak_rss_mib(self) -> float:
        """VmHWM: the most resident memory since the start or since `reset_peak_rss`."""
        return rss_mib(self.proc.pid, "VmHWM")

    def reset_peak_rss(self) -> None:
        """Start VmHWM again from the current VmRSS (``clear_refs`` 5, Linux 4.0+)."""
        with open(f"/proc/{self.proc.pid}/clear_refs", "w") as file:
            file.write("5")

    def cpu_ns(self) -> int:
        return cpu_ns(self.proc.pid)

    async def state_bytes(self, stats: Path) -> int:
        """The bytes the plugin's state store has written so far (the child runs with
        ``BENCH_STATS=stats``)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stats)
        os.kill(self.proc.pid, signal.SIGUSR1)
        for _ in range(200):
            await asyncio.sleep(0.01)
            with contextlib.suppress(FileNotFoundError), open(stats) as file:  # noqa: ASYNC230 (tiny)
                return int(json.load(file)["state_bytes"])
        raise RuntimeError("the plugin process wrote no stats")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=10)


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """VmRSS (or another size field of /proc/<pid>/status, e.g. VmHWM) of a process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for process {pid}")


def cpu_ns(pid: int) -> int:
    """CPU time a process has used so far, all threads, in ns (schedstat: not rounded to ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that just ended
            total += int((task / "schedstat").read_text().split()[0])
    return total


def percentile(samples: list[float], q: float) -> float:
    """The sample below which a fraction `q` of them lie (nearest rank, no interpolation)."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
