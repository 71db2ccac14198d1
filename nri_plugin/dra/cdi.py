"""The CDI spec written for a prepared ResourceClaim: how the signed marker reaches the container.

kubelet's ``NodePrepareResources`` answer names CDI devices (Container Device Interface,
``<vendor>/<class>=<name>``); kubelet hands those names to the runtime with the container, and the
runtime (containerd, CRI-O) applies the ``containerEdits`` it finds for them in the spec files of its
CDI directories (``/var/run/cdi`` among them) before the container is created. Our edit is one
environment entry per device, ``MIXED_CPU_SHARED_CPUS_ALLOCATION_<DEVICE>=<key.sign("dra.<device>",
pods=...)>`` (:func:`marker_env`, see `nri_plugin.deviceplugin.marker`): a new allocation, good only
in the pods the claim was reserved for (its ``status.reservedFor`` as the prepare read it), which the
NRI side checks like the device plugin's annotation. The name carries the device because CDI merges
a container's env entries by name: with one name for all, a container given two of our devices
would keep only the last marker.

One spec file per claim, named by the claim's uid, so unprepare removes exactly what prepare wrote
and two claims never share a file. Inside, one CDI device per allocated device of ours, named
``<claim uid>-<device>``; its annotations record the claim (namespace, name, uid), the pool, the
device and the claim's requests it serves, so that a prepare repeated after a daemon restart can be
answered from the file alone when the API server cannot be reached (:func:`read_recorded`). Such an
answer is only as good as the file, and whoever can write the CDI directory can plant one: the record
is taken only when each device is one the node published, in its pool, and its marker verifies with
the node's key for that device, which a planted file cannot forge.

The file is mode 0600: the runtimes read CDI specs as root (containerd and CRI-O run as root and
check no mode), and a prepared claim's marker is nobody else's business.

``cdiVersion`` is 0.6.0, the oldest version with the fields we write (annotations on a device);
runtimes refuse a spec whose version is older than its fields need, and accept any older version
than they speak, so the oldest that fits is the most widely read. It sets a floor: containerd 1.7.12
(docs/dra.md, "Which runtimes read our CDI specs"); ``check`` says so when the runtime is older.

What reaches a file path is checked first (:func:`check_claim`): the uid must be a Kubernetes UID
(a lowercase RFC 4122 UUID), so no claim can name a file outside ``cdi_dir``. Pure building and
checking, plus the three file operations (:func:`write_spec`, :func:`read_recorded`,
:func:`remove_spec`); no logging, no asyncio.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from nri_plugin.common.atomicfile import write_atomically
from nri_plugin.common.k8snames import is_dns_label, is_dns_subdomain
from nri_plugin.common.smallfile import RefusedFile, read_small_file
from nri_plugin.deviceplugin.marker import MARKER_ENV, HostKey, dra_device_id
from nri_plugin.dra.claims import AllocatedDevice, base_request

__all__ = [
    "CDI_VERSION",
    "CLASS",
    "KIND",
    "SPEC_MODE",
    "VENDOR",
    "CdiError",
    "ClaimRef",
    "PreparedDevice",
    "build_spec",
    "cdi_device_id",
    "cdi_device_name",
    "check_claim",
    "check_device",
    "encode_spec",
    "marker_env",
    "prepared_devices",
    "read_recorded",
    "remove_spec",
    "spec_path",
    "write_spec",
]

VENDOR: Final = "mixed-cpu.openshift.io"
CLASS: Final = "shared-cpus"
KIND: Final = f"{VENDOR}/{CLASS}"
CDI_VERSION: Final = "0.6.0"
SPEC_MODE: Final = 0o600  # the runtime reads it as root; the markers are nobody else's business
DIR_MODE: Final = 0o755  # the spec directory, when we make it: the runtime reads it
# The file-name prefix: the kind with its slash made a dash, as CDI's own tools name spec files.
_FILE_PREFIX: Final = f"{VENDOR}-{CLASS}_"
# Our spec files are a few hundred bytes a device; anything near this is not one of ours.
_READ_LIMIT: Final = 1 << 20

# Annotation keys on each CDI device (Kubernetes-style qualified names, as CDI requires).
ANN_NAMESPACE: Final = f"{VENDOR}/claim-namespace"
ANN_NAME: Final = f"{VENDOR}/claim-name"
ANN_UID: Final = f"{VENDOR}/claim-uid"
ANN_POOL: Final = f"{VENDOR}/pool"
ANN_DEVICE: Final = f"{VENDOR}/device"
ANN_REQUESTS: Final = f"{VENDOR}/requests"  # comma-separated: DNS labels, or two joined by "/"
# Comma-separated uids of the pods the claim was reserved for; absent in specs of earlier versions.
ANN_PODS: Final = f"{VENDOR}/reserved-for-pods"
_RECORDED: Final = (ANN_NAMESPACE, ANN_NAME, ANN_UID, ANN_POOL, ANN_DEVICE, ANN_REQUESTS)

# metadata.uid as the API server makes it: a lowercase RFC 4122 UUID.
_UID: Final = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# The marker signs "dra.<device>", at most 63 characters (marker.HostKey.sign).
_DEVICE_MAX: Final = 63 - len(dra_device_id(""))
# A pool name: DNS subdomains joined by slashes, 253 characters at most (resource.k8s.io/v1).
_POOL_MAX: Final = 253


class CdiError(Exception):
    """A claim or device that cannot be written as (or read back from) a CDI spec; the message says
    which value, why, and what to do. Sent back to kubelet as the claim's error."""


