"""mixed-cpu-nri-plugin: give containers with exclusive CPUs a node-wide pool of shared CPUs, through NRI."""

__version__ = "0.3.0"
