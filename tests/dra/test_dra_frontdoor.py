"""`DraFrontDoor`: the kubelet plugin and the ResourceSlice publisher started and closed as one.

The publisher retries every failure (tests/dra/test_dra_apiserver.py), one it does not know too: that
is a bug, said with its traceback, and retried; the kubelet plugin goes on serving meanwhile."""

from __future__ import annotations

import os
from pathlib import PurePosixPath

import pytest
from redteam_support import short_directory
from structlog.testing import capture_logs
from wait_support import wait_until

from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.dra.config import DraConfig
from nri_plugin.dra.frontdoor import DraFrontDoor

pytestmark = pytest.mark.asyncio


class _Broken:
    """An API client whose every call fails in a way no API client fails: a bug's stand-in."""

    def __getattr__(self, name: str) -> object:
        raise RuntimeError(f"bug: {name}")


async def test_a_publisher_bug_is_logged_retried_and_the_kubelet_plugin_serves_on() -> None:
    with short_directory("door-") as root:
        for name in ("reg", "plugins"):
            (root / name).mkdir()
        config = DraConfig(
            enabled=True,
            registry_dir=PurePosixPath(root / "reg"),
            plugins_dir=PurePosixPath(root / "plugins"),
            cdi_dir=PurePosixPath(root / "cdi"),
            node_name="node-1",
        )
        door = DraFrontDoor(
            config,
            HostKey(os.urandom(32)),
            node_name="node-1",
            device_count=4,
            make_api_client=_Broken,  # type: ignore[arg-type]
        )
        assert door.publisher is not None
        publisher = door.publisher
        with capture_logs() as logs:
            await door.start()
            try:
                await wait_until(lambda: publisher.failures >= 2, what="the bug retried")
                assert door.published is False
                assert door.kubelet_plugin.serving
                assert (root / "reg" / f"{config.driver_name}-reg.sock").exists()
            finally:
                await door.close()
        failed = [
            entry for entry in logs if entry["event"] == "publishing the ResourceSlices failed, retrying"
        ]
        assert failed[0]["log_level"] == "warning"
        assert failed[0]["error"].startswith("unexpected failure publishing: RuntimeError: bug:")
        assert isinstance(failed[0]["exc_info"], RuntimeError)  # the traceback, once per streak
        assert all(entry["log_level"] == "debug" for entry in failed[1:])
        assert not [entry for entry in logs if entry["log_level"] == "error"]  # it did not stop
        assert not (root / "reg" / f"{config.driver_name}-reg.sock").exists()
