"""NRI, the plugin side and a runtime simulator: nothing of any policy lives here.

* ``events``: NRI's event numbers, the subscription mask, what each runtime version accepts.
* ``mux``: NRI's connection multiplexer (a sans-I/O codec and the asyncio trunk over one socket).
* ``stub``: connects, registers, configures, synchronizes, serves events and reconnects, calling a
  plugin's handlers; the plugin is plugged in from outside.
* ``simulator``: the runtime side, as containerd and CRI-O behave, for tests, benchmarks and the demo.

Built on `nri_plugin.ttrpc`. This ``__init__`` imports nothing.
"""
