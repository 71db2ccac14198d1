"""``mixed-cpu-nri-plugin enable-nri``: turn NRI on in the node's runtime and restart the runtime, for
the chart's opt-in init container (``nri.runtime.patchConfig``), instead of editing drop-ins by hand.

What it does, in order, and why:

1. If a runtime already accepts connections on the NRI socket, NRI is on: nothing to do. This is
   the usual case (containerd 2.x and CRI-O 1.30+ have NRI on by default), and it keeps a pod
   restart from ever restarting the runtime.
2. containerd: set ``disable = false`` in the ``[plugins."io.containerd.nri.v1.nri"]`` table of
   ``/etc/containerd/config.toml``, by editing that one line (or adding it, or the table), so the
   operator's comments and layout stay. The edit is checked by parsing the result: anything but
   the same document with that one value set is refused, with the file left alone. A config that
   is a symbolic link is edited where it points (the link stays a link) and the old file is kept
   beside that real file (``real.toml.before-enable-nri``). A config that cannot be read is never
   replaced, and a version 1 config (containerd 1.6 and older know no NRI) is refused. CRI-O: write
   the drop-in ``/etc/crio/crio.conf.d/99-enable-nri.conf`` (``[crio.nri] enable_nri = true``; it
   sorts last, so it wins over earlier drop-ins); one of that name not written by this command is
   refused, not replaced.
3. Restart the runtime's systemd unit over D-Bus (`nri_plugin.systemd.bus`), only when step 2
   changed a file. A config that already says NRI is on while no socket answers is reported and
   left alone: restarting the runtime at every pod start would not mend it.

Host paths are taken under `host_root` (the init container mounts the host's directories there),
links included (`nri_plugin.daemon.hostpath`): a link leading out of the host root or to nothing, or
a missing runtime config directory (a wrong ``--host-root``), is refused before anything is written.
No directory is ever created. Running it again after it succeeded changes nothing.

Exit status: 0 done or nothing to do, 1 when the runtime could not be restarted, a file could not be
written, or the config says NRI is on while nothing answers, 2 when the config cannot be changed
safely (edit it by hand: ``packaging/runtime/``).
"""

from __future__ import annotations

import copy
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TextIO

from nri_plugin.common.atomicfile import write_atomically
from nri_plugin.common.smallfile import RefusedFile, open_regular_file, read_capped
from nri_plugin.daemon.hostpath import HostPath, HostPathError, resolve_under
from nri_plugin.systemd import bus as dbus

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = ["RUNTIMES", "EnableError", "Runtime", "enable_nri", "patch_containerd_config"]

NRI_PLUGIN: Final = "io.containerd.nri.v1.nri"
CONTAINERD_CONFIG: Final = "etc/containerd/config.toml"
CRIO_DROP_IN: Final = "etc/crio/crio.conf.d/99-enable-nri.conf"
NRI_SOCKET: Final = "var/run/nri/nri.sock"
BACKUP_SUFFIX: Final = ".before-enable-nri"
_MARK: Final = "# set by mixed-cpu-nri-plugin enable-nri"
_CRIO_TEXT: Final = (
    f"{_MARK}: NRI on (CRI-O 1.30 and later have it on already)\n[crio.nri]\nenable_nri = true\n"
)
_QUOTED_NRI: Final = r"""(?:"io\.containerd\.nri\.v1\.nri"|'io\.containerd\.nri\.v1\.nri')"""
_NRI_HEADER: Final = re.compile(
    rf"^[ \t]*\[[ \t]*plugins[ \t]*\.[ \t]*{_QUOTED_NRI}[ \t]*\][ \t]*(?:#.*)?$", re.M
)
_DISABLE_LINE: Final = re.compile(r"^([ \t]*)disable[ \t]*=[ \t]*true[ \t]*(?:#.*)?$")
EXIT_DONE, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2
# containerd's config is a few KiB; more is not a config this command should rewrite.
_MAX_CONFIG_BYTES: Final = 4 << 20


