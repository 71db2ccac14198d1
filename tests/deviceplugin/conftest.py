from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path, PurePosixPath

import pytest
import pytest_asyncio
from fake_kubelet import FakeKubelet

from nri_plugin.deviceplugin.config import DevicePluginConfig
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key
from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.deviceplugin.server import DevicePluginServer


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes and pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def key(tmp_path: Path) -> HostKey:
    return load_or_create_host_key(tmp_path / "state")


@pytest.fixture
def config(plugin_dir: Path) -> DevicePluginConfig:
    return DevicePluginConfig(plugin_dir=PurePosixPath(plugin_dir))


@pytest_asyncio.fixture
async def kubelet(plugin_dir: Path) -> AsyncIterator[FakeKubelet]:
    fake = await FakeKubelet(plugin_dir).start()
    yield fake
    await fake.stop()


@pytest_asyncio.fixture
async def plugin(config: DevicePluginConfig, key: HostKey) -> AsyncIterator[DevicePluginServer]:
    async with DevicePluginServer(config, key) as server:
        yield server
