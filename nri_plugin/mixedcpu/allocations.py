"""kubelet's own record of device allocations, as the mixed-CPU plugin asks for it.

A signed allocation marker proves that kubelet allocated our resource to *some* container once; it
does not say to which, nor for how long, and kubelet writes it into its checkpoint file on disk. So
where kubelet's PodResources API can be asked, its answer is the proof instead: which device ids of
our resource kubelet allocated to this pod's container. The plugin is given an `AllocationRecord`
at construction (`nri_plugin.deviceplugin.podresources.PodResourcesClient` in the daemon, a fake in
tests) and hands the policy plain data: the container's device ids, or None for "kubelet cannot be
asked now" (then the marker binding of `nri_plugin.mixedcpu.books` decides, as before).

Nothing here does I/O: the implementation lives in the device-plugin package, which this domain
package may not import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

__all__ = ["AllocationRecord", "ContainerDevices", "PodRef", "devices_of"]

# Container name -> the device ids of our resource kubelet allocated to it (containers with none
# may be left out).
ContainerDevices = Mapping[str, frozenset[str]]
# A pod as kubelet's record names it: (namespace, name).
PodRef = tuple[str, str]


class AllocationRecord(Protocol):
    """kubelet's record of which devices of our resource it allocated to which container."""

    async def pod_allocations(self, namespace: str, name: str) -> ContainerDevices | None:
        """The pod's containers and their device ids of our resource ({} for a pod kubelet does not
        run, or that got none); None when kubelet cannot be asked (no socket, no answer in time)."""

    async def node_allocations(self) -> Mapping[PodRef, ContainerDevices] | None:
        """The same for every pod kubelet runs (for Synchronize); None when kubelet cannot be asked."""


def devices_of(
    pods: Mapping[PodRef, ContainerDevices], namespace: str, pod: str, container: str
) -> frozenset[str]:
    """The device ids kubelet allocated to one container, from a node-wide answer (none if unlisted)."""
    return pods.get((namespace, pod), {}).get(container, frozenset())
