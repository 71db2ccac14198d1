"""ttrpc for Python, knowing nothing about NRI.

* ``errors``: status codes and the two error families (RPC outcomes, protocol violations).
* ``buffer``: the receive buffer and the ``NEED_DATA`` sentinel of the sans-I/O decoders.
* ``protocol``: sans-I/O framing and the per-connection rules of both roles.
* ``aio``: the asyncio `Server` and `Client` over a channel, and plain unix sockets.

Import from the submodules. This ``__init__`` imports nothing, so that loading the sans-I/O parts
does not load asyncio or socket.
"""
