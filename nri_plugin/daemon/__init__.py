"""The daemon: command line, configuration, wiring, lifecycle, logs, metrics and probes, `check`,
`demo`, and `enable-nri` (its D-Bus call through `nri_plugin.systemd.bus`).

The only package that knows every other one. ``wiring`` builds the NRI stub, the mixed-CPU plugin,
the device plugin, the metrics and the probe server from the configuration, each in one function;
``app`` (`Daemon`) runs them on one asyncio loop and owns start, signals, shutdown and the exit
status; ``cli`` parses the arguments and prints failures. This ``__init__`` imports nothing.
"""
