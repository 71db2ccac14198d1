"""The plugin process the benchmarks measure: the stub with the demo policy, on a given socket.

Usage: python bench/plugin_child.py SOCKET
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import structlog

from nri_plugin.demo import SHARED_CPUS, DemoPlugin
from nri_plugin.stub import Stub


async def main(socket_path: str) -> None:
    stub = Stub(
        DemoPlugin(SHARED_CPUS),
        name="bench",
        index="10",
        socket_path=socket_path,
        backoff_initial=0.01,
        backoff_max=0.05,
    )
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stub.stop)
    await stub.run()


if __name__ == "__main__":
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    asyncio.run(main(sys.argv[1]))
