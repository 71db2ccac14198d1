"""`DraFrontDoor`: the kubelet plugin and the ResourceSlice publisher started and closed as one.

The publisher retries every failure it knows (tests/dra/test_dra_apiserver.py); one it does not know
is a bug, and the front door must say so rather than let the task die unnoticed, while the kubelet
plugin goes on serving."""

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


async def test_a_publisher_bug_is_logged_and_the_kubelet_plugin_serves_on() -> None:
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
        with capture_logs() as logs:
            await door.start()
            try:
                await wait_until(
                    lambda: any(entry["log_level"] == "error" for entry in logs), what="the error line"
                )
                assert door.published is False
                assert door.kubelet_plugin.serving
                assert (root / "reg" / f"{config.driver_name}-reg.sock").exists()
            finally:
                await door.close()
        [error] = [entry for entry in logs if entry["log_level"] == "error"]
        assert "the ResourceSlice publisher stopped on an unexpected error" in error["event"]
        assert "restart the daemon" in error["event"]
        assert not (root / "reg" / f"{config.driver_name}-reg.sock").exists()
