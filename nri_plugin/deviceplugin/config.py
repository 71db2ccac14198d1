"""The ``[device_plugin]`` table of the daemon's TOML config.

Every key is optional; the defaults suit a stock kubelet::

    [device_plugin]
    enabled = true                                       # false: kubelet itself advertises the resource
    resource_name = "workload.openshift.io/enable-shared-cpus"
    device_count = 256                                   # how many containers may ask at once
    plugin_dir = "/var/lib/kubelet/device-plugins"       # kubelet's device-plugin directory
    endpoint = "mixed-cpu-nri-plugin.sock"               # our socket's file name in plugin_dir
    pod_resources_socket = "/var/lib/kubelet/pod-resources/kubelet.sock"   # "" : not asked

``plugin_dir`` is the directory as the daemon sees it (mount the host directory, never the socket
files: kubelet deletes and re-creates them). Kubelet's own socket is ``kubelet.sock`` in it, and
kubelet looks for our socket next to its own, so one directory setting serves both.

``enabled = false`` is for clusters where kubelet already advertises the resource (OpenShift): the
daemon then serves no device plugin, and the NRI side takes its proof of request from the annotation
source instead of our signed allocation marker.

``pod_resources_socket`` is kubelet's PodResources API: the NRI side asks it which devices of our
resource kubelet allocated to a container, and that record, not the marker alone, is the proof
(`nri_plugin.deviceplugin.podresources`). "" turns the question off; a socket that is absent or
does not answer leaves the marker binding alone as the proof, and the daemon says so.

Loading the TOML file is the caller's job; this module turns the table (any mapping) into a frozen,
validated :class:`DevicePluginConfig`, or raises :class:`DevicePluginConfigError` naming the key and
the fix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import PurePosixPath
from typing import Any

from nri_plugin.common.k8snames import is_dns_subdomain

TABLE = "device_plugin"

DEFAULT_RESOURCE_NAME = "workload.openshift.io/enable-shared-cpus"
DEFAULT_DEVICE_COUNT = 256
DEFAULT_PLUGIN_DIR = PurePosixPath("/var/lib/kubelet/device-plugins")
KUBELET_SOCKET_NAME = "kubelet.sock"
DEFAULT_ENDPOINT = "mixed-cpu-nri-plugin.sock"
DEFAULT_POD_RESOURCES_SOCKET = PurePosixPath("/var/lib/kubelet/pod-resources/kubelet.sock")

# Each advertised device is one container's admission ticket. 16384 devices make a 470 KiB
# ListAndWatch message, far below gRPC's 4 MiB default limit, and far more containers than a node runs.
MAX_DEVICE_COUNT = 16384
# sockaddr_un.sun_path is 108 bytes on Linux, one of them the terminating NUL.
MAX_SOCKET_PATH = 107
# Files kubelet keeps in its device-plugin directory; our socket must not take their names.
_KUBELET_FILES = frozenset({KUBELET_SOCKET_NAME, "kubelet_internal_checkpoint", "DEPRECATION"})

# An extended resource name as kubelet's Register accepts it (v1helper.IsExtendedResourceName):
# "<DNS-1123 subdomain>/<name>", not in the kubernetes.io domain, and "requests.<prefix>" must still
# be a valid subdomain of at most 253 characters (the quota form of the name).
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


class DevicePluginConfigError(ValueError):
    """A ``[device_plugin]`` key has a value we cannot use; the message names the key and the fix."""


@dataclass(frozen=True)
class DevicePluginConfig:
    """Validated settings of the device plugin; build with :meth:`from_table` or the constructor."""

    enabled: bool = True
    resource_name: str = DEFAULT_RESOURCE_NAME
    device_count: int = DEFAULT_DEVICE_COUNT
    plugin_dir: PurePosixPath = DEFAULT_PLUGIN_DIR
    endpoint: str = DEFAULT_ENDPOINT
    # None: kubelet's PodResources API is not asked (the TOML value "").
    pod_resources_socket: PurePosixPath | None = DEFAULT_POD_RESOURCES_SOCKET

    def __post_init__(self) -> None:
        _check_type("enabled", self.enabled, bool, "true or false")
        _check_type("resource_name", self.resource_name, str, "a string")
        _check_type("device_count", self.device_count, int, "an integer")
        _check_type("endpoint", self.endpoint, str, "a string")
        plugin_dir = _as_path("plugin_dir", self.plugin_dir)
        if not plugin_dir.is_absolute():
            raise _error(
                "plugin_dir", self.plugin_dir, f"must be an absolute path, e.g. '{DEFAULT_PLUGIN_DIR}'"
            )
        object.__setattr__(self, "plugin_dir", plugin_dir)
        _check_resource_name(self.resource_name)
        if not 1 <= self.device_count <= MAX_DEVICE_COUNT:
            raise _error(
                "device_count",
                self.device_count,
                f"must be between 1 and {MAX_DEVICE_COUNT}; to advertise nothing, set enabled = false",
            )
        _check_endpoint(self.endpoint)
        self._check_pod_resources_socket()
        for key, path in (("plugin_dir", self.kubelet_socket), ("endpoint", self.socket_path)):
            if len(str(path).encode()) > MAX_SOCKET_PATH:
                raise _error(
                    key,
                    getattr(self, key),
                    f"makes the socket path {str(path)!r} longer than the {MAX_SOCKET_PATH} bytes a unix"
                    " socket allows; use a shorter directory or file name",
                )

    def _check_pod_resources_socket(self) -> None:
        if self.pod_resources_socket is None:
            return
        path = _as_path("pod_resources_socket", self.pod_resources_socket)
        if not path.is_absolute():
            raise _error(
                "pod_resources_socket",
                self.pod_resources_socket,
                f"must be an absolute path, e.g. '{DEFAULT_POD_RESOURCES_SOCKET}' (\"\": do not ask kubelet)",
            )
        if len(str(path).encode()) > MAX_SOCKET_PATH:
            raise _error(
                "pod_resources_socket",
                str(path),
                f"is longer than the {MAX_SOCKET_PATH} bytes a unix socket path allows",
            )
        object.__setattr__(self, "pod_resources_socket", path)

    @property
    def socket_path(self) -> PurePosixPath:
        """Where our DevicePlugin service listens: ``plugin_dir / endpoint``."""
        return self.plugin_dir / self.endpoint

    @property
    def kubelet_socket(self) -> PurePosixPath:
        """Where kubelet's Registration service listens: ``plugin_dir / kubelet.sock``."""
        return self.plugin_dir / KUBELET_SOCKET_NAME

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> DevicePluginConfig:
        """Build from the ``[device_plugin]`` TOML table; missing keys take their defaults."""
        if not isinstance(table, Mapping):
            raise DevicePluginConfigError(f"[{TABLE}] must be a table, not {type(table).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise DevicePluginConfigError(
                f"[{TABLE}] unknown key(s) {', '.join(map(repr, unknown))}: check the spelling;"
                f" the known keys are {', '.join(sorted(known))}"
            )
        values = dict(table)
        if "plugin_dir" in values:
            _check_type("plugin_dir", values["plugin_dir"], str, "a path string")
            values["plugin_dir"] = PurePosixPath(values["plugin_dir"])
        if "pod_resources_socket" in values:
            text = values["pod_resources_socket"]
            _check_type("pod_resources_socket", text, str, 'a path string, or "" not to ask kubelet')
            values["pod_resources_socket"] = PurePosixPath(text) if text else None
        return cls(**values)


