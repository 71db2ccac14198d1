"""The plugin process the benchmarks measure: the stub with the real mixed-CPU plugin, on a given socket.

Usage: python bench/plugin_child.py SOCKET CGROUP_ROOT STATE_DIR

CGROUP_ROOT holds a fake cgroup v1 tree (``cpu/`` and ``cpuset/``) that the benchmark prepared;
containers prove their request with the pod annotation (trusted here), so no device plugin is needed.

Experiment knobs (environment): BENCH_UVLOOP=1 runs the stub on uvloop's event loop (when
installed); BENCH_LOG=info (or debug, warning) configures logging as ``run`` does (JSON on stderr, which
the benchmark sends to /dev/null) instead of dropping everything below error level. BENCH_STATS=PATH:
on SIGUSR1 the child writes ``{"state_bytes": N}`` there: the bytes it has passed to write(2) and
pwrite(2) so far (``wchar`` of /proc/self/io; the database's WAL pages, since nothing is logged at
the error level and the replies go out with send(2), which that count leaves out).
BENCH_GC=off: no garbage collection at all (to see what collections cost the round trips).
BENCH_METRICS=off: no metrics observer (the daemon has one unless metrics_address is empty, and so does
this child by default: each request counted and timed into its Prometheus histogram).
BENCH_PROFILE=PATH: SIGUSR2 starts cProfile in the child, the next SIGUSR2 stops it and dumps the stats
to PATH (to see where the live process's time goes during a timed part only).

The plugin runs as in its image: the development venv's packages the image lacks (rich, pygments:
structlog.dev imports them when it finds them) are refused before anything imports structlog
(bench/image_imports.py); BENCH_DEV_PACKAGES=1 lets them in.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import sys

from image_imports import refuse_not_in_image

if os.environ.get("BENCH_DEV_PACKAGES") != "1":
    refuse_not_in_image()  # before structlog is imported: as in the image

import structlog

from nri_plugin.cgroups import CgroupLayout, CgroupMode, Hierarchy
from nri_plugin.common.backoff import Backoff
from nri_plugin.daemon.app import freeze_start_up_heap
from nri_plugin.daemon.metrics import Metrics
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin, TrustedSources
from nri_plugin.mixedcpu.store import StateStore
from nri_plugin.nri.identity import Identity
from nri_plugin.nri.stub import Stub

SHARED_CPUS = frozenset({0, 1})


def bench_plugin(cgroup_root: str, state_dir: str, observer: Metrics | None = None) -> MixedCpuPlugin:
    layout = CgroupLayout(
        CgroupMode.V1,
        Hierarchy(1, os.path.join(cgroup_root, "cpu")),
        Hierarchy(1, os.path.join(cgroup_root, "cpuset")),
    )
    return MixedCpuPlugin(
        shared=SHARED_CPUS,
        layout=layout,
        store=StateStore(state_dir),
        trusted=TrustedSources(pod_annotation=True),
    )


class ToggledProfile:
    """cProfile switched on and off by a signal; each stop dumps the stats to `path`."""

    def __init__(self, path: str) -> None:
        import cProfile

        self.path = path
        self.profile: cProfile.Profile | None = None
        self._make = cProfile.Profile

    def toggle(self) -> None:
        if self.profile is None:
            self.profile = self._make()
            self.profile.enable()
            return
        self.profile.disable()
        self.profile.dump_stats(self.path)
        self.profile = None


def written_bytes() -> int:
    """``wchar`` of /proc/self/io: the bytes this process has passed to write(2) and its kin."""
    with open("/proc/self/io") as file:
        return next(int(line.split()[1]) for line in file if line.startswith("wchar:"))


def write_stats(path: str) -> None:
    written = written_bytes()
    with open(path + ".tmp", "w") as file:
        json.dump({"state_bytes": written}, file)
    os.replace(path + ".tmp", path)


async def main(socket_path: str, cgroup_root: str, state_dir: str) -> None:
    # As `daemon.wiring.build_daemon` wires them: one metrics observer for the plugin and the stub.
    metrics = None if os.environ.get("BENCH_METRICS") == "off" else Metrics()
    plugin = bench_plugin(cgroup_root, state_dir, metrics)
    stub = Stub(
        plugin,
        identity=Identity(name="bench", index="10"),
        socket_path=socket_path,
        backoff=Backoff(initial=0.01, maximum=0.05),
        observer=metrics,
    )
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stub.stop)
    stats = os.environ.get("BENCH_STATS")
    if stats:
        loop.add_signal_handler(signal.SIGUSR1, write_stats, stats)
    profile = os.environ.get("BENCH_PROFILE")
    if profile:
        loop.add_signal_handler(signal.SIGUSR2, ToggledProfile(profile).toggle)
    await stub.run()


def configure_logging() -> None:
    level = os.environ.get("BENCH_LOG", "error")
    if level == "error":
        structlog.configure(
            wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR), cache_logger_on_first_use=True
        )
    else:
        from nri_plugin.daemon.logs import configure_logging as production_logging

        production_logging(level, "json")


if __name__ == "__main__":
    configure_logging()
    if os.environ.get("BENCH_GC") == "off":
        gc.disable()
    freeze_start_up_heap()  # as the daemon's `Daemon.run` does
    if os.environ.get("BENCH_UVLOOP") == "1":
        import uvloop

        uvloop.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
    else:
        asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
