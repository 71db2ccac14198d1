"""The DRA front door: shared CPUs asked for through Dynamic Resource Allocation (``resource.k8s.io/v1``).

Beside the device plugin (`nri_plugin.deviceplugin`), and ending in the same place: a container
carrying our signed allocation marker, which the NRI side proves against kubelet's PodResources record
(its ``dynamic_resources``) or, when kubelet cannot be asked, against the marker's binding.

* ``config``: the ``[dra]`` table (off by default).
* ``claims``: what a prepare needs to know of a ResourceClaim (its allocated devices of our driver),
  as a protocol; the API-server implementation lives in ``apiserver``.
* ``cdi``: the CDI spec written for a prepared claim (its container edits set the marker variable).
* ``kubeletplugin``: registration through kubelet's plugin watcher and the ``dra.v1`` service.
* ``slices``: the ResourceSlice (and DeviceClass) objects; ``apiserver`` publishes them.

This ``__init__`` imports nothing: import what you need from the submodule that defines it.
"""
