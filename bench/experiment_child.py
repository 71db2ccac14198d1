"""bench/plugin_child.py with experimental changes patched in, to estimate what proposed changes to
the core code would save. Not a fix: bench/experiments.py measures these against the real thing.

$BENCH_PATCH is a comma-separated list of:

* ``recv64k``: asyncio's socket transports read at most 64 KiB at a time instead of 256 KiB. A 256 KiB
  read buffer is above glibc's mmap threshold, so every read of a small message costs an mmap, an
  mremap and a munmap (a BufferedProtocol reading into one reusable buffer would avoid them too);
* ``podcache``: the pod cgroup lookup (`MixedCpuPlugin._pod_dir`: parse and check cgroup_parent) is
  memoized per cgroup parent;
* ``plainread``: the pod's CFS quota is read with one open() per file instead of walking the path
  component by component with openat (what a cached directory descriptor, or openat2 with
  RESOLVE_NO_SYMLINKS|RESOLVE_BENEATH, would cost);
* ``logcache``: structlog caches each logger on first use (``cache_logger_on_first_use``);
* ``fastcheck``: a cgroup path component is checked with one regular-expression match over the whole
  component (the per-character scan only runs to name the bad character once that match fails);
* ``trim``: glibc's ``malloc_trim(0)`` a moment after each Synchronize, giving the memory that held
  the Synchronize messages back to the system.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys

import structlog
from plugin_child import configure_logging, main


def patch(names: set[str]) -> None:
    if "recv64k" in names:
        from asyncio import selector_events

        selector_events._SelectorSocketTransport.max_size = 64 * 1024  # type: ignore[attr-defined]
    if "podcache" in names:
        from nri_plugin.mixedcpu import quota

        original = quota.PodQuotas.pod_dir

        @functools.lru_cache(maxsize=4096)
        def lookup(quotas: quota.PodQuotas, parent: str) -> object:
            return original(quotas, parent)

        quota.PodQuotas.pod_dir = lambda self, parent: lookup(self, parent)  # type: ignore[method-assign,assignment,return-value]
    if "plainread" in names:
        from nri_plugin.cgroups import CpuQuota
        from nri_plugin.cgroups.quota import parse_cfs_period_us, parse_cfs_quota_us
        from nri_plugin.mixedcpu import quota as reconciler

        def read_text(path: str) -> str:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                return os.read(fd, 4096).decode("ascii")
            finally:
                os.close(fd)

        def read_cpu_quota(cgroup: object) -> CpuQuota:
            base = cgroup.fs_path  # type: ignore[attr-defined]
            return CpuQuota(
                parse_cfs_quota_us(read_text(os.path.join(base, "cpu.cfs_quota_us"))),
                parse_cfs_period_us(read_text(os.path.join(base, "cpu.cfs_period_us"))),
            )

        reconciler.read_cpu_quota = read_cpu_quota  # type: ignore[attr-defined,assignment]
    if "fastcheck" in names:
        import re

        from nri_plugin.cgroups import paths

        slow = paths._first_bad_char
        whole: dict[str, re.Pattern[str]] = {}

        def first_bad_char(text: str, allowed: re.Pattern[str]) -> str | None:
            pattern = whole.get(allowed.pattern)
            if pattern is None:
                pattern = whole[allowed.pattern] = re.compile(f"(?:{allowed.pattern})*", allowed.flags)
            return None if pattern.fullmatch(text) else slow(text, allowed)

        paths._first_bad_char = first_bad_char
    if "trim" in names:
        import ctypes

        from nri_plugin.mixedcpu import plugin as mixedcpu

        libc = ctypes.CDLL("libc.so.6")
        synchronize = mixedcpu.MixedCpuPlugin.synchronize

        async def synchronize_then_trim(self: mixedcpu.MixedCpuPlugin, *args: object) -> object:
            updates = await synchronize(self, *args)  # type: ignore[arg-type]
            asyncio.get_running_loop().call_later(0.05, libc.malloc_trim, 0)
            return updates

        mixedcpu.MixedCpuPlugin.synchronize = synchronize_then_trim  # type: ignore[assignment,method-assign]
    if "logcache" in names:
        structlog.configure(
            wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR), cache_logger_on_first_use=True
        )


if __name__ == "__main__":
    configure_logging()
    patch({name for name in os.environ.get("BENCH_PATCH", "").split(",") if name})
    if os.environ.get("BENCH_UVLOOP") == "1":
        import uvloop

        uvloop.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
    else:
        asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
