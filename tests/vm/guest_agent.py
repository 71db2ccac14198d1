"""The test VM's agent: runs in the guest, serves the host's requests on the virtio port ``agent``.

Started by the guest's init (busybox mode) or by a systemd unit (systemd mode), with the host's python
seen through the 9p root; it needs nothing but the standard library. One JSON object per line each way:

* guest → host, once at start: ``{"ready": {"kernel": ..., "uptime": ..., "mode": ...}}``;
* host → guest: ``{"argv": [...], "timeout": s, "env": {...}, "cwd": "..."}``, answered with
  ``{"returncode": n | null, "stdout": "...", "stderr": "...", "seconds": s, "timed_out": bool}``
  (a command past its timeout is killed with its whole process group; ``returncode`` is then null);
* host → guest: ``{"poweroff": true}``, answered with ``{"poweroff": true}``; then the VM powers off.

The port reads end of file when the host closes its side: the agent then powers the VM off too, so a
VM whose test session died does not linger.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, BinaryIO

PORT_NAME = "agent"
POWEROFF = ["/.vm/busybox", "poweroff", "-f"]


def find_port(name: str = PORT_NAME) -> str:
    """The device of the virtio port called `name` (virtio_console names them in sysfs)."""
    for entry in glob.glob("/sys/class/virtio-ports/vport*"):
        with open(os.path.join(entry, "name")) as handle:
            if handle.read().strip() == name:
                return os.path.join("/dev", os.path.basename(entry))
    raise SystemExit(f"guest agent: no virtio port named {name!r}")


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Run one command to its end (or its timeout); what it printed and how it ended."""
    started = time.monotonic()
    env = {**os.environ, **request.get("env", {})}
    proc = subprocess.Popen(
        request["argv"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=request.get("cwd") or "/",
        env=env,
        start_new_session=True,
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=request.get("timeout", 60))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return {
        "returncode": None if timed_out else proc.returncode,
        "stdout": out.decode(errors="replace"),
        "stderr": err.decode(errors="replace"),
        "seconds": round(time.monotonic() - started, 3),
        "timed_out": timed_out,
    }


def answer(port: BinaryIO, message: dict[str, Any]) -> None:
    port.write(json.dumps(message).encode() + b"\n")
    port.flush()


def serve(port: BinaryIO) -> None:
    """Answer requests until the host says power off or closes its side."""
    with open("/proc/uptime") as handle:
        uptime = handle.read().split()[0]
    answer(
        port,
        {
            "ready": {
                "kernel": os.uname().release,
                "uptime": float(uptime),
                "mode": os.environ.get("VM_MODE", ""),
            }
        },
    )
    while True:
        line = port.readline()
        if not line:
            return
        request = json.loads(line)
        if request.get("poweroff"):
            answer(port, {"poweroff": True})
            return
        try:
            reply = run(request)
        except OSError as exc:  # e.g. no such program: the host asserts on it like on any result
            reply = {
                "returncode": None,
                "stdout": "",
                "stderr": f"guest agent: {exc}",
                "seconds": 0.0,
                "timed_out": False,
            }
        answer(port, reply)


def main() -> None:
    fd = os.open(find_port(), os.O_RDWR)
    try:
        with os.fdopen(fd, "r+b", buffering=0) as port:
            serve(port)
    finally:
        os.sync()
        subprocess.run(POWEROFF, check=False)


if __name__ == "__main__":
    main()
    sys.exit(0)
