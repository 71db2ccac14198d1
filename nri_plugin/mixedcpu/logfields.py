"""What the domain's log lines are named and say about a pod: shared by the handlers and the reconciler.

Every line about a pod or container is logged under one logger name, whichever module writes it, so
an operator filters the plugin's decisions with one name. The NRI event a line belongs to goes in the
field the daemon's log configuration renders as ``event`` (`EVENT_NAME`; structlog keeps ``event``
for the message itself): defined here so that the domain imports nothing of the daemon, and checked
against the daemon's by a test.
"""

from __future__ import annotations

from typing import Final

from api.nri import api_pb2 as api
from cgroups import CpuQuota

__all__ = ["EVENT_NAME", "LOGGER_NAME", "pod_fields", "show_quota"]

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
