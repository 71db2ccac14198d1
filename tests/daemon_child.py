"""A real `Daemon` in a process of its own, with stand-in parts, for the signal tests of test_daemon.py.

Run as ``python tests/daemon_child.py [hang]``. It prints ``started`` once it serves. With ``hang``,
its one service never finishes closing (a shutdown that hangs), after printing ``closing``: only a
second signal ends the process then. The exit status is the daemon's.
"""

from __future__ import annotations

import asyncio
import sys

from nri_plugin.daemon.app import Daemon
from nri_plugin.daemon.logs import configure_logging


class StandInNri:
    """Serves nothing, until stopped."""

    def __init__(self) -> None:
        self._stopped = asyncio.Event()

    async def run(self) -> None:
        print("started", flush=True)
        await self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()


class StandInService:
    def __init__(self, hang: bool) -> None:
        self.hang = hang

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        print("closing", flush=True)
        if self.hang:
            await asyncio.Event().wait()


class StandInState:
    def flush(self) -> None:
        print("flushed", flush=True)


def main(argv: list[str]) -> int:
    configure_logging("info", "json")
    daemon = Daemon(StandInNri(), services=[StandInService("hang" in argv)], state=StandInState())
    return daemon.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
