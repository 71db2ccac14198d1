"""``check``'s one line about kubelet's PodResources API (issue #13): a warning when the NRI side would
fall back to the allocation marker alone, nothing when kubelet's record can prove requests."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from mixedcpu_support import write_daemon_config
from redteam_support import short_directory

from nri_plugin.daemon.check import Status, check_pod_resources, run_checks
from nri_plugin.daemon.config import load_config


def _config(root: Path, line: str) -> Path:
    return write_daemon_config(root, root / "dp", device_plugin_extra=line)


def test_a_socket_there_says_nothing() -> None:
    with short_directory("chk-") as root:
        path = root / "pr" / "kubelet.sock"
        path.parent.mkdir()
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        try:
            config = load_config(_config(root, f'pod_resources_socket = "{path}"\n'), check=False)
            assert check_pod_resources(config) is None
            report = run_checks(str(root / "config.toml"))
            assert not [f for f in report.findings if f.topic == "pod-resources API"]
        finally:
            server.close()


@pytest.mark.parametrize(
    ("line", "detail", "fix"),
    [
        (
            'pod_resources_socket = "{root}/pr/kubelet.sock"\n',
            "{root}/pr/kubelet.sock does not exist: the allocation marker alone proves requests for "
            "shared CPUs",
            "mount kubelet's pod-resources directory (the directory, not the socket) and point "
            "[device_plugin] pod_resources_socket at the socket in it",
        ),
        (
            'pod_resources_socket = ""\n',
            '[device_plugin] pod_resources_socket = "": the allocation marker alone proves requests for '
            "shared CPUs",
            'set pod_resources_socket to kubelet\'s socket, "/var/lib/kubelet/pod-resources/kubelet.sock"',
        ),
    ],
    ids=["absent", "not-asked"],
)
def test_the_fallback_is_one_warning(line: str, detail: str, fix: str) -> None:
    with short_directory("chk-") as root:
        _config(root, line.format(root=root))
        report = run_checks(str(root / "config.toml"))
        [finding] = [f for f in report.findings if f.topic == "pod-resources API"]
        assert finding.status is Status.WARN
        assert finding.detail == detail.format(root=root)
        assert finding.fix == fix
        assert report.count(Status.FAIL) == 0 or all(
            f.topic != "pod-resources API" for f in report.findings if f.status is Status.FAIL
        )


def test_nothing_to_say_when_markers_are_not_in_use() -> None:
    with short_directory("chk-") as root:
        config = write_daemon_config(
            root,
            root / "dp",
            extra="[trusted_sources]\ndevice_plugin_marker = false\npod_annotation = true\n",
        )
        assert check_pod_resources(load_config(config, check=False)) is None
