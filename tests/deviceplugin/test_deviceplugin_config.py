"""The [device_plugin] table: defaults, validation, and messages that name the key and the fix."""

from __future__ import annotations

import dataclasses
from pathlib import PurePosixPath
from typing import Any

import pytest

from nri_plugin.deviceplugin.config import DevicePluginConfig, DevicePluginConfigError


def test_defaults() -> None:
    config = DevicePluginConfig.from_table({})
    assert config == DevicePluginConfig()
    assert config.enabled is True
    assert config.resource_name == "workload.openshift.io/enable-shared-cpus"
    assert config.device_count == 256
    assert config.plugin_dir == PurePosixPath("/var/lib/kubelet/device-plugins")
    assert config.kubelet_socket == PurePosixPath("/var/lib/kubelet/device-plugins/kubelet.sock")
    assert config.socket_path == PurePosixPath("/var/lib/kubelet/device-plugins/mixed-cpu-nri-plugin.sock")


def test_every_key() -> None:
    config = DevicePluginConfig.from_table(
        {
            "enabled": False,
            "resource_name": "example.com/shared",
            "device_count": 16,
            "plugin_dir": "/host/device-plugins/",
            "endpoint": "shared.sock",
        }
    )
    assert (config.enabled, config.resource_name, config.device_count) == (False, "example.com/shared", 16)
    assert config.plugin_dir == PurePosixPath("/host/device-plugins")
    assert config.socket_path == PurePosixPath("/host/device-plugins/shared.sock")
    assert config.kubelet_socket == PurePosixPath("/host/device-plugins/kubelet.sock")


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        DevicePluginConfig().device_count = 3  # type: ignore[misc]


def test_not_a_table() -> None:
    with pytest.raises(DevicePluginConfigError, match=r"\[device_plugin\] must be a table"):
        DevicePluginConfig.from_table(["enabled"])  # type: ignore[arg-type]


def test_unknown_key_names_it_and_the_known_ones() -> None:
    with pytest.raises(DevicePluginConfigError) as info:
        DevicePluginConfig.from_table({"device_cout": 3})
    message = str(info.value)
    assert "'device_cout'" in message
    assert "device_count" in message
    assert "check the spelling" in message


@pytest.mark.parametrize(
    ("table", "key", "fix"),
    [
        ({"enabled": "yes"}, "enabled", "must be true or false"),
        ({"enabled": 1}, "enabled", "must be true or false"),
        ({"device_count": True}, "device_count", "must be an integer"),
        ({"device_count": 2.0}, "device_count", "must be an integer"),
        ({"device_count": 0}, "device_count", "set enabled = false"),
        ({"device_count": -1}, "device_count", "between 1 and 16384"),
        ({"device_count": 16385}, "device_count", "between 1 and 16384"),
        ({"resource_name": 5}, "resource_name", "must be a string"),
        ({"resource_name": "enable-shared-cpus"}, "resource_name", "has no domain prefix"),
        ({"resource_name": "kubernetes.io/shared"}, "resource_name", "reserved"),
        ({"resource_name": "node.kubernetes.io/shared"}, "resource_name", "reserved"),
        ({"resource_name": "requests.example.com/shared"}, "resource_name", "reserved"),
        ({"resource_name": "Example.com/shared"}, "resource_name", "lowercase DNS subdomain"),
        ({"resource_name": "example..com/shared"}, "resource_name", "lowercase DNS subdomain"),
        ({"resource_name": "example.com/"}, "resource_name", "the part after '/'"),
        ({"resource_name": "example.com/-x"}, "resource_name", "the part after '/'"),
        ({"resource_name": "example.com/a/b"}, "resource_name", "the part after '/'"),
        ({"resource_name": "example.com/" + "x" * 64}, "resource_name", "1-63 characters"),
        ({"resource_name": "a" * 241 + ".com/x"}, "resource_name", "at most 244"),
        ({"plugin_dir": "device-plugins"}, "plugin_dir", "must be an absolute path"),
        ({"plugin_dir": ""}, "plugin_dir", "must be an absolute path"),
        ({"plugin_dir": 3}, "plugin_dir", "must be a path string"),
        ({"plugin_dir": "/" + "d" * 100}, "plugin_dir", "longer than the 107 bytes"),
        ({"endpoint": ""}, "endpoint", "plain file name"),
        ({"endpoint": "../x.sock"}, "endpoint", "plain file name"),
        ({"endpoint": ".."}, "endpoint", "plain file name"),
        ({"endpoint": "kubelet.sock"}, "endpoint", "kubelet owns"),
        ({"endpoint": "kubelet_internal_checkpoint"}, "endpoint", "kubelet owns"),
        ({"endpoint": "x" * 80 + ".sock"}, "endpoint", "use a shorter directory or file name"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(table: dict[str, Any], key: str, fix: str) -> None:
    with pytest.raises(DevicePluginConfigError) as info:
        DevicePluginConfig.from_table(table)
    message = str(info.value)
    assert message.startswith(f"[device_plugin] {key} = "), message
    assert fix in message


@pytest.mark.parametrize(
    "name",
    [
        "workload.openshift.io/enable-shared-cpus",
        "example.com/x",
        "a.b-c.example/Shared_CPUs.v1",
        "example.com/" + "x" * 63,
        "a" * 240 + ".com/x",  # 244 characters of domain: "requests." + it is 253
    ],
)
def test_extended_resource_names_kubelet_accepts(name: str) -> None:
    assert DevicePluginConfig.from_table({"resource_name": name}).resource_name == name


def test_constructor_takes_strings_for_the_directory() -> None:
    config = DevicePluginConfig(plugin_dir="/run/dp")  # type: ignore[arg-type]
    assert config.plugin_dir == PurePosixPath("/run/dp")
    assert config == DevicePluginConfig.from_table({"plugin_dir": "/run/dp"})
