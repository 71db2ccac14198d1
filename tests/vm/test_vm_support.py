"""The VM tier's own machinery, on the host and without QEMU: finding the tools (skip here, fail under
CI), the kernel modules in dependency order, the initramfs archive, the guest's init script and
agent, and `Vm`'s boot, command and shutdown protocol against a stand-in QEMU (fake_qemu.py)."""

from __future__ import annotations

import lzma
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from vm import guest_agent
from vm.vm_support import (
    HERE,
    MODULES,
    ROOT,
    Entry,
    Result,
    Tools,
    ToolsMissing,
    Vm,
    VmFailed,
    build_initramfs,
    cpio_newc,
    find_kernel,
    find_tools,
    guest_config,
    is_static_elf,
    kernel_dir,
    module_depends,
    module_load_order,
    require_tools,
)

# -- finding the tools -------------------------------------------------------------------------------


def elf(program_headers: list[int]) -> bytes:
    """A minimal 64-bit little-endian ELF image with program headers of the given types."""
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x20, 64)  # e_phoff
    struct.pack_into("<HH", header, 0x36, 56, len(program_headers))  # e_phentsize, e_phnum
    table = b"".join(struct.pack("<I", kind) + bytes(52) for kind in program_headers)
    return bytes(header) + table


@pytest.mark.parametrize(
    ("image", "static"),
    [(elf([6, 1, 1]), True), (elf([6, 3, 1]), False), (b"#!/bin/sh\n", False), (elf([])[:40], False)],
    ids=["static", "with-interpreter", "script", "truncated"],
)
def test_only_an_elf_without_interpreter_counts_as_static(tmp_path: Path, image: bytes, static: bool) -> None:
    path = tmp_path / "busybox"
    path.write_bytes(image)
    assert is_static_elf(str(path)) is static


def test_the_python_running_the_tests_is_not_static() -> None:
    assert is_static_elf(os.path.realpath(sys.executable)) is False


def test_the_kernel_is_looked_for_where_vm_setup_puts_it() -> None:
    assert kernel_dir({"MIXED_CPU_VM_KERNEL_DIR": "/k"}) == Path("/k")
    assert kernel_dir({"XDG_CACHE_HOME": "/c", "HOME": "/h"}) == Path(
        "/c/mixed-cpu-nri-plugin/vm-kernel/current"
    )
    assert kernel_dir({"HOME": "/h"}) == Path("/h/.cache/mixed-cpu-nri-plugin/vm-kernel/current")
    setup = (ROOT / "scripts" / "vm-setup.sh").read_text()
    assert 'cache="${XDG_CACHE_HOME:-$HOME/.cache}/mixed-cpu-nri-plugin/vm-kernel"' in setup
    assert 'ln -sfn "$(basename "$target")" "$cache/current"' in setup


def unpacked_kernel(root: Path, release: str = "6.1.0-99-amd64") -> Path:
    (root / "boot").mkdir(parents=True)
    (root / "boot" / f"vmlinuz-{release}").write_bytes(b"kernel")
    (root / "lib" / "modules" / release / "kernel").mkdir(parents=True)
    return root


def test_find_kernel_gives_the_image_and_its_modules(tmp_path: Path) -> None:
    image, modules = find_kernel(unpacked_kernel(tmp_path))
    assert image == tmp_path / "boot" / "vmlinuz-6.1.0-99-amd64"
    assert modules == tmp_path / "lib" / "modules" / "6.1.0-99-amd64"


def test_find_kernel_refuses_an_image_without_modules(tmp_path: Path) -> None:
    (tmp_path / "boot").mkdir()
    (tmp_path / "boot" / "vmlinuz-6.1.0-99-amd64").write_bytes(b"kernel")
    with pytest.raises(ToolsMissing, match="has no modules"):
        find_kernel(tmp_path)


def test_every_missing_tool_is_named(tmp_path: Path) -> None:
    environ = {"PATH": str(tmp_path), "MIXED_CPU_VM_KERNEL_DIR": str(tmp_path / "none")}
    with pytest.raises(ToolsMissing) as info:
        find_tools(environ)
    message = str(info.value)
    assert "no qemu-system-x86_64 on PATH (Debian: qemu-system-x86)" in message
    assert "no static busybox on PATH (Debian: busybox-static)" in message
    assert "no unpacked linux-image package in" in message


