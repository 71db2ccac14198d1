"""The allocation marker: proof, carried by a container annotation, that kubelet allocated our resource.

When kubelet admits a container that requests the shared-CPUs resource, it calls our ``Allocate`` with
the device id it picked, and passes the container annotations we answer with to the runtime (CRI
``ContainerConfig.annotations``). The runtime shows them to NRI plugins as the container's
annotations. We answer with one annotation, :data:`ANNOTATION_KEY`, whose value is

    ``v1:<device id>:<base64url HMAC-SHA256 of the device id, no padding>``

under a 32-byte secret that never leaves the node (:class:`HostKey`; :mod:`.keyfile` keeps it in a
0600 file in the state dir, created on first start and stable across restarts, so markers of running
containers stay valid).

A pod author can put any annotation on a pod (and some runtime setups pass pod annotations through to
containers), but cannot compute the MAC, so a forged value fails :meth:`HostKey.verify`; a valid value
copied from one device id onto another fails too, since the MAC covers the id. What the MAC cannot see
is a valid value replayed onto a second container: the NRI side must also refuse a device id bound
to a different container (until that container's pod sandbox stops). Bare environment variables and
unsigned annotations are never proof.

Through DRA (`nri_plugin.dra`) the same signed value arrives in the :data:`MARKER_ENV` variable, set
by the CDI spec our driver writes when kubelet prepares a claim; the device id it signs is
``dra.<device name>`` (:func:`dra_device_id`).

Pure: the policy imports this module, so it touches no file, socket or logger (the key file is
:mod:`.keyfile`'s business).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

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

_VERSION = "v1"
# Domain separation: this key signs nothing else, but a fixed context keeps that true if it ever does.
_CONTEXT = b"mixed-cpu-nri-plugin shared-cpus-allocation v1\0"
# Kubelet limits device ids to 63 characters; ours are "shared-cpus-<n>".
_DEVICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_MAC_CHARS = 43  # 32 bytes in unpadded base64url
_MARKER = re.compile(rf"{_VERSION}:({_DEVICE_ID.pattern}):([A-Za-z0-9_-]{{{_MAC_CHARS}}})")


def dra_device_id(device_name: str) -> str:
    """The marker id of the DRA device `device_name` (a device of our ResourceSlice)."""
    return DRA_ID_PREFIX + device_name


class HostKey:
    """The node's marker secret: signs device ids for ``Allocate`` and checks markers for the NRI side."""

    __slots__ = ("_secret", "path")

    def __init__(self, secret: bytes, path: Path | None = None) -> None:
        if len(secret) != KEY_SIZE:
            raise ValueError(f"the marker secret must be {KEY_SIZE} bytes, got {len(secret)}")
        self._secret = bytes(secret)
        self.path = path  # where it was loaded from, for messages; None for an in-memory key

    def __repr__(self) -> str:
        return f"HostKey(path={str(self.path) if self.path else None!r})"

    def sign(self, device_id: str) -> str:
        """The annotation value that marks ``device_id`` as allocated by kubelet on this node."""
        if not _DEVICE_ID.fullmatch(device_id):
            raise ValueError(
                f"cannot sign device id {device_id!r}: expected 1-63 characters of [A-Za-z0-9_.-]"
            )
        return f"{_VERSION}:{device_id}:{self._mac(device_id)}"

    def verify(self, value: object) -> str | None:
        """The device id ``value`` was signed for, or None if it is not a marker made with this key.

        The MAC comparison is constant-time. Only the MAC proves anything: the caller must still refuse
        a device id bound to another container (a replayed marker; see `nri_plugin.mixedcpu.books`).
        """
        if not isinstance(value, str):
            return None
        match = _MARKER.fullmatch(value)
        if match is None:
            return None
        device_id, mac = match.groups()
        if not hmac.compare_digest(self._mac(device_id).encode(), mac.encode()):
            return None
        return device_id

    def verify_annotations(self, annotations: Mapping[str, str]) -> str | None:
        """:meth:`verify` applied to the :data:`ANNOTATION_KEY` entry of a container's annotations."""
        return self.verify(annotations.get(ANNOTATION_KEY))

    def _mac(self, device_id: str) -> str:
        digest = hmac.new(self._secret, _CONTEXT + device_id.encode("ascii"), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")
