"""The real-kernel VM tier: a stock Debian kernel under QEMU, and an agent in it running our commands.

Why a VM: the cgroup v2 kernel rules and systemd's handling of the cgroup files it owns cannot be
seen on the development machines (cgroup v1, a container). Why this shape (facts measured on these
machines, see the shared runtime observations): `/dev/kvm` here runs no stock kernel, so QEMU emulates
(``-accel tcg``); a Debian kernel boots that way in seconds when it needs no disk image: the host's
root is shared read-only over 9p, under a tmpfs overlay (the guest may write anywhere, the host sees
nothing of it), so the guest runs this very checkout with its venv's python.

Parts:

* `find_tools` / `require_tools`: QEMU, a static busybox and an unpacked ``linux-image-*`` package
  (``scripts/vm-setup.sh`` installs them, as ``.ci/run`` does). Missing tools skip the tier with the
  reason, except under ``CI=true``, where they fail it.
* `build_initramfs`: busybox, the 9p/virtio/overlay modules of that kernel (in dependency order),
  ``guest_init.sh`` as ``/init`` and its configuration; an uncompressed newc cpio archive.
* `Vm`: one QEMU process (ours alone: only it is ever killed), its serial console in a log file,
  and the agent (``guest_agent.py``) on a virtio serial port whose host end is a unix socket we
  listen on. `Vm.run` sends one command and returns its `Result`; every wait is bounded.

Two modes: ``busybox`` (busybox init, cgroup v2 mounted, ``+cpu +cpuset`` in the root's
``cgroup.subtree_control``) and ``systemd`` (systemd as PID 1, cgroup v2, D-Bus socket). Each test
module boots one VM (a module-scoped fixture) and runs all its checks in it.

Locally: ``sudo scripts/vm-setup.sh`` once, then ``pytest tests/vm``; ``pytest -m 'not vm'`` leaves
the tier out. A failed boot shows QEMU's output and the console's last lines.
"""

from __future__ import annotations

import contextlib
import json
import lzma
import os
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final, Literal, NoReturn

import pytest

Mode = Literal["busybox", "systemd"]

HERE: Final = Path(__file__).resolve().parent
ROOT: Final = HERE.parent.parent
KERNEL_DIR_ENV: Final = "MIXED_CPU_VM_KERNEL_DIR"
DEFAULT_KERNEL_DIR: Final = "mixed-cpu-nri-plugin/vm-kernel/current"
SETUP_HINT: Final = "scripts/vm-setup.sh installs what it needs (.ci/run runs it)"

# What the guest needs from the kernel's modules: the PCI transport, the serial port of the agent,
# 9p over virtio for the host's root, overlayfs above it. Their dependencies are read from the files.
MODULES: Final = ("virtio_pci", "virtio_console", "9pnet_virtio", "9p", "overlay")

# Bounds against hangs only. Measured here with the 2 cores shared: busybox mode boots (to the agent's
# first line) in 11-27 s, systemd mode in 19-51 s.
BOOT_TIMEOUT: Final = 180.0
POWEROFF_TIMEOUT: Final = 30.0
REPLY_MARGIN: Final = 30.0


class ToolsMissing(Exception):
    """What the tier needs and this machine lacks."""


@dataclass(frozen=True)
class Tools:
    """Where the tier's tools are: QEMU, a static busybox, a kernel image and its modules."""

    qemu: str
    busybox: str
    kernel: Path
    modules: Path  # lib/modules/<release> of the unpacked package

    @property
    def release(self) -> str:
        return self.modules.name