def _error(key: str, value: object, problem: str) -> DevicePluginConfigError:
    # A path is shown as the string the config file holds, not as Python's PurePosixPath('...').
    shown = str(value) if isinstance(value, PurePosixPath) else value
    return DevicePluginConfigError(f"[{TABLE}] {key} = {shown!r}: {problem}")


def _check_type(key: str, value: object, kind: type, wanted: str) -> None:
    # bool is an int subclass: device_count = true must not pass as 1.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _error(key, value, f"must be {wanted}, not {type(value).__name__}")


def _as_path(key: str, value: object) -> PurePosixPath:
    if isinstance(value, str):
        value = PurePosixPath(value)
    if not isinstance(value, PurePosixPath) or not str(value) or "\0" in str(value):
        raise _error(key, value, "must be a non-empty path string")
    return value


def _check_resource_name(name: str) -> None:
    fix = f"use a domain-prefixed extended resource name such as {DEFAULT_RESOURCE_NAME!r}"
    prefix, slash, local = name.partition("/")
    if not slash:
        raise _error("resource_name", name, f"has no domain prefix; {fix}")
    if prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io") or prefix.startswith("requests."):
        raise _error("resource_name", name, f"is reserved for Kubernetes' own resources; {fix}")
    quota_prefix = "requests." + prefix
    if not is_dns_subdomain(quota_prefix):
        raise _error(
            "resource_name",
            name,
            f"the domain must be a lowercase DNS subdomain of at most 244 characters; {fix}",
        )
    if len(local) > 63 or not _NAME.fullmatch(local):
        raise _error(
            "resource_name",
            name,
            "the part after '/' must be 1-63 characters of letters, digits, '-', '_' or '.',"
            f" starting and ending with a letter or digit; {fix}",
        )


def _check_endpoint(endpoint: str) -> None:
    if not endpoint or "/" in endpoint or "\0" in endpoint or endpoint in (".", ".."):
        raise _error(
            "endpoint", endpoint, f"must be a plain file name in plugin_dir, e.g. {DEFAULT_ENDPOINT!r}"
        )
    if endpoint in _KUBELET_FILES:
        raise _error(
            "endpoint", endpoint, f"is a file kubelet owns; use another name, e.g. {DEFAULT_ENDPOINT!r}"
        )
