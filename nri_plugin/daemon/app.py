"""The daemon's lifecycle: start, serve until told to stop, shut down in order, and the exit status.

A `Daemon` is handed its parts already built (`nri_plugin.daemon.wiring` builds them from the
config) and knows them only by what it does with them:

* the **NRI side** (the stub) is served until a stop signal, or until it ends on its own;
* the **services** beside it (the probe server, the kubelet device plugin) are started first, in
  order, so that a port already taken fails the start before the runtime ever sees the plugin; they
  are closed in the reverse order;
* the **state** (the plugin's books) is flushed last, once nothing can change it any more.

Signals, while the daemon runs:

* the first SIGTERM, SIGINT or SIGHUP stops the NRI side (the connection closes, handlers in flight
  are cancelled; a runtime that does not read costs at most the mux's 2 s close bound, and should
  the NRI side still not have ended after `NRI_STOP_SECONDS`, the shutdown goes on without it,
  saying so); the services are closed and the state flushed; the exit status is 0. SIGHUP is
  a stop signal too, not a reload: the config is read once, at start, so under a supervisor that
  restarts the daemon (systemd, a DaemonSet) SIGHUP amounts to a restart that reads it anew, and
  at a terminal that hangs up the daemon still stops in order, saying so;
* a second one, while that is under way, ends the process at once with 128 + the signal number,
  skipping whatever clean-up is left (an operator's way out of a shutdown that hangs);
* SIGUSR1 toggles debug logging (`nri_plugin.daemon.logs.debug_toggle_on_sigusr1`).

Exit statuses, as ``run --help`` documents them: `EXIT_OK` after a stop signal,
`EXIT_CANNOT_SERVE` when the runtime cannot be served (the NRI side failed, or the connection
ended for good with reconnecting off), `EXIT_CONFIG` for a config error: raised by the wiring, or
by the probe server when metrics_address cannot be listened on (taken, or not an address of this
host), which no restart mends. Failures are raised as `DaemonError`, whose one-line message the
command line prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Final, Protocol, TextIO

import structlog

from nri_plugin.daemon.logs import debug_toggle_on_sigusr1
from nri_plugin.daemon.probes import ProbeError
from nri_plugin.nri.stub import StubError

__all__ = [
    "DRAIN_SECONDS",
    "EXIT_CANNOT_SERVE",
    "EXIT_CONFIG",
    "EXIT_OK",
    "NRI_ENDED",
    "NRI_STOP_SECONDS",
    "STOP_SIGNALS",
    "Daemon",
    "DaemonError",
    "NriSide",
    "Service",
    "State",
    "freeze_start_up_heap",
]

log = structlog.get_logger("nri_plugin.daemon.app")

EXIT_OK: Final = 0
EXIT_CANNOT_SERVE: Final = 1
EXIT_CONFIG: Final = 2
STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# After shutdown, how long tasks we did not start (grpc's per-RPC tasks) may take to end by themselves.
DRAIN_SECONDS: Final = 1.0
# After a stop signal, how long the NRI side may take to end before the shutdown goes on without it:
# well within a pod's default grace (30 s) with the services' close, the state flush and the drain.
NRI_STOP_SECONDS: Final = 10.0
# What the operator reads when the NRI side ends by itself: the connection ended, reconnecting is
# off (the wiring gives the runtime-launched daemon its own wording).
NRI_ENDED: Final = (
    "the connection to the runtime ended and reconnecting is off; restart the daemon "
    "(or run it without --no-reconnect)"
)


class DaemonError(Exception):
    """The daemon cannot start or go on serving; the message is one line for the operator."""

    def __init__(self, message: str, status: int = EXIT_CANNOT_SERVE) -> None:
        super().__init__(message)
        self.status = status


class NriSide(Protocol):
    """The stub, as the daemon drives it."""

    async def run(self) -> None:
        """Serve the runtime until `stop()` (at once if it was called before), or until the connection
        ends for good (reconnecting off). Raises `StubError` when it cannot serve at all."""

    def stop(self) -> None: ...


class Service(Protocol):
    """Something served beside the NRI side: the probe server, the kubelet device plugin."""

    async def start(self) -> None:
        """Begin serving and return; raises (e.g. `ProbeError`) when that is not possible."""

    async def close(self) -> None: ...


class State(Protocol):
    """What must reach the disk before the process ends: the plugin's books."""

    def flush(self) -> None:
        """Write what is still waiting to be written. Raises OSError."""


