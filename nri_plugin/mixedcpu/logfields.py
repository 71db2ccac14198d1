"""What the domain's log lines are named and say about a pod: shared by the handlers and the reconciler.

Every line about a pod or container is logged under one logger name, whichever module writes it, so
an operator filters the plugin's decisions with one name. The NRI event a line belongs to goes in the
field the daemon's log configuration renders as ``event`` (`EVENT_NAME`; structlog keeps ``event``
for the message itself): defined here so that the domain imports nothing of the daemon, and checked
against the daemon's by a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, Final

import structlog

from api.nri import api_pb2 as api
from cgroups import CpuQuota

__all__ = [
    "EVENT_NAME",
    "LOGGER_NAME",
    "DomainLogger",
    "LaterLines",
    "domain_logger",
    "pod_fields",
    "show_quota",
]

LOGGER_NAME: Final = "nri_plugin.mixedcpu.plugin"
EVENT_NAME: Final = "event_name"


def pod_fields(pod: api.PodSandbox, container: api.Container | None = None, *, event: str) -> dict[str, str]:
    """A log line's fields about a pod (and container), and the NRI event (rendered as ``event``)."""
    fields = {EVENT_NAME: event, "namespace": pod.namespace, "pod": pod.name or pod.id}
    if container is not None:
        fields["container"] = container.name
        fields["container_id"] = container.id
    return fields


def show_quota(quota: CpuQuota | int | None) -> str:
    """A quota for a log line or message: its microseconds, or ``unlimited``."""
    if isinstance(quota, CpuQuota):
        quota = quota.quota
    return "unlimited" if quota is None else str(quota)


class LaterLines:
    """Log lines written once the reply has gone out, so that the runtime does not wait for them.

    Rendering a line the daemon's way (JSON, through the stdlib handler) costs more CPU than the
    rest of an asking creation; the line says what was done, which nothing waits for. `add` queues
    a line (a callable that logs it) and, when none was waiting, has the running loop write the
    queue at its next turn: after the reply, which the handler's return writes at once. `flush`
    writes what waits now: each handler does first, so that a line keeps its place before the next
    event's. With no running loop, a line is written at once.
    """

    __slots__ = ("_waiting",)

    def __init__(self) -> None:
        self._waiting: list[Callable[[], None]] = []

    def add(self, line: Callable[[], None]) -> None:
        if not self._waiting:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:
                line()
                return
        self._waiting.append(line)

    def flush(self) -> None:
        waiting, self._waiting = self._waiting, []
        for line in waiting:
            line()

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Every line of the domain's loggers (`DomainLogger`) written meanwhile, whatever its level,
        waits here in its order: for a handler whose many lines the runtime's reply need not wait
        for (Synchronize's, one or more per pod and container it changes)."""
        token = _DEFERRING.set(self)
        try:
            yield
        finally:
            _DEFERRING.reset(token)


# The LaterLines that the domain's lines wait in now (`LaterLines.deferring`), if any.
_DEFERRING: Final[contextvars.ContextVar[LaterLines | None]] = contextvars.ContextVar(
    "mixedcpu_deferring", default=None
)


class DomainLogger:
    """A structlog logger of the domain's (`domain_logger`) whose lines wait, in their order, in the
    `LaterLines` deferring them, if any (`LaterLines.deferring`), and are written at once otherwise.
    ``exception`` is always written at once: its traceback is the exception being handled now."""

    __slots__ = ("_log",)

    def __init__(self, log: Any) -> None:
        self._log = log

    def debug(self, event: str, **fields: Any) -> None:
        self._line("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._line("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._line("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._line("error", event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        self._log.exception(event, **fields)

    def is_enabled_for(self, level: int) -> bool:
        return bool(self._log.is_enabled_for(level))

    def _line(self, method: str, event: str, fields: dict[str, Any]) -> None:
        later = _DEFERRING.get()
        if later is None:
            getattr(self._log, method)(event, **fields)
        else:
            later.add(functools.partial(getattr(self._log, method), event, **fields))


def domain_logger(name: str = LOGGER_NAME) -> DomainLogger:
    """The logger a domain module writes its lines with (under `LOGGER_NAME` unless told)."""
    return DomainLogger(structlog.get_logger(name))