def test_found_tools(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, image in (("qemu-system-x86_64", b"#!/bin/sh\n"), ("busybox", elf([1]))):
        (bin_dir / name).write_bytes(image)
        (bin_dir / name).chmod(0o755)
    kernel = unpacked_kernel(tmp_path / "kernel")
    tools = find_tools({"PATH": str(bin_dir), "MIXED_CPU_VM_KERNEL_DIR": str(kernel)})
    assert (tools.qemu, tools.busybox) == (str(bin_dir / "qemu-system-x86_64"), str(bin_dir / "busybox"))
    assert tools.release == "6.1.0-99-amd64"


def test_missing_tools_skip_the_tier_here(tmp_path: Path) -> None:
    with pytest.raises(pytest.skip.Exception, match=r"VM tier cannot run: .*scripts/vm-setup\.sh installs"):
        require_tools({"PATH": str(tmp_path), "MIXED_CPU_VM_KERNEL_DIR": str(tmp_path)})


def test_missing_tools_fail_the_tier_under_ci(tmp_path: Path) -> None:
    environ = {"PATH": str(tmp_path), "MIXED_CPU_VM_KERNEL_DIR": str(tmp_path), "CI": "true"}
    with pytest.raises(pytest.fail.Exception, match=r"CI=true: the VM tier cannot run: no qemu"):
        require_tools(environ)


# -- kernel modules ----------------------------------------------------------------------------------


def module(directory: Path, name: str, depends: str, *, compress: bool = False) -> None:
    """A stand-in module file: enough of a .modinfo section for `module_depends`."""
    data = b"\x7fELF...\0license=GPL\0depends=" + depends.encode() + b"\0vermagic=6.1\0"
    directory.mkdir(parents=True, exist_ok=True)
    if compress:
        (directory / f"{name}.ko.xz").write_bytes(lzma.compress(data))
    else:
        (directory / f"{name}.ko").write_bytes(data)


def test_module_depends_reads_the_modinfo_entry() -> None:
    assert module_depends(b"x\0depends=virtio,virtio-ring\0name=v\0") == ["virtio", "virtio_ring"]
    assert module_depends(b"x\0depends=\0name=v\0") == []
    assert module_depends(b"no modinfo") == []


def test_modules_come_after_their_dependencies(tmp_path: Path) -> None:
    kernel = tmp_path / "kernel"
    module(kernel / "fs" / "9p", "9p", "9pnet,netfs")
    module(kernel / "net" / "9p", "9pnet", "")
    module(kernel / "net" / "9p", "9pnet_virtio", "virtio,9pnet,virtio_ring")
    module(kernel / "fs" / "netfs", "netfs", "", compress=True)
    module(kernel / "drivers", "virtio", "virtio_ring")
    module(kernel / "drivers", "virtio_ring", "")
    (tmp_path / "modules.builtin").write_text("kernel/drivers/virtio/virtio_ring.ko\n")
    order = module_load_order(tmp_path, ["9pnet_virtio", "9p"])
    names = [name for name, _ in order]
    assert names == ["virtio", "9pnet", "9pnet_virtio", "netfs", "9p"]  # virtio_ring is built in
    assert dict(order)["netfs"].startswith(b"\x7fELF")  # uncompressed for busybox insmod


def test_a_missing_module_or_a_cycle_is_reported(tmp_path: Path) -> None:
    module(tmp_path / "kernel", "a", "b")
    module(tmp_path / "kernel", "b", "a")
    with pytest.raises(ToolsMissing, match="kernel module overlay not found"):
        module_load_order(tmp_path, ["overlay"])
    with pytest.raises(ToolsMissing, match="module dependency cycle: a -> b -> a"):
        module_load_order(tmp_path, ["a"])


# -- the initramfs -----------------------------------------------------------------------------------


def read_cpio(data: bytes) -> list[tuple[str, int, bytes]]:
    """(name, mode, body) of each member of a newc archive, checking its layout as the kernel does."""
    members: list[tuple[str, int, bytes]] = []
    offset = 0
    while True:
        assert data[offset : offset + 6] == b"070701"
        fields = [int(data[offset + 6 + 8 * i : offset + 14 + 8 * i], 16) for i in range(13)]
        name_size, body_size = fields[11], fields[6]
        name_at = offset + 110
        name = data[name_at : name_at + name_size - 1].decode()
        assert data[name_at + name_size - 1] == 0
        body_at = name_at + name_size + (-(name_at + name_size) % 4)
        if name == "TRAILER!!!":
            return members
        members.append((name, fields[1], data[body_at : body_at + body_size]))
        offset = body_at + body_size + (-(body_at + body_size) % 4)


def test_cpio_newc_round_trips() -> None:
    archive = cpio_newc(
        [Entry("bin", 0o040755), Entry("bin/x", 0o100755, b"abc"), Entry("bin/sh", 0o120777, target="x")]
    )
    assert len(archive) % 4 == 0
    assert read_cpio(archive) == [
        ("bin", 0o040755, b""),
        ("bin/x", 0o100755, b"abc"),
        ("bin/sh", 0o120777, b"x"),
    ]


def fake_tools(tmp_path: Path, qemu: str = "/bin/false") -> Tools:
    kernel = unpacked_kernel(tmp_path / "kernel")
    modules = kernel / "lib" / "modules" / "6.1.0-99-amd64"
    for name in MODULES:
        module(modules / "kernel", name, "")
    busybox = tmp_path / "busybox"
    busybox.write_bytes(elf([1]))
    return Tools(qemu, str(busybox), kernel / "boot" / "vmlinuz-6.1.0-99-amd64", modules)


def test_the_initramfs_holds_busybox_the_modules_init_and_its_config(tmp_path: Path) -> None:
    members = {
        name: (mode, body)
        for name, mode, body in read_cpio(build_initramfs(fake_tools(tmp_path), "systemd", "/py"))
    }
    assert members["init"] == (0o100755, (HERE / "guest_init.sh").read_bytes())
    assert members["bin/busybox"] == (0o100755, elf([1]))
    assert members["bin/sh"] == (0o120777, b"busybox")
    assert {f"modules/{name}.ko" for name in MODULES} <= set(members)
    config = members["vm.conf"][1].decode()
    assert "MODE=systemd\n" in config
    assert "AGENT_PYTHON=/py\n" in config
    assert f"MODULES='{' '.join(MODULES)}'\n" in config


def test_the_guest_config_survives_the_shell() -> None:
    config = guest_config("busybox", ["a", "b"], "/odd path/py'thon")
    script = f'{config.decode()}\nprintf "%s|%s|%s" "$MODE" "$MODULES" "$AGENT_PYTHON"'
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout
    assert out == "busybox|a b|/odd path/py'thon"


def test_the_guest_init_script_parses() -> None:
    subprocess.run(["sh", "-n", str(HERE / "guest_init.sh")], check=True)


# -- the agent ---------------------------------------------------------------------------------------


def test_the_agent_kills_a_command_past_its_timeout_with_its_children() -> None:
    started = time.monotonic()
    reply = guest_agent.run({"argv": ["sh", "-c", "sleep 30 & sleep 30"], "timeout": 0.5, "cwd": "/"})
    assert reply["timed_out"] is True
    assert reply["returncode"] is None
    assert time.monotonic() - started < 10


def test_the_agent_reports_output_and_status() -> None:
    reply = guest_agent.run({"argv": ["sh", "-c", "echo out; echo err >&2; exit 4"], "env": {"X": "1"}})
    assert (reply["returncode"], reply["stdout"], reply["stderr"], reply["timed_out"]) == (
        4,
        "out\n",
        "err\n",
        False,
    )


# -- the VM protocol, against the stand-in QEMU --------------------------------------------------------


def fake_qemu(tmp_path: Path) -> str:
    wrapper = tmp_path / "qemu-system-x86_64"
    wrapper.write_text(
        f'#!/bin/sh\nPYTHONPATH="{ROOT / "tests"}" exec "{sys.executable}" "{HERE / "fake_qemu.py"}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    path = tmp_path / "vm"
    path.mkdir()
    return path


def test_vm_boots_runs_commands_and_powers_off(tmp_path: Path, workdir: Path) -> None:
    vm = Vm(fake_tools(tmp_path, fake_qemu(tmp_path)), "busybox", workdir)
    vm.start(boot_timeout=60)
    try:
        assert set(vm.ready) == {"kernel", "uptime", "mode"}
        result = vm.sh("echo hello; pwd")
        assert result.check().stdout == f"hello\n{ROOT}\n"
        assert vm.python("-c", "import vm.vm_support, sys; print(sys.argv)").check().stdout == "['-c']\n"
        failed = vm.run(["sh", "-c", "echo no >&2; exit 3"])
        with pytest.raises(AssertionError, match="exit status 3"):
            failed.check()
        missing = vm.run(["/nonexistent/program"])
        assert missing.returncode is None
        assert "guest agent:" in missing.stderr
    finally:
        status = vm.close()
    assert status == "powered off (status 0)"
    assert (workdir / "initramfs.cpio").exists()


def test_vm_fails_fast_when_qemu_exits_at_start(
    tmp_path: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_QEMU", "exit")
    vm = Vm(fake_tools(tmp_path, fake_qemu(tmp_path)), "busybox", workdir)
    started = time.monotonic()
    with pytest.raises(
        VmFailed, match=r"(?s)QEMU exited at start; QEMU exited with status 3.*refusing to start"
    ):
        vm.start(boot_timeout=60)
    assert time.monotonic() - started < 30


def test_vm_that_never_gets_ready_is_killed_at_the_boot_bound(
    tmp_path: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_QEMU", "silent")
    vm = Vm(fake_tools(tmp_path, fake_qemu(tmp_path)), "busybox", workdir)
    with pytest.raises(VmFailed, match=r"no answer from the agent within 2 s \(boot\); QEMU killed"):
        vm.start(boot_timeout=2)
    assert vm.proc is not None
    assert vm.proc.returncode is not None


def test_vm_that_does_not_power_off_is_killed(
    tmp_path: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_QEMU", "hang")
    monkeypatch.setattr("vm.vm_support.POWEROFF_TIMEOUT", 1.0)
    vm = Vm(fake_tools(tmp_path, fake_qemu(tmp_path)), "busybox", workdir)
    vm.start(boot_timeout=60)
    assert vm.close() == "killed"


def test_qemu_runs_emulated_with_the_hosts_root_read_only(tmp_path: Path, workdir: Path) -> None:
    argv = Vm(fake_tools(tmp_path), "systemd", workdir).qemu_argv(workdir / "i", workdir / "s")
    assert argv[argv.index("-accel") + 1] == "tcg"
    assert "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap" in argv
    assert "-no-reboot" in argv
    append = argv[argv.index("-append") + 1]
    assert "systemd.unit=vm-test.target" in append
    assert "systemd.unified_cgroup_hierarchy=1" in append


def test_kernel_args_replace_the_modes_own(tmp_path: Path, workdir: Path) -> None:
    """E.g. systemd on the v1 hierarchies (hybrid), which boots in this VM too."""
    hybrid = "systemd.unified_cgroup_hierarchy=0 systemd.unit=vm-test.target"
    argv = Vm(fake_tools(tmp_path), "systemd", workdir, kernel_args=hybrid).qemu_argv(
        workdir / "i", workdir / "s"
    )
    assert argv[argv.index("-append") + 1] == f"console=ttyS0 panic=-1 mitigations=off {hybrid}"


def test_result_json_is_the_last_line_of_a_successful_command() -> None:
    result = Result(("x",), 0, 'note\n{"a": 1}\n', "", 0.1, False)
    assert result.json() == {"a": 1}
    timed_out = Result(("x",), None, "", "", 5.0, True)
    with pytest.raises(AssertionError, match=r"timed out after 5\.0 s"):
        timed_out.json()


def test_the_agent_protocol_over_a_socket_pair() -> None:
    host, guest = socket.socketpair()
    with host, guest, guest.makefile("rwb", buffering=0) as port:
        server = threading.Thread(target=guest_agent.serve, args=(port,))
        server.start()
        reader = host.makefile("rb")
        assert b'"ready"' in reader.readline()
        host.sendall(b'{"argv": ["echo", "hi"], "timeout": 10}\n')
        assert b'"stdout": "hi\\n"' in reader.readline()
        host.sendall(b'{"poweroff": true}\n')
        assert reader.readline() == b'{"poweroff": true}\n'
        server.join(10)
        assert not server.is_alive()
