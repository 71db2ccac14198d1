"""A fake kubelet: the Registration server and device-manager client, over real unix sockets.

It does what kubelet's device manager does, in the same order:

* ``start()``: delete every socket in the directory (kubelet's ``CleanupPluginDirectory``), then
  serve ``v1beta1.Registration`` on ``kubelet.sock``;
* ``Register``: check the version and the resource name, dial the plugin's endpoint in the same
  directory, drop an earlier connection for the same resource, ask ``GetDevicePluginOptions``, answer,
  then keep a ``ListAndWatch`` stream open in the background (or, told to ``hang``, never answer);
* ``allocate()``: call ``Allocate`` on the connected plugin, as kubelet does at container admission;
* ``stop()``: go away (streams end, ``kubelet.sock`` is removed as Go's listener does on close).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from api.deviceplugin.v1beta1 import api_pb2 as api
from api.deviceplugin.v1beta1 import api_pb2_grpc as api_grpc

KUBELET_SOCKET = "kubelet.sock"


@dataclass
class PluginClient:
    """Kubelet's connection to one registered plugin."""

    resource: str
    endpoint: str
    channel: grpc.aio.Channel
    stub: Any  # api_grpc.DevicePluginAsyncStub
    options: api.DevicePluginOptions
    stream: asyncio.Task[None] | None = None
    device_lists: list[list[str]] = field(default_factory=list)
    health: dict[str, str] = field(default_factory=dict)

    async def disconnect(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.stream
        await self.channel.close()


class FakeKubelet(api_grpc.RegistrationServicer):
    def __init__(
        self,
        plugin_dir: Path,
        *,
        reject: str | None = None,
        drop_streams: bool = False,
        hang: bool = False,
    ) -> None:
        self.plugin_dir = plugin_dir
        self.socket_path = plugin_dir / KUBELET_SOCKET
        self.reject = reject  # answer Register with this error instead of accepting
        self.drop_streams = drop_streams  # end each ListAndWatch after its first message
        self.hang = hang  # never answer Register (a wedged kubelet); the call ends when the caller gives up
        self.registrations: list[api.RegisterRequest] = []
        self.attempts = 0
        self.clients: dict[str, PluginClient] = {}
        self.registered = asyncio.Event()
        self.lists_received = asyncio.Condition()
        self._server: grpc.aio.Server | None = None

    async def start(self, *, cleanup: bool = True) -> FakeKubelet:
        self.plugin_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        if cleanup:
            remove_sockets(self.plugin_dir)
        self._server = grpc.aio.server()
        api_grpc.add_RegistrationServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix:{self.socket_path}")
        await self._server.start()
        return self

    async def stop(self) -> None:
        for client in list(self.clients.values()):
            await client.disconnect()
        self.clients.clear()
        if self._server is not None:
            await self._server.stop(None)
            self._server = None

    # -- Registration service -----------------------------------------------------------------------

    async def Register(self, request: api.RegisterRequest, context: Any) -> api.Empty:
        self.attempts += 1
        if self.hang:
            await asyncio.Event().wait()
        if self.reject is not None:
            await context.abort(grpc.StatusCode.UNKNOWN, self.reject)
        if request.version != "v1beta1":
            await context.abort(grpc.StatusCode.UNKNOWN, f"unsupported version {request.version!r}")
        if "/" not in request.resource_name:
            await context.abort(grpc.StatusCode.UNKNOWN, f"invalid resource name {request.resource_name!r}")
        old = self.clients.pop(request.resource_name, None)
        if old is not None:
            await old.disconnect()
        channel = grpc.aio.insecure_channel(f"unix:{self.plugin_dir / request.endpoint}")
        stub = api_grpc.DevicePluginStub(channel)
        try:
            options = await stub.GetDevicePluginOptions(api.Empty(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            await channel.close()
            await context.abort(grpc.StatusCode.UNKNOWN, f"cannot connect to the plugin: {exc.details()}")
        client = PluginClient(request.resource_name, request.endpoint, channel, stub, options)
        self.clients[request.resource_name] = client
        client.stream = asyncio.create_task(self._list_and_watch(client))
        self.registrations.append(request)
        self.registered.set()
        return api.Empty()

    async def _list_and_watch(self, client: PluginClient) -> None:
        call = client.stub.ListAndWatch(api.Empty())
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for response in call:
                async with self.lists_received:
                    client.device_lists.append([d.ID for d in response.devices])
                    client.health = {d.ID: d.health for d in response.devices}
                    self.lists_received.notify_all()
                if self.drop_streams:
                    call.cancel()
                    break

    # -- what the tests drive -----------------------------------------------------------------------

    def client(self, resource: str) -> PluginClient:
        return self.clients[resource]

    async def wait_lists(self, resource: str, count: int) -> list[list[str]]:
        """Wait until ``count`` device lists arrived from ``resource``'s ListAndWatch; return them."""
        async with self.lists_received:
            await self.lists_received.wait_for(
                lambda: resource in self.clients and len(self.clients[resource].device_lists) >= count
            )
            return self.clients[resource].device_lists

    async def allocate(self, resource: str, *containers: list[str]) -> api.AllocateResponse:
        request = api.AllocateRequest()
        for ids in containers:
            request.container_requests.add(devices_ids=ids)
        response: api.AllocateResponse = await self.client(resource).stub.Allocate(request, timeout=5)
        return response

    async def drop_stream(self, resource: str) -> None:
        """End the ListAndWatch stream of ``resource`` and forget the plugin, keeping kubelet.sock."""
        client = self.clients.pop(resource)
        self.registered.clear()
        await client.disconnect()


def remove_sockets(directory: Path) -> None:
    """Delete every socket in ``directory``, as a starting kubelet does."""
    for entry in directory.iterdir():
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(entry).st_mode):
                entry.unlink()
