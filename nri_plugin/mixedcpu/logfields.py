"""What the domain's log lines are named and say about a pod: shared by the handlers and the reconciler.

Every line about a pod or container is logged under one logger name, whichever module writes it, so
an operator filters the plugin's decisions with one name. The NRI event a line belongs to goes in the
field the daemon's log configuration renders as ``event`` (`EVENT_NAME`; structlog keeps ``event``
for the message itself): defined here so that the domain imports nothing of the daemon, and checked
against the daemon's by a test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import CpuQuota

__all__ = ["EVENT_NAME", "LOGGER_NAME", "LaterLines", "pod_fields", "show_quota"]

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
    a line (a callable that logs it); `flush` writes what waits. Served by the stub, the plugin
    flushes right after each reply is written (`MixedCpuPlugin.after_reply`, which sets `followed`):
    in the same turn of the event loop. Where nothing flushes after the reply (a handler called
    directly), the running loop writes the queue at its next turn. Each handler flushes first too,
    so that a line keeps its place before the next event's. With no running loop, a line is written
    at once.
    """

    __slots__ = ("_waiting", "followed")

    def __init__(self) -> None:
        self._waiting: list[Callable[[], None]] = []
        self.followed = False  # a flush follows every reply: nothing to schedule

    def add(self, line: Callable[[], None]) -> None:
        if not self._waiting and not self.followed:
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
