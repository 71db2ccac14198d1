"""The seam between the stub and a plugin: one `Protocol` per NRI request a plugin may handle.

A plugin subclasses the protocols of the events it handles (``class MyPlugin(CreateContainer,
StopContainer)``), so mypy checks every handler's signature against NRI's; the stub subscribes to
exactly those events. All handlers are coroutines; ``api`` is ``api.nri.api_pb2``. A handler refuses a
request by raising one of `nri_plugin.nri.errors` (the stub turns it into a ttrpc status).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from nri_plugin.api.nri import api_pb2 as api

# -- the connection ----------------------------------------------------------------------------------


@runtime_checkable
class Configure(Protocol):
    async def configure(self, request: api.ConfigureRequest) -> None:
        """The runtime's name, version and NRI version; called once per connection, first."""


@runtime_checkable
class Synchronize(Protocol):
    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        """Everything the runtime runs (all chunks joined); the updates to apply to it."""


@runtime_checkable
class Shutdown(Protocol):
    async def shutdown(self) -> None:
        """The runtime is shutting the plugin down."""


# -- pods ---------------------------------------------------------------------------------------------


@runtime_checkable
class RunPodSandbox(Protocol):
    async def run_pod_sandbox(self, pod: api.PodSandbox) -> None: ...


@runtime_checkable
class StopPodSandbox(Protocol):
    async def stop_pod_sandbox(self, pod: api.PodSandbox) -> None: ...


@runtime_checkable
class RemovePodSandbox(Protocol):
    async def remove_pod_sandbox(self, pod: api.PodSandbox) -> None: ...


@runtime_checkable
class UpdatePodSandbox(Protocol):
    async def update_pod_sandbox(
        self, pod: api.PodSandbox, overhead: api.LinuxResources, resources: api.LinuxResources
    ) -> None: ...


@runtime_checkable
class PostUpdatePodSandbox(Protocol):
    async def post_update_pod_sandbox(self, pod: api.PodSandbox) -> None: ...


# -- containers ---------------------------------------------------------------------------------------


@runtime_checkable
class CreateContainer(Protocol):
    async def create_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> api.CreateContainerResponse | None:
        """The adjustment (and updates of other containers) to make; None changes nothing."""


@runtime_checkable
class PostCreateContainer(Protocol):
    async def post_create_container(self, pod: api.PodSandbox, container: api.Container) -> None: ...


@runtime_checkable
class StartContainer(Protocol):
    async def start_container(self, pod: api.PodSandbox, container: api.Container) -> None: ...


@runtime_checkable
class PostStartContainer(Protocol):
    async def post_start_container(self, pod: api.PodSandbox, container: api.Container) -> None: ...


@runtime_checkable
class UpdateContainer(Protocol):
    async def update_container(
        self, pod: api.PodSandbox, container: api.Container, resources: api.LinuxResources
    ) -> Sequence[api.ContainerUpdate]:
        """The updates to make instead of (or beside) the requested `resources`."""


@runtime_checkable
class PostUpdateContainer(Protocol):
    async def post_update_container(self, pod: api.PodSandbox, container: api.Container) -> None: ...


@runtime_checkable
class StopContainer(Protocol):
    async def stop_container(
        self, pod: api.PodSandbox, container: api.Container
    ) -> Sequence[api.ContainerUpdate]: ...


@runtime_checkable
class RemoveContainer(Protocol):
    async def remove_container(self, pod: api.PodSandbox, container: api.Container) -> None: ...


@runtime_checkable
class ValidateContainerAdjustment(Protocol):
    async def validate_container_adjustment(
        self, request: api.ValidateContainerAdjustmentRequest
    ) -> str | None:
        """A reason rejects the adjustment; None accepts it."""
