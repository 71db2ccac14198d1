"""The asking CreateContainer round trip through NRI's real Go runtime library, to a Go plugin and to
this project's daemon, side by side in one run.

Usage: python bench/go/side_by_side.py --bin DIR [--rounds 6] [--calls 1000] [--warmup 300]
       [--state disk|tmpfs|both] [--tree NAME=PATH ...]

DIR holds the two Go programs built by hand from bench/go/ (see bench/go/README.md; not run in CI):
``nribench-runtime``, NRI's runtime side (``pkg/adaptation``, as containerd uses it) listening on one
socket per plugin, and ``nribench-plugin``, a plugin on NRI's Go stub doing the same work per asking
creation as ours. The plugins timed in one run, by the same runtime process:

* ``go``: the Go plugin;
* ``NAME-disk``: ``mixed-cpu-nri-plugin run`` (``python -m nri_plugin.daemon.cli``, run by this
  interpreter) from source tree NAME (``--tree``; by default this one, named ``py``) with a config of
  its own, its state directory on disk (the machine's /tmp);
* ``NAME-tmpfs``: the same daemon with its state directory on tmpfs (/dev/shm): the state written as
  before, only the filesystem under it differs.

Several trees (say, the code before and after a change) run side by side in the same run. Each
plugin has its own fake cgroup v1 tree (regular files) holding every pod's cgroup; each creation is
the first container of a new pod that asks (the pod annotation, trusted in the daemon's config), so
each reads and raises its pod's quota. The daemons run as in production (log level info, JSON lines
to /dev/null, metrics on a free port), except ``reconcile_interval = 3600``: its pass over the
thousands of benchmark pods in the books is not the creation path, and would land in some rounds.

A round times ``--calls`` creations one after the other on each plugin in turn (the order rotates
from round to round); each plugin's CPU time over its block is read from /proc (schedstat). Printed:
per round and plugin p50, p99 and mean round trip and CPU per creation (the plugin's, and the Go
runtime's), the ratio of each daemon's p50 and p99 to Go's, and their median and range over the
rounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))

from workload import cpu_ns, percentile  # noqa: E402 - bench/ is on the path only from here

POD_QUOTA = 1_000_000
PERIOD = 100_000


def uid(n: int) -> str:
    """Pod n's uid, as nribench-runtime (and bench/workload.py) make it."""
    return f"{n:08x}-1b2c-4d5e-8f90-{n:012x}"


def make_pods(cgroup_root: Path, pods: int) -> None:
    """A fake cgroup v1 tree holding the pods' cgroups, each with 10 CPUs of quota."""
    (cgroup_root / "cpuset").mkdir(parents=True, exist_ok=True)
    kubepods = cgroup_root / "cpu" / "kubepods"
    for n in range(pods):
        pod = kubepods / f"pod{uid(n)}"
        pod.mkdir(parents=True)
        (pod / "cpu.cfs_quota_us").write_text(f"{POD_QUOTA}\n")
        (pod / "cpu.cfs_period_us").write_text(f"{PERIOD}\n")


def socket_of(root: Path, name: str) -> Path:
    """A plugin's NRI socket, in a directory of its own: the daemon's node-wide lock lies beside it."""
    directory = root / f"{name}-nri"
    directory.mkdir(exist_ok=True)
    return directory / "nri.sock"


def daemon_config(root: Path, name: str, state_dir: Path) -> Path:
    """The daemon's config: shared CPUs 0-1 of 64 online, the pod annotation trusted, no device
    plugin, no systemd bus, its own socket, cgroup tree and state directory."""
    sysfs = root / "sys"
    (sysfs / "devices" / "system" / "cpu").mkdir(parents=True, exist_ok=True)
    (sysfs / "devices" / "system" / "cpu" / "online").write_text("0-63\n")
    config = root / f"{name}.toml"
    config.write_text(
        f'shared_cpuset = "0-1"\nsysfs_root = "{sysfs}"\nstate_dir = "{state_dir}"\n'
        f'cgroup_root = "{root / name}-cg"\ncgroup_version = "v1"\nmetrics_address = "127.0.0.1:0"\n'
        f'systemd_bus = ""\nnri_socket = "{socket_of(root, name)}"\n'
        'reconcile_interval = 3600\nlog_level = "info"\n'
        "[trusted_sources]\ndevice_plugin_marker = false\npod_annotation = true\n"
        "[device_plugin]\nenabled = false\n"
    )
    return config