class Daemon:
    """Runs the NRI side and the services beside it until a stop signal; see the module docstring.

    `hard_exit` ends the process at a second stop signal (`os._exit`: no clean-up, no waiting);
    `stderr` takes the line saying the state could not be saved (the exit status stays 0: the
    books are rebuilt at the next start's Synchronize); `nri_ended` is the error when the NRI
    side ends by itself.
    """

    def __init__(
        self,
        nri: NriSide,
        *,
        services: Sequence[Service] = (),
        state: State | None = None,
        hard_exit: Callable[[int], object] = os._exit,
        stderr: TextIO | None = None,
        drain_seconds: float = DRAIN_SECONDS,
        nri_ended: str = NRI_ENDED,
        nri_stop_seconds: float = NRI_STOP_SECONDS,
    ) -> None:
        self.nri = nri
        self.services = tuple(services)
        self.state = state
        self.drain_seconds = drain_seconds
        self.nri_ended = nri_ended
        self.nri_stop_seconds = nri_stop_seconds
        self._hard_exit = hard_exit
        self._stderr = stderr
        self._stopping = False
        self._stop_requested = asyncio.Event()

    @property
    def stopping(self) -> bool:
        """True once an orderly stop has begun (a signal, or `stop()`)."""
        return self._stopping

    def run(self) -> int:
        """Serve in a new event loop until stopped; the exit status. Raises `DaemonError`."""
        freeze_start_up_heap()
        return asyncio.run(self.main())

    async def main(self) -> int:
        """`serve` with the signals handled throughout, then a moment for leftover tasks to end."""
        loop = asyncio.get_running_loop()
        with self._stop_signals(loop), debug_toggle_on_sigusr1(loop):
            try:
                await self.serve()
            finally:
                await let_leftover_tasks_finish(self.drain_seconds)
        return EXIT_OK

    def stop(self) -> None:
        """Begin an orderly stop, as the first SIGTERM does."""
        self._stopping = True
        self._stop_requested.set()
        self.nri.stop()

    # -- start, serve, shut down -----------------------------------------------------------------------

    async def serve(self) -> None:
        """Start the services, serve the runtime until stopped, then shut down. Raises `DaemonError`."""
        started: list[Service] = []
        try:
            for service in self.services:
                await service.start()
                started.append(service)
            await self._run_nri()
            if not self._stopping:
                # Also in the log, not only on stderr: the runtime-launched daemon's log is a file.
                log.warning("the connection to the runtime ended; not reconnecting", why=self.nri_ended)
                raise DaemonError(self.nri_ended)
        except StubError as exc:
            raise DaemonError(str(exc)) from None
        except ProbeError as exc:
            raise DaemonError(str(exc), EXIT_CONFIG) from None
        finally:
            await self._shut_down(started)

    async def _run_nri(self) -> None:
        """The NRI side until it ends; once a stop has begun, for at most `nri_stop_seconds` more,
        then it is cancelled and the shutdown goes on (whatever the connection to the runtime is
        doing, the first signal ends the daemon)."""
        run = asyncio.ensure_future(self.nri.run())
        stop = asyncio.ensure_future(self._stop_requested.wait())
        try:
            await asyncio.wait((run, stop), return_when=asyncio.FIRST_COMPLETED)
            if not run.done():
                await asyncio.wait((run,), timeout=self.nri_stop_seconds)
            if not run.done():
                log.error(
                    "the NRI side did not stop in time; shutting down without it",
                    waited_seconds=self.nri_stop_seconds,
                )
                run.cancel()
                await asyncio.wait((run,), timeout=self.drain_seconds)
                return
            run.result()
        finally:
            stop.cancel()
            if not run.done():
                run.cancel()

    async def _shut_down(self, started: Sequence[Service]) -> None:
        """The NRI side has stopped: close the services, newest first, then flush the state."""
        for service in reversed(started):
            await service.close()
        if self.state is None:
            return
        try:
            self.state.flush()
        except OSError as exc:
            print(f"error: cannot save the plugin's state: {exc}", file=self._stderr or sys.stderr)

    # -- signals ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _stop_signals(self, loop: asyncio.AbstractEventLoop) -> Iterator[None]:
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, self._on_stop_signal, signum)
        try:
            yield
        finally:
            for signum in STOP_SIGNALS:
                loop.remove_signal_handler(signum)

    def _on_stop_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._stopping:
            log.warning("second signal received, exiting at once", signal=name)
            self._hard_exit(128 + signum)
            return
        log.info("signal received, shutting down", signal=name)
        self.stop()


def freeze_start_up_heap() -> None:
    """Take what start-up built (the modules, the config, the plugin and its books as loaded) out of
    the garbage collector's sight for good.

    A full collection walks every tracked object: over the daemon's start-up heap (some 42,000
    objects) that is 28 ms of CPU on the development VM, a pause that whichever request triggers it
    waits through, and it comes back every time the heap has grown by a quarter. Frozen, those
    objects are never walked again (a full collection right after takes well under a millisecond).
    Cyclic garbage is collected first, so that nothing already unreachable is kept for good.
    """
    gc.collect()
    gc.freeze()


async def let_leftover_tasks_finish(seconds: float) -> None:
    """Give tasks still running after shutdown a moment to end on their own.

    grpc.aio keeps a task per RPC that ends only once its core reports the call closed, a few loop
    turns after the server stopped. `asyncio.run` would cancel such a task at once, and grpc then
    prints a bare CancelledError traceback on stderr: a clean stop that looks like a crash.
    """
    current = asyncio.current_task()
    leftover = {task for task in asyncio.all_tasks() if task is not current}
    if leftover:
        await asyncio.wait(leftover, timeout=seconds)
