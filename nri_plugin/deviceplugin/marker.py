"""The allocation marker: proof, carried by a container annotation, that kubelet allocated our resource.

When kubelet admits a container that requests the shared-CPUs resource, it calls our ``Allocate`` with
the device id it picked, and passes the container annotations we answer with to the runtime (CRI
``ContainerConfig.annotations``). The runtime shows them to NRI plugins as the container's
annotations. We answer with one annotation, :data:`ANNOTATION_KEY`, whose value is

    ``v2:<device id>:<allocation>:<pods>:<base64url HMAC-SHA256 of the three, no padding>``

under a 32-byte secret that never leaves the node (:class:`HostKey`; :mod:`.keyfile` keeps it in a
0600 file in the state dir, created on first start and stable across restarts, so markers of running
containers stay valid).

``<allocation>`` numbers the allocation: every ``Allocate`` (and every DRA prepare) signs a new one,
larger than any this key signed before in this process and than the wall clock in nanoseconds, so a
later allocation of a device has a larger number than an earlier one, across daemon restarts too
(the daemon also raises the floor to the largest number its books hold: :meth:`HostKey.raise_floor`).
Two allocations of one device therefore never carry the same marker, and the NRI side can tell
kubelet's newest allocation of a device from a copy of an older one (`nri_plugin.mixedcpu.books`).
``<pods>`` is empty for the device plugin (kubelet's ``Allocate`` does not name the pod); for a DRA
claim it lists the uids of the pods the claim was reserved for when it was prepared, comma-separated,
and the marker proves nothing in any other pod.

A pod author can put any annotation on a pod (and some runtime setups pass pod annotations through to
containers), but cannot compute the MAC, so a forged value fails :meth:`HostKey.read`; a valid value
edited to another device id, allocation or pod list fails too, since the MAC covers them. What the
MAC cannot see is a valid value copied onto a second container: the NRI side refuses a marker whose
allocation another container of another pod presented first, unless its own is newer.
Bare environment variables and unsigned annotations are never proof.

Markers signed before the allocation number existed (``v1:<device id>:<mac>``, in containers created
by an earlier version and restarted since) are still read, as allocation 0: older than any other.

Through DRA (`nri_plugin.dra`) the same signed value arrives in the :data:`MARKER_ENV` variable, set
by the CDI spec our driver writes when kubelet prepares a claim; the device id it signs is
``dra.<device name>`` (:func:`dra_device_id`).

Pure: the policy imports this module, so it touches no file, socket or logger (the key file is
:mod:`.keyfile`'s business); it reads the wall clock to number allocations.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pathlib import Path

# Namespaced to this project; "allocation" says what it records (kubelet's allocation of one device).
ANNOTATION_KEY = "mixed-cpu.openshift.io/shared-cpus-allocation"
# The same marker where it comes through DRA: a CDI spec's container edits can set env entries but
# no annotations, so the DRA driver's spec sets this variable to the signed value. The checks are the
# same; only where the NRI side finds the value differs.
MARKER_ENV = "MIXED_CPU_SHARED_CPUS_ALLOCATION"
# A DRA device's marker id: its device name behind this prefix, so it can never equal a device-plugin
# device id ("shared-cpus-<n>") that kubelet hands out on the same node at the same time.
DRA_ID_PREFIX = "dra."
KEY_SIZE = 32

_VERSION = "v2"
# Domain separation: this key signs nothing else, but a fixed context keeps that true if it ever does.
_CONTEXT = b"mixed-cpu-nri-plugin shared-cpus-allocation v2\0"
_CONTEXT_V1 = b"mixed-cpu-nri-plugin shared-cpus-allocation v1\0"
# Kubelet limits device ids to 63 characters; ours are "shared-cpus-<n>".
_DEVICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_MAC_CHARS = 43  # 32 bytes in unpadded base64url
_MAC = rf"([A-Za-z0-9_-]{{{_MAC_CHARS}}})"
# A pod uid: the API server makes lowercase RFC 4122 UUIDs; any letters, digits and dashes are read
# (never a comma or a colon, which separate the marker's fields).
_POD_UID = r"[0-9A-Za-z][0-9A-Za-z-]{0,63}"
_POD_UID_RE = re.compile(_POD_UID)
# A claim may be reserved for at most 256 pods (resource.k8s.io ResourceClaimReservedForMaxSize).
MAX_PODS = 256
_ALLOCATION_DIGITS = 20  # below 2**64: nanoseconds since 1970 for five centuries
_MARKER = re.compile(
    rf"{_VERSION}:({_DEVICE_ID.pattern}):([0-9]{{1,{_ALLOCATION_DIGITS}}}):((?:{_POD_UID}(?:,{_POD_UID})*)?):{_MAC}"
)
_MARKER_V1 = re.compile(rf"v1:({_DEVICE_ID.pattern}):{_MAC}")


class Signed(NamedTuple):
    """What a marker made with this node's key says: the device id, the allocation's number (0: a
    v1 marker, older than any numbered one) and the pods it may prove a request in (empty: any)."""

    device: str
    allocation: int = 0
    pods: frozenset[str] = frozenset()


def dra_device_id(device_name: str) -> str:
    """The marker id of the DRA device `device_name` (a device of our ResourceSlice)."""
    return DRA_ID_PREFIX + device_name


class HostKey:
    """The node's marker secret: signs device ids for ``Allocate`` and checks markers for the NRI side.

    It also numbers allocations (:meth:`sign`); the numbering is safe to use from several threads."""

    __slots__ = ("_last", "_lock", "_secret", "path")

    def __init__(self, secret: bytes, path: Path | None = None) -> None:
        if len(secret) != KEY_SIZE:
            raise ValueError(f"the marker secret must be {KEY_SIZE} bytes, got {len(secret)}")
        self._secret = bytes(secret)
        self.path = path  # where it was loaded from, for messages; None for an in-memory key
        self._last = 0  # the largest allocation number signed or known
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"HostKey(path={str(self.path) if self.path else None!r})"

    def raise_floor(self, allocation: int) -> None:
        """Number every later allocation above `allocation` (the largest the books hold: a wall clock
        stepped back across a restart must not make a new allocation look older than a spent one)."""
        with self._lock:
            self._last = max(self._last, allocation)

    def next_allocation(self) -> int:
        """A new allocation number: above every one before, and at least the wall clock in ns."""
        with self._lock:
            self._last = max(self._last + 1, time.time_ns())
            return self._last

    def sign(self, device_id: str, *, pods: Iterable[str] = (), allocation: int | None = None) -> str:
        """The annotation value that marks a new allocation of ``device_id`` by kubelet on this node
        (`allocation`: its number, None for the next one), good only in the pods with uids `pods`
        when any are given (a DRA claim's reservedFor)."""
        if not _DEVICE_ID.fullmatch(device_id):
            raise ValueError(
                f"cannot sign device id {device_id!r}: expected 1-63 characters of [A-Za-z0-9_.-]"
            )
        uids = sorted(set(pods))
        if len(uids) > MAX_PODS or not all(_POD_UID_RE.fullmatch(uid) for uid in uids):
            raise ValueError(f"cannot sign pod uids {uids[:3]!r}...: expected up to {MAX_PODS} pod uids")
        number = self.next_allocation() if allocation is None else allocation
        if not 0 < number < 10**_ALLOCATION_DIGITS:
            raise ValueError(f"cannot sign allocation number {number}: expected 1 to 10**20 - 1")
        text = f"{device_id}:{number}:{','.join(uids)}"
        return f"{_VERSION}:{text}:{self._mac(_CONTEXT, text)}"

    def read(self, value: object) -> Signed | None:
        """What a marker made with this key says, or None for a value that is not one.

        The MAC comparison is constant-time. Only the MAC proves anything: the caller must still refuse
        a marker another container presented first (a copy; see `nri_plugin.mixedcpu.books`)."""
        if not isinstance(value, str):
            return None
        match = _MARKER.fullmatch(value)
        if match is not None:
            device_id, number, uids, mac = match.groups()
            text = f"{device_id}:{number}:{uids}"
            if not hmac.compare_digest(self._mac(_CONTEXT, text).encode(), mac.encode()):
                return None
            return Signed(device_id, int(number), frozenset(uids.split(",")) if uids else frozenset())
        match = _MARKER_V1.fullmatch(value)
        if match is None:
            return None
        device_id, mac = match.groups()
        if not hmac.compare_digest(self._mac(_CONTEXT_V1, device_id).encode(), mac.encode()):
            return None
        return Signed(device_id)

    def verify(self, value: object) -> str | None:
        """The device id ``value`` was signed for, or None if it is not a marker made with this key
        (:meth:`read`, for callers that need only the device)."""
        signed = self.read(value)
        return None if signed is None else signed.device

    def verify_annotations(self, annotations: Mapping[str, str]) -> str | None:
        """:meth:`verify` applied to the :data:`ANNOTATION_KEY` entry of a container's annotations."""
        return self.verify(annotations.get(ANNOTATION_KEY))

    def _mac(self, context: bytes, text: str) -> str:
        digest = hmac.new(self._secret, context + text.encode("ascii"), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")
