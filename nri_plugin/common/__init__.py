"""Small building blocks any layer may use; nothing here knows NRI, cgroups or the policy.

* ``clock``: time passed in (`LoopClock`, and `ManualClock` for tests on virtual time).
* ``backoff``: the one retry pacing, exponential with jitter.
* ``atomicfile``: publish a whole file atomically and durably.
* ``heap``: gives glibc's free heap back to the system after a large message.
* ``smallfile``: open and read a small file whose path may hold a link, a FIFO or a huge file.
* ``unixsocket``: serve a unix socket at a fixed path, mode 0600 from its first instant, no umask.
* ``text``: a peer's string capped and its control characters escaped before it is kept or logged.

This ``__init__`` imports nothing.
"""
