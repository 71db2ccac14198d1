"""The mixed-CPU domain: who gets the shared CPUs, and keeping pod quotas right.

* ``policy``: pure functions from (shared CPUs, pod, container) to a verdict and an adjustment; no I/O.
* ``state``: the books (which container holds a share of which pod) and their state file.
* ``plugin``: `MixedCpuPlugin`, the NRI handlers that apply the policy to pod cgroups and the books.

Knows NRI's message types but not its transport. This ``__init__`` imports nothing.
"""
