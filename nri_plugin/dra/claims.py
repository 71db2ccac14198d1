"""What preparing a ResourceClaim needs to know of it: the devices of our driver it was allocated.

kubelet's ``NodePrepareResources`` names a claim (namespace, name, uid) and nothing more; the
allocation lives in the claim's ``status.allocation.devices.results`` on the API server. The kubelet
plugin (``kubeletplugin``) asks a :class:`ClaimSource` for it; ``apiserver.ApiClaimSource`` reads the
claim with the node's credentials, tests give a fake. Pure: no I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["AllocatedDevice", "ClaimError", "ClaimSource", "ClaimSourceUnreachable", "base_request"]


@dataclass(frozen=True)
class AllocatedDevice:
    """One result of a claim's allocation that names our driver."""

    # The claim's request this device serves, as the result names it: ``<request>``, or
    # ``<request>/<subrequest>`` when the request lists alternatives (``firstAvailable``) and the
    # scheduler chose one of them. For an extended resource: the request the scheduler generated.
    request: str
    pool: str  # the ResourceSlice pool: our node's name
    device: str  # a device of that pool, e.g. "shared-cpus-3"
    admin_access: bool = False  # the result's adminAccess: access to a device someone else may hold
    # The uids of the pods the claim was reserved for when read (its status.reservedFor): the marker
    # signed for the device proves a request in those pods only. Empty: not known (no pod bound).
    reserved_for: tuple[str, ...] = ()


def base_request(request: str) -> str:
    """The claim's own request a result's request reference belongs to: ``shared`` for both
    ``shared`` and ``shared/first``. A container names that one in ``resources.claims[].request``, and
    kubelet matches it against a prepared device's ``request_names``."""
    return request.split("/", 1)[0]


class ClaimError(Exception):
    """The claim cannot be prepared now; the message, sent back to kubelet, says why and what to do
    (the claim is gone or was re-created with another uid, it is not allocated, it names no device of
    ours, or the API server could not be asked)."""


class ClaimSourceUnreachable(ClaimError):
    """The API server could not be reached at all (no connection, or no answer in time): it said
    nothing about the claim. Only then may a prepare be answered from the spec written before; an
    answer (the claim is gone, re-created, refused, a server error) is a plain `ClaimError`."""


class ClaimSource(Protocol):
    """Where a prepare learns what a claim was allocated."""

    async def allocated_devices(self, namespace: str, name: str, uid: str) -> tuple[AllocatedDevice, ...]:
        """Our driver's devices in the claim's allocation, in the order the allocation lists them.

        Raises :class:`ClaimError` when the claim cannot be read, its uid is not `uid`, it is not
        allocated, or none of its results names our driver; :class:`ClaimSourceUnreachable` when
        the API server could not be reached."""
        ...
