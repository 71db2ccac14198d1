"""Stands in for qemu-system-x86_64 in test_vm_support.py, on the host, without a VM.

It connects to the agent's socket named in its arguments (``-chardev socket,id=agent,path=...``), as
QEMU does, and serves it with the guest agent's own loop (`guest_agent.serve`: the ready line, the
commands, the poweroff), so `Vm` is exercised end to end with no kernel. ``FAKE_QEMU`` picks another
behaviour: ``exit`` (exit 3 at once, as a QEMU refusing its arguments), ``silent`` (connect, then say
nothing), ``hang`` (serve, but ignore the poweroff: only a kill ends it).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

from vm.guest_agent import serve


def agent_socket(argv: list[str]) -> str:
    for arg in argv:
        if arg.startswith("socket,id=agent,"):
            return dict(item.split("=", 1) for item in arg.split(",")[1:])["path"]
    raise SystemExit("fake qemu: no agent socket in the arguments")


def main(argv: list[str]) -> int:
    behaviour = os.environ.get("FAKE_QEMU", "serve")
    if behaviour == "exit":
        print("fake qemu: refusing to start", file=sys.stderr)
        return 3
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(agent_socket(argv))
        if behaviour == "silent":
            time.sleep(600)
            return 0
        with conn.makefile("rwb", buffering=0) as port:
            serve(port)  # type: ignore[arg-type]
    if behaviour == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