class EnableError(Exception):
    """NRI cannot be turned on safely here; `status` is the exit status (1 or 2)."""

    def __init__(self, message: str, status: int = EXIT_REFUSED) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Runtime:
    """How one runtime is configured and run."""

    unit: str
    turn_on: Callable[[str], str | None]


def patch_containerd_config(text: str) -> str | None:
    """`text` (containerd's config.toml) with NRI on, or None when NRI is on already. Raises
    `EnableError` when the change cannot be made safely by editing one line."""
    document = _parse(text, "containerd's config")
    version = document.get("version", 1)
    if not isinstance(version, int) or version < 2:
        raise EnableError(
            f"containerd's config is version {version}: containerd 1.6 and older know no NRI; upgrade to "
            "containerd 1.7 or later, or write a version 2 config by hand (packaging/runtime/containerd/)"
        )
    plugins = document.get("plugins", {})
    nri = plugins.get(NRI_PLUGIN, {}) if isinstance(plugins, Mapping) else None
    if not isinstance(nri, Mapping):
        raise EnableError(f'containerd\'s config: plugins."{NRI_PLUGIN}" is not a table; edit it by hand')
    if nri.get("disable") is False or ("disable" not in nri and version >= 3):
        return None  # on: set so, or containerd 2.x's default
    edited = _edit_nri_table(text)
    expected = copy.deepcopy(document)
    expected.setdefault("plugins", {}).setdefault(NRI_PLUGIN, {})["disable"] = False
    try:
        same = tomllib.loads(edited) == expected
    except tomllib.TOMLDecodeError:
        same = False
    if not same:
        raise EnableError(
            f'containerd\'s config sets plugins."{NRI_PLUGIN}" in a way this command does not edit (an '
            "inline or dotted table, say); set disable = false there by hand"
        )
    return edited