def in_ci(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get("CI", "").lower() == "true"


def kernel_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The unpacked kernel package: $MIXED_CPU_VM_KERNEL_DIR, or where scripts/vm-setup.sh puts it."""
    if environ.get(KERNEL_DIR_ENV):
        return Path(environ[KERNEL_DIR_ENV])
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME", "/root"), ".cache")
    return Path(cache, DEFAULT_KERNEL_DIR)


def is_static_elf(path: str) -> bool:
    """Whether `path` is an ELF executable with no program interpreter (runs without a libc).

    A dynamic busybox (Debian's ``busybox`` package) would not start in an initramfs holding no
    libraries; ``busybox-static``'s is what the guest needs."""
    with open(path, "rb") as handle:
        header = handle.read(64)
        if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2:  # 64-bit only
            return False
        order = "<" if header[5] == 1 else ">"
        (phoff,) = struct.unpack_from(order + "Q", header, 0x20)
        phentsize, phnum = struct.unpack_from(order + "HH", header, 0x36)
        handle.seek(phoff)
        table = handle.read(phentsize * phnum)
    pt_interp = 3
    return all(
        struct.unpack_from(order + "I", table, index * phentsize)[0] != pt_interp for index in range(phnum)
    )


def find_kernel(directory: Path) -> tuple[Path, Path]:
    """The kernel image and its modules directory in an unpacked ``linux-image-*`` package."""
    images = sorted(directory.glob("boot/vmlinuz-*"))
    if not images:
        raise ToolsMissing(f"no unpacked linux-image package in {directory} (no boot/vmlinuz-*)")
    image = images[-1]
    release = image.name.removeprefix("vmlinuz-")
    modules = directory / "lib" / "modules" / release
    if not (modules / "kernel").is_dir():
        raise ToolsMissing(f"{image} has no modules in {modules}")
    return image, modules


def find_tools(environ: Mapping[str, str] = os.environ) -> Tools:
    """The tier's tools, or `ToolsMissing` naming everything that is missing."""
    missing = []
    qemu = shutil.which("qemu-system-x86_64", path=environ.get("PATH"))
    if qemu is None:
        missing.append("no qemu-system-x86_64 on PATH (Debian: qemu-system-x86)")
    busybox = shutil.which("busybox", path=environ.get("PATH"))
    if busybox is None or not is_static_elf(busybox):
        missing.append("no static busybox on PATH (Debian: busybox-static)")
    try:
        image, modules = find_kernel(kernel_dir(environ))
    except ToolsMissing as exc:
        missing.append(str(exc))
    if missing:
        raise ToolsMissing("; ".join(missing))
    assert qemu is not None
    assert busybox is not None
    return Tools(qemu, busybox, image, modules)


def require_tools(environ: Mapping[str, str] = os.environ) -> Tools:
    """The tools; else the test skips with the reason, or fails under ``CI=true`` (CI installs them,
    so a missing tool there is a broken install step, not a machine without QEMU)."""
    try:
        return find_tools(environ)
    except ToolsMissing as exc:
        message = f"the VM tier cannot run: {exc}; {SETUP_HINT}"
        if in_ci(environ):
            pytest.fail(f"CI=true: {message}", pytrace=False)
        pytest.skip(message)


# -- kernel modules ----------------------------------------------------------------------------------


def module_name(filename: str) -> str:
    """A module's name from its file's name: ``9pnet_virtio.ko.xz`` → ``9pnet_virtio`` (the kernel
    treats ``-`` and ``_`` alike in names)."""
    return filename.split(".ko", 1)[0].replace("-", "_")


def module_bytes(path: Path) -> bytes:
    """A module file's contents, uncompressed (busybox insmod takes plain ELF objects)."""
    data = path.read_bytes()
    return lzma.decompress(data) if path.name.endswith(".ko.xz") else data


def module_depends(data: bytes) -> list[str]:
    """The ``depends=`` entry of a module's ``.modinfo`` section (names, maybe none)."""
    start = data.find(b"\0depends=")
    if start < 0:
        return []
    start += len(b"\0depends=")
    value = data[start : data.index(b"\0", start)].decode()
    return [module_name(name) for name in value.split(",") if name]


def builtin_modules(modules_dir: Path) -> set[str]:
    """The modules compiled into the kernel (nothing to load for them)."""
    listing = modules_dir / "modules.builtin"
    if not listing.exists():
        return set()
    return {module_name(os.path.basename(line)) for line in listing.read_text().split()}


def module_load_order(modules_dir: Path, wanted: Iterable[str]) -> list[tuple[str, bytes]]:
    """`wanted` and their dependencies, each before what needs it: (name, uncompressed object)."""
    index = {module_name(p.name): p for p in (modules_dir / "kernel").rglob("*.ko*")}
    builtin = builtin_modules(modules_dir)
    order: list[tuple[str, bytes]] = []
    done: set[str] = set()

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if name in done or name in builtin:
            return
        if name in chain:
            raise ToolsMissing(f"module dependency cycle: {' -> '.join((*chain, name))}")
        if name not in index:
            raise ToolsMissing(f"kernel module {name} not found in {modules_dir}")
        data = module_bytes(index[name])
        for dependency in module_depends(data):
            visit(dependency, (*chain, name))
        done.add(name)
        order.append((name, data))

    for name in wanted:
        visit(module_name(name), ())
    return order


# -- the initramfs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One member of a cpio archive: a directory, a regular file or a symlink (`target`)."""

    name: str
    mode: int
    data: bytes = b""
    target: str | None = None


def cpio_newc(entries: Sequence[Entry]) -> bytes:
    """The entries as a "newc" cpio archive, the format the kernel unpacks into its initramfs."""
    out = bytearray()
    for inode, entry in enumerate([*entries, Entry("TRAILER!!!", 0)], start=1):
        body = entry.target.encode() if entry.target is not None else entry.data
        name = entry.name.encode() + b"\0"
        nlink = 2 if entry.mode & 0o170000 == 0o040000 else 1
        fields = (inode, entry.mode, 0, 0, nlink, 0, len(body), 0, 0, 0, 0, len(name), 0)
        out += b"070701" + b"".join(b"%08X" % value for value in fields) + name
        out += b"\0" * (-len(out) % 4) + body
        out += b"\0" * (-len(out) % 4)
    return bytes(out)


def directory(name: str) -> Entry:
    return Entry(name, 0o040755)


def regular(name: str, data: bytes, mode: int = 0o644) -> Entry:
    return Entry(name, 0o100000 | mode, data)


def guest_config(mode: Mode, modules: Sequence[str], agent_python: str) -> bytes:
    """``/vm.conf``: shell assignments that ``guest_init.sh`` sources."""
    values = {
        "MODE": mode,
        "MODULES": " ".join(modules),
        "AGENT_PYTHON": agent_python,
        "AGENT_SCRIPT": str(HERE / "guest_agent.py"),
        # The checkout, which the fresh /tmp and /var/tmp would hide when it lives there (CI's may).
        "CHECKOUT": str(ROOT),
    }
    return "".join(f"{key}={shlex.quote(value)}\n" for key, value in values.items()).encode()


def build_initramfs(tools: Tools, mode: Mode, agent_python: str) -> bytes:
    """The initramfs for `mode`: busybox, the modules, ``/init`` and ``/vm.conf``."""
    modules = module_load_order(tools.modules, MODULES)
    entries = [directory(name) for name in ("bin", "modules", "dev", "proc", "sys")]
    entries.append(regular("bin/busybox", Path(tools.busybox).read_bytes(), 0o755))
    entries.append(Entry("bin/sh", 0o120777, target="busybox"))
    entries += [regular(f"modules/{name}.ko", data) for name, data in modules]
    entries.append(regular("init", (HERE / "guest_init.sh").read_bytes(), 0o755))
    entries.append(regular("vm.conf", guest_config(mode, [name for name, _ in modules], agent_python)))
    return cpio_newc(entries)


# -- the VM ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    """How a command ended in the guest, and what it printed."""

    argv: tuple[str, ...]
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool

    def describe(self) -> str:
        status = "timed out" if self.timed_out else f"exit status {self.returncode}"
        return (
            f"{shlex.join(self.argv)}: {status} after {self.seconds} s\n"
            f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"
        )

    def check(self) -> Result:
        """This result, if the command exited 0; else an AssertionError telling all about it."""
        if self.returncode != 0:
            raise AssertionError(f"in the VM: {self.describe()}")
        return self

    def json(self) -> Any:
        """The command's stdout (its last line) as JSON, once it exited 0."""
        lines = self.check().stdout.strip().splitlines()
        assert lines, f"no output in the VM: {self.describe()}"
        return json.loads(lines[-1])


class VmFailed(Exception):
    """The VM did not boot, or stopped answering; the console log's tail says more."""


KERNEL_ARGS: Final[Mapping[Mode, str]] = {
    "busybox": "",
    # systemd: cgroup v2 only, our target (basic system, D-Bus, the agent; no getty), quiet units.
    "systemd": "systemd.unified_cgroup_hierarchy=1 systemd.unit=vm-test.target "
    "systemd.show_status=false systemd.log_level=notice",
}


class Vm:
    """One VM: `start` boots it and waits for its agent, `run` runs a command in it, `close` powers it
    off (or, past a bound, kills it). Its files (initramfs, console log, agent socket) are in `workdir`.

    `kernel_args` replace the mode's own (`KERNEL_ARGS`), e.g. systemd on the v1 hierarchies:
    ``"systemd.unified_cgroup_hierarchy=0 systemd.unit=vm-test.target"``."""

    def __init__(
        self,
        tools: Tools,
        mode: Mode,
        workdir: Path,
        *,
        cpus: int = 4,
        memory_mb: int = 1024,
        kernel_args: str | None = None,
    ) -> None:
        self.tools = tools
        self.mode = mode
        self.workdir = workdir
        self.cpus = cpus
        self.memory_mb = memory_mb
        self.kernel_args = KERNEL_ARGS[mode] if kernel_args is None else kernel_args
        self.console_path = workdir / "console.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] = {}
        self.boot_seconds = 0.0
        self._conn: socket.socket | None = None
        self._reader: IO[bytes] | None = None

    def qemu_argv(self, initramfs: Path, agent_socket: Path) -> list[str]:
        append = f"console=ttyS0 panic=-1 mitigations=off {self.kernel_args}".strip()
        return [
            self.tools.qemu,
            "-accel", "tcg",
            "-machine", "pc",
            "-smp", str(self.cpus),
            "-m", str(self.memory_mb),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(self.tools.kernel),
            "-initrd", str(initramfs),
            "-append", append,
            "-chardev", f"file,id=console,path={self.console_path}",
            "-serial", "chardev:console",
            "-fsdev", "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
            "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
            "-device", "virtio-serial-pci",
            "-chardev", f"socket,id=agent,path={agent_socket}",
            "-device", "virtserialport,chardev=agent,name=agent",
        ]  # fmt: skip

    def console(self, tail: int = 60) -> str:
        """The last `tail` lines of the serial console (kernel, init, systemd)."""
        try:
            lines = self.console_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no console log)"
        return "\n".join(lines[-tail:])

    def start(self, boot_timeout: float = BOOT_TIMEOUT) -> None:
        """Boot, and wait for the agent's first line; `VmFailed` (VM killed) if it does not come."""
        started = time.monotonic()
        initramfs = self.workdir / "initramfs.cpio"
        initramfs.write_bytes(build_initramfs(self.tools, self.mode, sys.executable))
        agent_socket = self.workdir / "agent.sock"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(str(agent_socket))
            listener.listen(1)
            with open(self.workdir / "qemu.log", "wb") as log:
                self.proc = subprocess.Popen(
                    self.qemu_argv(initramfs, agent_socket), stdin=subprocess.DEVNULL, stdout=log, stderr=log
                )
            self._conn = self._accept(listener, started + boot_timeout)
        self._reader = self._conn.makefile("rb")
        ready = self._receive(boot_timeout - (time.monotonic() - started), "boot")
        if "ready" not in ready:
            self._fail(f"the agent's first line is not ready: {ready}")
        self.ready = ready["ready"]
        self.boot_seconds = round(time.monotonic() - started, 2)

    def _accept(self, listener: socket.socket, deadline: float) -> socket.socket:
        """QEMU's connection to the agent's port (it connects at start, or has exited)."""
        assert self.proc is not None
        listener.settimeout(0.2)
        while time.monotonic() < deadline:
            try:
                return listener.accept()[0]
            except TimeoutError:
                if self.proc.poll() is not None:
                    self._fail("QEMU exited at start")
        self._fail("QEMU did not connect the agent's port")

    def _receive(self, timeout: float, what: str) -> dict[str, Any]:
        """The agent's next line; the VM is killed and `VmFailed` raised if none comes in `timeout`."""
        assert self._conn is not None
        assert self._reader is not None
        self._conn.settimeout(max(timeout, 0.1))
        try:
            line = self._reader.readline()
        except TimeoutError:
            self._fail(f"no answer from the agent within {timeout:.0f} s ({what})")
        if not line:
            self._fail(f"the agent's port closed ({what})")
        message: dict[str, Any] = json.loads(line)
        return message

    def _send(self, message: Mapping[str, Any]) -> None:
        assert self._conn is not None
        self._conn.settimeout(REPLY_MARGIN)
        try:
            self._conn.sendall(json.dumps(message).encode() + b"\n")
        except OSError as exc:
            self._fail(f"cannot write to the agent: {exc}")

    def _fail(self, reason: str) -> NoReturn:
        status = self.kill()
        qemu_log = (self.workdir / "qemu.log").read_text(errors="replace").strip()
        raise VmFailed(
            f"{self.mode} VM: {reason}; QEMU {status}\n--- QEMU ---\n{qemu_log}\n"
            f"--- console (last lines) ---\n{self.console()}"
        )

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> Result:
        """Run `argv` in the guest (as root, its own process group), to its end or `timeout`."""
        request = {"argv": list(argv), "timeout": timeout, "env": dict(env or {}), "cwd": cwd or str(ROOT)}
        self._send(request)
        reply = self._receive(timeout + REPLY_MARGIN, shlex.join(argv))
        return Result(
            tuple(argv),
            reply["returncode"],
            reply["stdout"],
            reply["stderr"],
            reply["seconds"],
            reply["timed_out"],
        )

    def python(self, *args: str, timeout: float = 60.0) -> Result:
        """This checkout's python (the venv the tests run in) with `args`, from the repository's root,
        the repository and its tests importable."""
        path = f"{ROOT}{os.pathsep}{ROOT / 'tests'}"  # as pytest's `pythonpath` has it
        return self.run([sys.executable, *args], timeout=timeout, env={"PYTHONPATH": path})

    def sh(self, script: str, *, timeout: float = 60.0) -> Result:
        """A shell script (the guest's /bin/sh, the host's dash or busybox's)."""
        return self.run(["/bin/sh", "-c", script], timeout=timeout)

    def kill(self) -> str:
        """Kill our QEMU process (only it) if it still runs; how it ended."""
        self._close_channel()
        if self.proc is None:
            return "not started"
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            return "killed"
        return f"exited with status {self.proc.returncode}"

    def _close_channel(self) -> None:
        for closable in (self._reader, self._conn):
            if closable is not None:
                with contextlib.suppress(OSError):
                    closable.close()
        self._reader = self._conn = None

    def close(self) -> str:
        """Ask the guest to power off and wait for QEMU's exit; kill it past `POWEROFF_TIMEOUT`."""
        if self.proc is None or self.proc.poll() is not None:
            return self.kill()
        with contextlib.suppress(VmFailed):
            # Wait for the answer: a guest writing to a port whose host end is closed may block.
            self._send({"poweroff": True})
            self._receive(REPLY_MARGIN, "poweroff")
        self._close_channel()
        try:
            self.proc.wait(POWEROFF_TIMEOUT)
        except subprocess.TimeoutExpired:
            return self.kill()
        return f"powered off (status {self.proc.returncode})"


@contextlib.contextmanager
def vm_session(mode: Mode, **options: Any) -> Iterator[Vm]:
    """A booted VM of `mode` for the body of the `with` (skipped, or failed under CI, without its
    tools); powered off, or killed, afterwards; its console log printed (shown when a test fails)."""
    tools = require_tools()
    with tempfile.TemporaryDirectory(prefix="mcpu-vm-", dir="/tmp") as work:
        vm = Vm(tools, mode, Path(work), **options)
        try:
            vm.start()
            print(f"{mode} VM booted in {vm.boot_seconds} s: {vm.ready}")
            yield vm
        finally:
            print(f"{mode} VM: {vm.close()}\n--- console (last lines) ---\n{vm.console()}")
