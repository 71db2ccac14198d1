"""The mixed-CPU domain: who gets the shared CPUs, and keeping pod quotas right.

* ``policy``: pure functions from (shared CPUs, pod, container) to a verdict and an adjustment; no I/O.
* ``books``: the books (which container holds a share of which pod, device bindings); immutable
  records, pure operations, no I/O.
* ``store``: the books' SQLite database (``legacy``: the JSON books of earlier versions, read once);
  ``bookkeeper``: what changed, written in one transaction per event.
* ``quota``: the pod-quota reconciler: pod cgroups brought to the books' targets, undone on failure,
  refused lowerings retried on the clock.
* ``resync``: Synchronize's rebuilding of the books from what the runtime runs.
* ``plugin``: `MixedCpuPlugin`, the NRI handlers: decide with the policy, delegate the rest.
* ``logfields``: the logger name and log fields every module here shares.

Knows NRI's message types and refusals (`nri_plugin.nri.errors`) but not its transport, and nothing
of the daemon. This ``__init__`` imports nothing.
"""
