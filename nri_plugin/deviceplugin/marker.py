"""The allocation marker: proof, carried by a container annotation, that kubelet allocated our resource.

When kubelet admits a container that requests the shared-CPUs resource, it calls our ``Allocate`` with
the device id it picked, and passes the container annotations we answer with to the runtime (CRI
``ContainerConfig.annotations``). The runtime shows them to NRI plugins as the container's
annotations. We answer with one annotation, :data:`ANNOTATION_KEY`, whose value is

    ``v1:<device id>:<base64url HMAC-SHA256 of the device id, no padding>``

under a 32-byte secret that never leaves the node (:class:`HostKey`, a 0600 file in the state dir,
created on first start and stable across restarts, so markers of running containers stay valid).

A pod author can put any annotation on a pod (and some runtime setups pass pod annotations through to
containers), but cannot compute the MAC, so a forged value fails :meth:`HostKey.verify`; a valid value
copied from one device id onto another fails too, since the MAC covers the id. What the MAC cannot see
is a valid value replayed onto a second container: the NRI side must also refuse a device id bound
to a different container (until that container's pod sandbox stops). Bare environment variables and
unsigned annotations are never proof.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import hmac
import os
import re
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from nri_plugin.common.atomicfile import write_atomically

# Namespaced to this project; "allocation" says what it records (kubelet's allocation of one device).
ANNOTATION_KEY = "mixed-cpu.openshift.io/shared-cpus-allocation"
KEY_FILE_NAME = "device-plugin-hmac.key"
KEY_SIZE = 32

_VERSION = "v1"
# Domain separation: this key signs nothing else, but a fixed context keeps that true if it ever does.
_CONTEXT = b"mixed-cpu-nri-plugin shared-cpus-allocation v1\0"
# Kubelet limits device ids to 63 characters; ours are "shared-cpus-<n>".
_DEVICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_MAC_CHARS = 43  # 32 bytes in unpadded base64url
_MARKER = re.compile(rf"{_VERSION}:({_DEVICE_ID.pattern}):([A-Za-z0-9_-]{{{_MAC_CHARS}}})")


class HostKeyError(Exception):
    """The secret file exists but cannot be trusted or read; the message says why and what to do."""


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

    @classmethod
    def load_or_create(cls, state_dir: str | os.PathLike[str], name: str = KEY_FILE_NAME) -> HostKey:
        """Load ``state_dir/name``, creating it (32 random bytes, mode 0600) if it does not exist.

        The file is written under a temporary name opened with ``O_EXCL`` and published with
        ``link()``, which never replaces an existing file: a crash leaves no half-written key behind,
        and of two processes starting at once both end up with whichever key was published first.
        Raises :class:`HostKeyError` for a file that is not ours, is readable by others, or has the
        wrong size.
        """
        directory = Path(state_dir)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = directory / name
        try:
            return cls(_read_secret(path), path)
        except FileNotFoundError:
            pass
        _publish_new_secret(path)
        return cls(_read_secret(path), path)

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
        a device id bound to another container (a replayed marker; see `nri_plugin.mixedcpu.state`).
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


def _read_secret(path: Path) -> bytes:
    """Read and vet the secret file; FileNotFoundError if there is none."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # NONBLOCK: a FIFO must not hang us
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise HostKeyError(
                f"{path}: is a symbolic link; remove it, a new secret is then created"
            ) from exc
        if isinstance(exc, FileNotFoundError):
            raise
        raise HostKeyError(f"{path}: cannot open the marker secret: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        _vet(path, info)
        data = b""
        while len(data) < KEY_SIZE + 1:
            chunk = os.read(fd, KEY_SIZE + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) != KEY_SIZE:
        raise HostKeyError(_wrong_size(path, len(data)))
    return data


def _vet(path: Path, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise HostKeyError(f"{path}: not a regular file; remove it, a new secret is then created")
    if info.st_uid != os.geteuid():
        raise HostKeyError(
            f"{path}: owned by uid {info.st_uid}, not by us (uid {os.geteuid()});"
            f" `chown {os.geteuid()} {path}` if it is the node's secret, else remove it"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077 or not mode & stat.S_IRUSR:
        raise HostKeyError(
            f"{path}: mode {mode:04o}, but the marker secret must be readable by its owner only;"
            f" `chmod 600 {path}` (and check who may have read it: if in doubt, remove it)"
        )
    if info.st_size != KEY_SIZE:
        raise HostKeyError(_wrong_size(path, info.st_size))


def _wrong_size(path: Path, size: int) -> str:
    return (
        f"{path}: {size} bytes, a marker secret is {KEY_SIZE}; remove it and a new one is created"
        " (allocation markers of running containers then stop verifying until they restart)"
    )


def _publish_new_secret(path: Path) -> None:
    # Never over an existing file: when someone else published first, theirs is the key.
    write_atomically(path, secrets.token_bytes(KEY_SIZE), mode=0o600, replace=False)