@dataclass(frozen=True)
class ClaimRef:
    """A ResourceClaim as kubelet names it in a prepare or unprepare request."""

    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim as kubelet is told of it (one ``dra.v1`` Device)."""

    requests: tuple[str, ...]  # the claim's requests it serves (base names, as kubelet matches them)
    pool: str
    device: str
    cdi_device_id: str  # the one CDI device kubelet passes to the runtime for it


def check_claim(claim: ClaimRef) -> None:
    """Raise `CdiError` unless the claim's uid is a Kubernetes UID and its namespace and name are
    valid Kubernetes names. The uid names the spec file: this is what keeps it inside ``cdi_dir``."""
    if not _UID.fullmatch(claim.uid):
        raise CdiError(
            f"claim uid {_show(claim.uid)} is not a Kubernetes UID (a lowercase UUID such as "
            "0b5f6a1e-3c1d-4e8a-9f00-5a1b2c3d4e5f); refusing to name a CDI spec file after it: "
            "kubelet sends the claim's metadata.uid, so check what sent this request"
        )
    if not is_dns_label(claim.namespace):
        raise CdiError(
            f"claim namespace {_show(claim.namespace)} of claim {claim.uid} is not a Kubernetes "
            "namespace name (a DNS label: 1-63 of [a-z0-9-]); check what sent this request"
        )
    if not is_dns_subdomain(claim.name):
        raise CdiError(
            f"claim name {_show(claim.name)} of claim {claim.uid} is not a ResourceClaim name "
            "(a DNS subdomain: 1-253 of [a-z0-9.-]); check what sent this request"
        )


def check_device(device: AllocatedDevice) -> None:
    """Raise `CdiError` unless `device` can be written into a spec: its device name a DNS label short
    enough for the marker (59 characters), its request a DNS label or two joined by ``/`` (a
    subrequest of ``firstAvailable``), its pool name set, and not allocated with admin access."""
    if len(device.device) > _DEVICE_MAX or not is_dns_label(device.device):
        raise CdiError(
            f"allocated device name {_show(device.device)} is not a DNS label of at most "
            f"{_DEVICE_MAX} characters, so it cannot be signed into a marker; our ResourceSlice "
            "publishes shared-cpus-<n>: check the claim's allocation"
        )
    parts = device.request.split("/")
    if len(parts) > 2 or not all(is_dns_label(part) for part in parts):
        raise CdiError(
            f"request name {_show(device.request)} of device {device.device} is neither a DNS label "
            "nor <request>/<subrequest> of two; check the claim's allocation"
        )
    if device.admin_access:
        raise CdiError(
            f"device {device.device} was allocated to request {_show(device.request)} with adminAccess: "
            "admin access lets a claim reach a device another container may hold, and each of this "
            "driver's devices is one container's ticket to the shared CPUs; remove adminAccess from "
            "the request"
        )
    if not device.pool or len(device.pool) > _POOL_MAX or not device.pool.isprintable():
        raise CdiError(
            f"pool name {_show(device.pool)} of device {device.device} is empty, too long or not "
            "printable; check the claim's allocation"
        )


def spec_path(cdi_dir: str | os.PathLike[str], claim_uid: str) -> Path:
    """Where the spec of the claim with uid `claim_uid` lives. Raises `CdiError` for a uid that is
    not a Kubernetes UID (so the path stays in `cdi_dir`)."""
    if not _UID.fullmatch(claim_uid):
        raise CdiError(
            f"claim uid {_show(claim_uid)} is not a Kubernetes UID (a lowercase UUID); "
            "refusing to name a CDI spec file after it"
        )
    return Path(cdi_dir) / f"{_FILE_PREFIX}{claim_uid}.json"


def marker_env(device: str) -> str:
    """The env name our spec sets `device`'s marker in: ``MIXED_CPU_SHARED_CPUS_ALLOCATION_`` and the
    device name in capitals with its dashes as underscores (device names are DNS labels, so two
    devices never share a name)."""
    return f"{MARKER_ENV}_{device.upper().replace('-', '_')}"


def cdi_device_name(claim_uid: str, device: str) -> str:
    """The CDI device name, inside our spec, of `device` prepared for the claim `claim_uid`."""
    return f"{claim_uid}-{device}"


def cdi_device_id(claim_uid: str, device: str) -> str:
    """The fully qualified CDI device id kubelet passes to the runtime: ``<kind>=<name>``."""
    return f"{KIND}={cdi_device_name(claim_uid, device)}"


def build_spec(
    claim: ClaimRef, devices: Sequence[AllocatedDevice], key: HostKey, *, allocation: int | None = None
) -> dict[str, Any]:
    """The CDI spec (a JSON-ready dict) for `claim` allocated `devices`, each device's edits setting
    the marker variable to its signed ``dra.<device>`` id: a new allocation (`allocation`: its
    number; None: the key's next), good in the pods the claim is reserved for. A device listed for
    several requests of the claim is one CDI device recording all of them. Raises `CdiError` for a
    bad claim or device, or none at all. Each prepare is a new allocation: a spec written again for
    the same claim differs in its markers' numbers only."""
    check_claim(claim)
    if not devices:
        raise CdiError(
            f"claim {claim.namespace}/{claim.name} ({claim.uid}) has no device of ours to prepare; "
            "check its allocation"
        )
    for device in devices:
        check_device(device)
    pods = sorted({uid for device in devices for uid in device.reserved_for})
    try:
        markers = {
            name: key.sign(dra_device_id(name), pods=pods, allocation=allocation)
            for name in _grouped(devices)
        }
    except ValueError as exc:
        raise CdiError(
            f"claim {claim.namespace}/{claim.name} ({claim.uid}) cannot be signed for the pods it is "
            f"reserved for ({exc}); check the claim's status.reservedFor"
        ) from None
    cdi_devices = []
    for name, (pool, requests) in _grouped(devices).items():
        notes = {
            ANN_NAMESPACE: claim.namespace,
            ANN_NAME: claim.name,
            ANN_UID: claim.uid,
            ANN_POOL: pool,
            ANN_DEVICE: name,
            ANN_REQUESTS: ",".join(requests),
        }
        if pods:
            notes[ANN_PODS] = ",".join(pods)
        cdi_devices.append(
            {
                "name": cdi_device_name(claim.uid, name),
                "annotations": notes,
                "containerEdits": {"env": [f"{marker_env(name)}={markers[name]}"]},
            }
        )
    return {"cdiVersion": CDI_VERSION, "kind": KIND, "devices": cdi_devices}


def prepared_devices(claim_uid: str, devices: Sequence[AllocatedDevice]) -> tuple[PreparedDevice, ...]:
    """What kubelet is answered for `devices` of the claim `claim_uid`: one entry per device (as in
    its spec, in the same order), with every request it serves and its CDI device id. A subrequest
    (``shared/first``) is answered as its request (``shared``): kubelet gives a container the devices
    whose ``request_names`` hold the request the container names, and a container can only name a
    claim's own requests."""
    return tuple(
        PreparedDevice(
            tuple(dict.fromkeys(base_request(r) for r in requests)),
            pool,
            name,
            cdi_device_id(claim_uid, name),
        )
        for name, (pool, requests) in _grouped(devices).items()
    )


def encode_spec(spec: Mapping[str, Any]) -> bytes:
    """The bytes of a spec file: sorted keys and a fixed layout, so the same spec is the same file."""
    return (json.dumps(spec, indent=2, sort_keys=True) + "\n").encode()


def write_spec(
    cdi_dir: str | os.PathLike[str], claim: ClaimRef, spec: Mapping[str, Any], *, fsync: bool = True
) -> Path:
    """Publish `spec` as the claim's spec file (atomically, mode 0600, replacing an earlier one) and
    return its path. The directory is made (0755) when it is missing: ``/var/run/cdi`` is on a tmpfs
    that a reboot empties, and nothing else may have made it yet. Raises `CdiError` for a bad uid,
    `OSError` when the file cannot be written."""
    path = spec_path(cdi_dir, claim.uid)
    os.makedirs(path.parent, mode=DIR_MODE, exist_ok=True)
    write_atomically(path, encode_spec(spec), mode=SPEC_MODE, fsync=fsync)
    return path


def remove_spec(cdi_dir: str | os.PathLike[str], claim_uid: str) -> bool:
    """Remove the claim's spec file; True if there was one. Absent is fine (unprepare is retried).
    Raises `CdiError` for a bad uid, `OSError` when it cannot be removed."""
    path = spec_path(cdi_dir, claim_uid)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def read_recorded(
    cdi_dir: str | os.PathLike[str],
    claim: ClaimRef,
    *,
    key: HostKey,
    pool: str,
    devices: Container[str],
) -> tuple[AllocatedDevice, ...] | None:
    """The devices a spec file written earlier for `claim` records (one per request it serves, in
    the file's order), or None when the claim has no spec file. Raises `CdiError` when the file is
    not one of ours (a device not among the published `devices` of `pool`, or whose marker `key`
    did not sign), is damaged, or records another claim; `OSError` when it cannot be read."""
    check_claim(claim)
    path = spec_path(cdi_dir, claim.uid)
    try:
        data = read_small_file(path, _READ_LIMIT)
    except FileNotFoundError:
        return None
    except RefusedFile as exc:
        raise CdiError(
            f"CDI spec {path} is {exc}; remove it and let kubelet prepare the claim again"
        ) from None
    try:
        recorded = _recorded_devices(json.loads(data), claim, key)
        for device in recorded:
            check_device(device)
            if device.pool != pool or device.device not in devices:
                raise ValueError(
                    f"device {device.device} of pool {device.pool!r} is not one this node published"
                )
    except (ValueError, KeyError, TypeError, AttributeError, CdiError) as exc:
        raise CdiError(
            f"CDI spec {path} is not one this driver wrote for claim {claim.namespace}/{claim.name} "
            f"({_show(str(exc), 200)}); remove it and let kubelet prepare the claim again"
        ) from None
    return recorded


def _recorded_devices(spec: Any, claim: ClaimRef, key: HostKey) -> tuple[AllocatedDevice, ...]:
    if spec.get("kind") != KIND:
        raise ValueError(f"kind {spec.get('kind')!r}, not {KIND}")
    recorded: list[AllocatedDevice] = []
    for entry in spec["devices"]:
        notes = entry["annotations"]
        if not all(isinstance(notes[k], str) for k in _RECORDED):
            raise ValueError("an annotation is not a string")
        seen = ClaimRef(notes[ANN_NAMESPACE], notes[ANN_NAME], notes[ANN_UID])
        if seen != claim:
            raise ValueError(f"it records claim {seen.namespace}/{seen.name} ({seen.uid})")
        device = notes[ANN_DEVICE]
        if entry["name"] != cdi_device_name(claim.uid, device):
            raise ValueError(f"device {entry['name']!r} does not match its annotations")
        reserved = _signed_pods(entry, device, key)
        for request in notes[ANN_REQUESTS].split(","):
            recorded.append(
                AllocatedDevice(request=request, pool=notes[ANN_POOL], device=device, reserved_for=reserved)
            )
    if not recorded:
        raise ValueError("no devices")
    return tuple(recorded)


def _signed_pods(entry: Any, device: str, key: HostKey) -> tuple[str, ...]:
    """The pods a spec file's device records (its pods annotation; none in specs of earlier versions),
    once its marker proves to be the one this node's key signed for that device and those pods.
    Raises ValueError (or KeyError, TypeError) for anything else."""
    pods = entry["annotations"].get(ANN_PODS, "")
    if not isinstance(pods, str):
        raise ValueError("the pods annotation is not a string")
    reserved = tuple(pods.split(",")) if pods else ()
    [env] = entry["containerEdits"]["env"]
    name, _, marker = env.partition("=")
    signed = key.read(marker)
    if name != marker_env(device) or signed is None or signed.device != dra_device_id(device):
        raise ValueError(f"device {device!r} does not carry the marker this node's key signs for it")
    if signed.pods != frozenset(reserved):
        raise ValueError(f"device {device!r}: its marker names other pods than its annotation records")
    return reserved


def _grouped(devices: Iterable[AllocatedDevice]) -> dict[str, tuple[str, list[str]]]:
    """device name -> (its pool, the requests it serves, each once, in first-seen order). Raises
    `CdiError` for one device name in two pools (CDI device names must be unique in a spec)."""
    grouped: dict[str, tuple[str, list[str]]] = {}
    for device in devices:
        pool, requests = grouped.setdefault(device.device, (device.pool, []))
        if pool != device.pool:
            raise CdiError(
                f"device {device.device} is allocated from two pools ({pool}, {device.pool}); "
                "this driver serves one pool per node: check the claim's allocation"
            )
        if device.request not in requests:
            requests.append(device.request)
    return grouped


def _show(value: str, limit: int = 80) -> str:
    """`value` quoted for a message, cut to `limit` characters (a hostile value can be huge)."""
    return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"
