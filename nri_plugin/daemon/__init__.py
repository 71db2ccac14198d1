"""The daemon: command line, configuration, wiring, logs, metrics and probes, `check` and `demo`.

The only package that knows every other one: it builds the NRI stub, the mixed-CPU plugin and the
device plugin from the configuration and runs them on one asyncio loop. This ``__init__`` imports
nothing.
"""
