"""The DRA front door as one of the daemon's services: the kubelet plugin and the ResourceSlices.

:class:`DraFrontDoor` puts together, from the ``[dra]`` table, the node's name and the device count
(``[device_plugin] device_count``: one number for both doors):

* the kubelet plugin (:mod:`.kubeletplugin`), which registers with kubelet and prepares claims,
  reading each claim's allocation from the API server (:class:`.apiserver.ApiClaimSource`);
* unless ``publish_resource_slices = false``, the ResourceSlice publisher
  (:class:`.apiserver.ResourceSlicePublisher`), which runs in the background, retries until the
  API server holds the node's pool, and keeps it there: it watches the slices, publishes them again
  when kubelet (at its start, or after the driver was unusable) or anyone else deletes or changes
  them, and checks them at every registration kubelet reports.

Both share one API client, made at the first call that needs it: missing credentials are a logged,
retried failure of the publisher and an error kubelet shows for a prepare, never a crash at start
(``check`` says so beforehand).

``start()`` raises :class:`.kubeletplugin.DraPluginError` when a socket cannot be served;
``close()`` stops the publisher, takes the sockets down and closes the client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
from lightkube import AsyncClient

from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.dra import slices
from nri_plugin.dra.apiserver import ApiClaimSource, LazyClient, ResourceSlicePublisher, make_client
from nri_plugin.dra.config import DraConfig
from nri_plugin.dra.kubeletplugin import DraKubeletPlugin, DraPluginSettings

__all__ = ["DraFrontDoor"]

log = structlog.get_logger("nri_plugin.dra")


class DraFrontDoor:
    """The DRA kubelet plugin and (optionally) the ResourceSlice publisher, started and closed as one."""

    def __init__(
        self,
        config: DraConfig,
        key: HostKey,
        *,
        node_name: str,
        device_count: int,
        make_api_client: Callable[[], AsyncClient] | None = None,
    ) -> None:
        self.config = config
        self.node_name = node_name
        self._client = LazyClient(make_api_client or (lambda: make_client(config.kubeconfig)))
        settings = DraPluginSettings(
            driver_name=config.driver_name,
            registry_dir=config.registry_dir,
            plugins_dir=config.plugins_dir,
            cdi_dir=config.cdi_dir,
            pool_name=node_name,
            device_names=slices.device_names(device_count),
        )
        claims = ApiClaimSource(client=self._client, driver=config.driver_name)
        self.kubelet_plugin = DraKubeletPlugin(settings, key, claims)
        self.publisher: ResourceSlicePublisher | None = None
        if config.publish_resource_slices:
            self.publisher = ResourceSlicePublisher(
                client=self._client, driver=config.driver_name, node_name=node_name, device_count=device_count
            )
            # A (re)registration often follows a kubelet start, which wipes the node's slices: look.
            self.kubelet_plugin.on_registered = self.publisher.check
        self._publishing: asyncio.Task[None] | None = None

    @property
    def registered(self) -> bool:
        """Whether kubelet holds our registration (readiness)."""
        return self.kubelet_plugin.registered

    @property
    def published(self) -> bool | None:
        """Whether the API server holds the node's ResourceSlices; None when we do not publish them."""
        return None if self.publisher is None else self.publisher.published

    async def start(self) -> None:
        await self.kubelet_plugin.start()
        if self.publisher is not None:
            self._publishing = asyncio.create_task(self.publisher.run(), name="dra-resource-slices")
            self._publishing.add_done_callback(_say_if_failed)
        log.info(
            "DRA front door serving",
            driver=self.config.driver_name,
            node=self.node_name,
            registration_socket=str(self.kubelet_plugin.registration_socket),
            endpoint=str(self.kubelet_plugin.endpoint),
            cdi_dir=str(self.config.cdi_dir),
            publishes_resource_slices=self.publisher is not None,
        )

    async def close(self) -> None:
        task, self._publishing = self._publishing, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])  # a failure of its own was logged when it ended
        await self.kubelet_plugin.close()
        await self._client.close()


def _say_if_failed(task: asyncio.Task[None]) -> None:
    """The publisher retries every failure of a round or a watch; should it still end, that is a bug:
    said, not swallowed (the kubelet plugin goes on serving, and the gauge and ``status`` show it)."""
    if not task.cancelled() and task.exception() is not None:
        log.error(
            "the ResourceSlice publisher stopped on an unexpected error; restart the daemon to publish again",
            exc_info=task.exception(),
        )
