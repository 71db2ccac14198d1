"""CDI device injection, the part a runtime does before NRI sees a container: for the simulator.

The Container Device Interface (CDI) lets a device driver describe, in spec files on the node, what a
container using one of its devices needs: edits to the container's OCI spec. kubelet names the devices
a container gets by their fully qualified CDI names (``<vendor>/<class>=<name>``; a DRA driver returns
them from ``NodePrepareResources``), and containerd and CRI-O resolve those names against the spec
files and apply the edits while they build the container's spec, before NRI's ``CreateContainer``
shows the container to plugins. So a plugin sees the edits already in place.

What is modelled here, as the runtimes' CDI library does it:

* spec files are the ``*.json`` and ``*.yaml`` files directly in each spec directory; a directory later
  in the list takes precedence over an earlier one for a device both define; two files of the same
  directory defining one device are a conflict, and neither definition is used;
* a file that cannot be read or is not a valid spec is skipped (its devices stay unresolvable);
* the files are read again at each injection, so a spec written just before a creation counts;
* injecting devices applies, for each spec involved, its top-level ``containerEdits`` once (before
  its first device's), then each device's own ``containerEdits``, in the order the devices were
  named;
* an env entry ``NAME=value`` replaces the container's entry of that name in place, or is appended;
* a name no spec defines fails the injection: ``unresolvable CDI devices <names>``, nothing applied.

Only the env edits are applied: device nodes, mounts and hooks have no place in the simulator's
container model and are not simulated (they are read, and otherwise ignored).

Generic: nothing here knows which driver wrote a spec.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, MutableSequence, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import yaml

__all__ = ["CdiDevice", "CdiError", "CdiSpecs", "apply_env"]

SPEC_SUFFIXES: Final = (".json", ".yaml")
# Larger spec files are not read (a spec describing a few devices is a few KB).
MAX_SPEC_BYTES: Final = 1024 * 1024


class CdiError(Exception):
    """A CDI injection failed; the message says which devices, as the runtimes' CDI library does."""


class _BadSpec(Exception):
    """A spec file that is not a valid CDI spec (the message says why)."""


@dataclass(frozen=True, slots=True)
class CdiDevice:
    """One device a spec file defines: its fully qualified name, its env edits and its spec's."""

    name: str  # "<vendor>/<class>=<device>"
    env: tuple[str, ...]
    spec_env: tuple[str, ...]  # the spec's top-level containerEdits env
    spec_path: str
    priority: int  # the index of its spec directory: higher wins


class CdiSpecs:
    """The CDI spec directories a runtime reads, lowest precedence first."""

    def __init__(self, spec_dirs: Iterable[str | os.PathLike[str]] = ()) -> None:
        self.spec_dirs = tuple(Path(d) for d in spec_dirs)
        # What the last scan could not use, one line each (bad files, conflicting devices).
        self.errors: tuple[str, ...] = ()

    def devices(self) -> dict[str, CdiDevice]:
        """Every device the spec files define now, by fully qualified name."""
        found: dict[str, CdiDevice] = {}
        conflicts: set[str] = set()
        errors: list[str] = []
        for priority, directory in enumerate(self.spec_dirs):
            for path in _spec_files(directory, errors):
                try:
                    devices = _read_spec(path, priority)
                except _BadSpec as exc:
                    errors.append(f"{path}: {exc}")
                    continue
                for device in devices:
                    other = found.get(device.name)
                    if other is not None and other.priority == priority:
                        errors.append(
                            f"conflicting device {device.name!r} (specs {device.spec_path!r}, "
                            f"{other.spec_path!r})"
                        )
                        conflicts.add(device.name)
                        continue
                    found[device.name] = device  # a later directory's definition wins
        for name in conflicts:
            found.pop(name, None)
        self.errors = tuple(errors)
        return found

    def env_edits(self, names: Sequence[str]) -> list[str]:
        """The env entries injecting the devices `names` adds, in the order they apply; `CdiError`
        when one of them is not defined by any usable spec."""
        devices = self.devices()
        unresolved = [name for name in names if name not in devices]
        if unresolved:
            raise CdiError(f"unresolvable CDI devices {', '.join(unresolved)}")
        edits: list[str] = []
        specs_applied: set[str] = set()
        for name in names:
            device = devices[name]
            if device.spec_path not in specs_applied:
                specs_applied.add(device.spec_path)
                edits.extend(device.spec_env)
            edits.extend(device.env)
        return edits


def apply_env(env: MutableSequence[str], edits: Iterable[str]) -> None:
    """Apply CDI env edits to a container's env: each ``NAME=value`` replaces the last entry of that
    name where it stands, or is appended."""
    for edit in edits:
        name = edit.partition("=")[0]
        for index in range(len(env) - 1, -1, -1):
            if env[index].partition("=")[0] == name:
                env[index] = edit
                break
        else:
            env.append(edit)


def _spec_files(directory: Path, errors: list[str]) -> list[Path]:
    """The spec files directly in `directory`, by name; none when it does not exist."""
    try:
        entries = sorted(directory.iterdir())
    except FileNotFoundError:
        return []
    except OSError as exc:
        errors.append(f"{directory}: cannot be listed: {exc.strerror}")
        return []
    return [entry for entry in entries if entry.suffix in SPEC_SUFFIXES and entry.is_file()]


def _read_spec(path: Path, priority: int) -> list[CdiDevice]:
    """The devices of one spec file; `_BadSpec` when it cannot be read or is not a CDI spec."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise _BadSpec(f"cannot be read: {exc.strerror}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise _BadSpec(f"larger than {MAX_SPEC_BYTES} bytes")
    try:
        spec = json.loads(data) if path.suffix == ".json" else yaml.safe_load(data)
    except (ValueError, yaml.YAMLError) as exc:
        raise _BadSpec(f"not valid {path.suffix[1:].upper()}: {exc}") from None
    if not isinstance(spec, dict):
        raise _BadSpec("not a CDI spec: the document is not an object")
    if not isinstance(spec.get("cdiVersion"), str):
        raise _BadSpec("not a CDI spec: no cdiVersion")
    kind = spec.get("kind")
    vendor, slash, device_class = kind.partition("/") if isinstance(kind, str) else ("", "", "")
    if not (vendor and slash and device_class) or "/" in device_class:
        raise _BadSpec(f"kind {kind!r} is not <vendor>/<class>")
    spec_env = _env(spec.get("containerEdits"), "containerEdits")
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        raise _BadSpec("devices: a spec defines at least one device")
    found = []
    for index, device in enumerate(devices):
        name = device.get("name") if isinstance(device, dict) else None
        if not isinstance(name, str) or not name:
            raise _BadSpec(f"devices[{index}]: no name")
        edits = _env(device.get("containerEdits"), f"devices[{index}].containerEdits")
        found.append(CdiDevice(f"{kind}={name}", edits, spec_env, str(path), priority))
    return found


def _env(edits: object, where: str) -> tuple[str, ...]:
    """The env entries of a ``containerEdits`` object (absent: none)."""
    if edits is None:
        return ()
    if not isinstance(edits, dict):
        raise _BadSpec(f"{where}: not an object")
    env = edits.get("env") or []
    if not isinstance(env, list):
        raise _BadSpec(f"{where}.env: not a list")
    for entry in env:
        if not isinstance(entry, str) or entry.find("=") <= 0:
            raise _BadSpec(f"{where}.env: invalid environment variable {entry!r} (expected NAME=value)")
    return tuple(env)
