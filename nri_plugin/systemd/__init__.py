"""systemd, spoken to over D-Bus on the system bus: the project's one D-Bus client.

* ``bus``: connecting to a bus and calling a method on it (dbus-fast, asyncio), with bounded waits;
  a blocking ``restart_unit`` for the ``enable-nri`` init command.
* ``units``: which pod cgroups are systemd units, and the unit properties that set a CFS limit.
* ``podquota``: `SystemdPodQuotaWriter`, the pod quota writer the daemon hands the mixed-CPU plugin:
  a pod cgroup that is a systemd unit gets its limit through systemd (which re-applies it at every
  ``daemon-reload``), and its cgroup file only when no bus is reachable; it owns the files and
  their read-back.
* ``sender``: `QuotaSender`, the writer's bus side: one connection, one call per unit in order,
  rests after slow calls, each answer reported.

Knows cgroups (the fallback writes, the read-backs) and the common building blocks, nothing of NRI
or of the policy. This ``__init__`` imports nothing.
"""
