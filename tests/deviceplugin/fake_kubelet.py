"""A fake kubelet: the Registration server and device-manager client, and the PodResources API,
over real unix sockets.

It does what kubelet's device manager does, in the same order:

* ``start()``: delete every socket in the directory (kubelet's ``CleanupPluginDirectory``), then
  serve ``v1beta1.Registration`` on ``kubelet.sock``;
* ``Register``: check the version and the resource name, dial the plugin's endpoint in the same
  directory, drop an earlier connection for the same resource, ask ``GetDevicePluginOptions``, answer,
  then keep a ``ListAndWatch`` stream open in the background (or, told to ``hang``, never answer);
* ``allocate()``: call ``Allocate`` on the connected plugin, as kubelet does at container admission;
* ``stop()``: go away (streams end, ``kubelet.sock`` is removed as Go's listener does on close).

Given `pod_resources` (a socket path), it also serves ``v1.PodResourcesLister`` there (``List``, and
``Get`` unless `get_enabled` is false, when it answers as kubelet does with the feature gate off):
``admit()`` allocates a device to a pod's container through the plugin's ``Allocate`` and records
it, as kubelet's device manager does; ``forget()`` drops a pod (deleted). ``records.claim()`` records
a device a DRA driver prepared for a container (its ``dynamic_resources``, as kubelet's DRA manager
reports them).
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

from nri_plugin.api.deviceplugin.v1beta1 import api_pb2 as api
from nri_plugin.api.deviceplugin.v1beta1 import api_pb2_grpc as api_grpc
from nri_plugin.api.podresources.v1 import api_pb2 as podresources
from nri_plugin.api.podresources.v1 import api_pb2_grpc as podresources_grpc

KUBELET_SOCKET = "kubelet.sock"
# The test side's Allocate calls: against hangs only (a loaded 2-core CI machine took over 5 s).
ALLOCATE_TIMEOUT = 15.0


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
        pod_resources: Path | None = None,
        get_enabled: bool = True,
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
        self.records = PodResourcesRecord(pod_resources, get_enabled=get_enabled)

    async def start(self, *, cleanup: bool = True) -> FakeKubelet:
        self.plugin_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        if cleanup:
            remove_sockets(self.plugin_dir)
        self._server = grpc.aio.server()
        api_grpc.add_RegistrationServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix:{self.socket_path}")
        await self._server.start()
        await self.records.start()
        return self

    async def stop(self) -> None:
        for client in list(self.clients.values()):
            await client.disconnect()
        self.clients.clear()
        if self._server is not None:
            await self._server.stop(None)
            self._server = None
        await self.records.stop()

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
        stub = self.client(resource).stub
        response: api.AllocateResponse = await stub.Allocate(request, timeout=ALLOCATE_TIMEOUT)
        return response

    async def admit(
        self, resource: str, namespace: str, pod: str, container: str, device: str
    ) -> dict[str, str]:
        """Admit a container asking for 1 device: Allocate it on the plugin and record it in the
        pod-resources record; the annotations kubelet passes to the runtime."""
        response = await self.allocate(resource, [device])
        self.records.assign(namespace, pod, container, resource, device)
        [answer] = response.container_responses
        return dict(answer.annotations)

    def forget(self, namespace: str, pod: str) -> None:
        """The pod is gone from kubelet: its allocations with it."""
        self.records.forget(namespace, pod)

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


class PodResourcesRecord(podresources_grpc.PodResourcesListerServicer):
    """kubelet's pod-resources API: what it allocated to whom (``pods``), served on `socket_path`."""

    def __init__(self, socket_path: Path | None, *, get_enabled: bool = True) -> None:
        self.socket_path = socket_path
        self.get_enabled = get_enabled
        # (namespace, pod) -> container -> resource -> device ids
        self.pods: dict[tuple[str, str], dict[str, dict[str, list[str]]]] = {}
        # (namespace, pod) -> container -> its DRA claims, as kubelet reports them
        self.claims: dict[tuple[str, str], dict[str, list[podresources.DynamicResource]]] = {}
        self.calls: list[str] = []
        # Set: every Get is answered with this error instead (status code, details).
        self.get_error: tuple[grpc.StatusCode, str] | None = None
        self._server: grpc.aio.Server | None = None

    def run(self, namespace: str, pod: str, *containers: str) -> None:
        """kubelet runs this pod (its containers listed, with no devices unless assigned)."""
        entries = self.pods.setdefault((namespace, pod), {})
        for container in containers:
            entries.setdefault(container, {})

    def assign(self, namespace: str, pod: str, container: str, resource: str, device: str) -> None:
        containers = self.pods.setdefault((namespace, pod), {})
        containers.setdefault(container, {}).setdefault(resource, []).append(device)

    def claim(
        self,
        namespace: str,
        pod: str,
        container: str,
        claim: str,
        driver: str,
        device: str,
        *,
        pool: str = "node-1",
        cdi_devices: tuple[str, ...] = (),
    ) -> None:
        """A DRA driver prepared `device` (of `pool`) for the container through the claim `claim`
        (a ResourceClaim of the pod's namespace), with the CDI devices it returned."""
        self.run(namespace, pod, container)
        claims = self.claims.setdefault((namespace, pod), {}).setdefault(container, [])
        entry = next((c for c in claims if c.claim_name == claim), None)
        if entry is None:
            entry = podresources.DynamicResource(claim_name=claim, claim_namespace=namespace)
            claims.append(entry)
        resource = entry.claim_resources.add(driver_name=driver, pool_name=pool, device_name=device)
        for name in cdi_devices:
            resource.cdi_devices.add(name=name)

    def forget(self, namespace: str, pod: str) -> None:
        """The pod is gone from kubelet: its allocations with it."""
        self.pods.pop((namespace, pod), None)
        self.claims.pop((namespace, pod), None)

    def crowd(self, pods: int = 110, containers: int = 10, devices: int = 72) -> None:
        """A full node: `pods` pods (kubelet's default maxPods) of `containers` containers, each
        holding `devices` devices of another resource, with long ids: a List answer over gRPC's
        4 MB default."""
        for pod in range(pods):
            for container in range(containers):
                for device in range(devices):
                    self.assign(
                        "crowd",
                        f"pod-{pod}",
                        f"c{container}",
                        "example.com/vf",
                        f"vf-{device:04d}-" + "x" * 48,
                    )

    async def start(self) -> None:
        if self.socket_path is None:
            return
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()  # a new kubelet re-creates its socket
        self._server = grpc.aio.server()
        podresources_grpc.add_PodResourcesListerServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix:{self.socket_path}")
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
            self._server = None

    def _pod(self, namespace: str, pod: str) -> podresources.PodResources:
        message = podresources.PodResources(name=pod, namespace=namespace)
        for container, resources in self.pods.get((namespace, pod), {}).items():
            entry = message.containers.add(name=container, cpu_ids=[2, 3])
            for resource, ids in resources.items():
                entry.devices.add(resource_name=resource, device_ids=ids)
            entry.dynamic_resources.extend(self.claims.get((namespace, pod), {}).get(container, []))
        return message

    async def List(
        self, request: podresources.ListPodResourcesRequest, context: Any
    ) -> podresources.ListPodResourcesResponse:
        self.calls.append("List")
        return podresources.ListPodResourcesResponse(
            pod_resources=[self._pod(namespace, pod) for namespace, pod in self.pods]
        )

    async def Get(
        self, request: podresources.GetPodResourcesRequest, context: Any
    ) -> podresources.GetPodResourcesResponse:
        self.calls.append("Get")
        if self.get_error is not None:
            await context.abort(*self.get_error)
        if not self.get_enabled:
            await context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        key = (request.pod_namespace, request.pod_name)
        if key not in self.pods:
            missing = f"pod {request.pod_name} in namespace {request.pod_namespace} not found"
            await context.abort(grpc.StatusCode.UNKNOWN, missing)
        return podresources.GetPodResourcesResponse(pod_resources=self._pod(*key))