@dataclass
class Block:
    """One plugin's creations in one round."""

    name: str
    took_ns: list[int]
    plugin_cpu_ns: int
    runtime_cpu_ns: int

    def p(self, q: float) -> float:
        return percentile([float(t) for t in self.took_ns], q) / 1000

    @property
    def mean_us(self) -> float:
        return statistics.fmean(self.took_ns) / 1000

    def per_call_us(self, ns: int) -> float:
        return ns / len(self.took_ns) / 1000


class Runtime:
    """nribench-runtime, driven over its stdin and stdout."""

    def __init__(self, binary: Path, sockets: dict[str, Path]) -> None:
        argv = [str(binary)]
        for name, path in sockets.items():
            argv += ["-socket", f"{name}={path}"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.readline() == "listening"

    def readline(self) -> str:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        line = out.readline()
        if not line:
            raise RuntimeError(f"nribench-runtime ended (status {self.proc.wait()})")
        return line.strip()

    def wait_ready(self, names: set[str]) -> None:
        waiting = set(names)
        while waiting:
            word, name = self.readline().split()
            assert word == "ready", word
            waiting.discard(name)

    def create(self, name: str, first: int, count: int) -> list[int]:
        stdin = self.proc.stdin
        assert stdin is not None
        stdin.write(f"create {name} {first} {count}\n")
        stdin.flush()
        fields = self.readline().split()
        assert fields[:2] == ["done", name], fields[:2]
        return [int(f) for f in fields[2:]]

    def stop(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        self.proc.wait(timeout=10)


@dataclass(frozen=True)
class DaemonSpec:
    """A daemon to time: its name, the source tree it runs from, its state directory."""

    name: str
    tree: Path
    state_dir: Path


def start_plugins(
    daemons: list[DaemonSpec], root: Path, binary: Path, pods: int, devnull: IO[bytes]
) -> dict[str, subprocess.Popen[bytes]]:
    """The Go plugin and the daemons, each on its own cgroup tree and socket."""
    make_pods(root / "go-cg", pods)
    procs: dict[str, subprocess.Popen[bytes]] = {
        "go": subprocess.Popen(
            [str(binary), "-socket", str(socket_of(root, "go")), "-cgroup-root", str(root / "go-cg")],
            stdout=devnull,
            stderr=devnull,
        )
    }
    for daemon in daemons:
        make_pods(root / f"{daemon.name}-cg", pods)
        config = daemon_config(root, daemon.name, daemon.state_dir)
        procs[daemon.name] = subprocess.Popen(
            [sys.executable, "-m", "nri_plugin.daemon.cli", "run", "--config", str(config)],
            cwd=daemon.tree,
            env={**os.environ, "PYTHONPATH": str(daemon.tree)},
            stdout=devnull,
            stderr=devnull,
        )
    return procs


def report(rounds: list[dict[str, Block]]) -> None:
    names = list(rounds[0])
    print(
        f"{'round':>5} {'plugin':>12} {'p50 µs':>8} {'p99 µs':>8} {'mean µs':>8} "
        f"{'plugin CPU':>10} {'runtime CPU':>11}"
    )
    for n, blocks in enumerate(rounds, 1):
        for name in names:
            b = blocks[name]
            print(
                f"{n:>5} {name:>12} {b.p(0.5):8.1f} {b.p(0.99):8.1f} {b.mean_us:8.1f} "
                f"{b.per_call_us(b.plugin_cpu_ns):10.1f} {b.per_call_us(b.runtime_cpu_ns):11.1f}"
            )
    for name in names:
        if name == "go":
            continue
        for label, q in (("p50", 0.5), ("p99", 0.99)):
            ratios = [r[name].p(q) / r["go"].p(q) for r in rounds]
            print(
                f"{name} / go, {label}: median {statistics.median(ratios):.2f}x "
                f"(rounds {min(ratios):.2f}-{max(ratios):.2f}: {', '.join(f'{x:.2f}' for x in ratios)})"
            )
    for name in names:
        p50 = [r[name].p(0.5) for r in rounds]
        cpu = [r[name].per_call_us(r[name].plugin_cpu_ns) for r in rounds]
        print(
            f"{name}: p50 median {statistics.median(p50):.1f} µs ({min(p50):.1f}-{max(p50):.1f}), "
            f"plugin CPU per creation median {statistics.median(cpu):.1f} µs ({min(cpu):.1f}-{max(cpu):.1f})"
        )


def daemons_to_run(trees: list[str], states: str, root: Path, shm: Path) -> list[DaemonSpec]:
    """One daemon per source tree and state directory: ``NAME-disk`` (under /tmp), ``NAME-tmpfs``."""
    daemons = []
    for tree in trees or [f"py={ROOT}"]:
        name, _, path = tree.partition("=")
        for state, under in (("disk", root), ("tmpfs", shm)):
            if states in (state, "both"):
                label = f"{name}-{state}"
                daemons.append(DaemonSpec(label, Path(path).resolve(), under / f"{label}-state"))
    return daemons


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--bin", type=Path, required=True, help="holds nribench-runtime, nribench-plugin")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=1000, help="creations per plugin per round (1000)")
    parser.add_argument("--warmup", type=int, default=300, help="untimed creations per plugin first (300)")
    parser.add_argument("--state", choices=("disk", "tmpfs", "both"), default="both", help="(both)")
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a source tree to run the daemon from (repeat; default: this one, named py)",
    )
    args = parser.parse_args(argv)
    pods = args.warmup + args.rounds * args.calls
    root = Path(tempfile.mkdtemp(prefix="nribench-", dir="/tmp"))  # unix socket paths: short
    shm = Path(tempfile.mkdtemp(prefix="nribench-", dir="/dev/shm"))
    devnull = open(os.devnull, "wb")  # noqa: SIM115 - for the whole run
    procs: dict[str, subprocess.Popen[bytes]] = {}
    runtime = None
    try:
        daemons = daemons_to_run(args.tree, args.state, root, shm)
        names = ["go", *(d.name for d in daemons)]
        runtime = Runtime(args.bin / "nribench-runtime", {n: socket_of(root, n) for n in names})
        procs = start_plugins(daemons, root, args.bin / "nribench-plugin", pods, devnull)
        runtime.wait_ready(set(names))
        for name in names:
            runtime.create(name, 0, args.warmup)
        rounds: list[dict[str, Block]] = []
        for n in range(args.rounds):
            first = args.warmup + n * args.calls
            order = names[n % len(names) :] + names[: n % len(names)]
            blocks = {}
            for name in order:
                pid = procs[name].pid
                cpu, rt = cpu_ns(pid), cpu_ns(runtime.proc.pid)
                took = runtime.create(name, first, args.calls)
                blocks[name] = Block(name, took, cpu_ns(pid) - cpu, cpu_ns(runtime.proc.pid) - rt)
            rounds.append({name: blocks[name] for name in names})
            time.sleep(0.2)
        print(
            f"{args.rounds} rounds of {args.calls} asking creations per plugin ({args.warmup} untimed "
            f"first), Python {sys.version.split()[0]}; load average {os.getloadavg()[0]:.2f}"
        )
        report(rounds)
    finally:
        if runtime is not None:
            runtime.stop()
        for proc in procs.values():
            proc.terminate()
            proc.wait(timeout=20)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
