"""bench/plugin_child.py under cProfile, switched on by SIGUSR1 (or from the start with
BENCH_PROFILE_START=1) and off by SIGUSR2.

SIGUSR2 writes the stats gathered since then to $BENCH_PROFILE_OUT. Used by
bench/profile_create.py as BENCH_CHILD; same arguments as plugin_child.py.
"""

from __future__ import annotations

import asyncio
import cProfile
import os
import signal
import sys

from plugin_child import configure_logging, main

if __name__ == "__main__":
    configure_logging()
    profiler = cProfile.Profile()

    def start(*_: object) -> None:
        profiler.enable()

    def stop(*_: object) -> None:
        profiler.disable()
        profiler.dump_stats(os.environ["BENCH_PROFILE_OUT"])

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    if os.environ.get("BENCH_PROFILE_START") == "1":
        start()
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
