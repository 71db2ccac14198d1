"""Kubernetes device plugin for the shared-CPUs resource, run in the daemon's asyncio loop.

A pod asks for shared CPUs with ``resources.requests`` (and ``limits``)
``{"workload.openshift.io/enable-shared-cpus": 1}`` per container. This package makes kubelet count
that resource and proves each real request to the NRI side:

* :class:`DevicePluginConfig` (``config``): the ``[device_plugin]`` table, frozen and validated;
  ``DevicePluginConfig.from_table(mapping)`` raises :class:`DevicePluginConfigError` naming the key and
  the fix. ``enabled = false`` for clusters whose kubelet advertises the resource itself.
* :class:`HostKey` (``marker``, pure): the node's 32-byte marker secret. ``key.sign(device_id) -> str``
  makes the value of the :data:`ANNOTATION_KEY` container annotation for a new allocation (numbered
  above every earlier one); ``key.read(value) -> Signed | None`` (constant-time: the device id, the
  allocation number, the pods a DRA marker is good in), ``key.verify(value) -> device_id | None`` and
  ``key.verify_annotations(annotations)`` check one.
* ``load_or_create_host_key(state_dir)`` (``keyfile``): the key from its file ``device-plugin-hmac.key``
  (mode 0600, created once, stable across restarts; a file with the wrong owner, mode or size raises
  :class:`HostKeyError`).
* :class:`DevicePluginServer` (``server``): ``async with DevicePluginServer(config, key) as plugin``
  serves ``v1beta1.DevicePlugin`` on ``plugin_dir/endpoint`` (0600), registers with kubelet, re-creates
  the socket and registers again after kubelet restarts, and pushes a new device count on
  ``plugin.reconfigure(config)``. ``plugin.registered``, ``plugin.open_streams`` and
  ``await plugin.wait_registered()`` are for readiness; ``plugin.state`` says where the registration
  stands (:class:`RegistrationState`, ``registration``: the states and the moves allowed between
  them). Its waits run on the `Clock` it is given, its retries on a `Backoff`.

What the NRI side does with a container's marker (the policy's part, `nri_plugin.mixedcpu.policy.
check_request`): a marker is a bearer token, so where kubelet's PodResources API can be asked
(``podresources``: :class:`PodResourcesClient`) the marker only triggers the question, and the
device ids kubelet's record gives that pod's container are the proof; a marker on a container
kubelet gave none is refused. Only when kubelet does not answer is the marker itself the proof:
refused when it does not read (absent, unsigned or forged), and when another container presented
the same or a newer allocation of its device id first (a replayed marker), whether that container
still runs or not. Kubelet gives one device to one container of one pod at a time, and a new
allocation only once the previous holder is gone, so kubelet's newest allocation of a device wins
and one allocation presented by two containers is never legitimate.

This ``__init__`` imports nothing: ``marker`` and ``config`` are light and pure enough for the policy
to use without loading grpc or touching a file; import what you need from the submodule that defines
it.
"""