def _parse(text: str, what: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise EnableError(f"{what} is not valid TOML ({exc}); fix it first") from None


def _edit_nri_table(text: str) -> str:
    """Set ``disable = false`` in the NRI table's own lines, or add the table at the end."""
    lines = text.splitlines(keepends=True)
    header = _NRI_HEADER.search(text)
    if header is None:
        ending = "" if not text or text.endswith("\n") else "\n"
        return f'{text}{ending}\n[plugins."{NRI_PLUGIN}"]\n  disable = false  {_MARK}\n'
    first = text.count("\n", 0, header.start()) + 1
    for at in range(first, len(lines)):
        if lines[at].lstrip().startswith("["):
            break
        found = _DISABLE_LINE.match(lines[at].rstrip("\r\n"))
        if found:
            lines[at] = f"{found.group(1)}disable = false  {_MARK}\n"
            return "".join(lines)
    lines.insert(first, f"  disable = false  {_MARK}\n")
    return "".join(lines)


def _turn_on_containerd(host_root: str) -> str | None:
    found = _host_file(host_root, CONTAINERD_CONFIG)
    if found.exists:
        text, mode = _read_config(found.real)
    else:
        text, mode = "version = 2\n", 0o644  # containerd runs on its defaults: 1.7's have NRI off
    edited = patch_containerd_config(text)
    if edited is None:
        return None
    if found.exists:
        _publish(found.real + BACKUP_SUFFIX, text, mode)
    _publish(found.real, edited, mode)
    return found.real


def _turn_on_crio(host_root: str) -> str | None:
    found = _host_file(host_root, CRIO_DROP_IN)
    if found.exists:
        text, _ = _read_config(found.real)
        if text == _CRIO_TEXT:
            return None
        raise EnableError(
            f"{found.real} is there and was not written by enable-nri; set enable_nri = true in [crio.nri] "
            "there by hand, or remove it"
        )
    _publish(found.real, _CRIO_TEXT, 0o644)
    return found.real


def _host_file(host_root: str, path: str) -> HostPath:
    """`path` under `host_root`, links followed as the host follows them; refused (`EnableError`,
    status 2) when a link leaves the host root or dangles, or a directory on the way is missing."""
    if not os.path.isdir(host_root):
        raise EnableError(f"--host-root {host_root} is not a directory; give where the host's / is mounted")
    try:
        return resolve_under(host_root, path)
    except HostPathError as exc:
        raise EnableError(str(exc)) from None


def _read_config(path: str) -> tuple[str, int]:
    """The text and mode of the runtime's config at `path` (links already followed). A config that
    cannot be read is never replaced: `EnableError`, status 2."""
    try:
        fd, info = open_regular_file(path)
        try:
            data = read_capped(fd, _MAX_CONFIG_BYTES)
        finally:
            os.close(fd)
        return data.decode("utf-8"), info.st_mode & 0o7777
    except (OSError, RefusedFile, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise EnableError(
            f"cannot read {path} ({why}); nothing changed: fix it, or edit it by hand"
        ) from None


def _publish(path: str, text: str, mode: int) -> None:
    """`text` at `path` (its directory is there: none is ever made), whole or not at all."""
    try:
        write_atomically(path, text.encode(), mode=mode)
    except OSError as exc:
        raise EnableError(f"cannot write {path}: {exc}", EXIT_FAILED) from None


RUNTIMES: Final = {
    "containerd": Runtime("containerd.service", _turn_on_containerd),
    "cri-o": Runtime("crio.service", _turn_on_crio),
}


def _host_path_or_none(host_root: str, path: str) -> str | None:
    """`path` under `host_root` with its links followed there, if it is there."""
    try:
        found = resolve_under(host_root, path)
    except HostPathError:
        return None
    return found.real if found.exists else None


def _accepts_connections(path: str | None) -> bool:
    if path is None:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def _keep_socket_dir_private(directory: str | None) -> None:
    """The runtime makes its socket directory 0700, but only when it makes it: the pod that mounts
    it before NRI was on had kubelet make it, 0755. Give it the runtime's mode back."""
    if directory is None:
        return
    try:
        if os.stat(directory).st_uid == 0:
            os.chmod(directory, 0o700)
    except OSError:
        pass


def enable_nri(
    runtime: str,
    *,
    host_root: str = "/host",
    out: TextIO = sys.stdout,
    restart: Callable[[str], object] | None = None,
) -> int:
    """Steps 1 to 3 of the module docstring for `runtime` (a key of `RUNTIMES`); says on `out` what
    it found and did; the exit status. `restart` (default: systemd over the host's system bus under
    `host_root`) restarts a unit by name."""
    chosen = RUNTIMES[runtime]
    if _accepts_connections(_host_path_or_none(host_root, NRI_SOCKET)):
        print(f"NRI is on: the runtime accepts connections on /{NRI_SOCKET}; nothing to do", file=out)
        return EXIT_DONE
    bus = _host_path_or_none(host_root, dbus.SYSTEM_BUS) or os.path.join(host_root, dbus.SYSTEM_BUS[1:])
    restarter = restart or (lambda unit: dbus.restart_unit(unit, bus=bus))
    try:
        changed = chosen.turn_on(host_root)
        if changed is None:
            raise EnableError(
                f"the {runtime} config already has NRI on, yet nothing answers on /{NRI_SOCKET}: is the "
                "socket elsewhere (socket_path, nri_listen) or are connections off (disable_connections)? "
                "Not restarting the runtime for that",
                EXIT_FAILED,
            )
        print(f"NRI turned on in /{os.path.relpath(changed, host_root)}", file=out)
        _keep_socket_dir_private(_host_path_or_none(host_root, os.path.dirname(NRI_SOCKET)))
        try:
            restarter(chosen.unit)
        except (dbus.BusError, OSError) as exc:
            raise EnableError(
                f"cannot restart {chosen.unit}: {exc}; restart it by hand", EXIT_FAILED
            ) from None
    except EnableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.status
    print(f"restarting {chosen.unit}: the plugin connects once it is back", file=out)
    return EXIT_DONE
