"""The ``[dra]`` table of the daemon's TOML config: the DRA front door, off unless turned on.

Every key is optional; the defaults suit a stock kubelet::

    [dra]
    enabled = false                                  # true: also serve shared CPUs through DRA
    driver_name = "shared-cpus.mixed-cpu.openshift.io"
    registry_dir = "/var/lib/kubelet/plugins_registry"   # kubelet's plugin watcher looks here
    plugins_dir = "/var/lib/kubelet/plugins"         # our service socket: <plugins_dir>/<driver>/dra.sock
    cdi_dir = "/var/run/cdi"                         # where prepared claims' CDI specs are written
    node_name = ""                                   # "": the NODE_NAME environment variable
    publish_resource_slices = true                   # false: another component publishes them
    kubeconfig = ""                                  # "": the pod's service account (in-cluster)

How many devices the node offers is ``[device_plugin] device_count``: one number for both front
doors, so the scheduler counts the same pool whichever one serves a pod.

Loading the TOML file is the caller's job; this module turns the table (any mapping) into a frozen,
validated :class:`DraConfig`, or raises :class:`DraConfigError` naming the key and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import PurePosixPath
from typing import Any, Final

from nri_plugin.common.k8snames import is_dns_subdomain

__all__ = ["DEFAULT_DRIVER_NAME", "TABLE", "DraConfig", "DraConfigError"]

TABLE: Final = "dra"

DEFAULT_DRIVER_NAME: Final = "shared-cpus.mixed-cpu.openshift.io"
DEFAULT_REGISTRY_DIR: Final = PurePosixPath("/var/lib/kubelet/plugins_registry")
DEFAULT_PLUGINS_DIR: Final = PurePosixPath("/var/lib/kubelet/plugins")
DEFAULT_CDI_DIR: Final = PurePosixPath("/var/run/cdi")
SERVICE_SOCKET_NAME: Final = "dra.sock"
# sockaddr_un.sun_path is 108 bytes on Linux, one of them the terminating NUL.
MAX_SOCKET_PATH: Final = 107
# A driver name is a DNS subdomain of at most 63 characters (ResourceSlice's spec.driver).
DRIVER_NAME_MAX: Final = 63
_PATH_KEYS: Final = ("registry_dir", "plugins_dir", "cdi_dir")


class DraConfigError(ValueError):
    """A ``[dra]`` key has a value we cannot use; the message names the key and the fix."""


@dataclass(frozen=True)
class DraConfig:
    """Validated settings of the DRA front door; build with :meth:`from_table` or the constructor."""

    enabled: bool = False
    driver_name: str = DEFAULT_DRIVER_NAME
    registry_dir: PurePosixPath = DEFAULT_REGISTRY_DIR
    plugins_dir: PurePosixPath = DEFAULT_PLUGINS_DIR
    cdi_dir: PurePosixPath = DEFAULT_CDI_DIR
    node_name: str = ""
    publish_resource_slices: bool = True
    kubeconfig: str = ""

    def __post_init__(self) -> None:
        for key in ("enabled", "publish_resource_slices"):
            _check_type(key, getattr(self, key), bool, "true or false")
        for key in ("driver_name", "node_name", "kubeconfig"):
            _check_type(key, getattr(self, key), str, "a string")
        for key in _PATH_KEYS:
            object.__setattr__(self, key, _absolute(key, getattr(self, key)))
        if not is_dns_subdomain(self.driver_name, DRIVER_NAME_MAX):
            raise _error(
                "driver_name",
                self.driver_name,
                "must be a lowercase DNS subdomain of at most 63 characters, e.g. "
                f"{DEFAULT_DRIVER_NAME!r} (kubelet and the ResourceSlice name the driver by it)",
            )
        if self.node_name and not is_dns_subdomain(self.node_name):
            raise _error(
                "node_name",
                self.node_name,
                'must be the node\'s name (a lowercase DNS subdomain), or "" to take NODE_NAME',
            )
        if self.kubeconfig and not PurePosixPath(self.kubeconfig).is_absolute():
            raise _error("kubeconfig", self.kubeconfig, 'must be an absolute path, or "" for in-cluster')
        for key, path in (("registry_dir", self.registration_socket), ("plugins_dir", self.service_socket)):
            if len(str(path).encode()) > MAX_SOCKET_PATH:
                raise _error(
                    key,
                    getattr(self, key),
                    f"makes the socket path {str(path)!r} longer than the {MAX_SOCKET_PATH} bytes a unix"
                    " socket allows; use a shorter directory or driver name",
                )

    @property
    def registration_socket(self) -> PurePosixPath:
        """Where kubelet's plugin watcher finds us: ``registry_dir / <driver>-reg.sock``."""
        return self.registry_dir / f"{self.driver_name}-reg.sock"

    @property
    def service_socket(self) -> PurePosixPath:
        """Where the ``dra.v1`` service listens: ``plugins_dir / <driver> / dra.sock``."""
        return self.plugins_dir / self.driver_name / SERVICE_SOCKET_NAME

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> DraConfig:
        """Build from the ``[dra]`` TOML table; missing keys take their defaults."""
        if not isinstance(table, Mapping):
            raise DraConfigError(f"[{TABLE}] must be a table, not {type(table).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise DraConfigError(
                f"[{TABLE}] unknown key(s) {', '.join(map(repr, unknown))}: check the spelling;"
                f" the known keys are {', '.join(sorted(known))}"
            )
        values = dict(table)
        for key in _PATH_KEYS:
            if key in values:
                _check_type(key, values[key], str, "a path string")
                values[key] = PurePosixPath(values[key])
        return cls(**values)


def _error(key: str, value: object, problem: str) -> DraConfigError:
    shown = str(value) if isinstance(value, PurePosixPath) else value
    return DraConfigError(f"[{TABLE}] {key} = {shown!r}: {problem}")


def _check_type(key: str, value: object, kind: type, wanted: str) -> None:
    if not isinstance(value, kind):
        raise _error(key, value, f"must be {wanted}, not {type(value).__name__}")


def _absolute(key: str, value: object) -> PurePosixPath:
    if isinstance(value, str):
        value = PurePosixPath(value)
    if not isinstance(value, PurePosixPath) or not value.is_absolute() or "\0" in str(value):
        raise _error(key, value, "must be an absolute path")
    return value
