"""The reconciler's whole pass (`nri_plugin.mixedcpu.heal`) on a node whose books hold N shared pods:
the time one pass takes when there is nothing to heal (the pass every `reconcile_interval` seconds).

Usage: python bench/heal_pass.py [--pods N] [--passes N] [--kernel]

The plugin runs in this process, its books built by a Synchronize of N pods whose container ``app-0``
already holds the shared CPUs (pod quotas at their targets). A pass walks to each pod's cgroup
directory once and reads its quota (on v1, ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us``). The
node is a fake cgroup v1 tree of regular files (as every benchmark here), or with --kernel the real
kernel's v1 ``cpu`` hierarchy: N pod cgroups made in a scratch subtree ``<mount>/heal-bench-<pid>``
and removed afterwards (root only). run_all.py reports the fake tree's figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

import structlog
from workload import already_shared, fake_node, lean_container, lean_pod

from nri_plugin.cgroups import CgroupLayout, CgroupMode, Hierarchy, read_layout
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin, TrustedSources
from nri_plugin.mixedcpu.store import StateStore

SHARED_CPUS = frozenset({0, 1})
# Each benchmark pod's own quota: 5 containers x 2 CPUs, as fake_node writes it.
POD_QUOTA = 1_000_000


async def pass_seconds(layout: CgroupLayout, parents: list[str], state_dir: str, passes: int) -> list[float]:
    """Seconds per whole pass, `passes` of them, over books holding one shared pod per parent."""
    plugin = MixedCpuPlugin(
        shared=SHARED_CPUS,
        layout=layout,
        store=StateStore(state_dir),
        trusted=TrustedSources(pod_annotation=True),
    )
    pods, containers = [], []
    for n, parent in enumerate(parents):
        pod = lean_pod(n)
        pod.linux.cgroup_parent = parent
        pods.append(pod)
        containers.append(already_shared(lean_container(pod, n * 5)))  # app-0: it asks
    await plugin.synchronize(pods, containers)
    assert len(plugin.books.pods) == len(parents), "every pod holds a shared container"
    samples = []
    for _ in range(passes):
        report = await plugin.healer.reconcile()
        assert report.healed == 0, "a node with nothing to heal"
        samples.append(report.seconds)
    return samples


async def on_fake_tree(root: Path, pods: int, passes: int) -> list[float]:
    cgroup_root, state_dir = fake_node(root, pods)
    layout = CgroupLayout(
        CgroupMode.V1,
        Hierarchy(1, os.path.join(cgroup_root, "cpu")),
        Hierarchy(1, os.path.join(cgroup_root, "cpuset")),
    )
    parents = [lean_pod(n).linux.cgroup_parent for n in range(pods)]
    return await pass_seconds(layout, parents, state_dir, passes)


@contextlib.contextmanager
def kernel_pods(pods: int) -> Iterator[tuple[CgroupLayout, list[str]]]:
    """`pods` pod cgroups in a scratch subtree of the real v1 cpu hierarchy, removed afterwards."""
    layout = read_layout()
    if layout.cpu.version != 1 or os.geteuid() != 0:
        raise SystemExit("--kernel needs root and a cgroup v1 cpu hierarchy")
    top = f"heal-bench-{os.getpid()}"
    base = Path(layout.cpu.mount_point, top, "kubepods")
    parents = []
    try:
        for n in range(pods):
            uid = lean_pod(n).uid
            pod_dir = base / f"pod{uid}"
            pod_dir.mkdir(parents=True)
            (pod_dir / "cpu.cfs_quota_us").write_text(f"{POD_QUOTA}\n")
            parents.append(f"/{top}/kubepods/pod{uid}")
        yield layout, parents
    finally:
        for path in [*sorted(base.glob("pod*")), base, base.parent]:
            with contextlib.suppress(FileNotFoundError):
                path.rmdir()


async def on_kernel(root: Path, pods: int, passes: int) -> list[float]:
    state_dir = root / "state"
    state_dir.mkdir()
    with kernel_pods(pods) as (layout, parents):
        return await pass_seconds(layout, parents, str(state_dir), passes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pods", type=int, default=1000, help="shared pods in the books (1000)")
    parser.add_argument("--passes", type=int, default=30, help="passes timed (30)")
    parser.add_argument("--kernel", action="store_true", help="real cgroup v1 cpu hierarchy (root)")
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    with tempfile.TemporaryDirectory(prefix="heal-bench-") as tmp:
        measure = on_kernel if args.kernel else on_fake_tree
        samples = asyncio.run(measure(Path(tmp), args.pods, args.passes))
    where = "the kernel's cgroup v1 cpu hierarchy" if args.kernel else "a fake cgroup v1 tree"
    median, low, high = (value * 1e3 for value in (statistics.median(samples), min(samples), max(samples)))
    print(
        f"reconcile pass over {args.pods:,} shared pods on {where}: median {median:.1f} ms, "
        f"min {low:.1f} ms, max {high:.1f} ms ({len(samples)} passes)"
    )


if __name__ == "__main__":
    main()
