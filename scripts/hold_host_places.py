#!/usr/bin/env python3
"""Hold what a daemon serving this machine's runtime holds, until SIGTERM: .ci/run runs the test
suite under it, so a test that takes the host's node lock or binds the default metrics port fails.

Usage: python3 scripts/hold_host_places.py LOCK_FILE HOST:PORT READY_FILE

Takes ``flock(LOCK_EX)`` on LOCK_FILE (created, with its directory, if missing) and writes a pid and
a line saying who holds it, as the daemon does; binds and listens on HOST:PORT; then writes
READY_FILE and waits. A lock or port some other process holds already is as good (a real daemon
on a developer's machine): that is said on stderr and the rest is still held.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import sys
from pathlib import Path


def hold_lock(path: Path) -> int | None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        print(f"note: {path} is held by another process already", file=sys.stderr)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n.ci/run (held while the test suite runs)\n".encode())
    return fd


def hold_port(address: str) -> socket.socket | None:
    host, _, port = address.rpartition(":")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, int(port)))
    except OSError as exc:
        sock.close()
        if exc.errno != errno.EADDRINUSE:
            raise
        print(f"note: {address} is bound by another process already", file=sys.stderr)
        return None
    sock.listen()
    return sock


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    lock, address, ready = Path(argv[0]), argv[1], Path(argv[2])
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    held = (hold_lock(lock), hold_port(address))
    ready.write_text(f"{os.getpid()}\n")
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    del held
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
