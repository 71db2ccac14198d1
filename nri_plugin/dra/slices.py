"""The API objects that tell the scheduler about our devices: the node's ResourceSlices and the DeviceClass.

A DRA driver publishes what it can hand out as ``resource.k8s.io/v1`` ResourceSlices. Ours are the
same admission tickets the device plugin advertises: ``shared-cpus-0`` .. ``shared-cpus-<N-1>``,
interchangeable, without attributes, all on one node. They form one pool named after the node.

One slice may list at most :data:`MAX_DEVICES_PER_SLICE` (128) devices (``ResourceSliceSpec.devices``
in ``k8s.io/api/resource/v1``; the OpenAPI schema only states it, the API server enforces it). The
default device count is 256, so the pool is cut into ``ceil(N / 128)`` slices, each carrying
``pool.resourceSliceCount`` = that number, so the scheduler knows when it has seen the whole pool.
All slices of a pool share ``pool.generation``; the publisher raises it whenever the devices change, and
the scheduler ignores slices of an older generation.

Slices are owned by the Node (an owner reference, ``controller: true``), so the garbage collector
removes them with the node. Their names are fixed (node, driver and index), so a restarted daemon
finds and updates the same objects instead of adding new ones; a name that would be too long for
a DNS subdomain keeps a readable prefix and ends in a hash of the whole.

The DeviceClass selects our driver's devices and names ``workload.openshift.io/enable-shared-cpus``
as its extended resource (KEP-5004), so an unchanged pod request of that resource is served by DRA
where the cluster enables it. The chart renders the same object; this builder is what tests compare
it with.

Objects are plain dicts in the API's JSON shape: what the API server takes, what kubernetes-validate
checks and what lightkube sends as it is (a server-side apply body). Pure: no I/O here.
"""

from __future__ import annotations

import hashlib
from typing import Any, Final

from nri_plugin.common.k8snames import SUBDOMAIN_MAX, is_dns_subdomain

__all__ = [
    "API_VERSION",
    "DEFAULT_EXTENDED_RESOURCE_NAME",
    "DEVICE_NAME_PREFIX",
    "MAX_DEVICES_PER_SLICE",
    "device_class",
    "device_names",
    "resource_slices",
    "slice_count",
    "slice_name",
]

API_VERSION: Final = "resource.k8s.io/v1"
# The device plugin's device ids have this prefix too: one name for the same ticket on either door.
DEVICE_NAME_PREFIX: Final = "shared-cpus-"
# ResourceSliceSpec.devices: "Must not have more than 128 entries" (64 with taints or counters,
# which we do not use).
MAX_DEVICES_PER_SLICE: Final = 128
# The request pod specs already carry; the DeviceClass maps it onto our devices (KEP-5004).
DEFAULT_EXTENDED_RESOURCE_NAME: Final = "workload.openshift.io/enable-shared-cpus"

_DNS_SUBDOMAIN_MAX: Final = SUBDOMAIN_MAX
_DRIVER_NAME_MAX: Final = 63  # a driver name is a DNS subdomain of at most 63 characters
_HASH_CHARS: Final = 10  # hex digits of sha256 in a shortened name: 40 bits, no collision among nodes


def _check_subdomain(what: str, value: str, limit: int) -> None:
    if not (isinstance(value, str) and is_dns_subdomain(value, limit)):
        raise ValueError(
            f"{what} {value!r} is not a DNS subdomain of at most {limit} characters"
            " (lower-case letters, digits, '-' and '.', starting and ending with a letter or digit)"
        )


def _check_count(device_count: int) -> None:
    if isinstance(device_count, bool) or not isinstance(device_count, int) or device_count < 1:
        raise ValueError(f"device count {device_count!r} must be a positive integer")


def device_names(device_count: int) -> tuple[str, ...]:
    """``shared-cpus-0`` .. ``shared-cpus-<device_count - 1>``: DNS labels, as device names must be."""
    _check_count(device_count)
    return tuple(f"{DEVICE_NAME_PREFIX}{index}" for index in range(device_count))


def slice_count(device_count: int) -> int:
    """How many slices the pool needs: at most :data:`MAX_DEVICES_PER_SLICE` devices in each."""
    _check_count(device_count)
    return -(-device_count // MAX_DEVICES_PER_SLICE)


def slice_name(node_name: str, driver: str, index: int) -> str:
    """The fixed name of the node's `index`-th slice: ``<node>-<driver>-<index>``.

    When that exceeds 253 characters (a long node name), the front is cut and a hash of the full
    name is put before the index, so names stay distinct per node and driver."""
    _check_subdomain("node name", node_name, _DNS_SUBDOMAIN_MAX)
    _check_subdomain("driver name", driver, _DRIVER_NAME_MAX)
    full = f"{node_name}-{driver}-{index}"
    if len(full) <= _DNS_SUBDOMAIN_MAX:
        return full
    digest = hashlib.sha256(f"{node_name}\0{driver}".encode()).hexdigest()[:_HASH_CHARS]
    tail = f"-{digest}-{index}"
    # The cut may end on '-' or '.', or leave a label of '-' only at its end: strip back to a
    # letter or digit so the name stays a DNS subdomain.
    head = full[: _DNS_SUBDOMAIN_MAX - len(tail)].rstrip("-.")
    return head + tail


def resource_slices(
    *, node_name: str, node_uid: str, driver: str, device_count: int, generation: int
) -> tuple[dict[str, Any], ...]:
    """The node's pool as ResourceSlices: devices in order, :data:`MAX_DEVICES_PER_SLICE` per slice."""
    _check_subdomain("driver name", driver, _DRIVER_NAME_MAX)
    if not node_uid:
        raise ValueError("node uid is empty: read it from the Node object (metadata.uid)")
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 1:
        raise ValueError(f"pool generation {generation!r} must be a positive integer")
    names = device_names(device_count)
    count = slice_count(device_count)
    owner = {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}
    slices = []
    for index in range(count):
        chunk = names[index * MAX_DEVICES_PER_SLICE : (index + 1) * MAX_DEVICES_PER_SLICE]
        slices.append(
            {
                "apiVersion": API_VERSION,
                "kind": "ResourceSlice",
                "metadata": {"name": slice_name(node_name, driver, index), "ownerReferences": [owner]},
                "spec": {
                    "driver": driver,
                    "nodeName": node_name,
                    "pool": {"name": node_name, "generation": generation, "resourceSliceCount": count},
                    "devices": [{"name": name} for name in chunk],
                },
            }
        )
    return tuple(slices)


def device_class(driver: str, extended_resource_name: str = DEFAULT_EXTENDED_RESOURCE_NAME) -> dict[str, Any]:
    """The DeviceClass named after the driver that selects its devices; `extended_resource_name` ""
    leaves the extended-resource mapping out (pods must then ask through a ResourceClaim)."""
    _check_subdomain("driver name", driver, _DRIVER_NAME_MAX)
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]}
    if extended_resource_name:
        spec["extendedResourceName"] = extended_resource_name
    return {
        "apiVersion": API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": driver},
        "spec": spec,
    }
