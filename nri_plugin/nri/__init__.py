"""NRI, the plugin side and a runtime simulator: nothing of any policy lives here.

* ``events``: NRI's event numbers, the subscription mask, what each runtime version accepts.
* ``handlers``: the seam, one `Protocol` per request a plugin handles; ``errors``: how it refuses one.
* ``routes``: the one table of the Plugin service's methods (event, handler, label, types), from
  which the stub, the simulator and the metrics labels are derived.
* ``identity``: the plugin name and index rules, and the default socket.
* ``connection``: the named states of the stub's connection and the moves between them.
* ``mux``: NRI's connection multiplexer (a sans-I/O codec and the asyncio trunk over one socket).
* ``stub``: connects, registers, configures, synchronizes, serves events and reconnects, calling a
  plugin's handlers through the routes; the plugin is plugged in from outside.
* ``simulator``: the runtime side, as containerd and CRI-O behave, for tests, benchmarks and the demo.

Built on `nri_plugin.ttrpc`. This ``__init__`` imports nothing.
"""
