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
checks and what lightkube sends as it is (a server-side apply body). :func:`slice_shape` and
:func:`event_needs_publish` decide whether a stored slice, or a watch event on one, still matches
what the publisher last wrote. Pure: no I/O here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Final

from nri_plugin.common.k8snames import SUBDOMAIN_MAX, is_dns_subdomain

__all__ = [
    "API_VERSION",
    "DEFAULT_EXTENDED_RESOURCE_NAME",
    "DEVICE_NAME_PREFIX",
    "MAX_DEVICES_PER_SLICE",
    "device_class",
    "device_names",
    "event_needs_publish",
    "pool_generation",
    "resource_slices",
    "slice_count",
    "slice_name",
    "slice_shape",
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


def pool_generation(obj: Mapping[str, Any]) -> int:
    """A stored slice's ``spec.pool.generation`` (0 when it has none)."""
    generation = ((obj.get("spec") or {}).get("pool") or {}).get("generation")
    return generation if isinstance(generation, int) and not isinstance(generation, bool) else 0


def slice_shape(obj: Mapping[str, Any]) -> tuple[object, ...]:
    """What decides whether a stored slice is the one we would publish: name, driver, node, pool
    (name, generation, slice count), device names and owners. Fields the server adds (defaults,
    managed fields, resourceVersion) do not count."""
    metadata = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    pool = spec.get("pool") or {}
    owners = tuple(
        (ref.get("kind"), ref.get("name"), ref.get("uid"), bool(ref.get("controller")))
        for ref in metadata.get("ownerReferences") or ()
    )
    return (
        metadata.get("name"),
        spec.get("driver"),
        spec.get("nodeName"),
        pool.get("name"),
        pool.get("generation"),
        pool.get("resourceSliceCount"),
        tuple(device.get("name") for device in spec.get("devices") or ()),
        owners,
    )


def event_needs_publish(
    event_type: str, obj: Mapping[str, Any], published: Mapping[str, tuple[object, ...]]
) -> bool:
    """Whether a watch event on our driver's slices of this node means the API server no longer
    holds exactly `published` (slice name -> :func:`slice_shape` of what we wrote):

    * ``DELETED`` of one of ours (kubelet wiping the node's slices at its start, or the driver's
      after it was unusable for a while; an operator; the garbage collector);
    * ``ADDED`` or ``MODIFIED`` leaving a slice unlike ours (another writer changed it), or adding
      one we did not write (publishing again deletes it).

    The events of our own writes match `published` and need nothing; so do other kinds of event
    (``BOOKMARK``) and the deletion of a slice we no longer publish."""
    name = (obj.get("metadata") or {}).get("name")
    if not isinstance(name, str):
        return False
    if event_type == "DELETED":
        return name in published
    if event_type in ("ADDED", "MODIFIED"):
        return published.get(name) != slice_shape(obj)
    return False
