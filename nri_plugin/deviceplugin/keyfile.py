"""The node's marker secret on disk: ``state_dir/device-plugin-hmac.key``, 32 bytes, mode 0600.

Created once, on the first start, and kept across restarts so that the markers of running containers
stay valid. A file this module did not make the way it makes them (another owner, readable by others,
the wrong size, a link, a FIFO) is refused with :class:`HostKeyError`, never replaced: the message
says what to check and how to fix it.

The file I/O half of the marker; the signing itself is :mod:`.marker`, which stays pure.
"""

from __future__ import annotations

import functools
import os
import secrets
import stat
from pathlib import Path

from nri_plugin.common.atomicfile import write_atomically
from nri_plugin.common.smallfile import RefusedFile, SymbolicLink, TooLarge, read_small_file
from nri_plugin.deviceplugin.marker import KEY_SIZE, HostKey

KEY_FILE_NAME = "device-plugin-hmac.key"


class HostKeyError(Exception):
    """The secret file exists but cannot be trusted or read; the message says why and what to do."""


def load_or_create_host_key(state_dir: str | os.PathLike[str], name: str = KEY_FILE_NAME) -> HostKey:
    """Load ``state_dir/name``, creating it (32 random bytes, mode 0600) if it does not exist.

    The file is written under a temporary name opened with ``O_EXCL`` and published with ``link()``,
    which never replaces an existing file: a crash leaves no half-written key behind, and of two
    processes starting at once both end up with whichever key was published first. Raises
    :class:`HostKeyError` for a file that is not ours, is readable by others, or has the wrong size.
    """
    directory = Path(state_dir)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / name
    try:
        return HostKey(_read_secret(path), path)
    except FileNotFoundError:
        pass
    _publish_new_secret(path)
    return HostKey(_read_secret(path), path)


def _read_secret(path: Path) -> bytes:
    """Read and vet the secret file (`nri_plugin.common.smallfile`); FileNotFoundError if there is none."""
    try:
        data = read_small_file(path, KEY_SIZE, vet=functools.partial(_vet, path))
    except FileNotFoundError:
        raise
    except RefusedFile as exc:
        raise HostKeyError(_refusal(path, exc)) from exc
    except OSError as exc:
        raise HostKeyError(f"{path}: cannot open the marker secret: {exc.strerror}") from exc
    if len(data) != KEY_SIZE:
        raise HostKeyError(_wrong_size(path, len(data)))
    return data


def _refusal(path: Path, exc: RefusedFile) -> str:
    if isinstance(exc, TooLarge):  # grown since `_vet` saw its size
        return _wrong_size(path, exc.size)
    if isinstance(exc, SymbolicLink):
        return f"{path}: is a symbolic link; remove it, a new secret is then created"
    return f"{path}: not a regular file; remove it, a new secret is then created"


def _vet(path: Path, info: os.stat_result) -> None:
    """Ours alone, and of the right size: the checks beyond what every small file gets."""
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
