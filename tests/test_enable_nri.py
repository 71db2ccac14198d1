"""``enable-nri``: NRI turned on in the runtime's config by editing one line (or nothing at all), the
runtime restarted over D-Bus only when a file changed; and the D-Bus client against a real bus."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from dbus_support import private_bus
from mixedcpu_support import run_cli

from nri_plugin.daemon.enable_nri import (
    BACKUP_SUFFIX,
    CONTAINERD_CONFIG,
    CRIO_DROP_IN,
    EnableError,
    enable_nri,
    patch_containerd_config,
)
from nri_plugin.systemd import bus as dbus

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10 only
    import tomli as tomllib

GUARD = 60.0
MARK = "# set by mixed-cpu-nri-plugin enable-nri"
NRI = "io.containerd.nri.v1.nri"


def nri_of(text: str) -> dict[str, object]:
    table: dict[str, object] = tomllib.loads(text)["plugins"][NRI]
    return table


# -- containerd's config, edited ------------------------------------------------------------------


def test_a_version_2_config_without_the_table_gets_it_appended() -> None:
    text = (
        'version = 2\n\n# the CRI plugin\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "pause"\n'
    )
    edited = patch_containerd_config(text)
    assert edited is not None
    assert edited.startswith(text), "the operator's lines stay as they were"
    assert edited[len(text) :] == f'\n[plugins."{NRI}"]\n  disable = false  {MARK}\n'
    assert nri_of(edited) == {"disable": False}


def test_disable_true_is_the_one_line_changed() -> None:
    text = (
        "version = 2\n"
        f"[plugins.'{NRI}']   # NRI\n"
        "  disable = true   # off for now\n"
        '  socket_path = "/var/run/nri/nri.sock"\n'
        f'[plugins."{NRI}".default_validator]\n'
        "  enable = false\n"
    )
    edited = patch_containerd_config(text)
    assert edited is not None
    changed = [(a, b) for a, b in zip(text.splitlines(), edited.splitlines(), strict=True) if a != b]
    assert changed == [("  disable = true   # off for now", f"  disable = false  {MARK}")]
    assert nri_of(edited)["disable"] is False


def test_a_table_without_disable_gets_the_line_under_its_header() -> None:
    text = f'version = 2\n[plugins."{NRI}"]\n  plugin_request_timeout = "2s"\n'
    edited = patch_containerd_config(text)
    assert (
        edited
        == f'version = 2\n[plugins."{NRI}"]\n  disable = false  {MARK}\n  plugin_request_timeout = "2s"\n'
    )


@pytest.mark.parametrize(
    "text",
    [
        f'version = 2\n[plugins."{NRI}"]\n  disable = false\n',
        f'version = 3\n[plugins."{NRI}"]\n  socket_path = "/var/run/nri/nri.sock"\n',  # 2.x: on by default
        "version = 3\n",
    ],
    ids=["said-so", "containerd-2-default", "containerd-2-empty"],
)
def test_nri_already_on_changes_nothing(text: str) -> None:
    assert patch_containerd_config(text) is None


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "containerd's config is version 1: containerd 1.6 and older know no NRI"),
        ("version = 2\n[plugins\n", "containerd's config is not valid TOML"),
        (f'version = 2\nplugins."{NRI}" = 1\n', f'plugins."{NRI}" is not a table'),
        (
            f'version = 2\n[plugins]\n"{NRI}".disable = true\n',
            "in a way this command does not edit (an inline or dotted table, say)",
        ),
        (
            f'version = 2\n[plugins."{NRI}"]\n  disable = "yes"\n',
            "in a way this command does not edit",
        ),
    ],
    ids=["version-1", "invalid", "not-a-table", "dotted", "odd-value"],
)
def test_a_config_that_cannot_be_edited_safely_is_refused(text: str, problem: str) -> None:
    with pytest.raises(EnableError) as info:
        patch_containerd_config(text)
    assert problem in str(info.value)
    assert info.value.status == 2


# -- the command, on a fake host ------------------------------------------------------------------


@pytest.fixture
def host() -> Iterator[Path]:
    """A host root with the runtime's directories (short: unix socket paths are limited)."""
    root = Path(tempfile.mkdtemp(prefix="host-", dir="/tmp"))
    (root / "etc" / "containerd").mkdir(parents=True)
    (root / "etc" / "crio" / "crio.conf.d").mkdir(parents=True)
    (root / "var" / "run" / "nri").mkdir(parents=True, mode=0o755)
    os.chmod(root / "var" / "run" / "nri", 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def run(host: Path, runtime: str = "containerd") -> tuple[int, str, list[str]]:
    out = io.StringIO()
    restarted: list[str] = []
    status = enable_nri(runtime, host_root=str(host), out=out, restart=restarted.append)
    return status, out.getvalue(), restarted


def test_a_runtime_serving_nri_is_left_alone(host: Path) -> None:
    config = host / CONTAINERD_CONFIG
    config.write_text("version = 2\n")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(host / "var" / "run" / "nri" / "nri.sock"))
        server.listen()
        status, out, restarted = run(host)
    assert (status, restarted) == (0, [])
    assert out == "NRI is on: the runtime accepts connections on /var/run/nri/nri.sock; nothing to do\n"
    assert config.read_text() == "version = 2\n"


def test_containerd_17_is_edited_kept_and_restarted(host: Path) -> None:
    config = host / CONTAINERD_CONFIG
    config.write_text("version = 2\n")
    os.chmod(config, 0o640)
    status, out, restarted = run(host)
    assert (status, restarted) == (0, ["containerd.service"])
    assert out.splitlines() == [
        "NRI turned on in /etc/containerd/config.toml",
        "restarting containerd.service: the plugin connects once it is back",
    ]
    assert nri_of(config.read_text()) == {"disable": False}
    assert os.stat(config).st_mode & 0o777 == 0o640, "the file keeps its mode"
    assert Path(f"{config}{BACKUP_SUFFIX}").read_text() == "version = 2\n"
    assert os.stat(host / "var" / "run" / "nri").st_mode & 0o777 == (0o700 if os.geteuid() == 0 else 0o755)


def test_no_containerd_config_at_all_gets_one(host: Path) -> None:
    status, _, restarted = run(host)
    assert (status, restarted) == (0, ["containerd.service"])
    config = (host / CONTAINERD_CONFIG).read_text()
    assert tomllib.loads(config) == {"version": 2, "plugins": {NRI: {"disable": False}}}
    assert not Path(f"{host / CONTAINERD_CONFIG}{BACKUP_SUFFIX}").exists()


def test_a_config_saying_on_without_a_socket_is_reported_not_restarted(
    host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (host / CONTAINERD_CONFIG).write_text("version = 3\n")
    status, out, restarted = run(host)
    assert (status, out, restarted) == (1, "", [])
    assert capsys.readouterr().err.startswith(
        "error: the containerd config already has NRI on, yet nothing answers on /var/run/nri/nri.sock: "
    )


def test_a_refused_config_is_left_as_it_was(host: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = f'version = 2\n[plugins]\n"{NRI}".disable = true\n'
    (host / CONTAINERD_CONFIG).write_text(text)
    status, _, restarted = run(host)
    assert (status, restarted) == (2, [])
    assert (host / CONTAINERD_CONFIG).read_text() == text
    assert "set disable = false there by hand" in capsys.readouterr().err


def test_crio_gets_a_drop_in_once(host: Path) -> None:
    status, out, restarted = run(host, "cri-o")
    assert (status, restarted) == (0, ["crio.service"])
    assert out.startswith("NRI turned on in /etc/crio/crio.conf.d/99-enable-nri.conf\n")
    drop_in = tomllib.loads((host / CRIO_DROP_IN).read_text())
    assert drop_in == {"crio": {"nri": {"enable_nri": True}}}
    status, _, restarted = run(host, "cri-o")  # the drop-in is there, yet no socket: not again
    assert (status, restarted) == (1, [])


def test_a_failed_restart_says_to_restart_by_hand(host: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(unit: str) -> None:
        raise dbus.BusError(f"RestartUnit: org.freedesktop.DBus.Error.AccessDenied: not {unit}")

    status = enable_nri("containerd", host_root=str(host), out=io.StringIO(), restart=refuse)
    assert status == 1
    assert capsys.readouterr().err == (
        "error: cannot restart containerd.service: RestartUnit: org.freedesktop.DBus.Error.AccessDenied: "
        "not containerd.service; restart it by hand\n"
    )


# -- links, unreadable configs, a wrong host root (issue #25, break 1) -------------------------------

REAL_CONFIG = (
    'version = 2\n\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n'
    "  SystemdCgroup = true\n"
)


def assert_edited_through_the_link(config: Path, real: Path, target: str) -> None:
    """`config` is still the same link; the file it points to has NRI on and all it had before; the
    old text is kept beside the real file."""
    assert config.is_symlink(), "the link stays a link"
    assert os.readlink(config) == target
    document = tomllib.loads(real.read_text())
    assert document["plugins"][NRI] == {"disable": False}
    assert document["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["runc"]["options"] == {
        "SystemdCgroup": True
    }, "the operator's settings stay"
    assert Path(f"{real}{BACKUP_SUFFIX}").read_text() == REAL_CONFIG
    assert not Path(f"{config}{BACKUP_SUFFIX}").exists()


def test_an_absolute_symlinked_config_is_edited_under_the_host_root(host: Path) -> None:
    """The chart's init container: /host/etc/containerd/config.toml -> /etc/containerd/real.toml is
    the host's /etc/containerd/real.toml, that is /host/etc/containerd/real.toml here."""
    real = host / "etc" / "containerd" / "real.toml"
    real.write_text(REAL_CONFIG)
    os.chmod(real, 0o600)
    (host / CONTAINERD_CONFIG).symlink_to("/etc/containerd/real.toml")
    status, out, restarted = run(host)
    assert (status, restarted) == (0, ["containerd.service"])
    assert out.splitlines()[0] == "NRI turned on in /etc/containerd/real.toml"
    assert_edited_through_the_link(host / CONTAINERD_CONFIG, real, "/etc/containerd/real.toml")
    assert os.stat(real).st_mode & 0o777 == 0o600


def test_a_symlinked_config_through_the_real_command_keeps_the_operators_config(host: Path) -> None:
    """The attack as found, through the command's own process (no D-Bus under this host root: the
    restart fails, with the file already edited where the link points)."""
    (host / "srv" / "conf").mkdir(parents=True)
    real = host / "srv" / "conf" / "containerd.toml"
    real.write_text(REAL_CONFIG)
    (host / "etc" / "containerd").rmdir()
    (host / "etc" / "containerd").symlink_to("/srv/conf")  # a linked directory on the way, too
    (host / "srv" / "conf" / "config.toml").symlink_to("containerd.toml")
    result = run_cli("enable-nri", "--runtime", "containerd", "--host-root", str(host), timeout=GUARD)
    assert result.returncode == 1, result.stderr
    assert result.stdout == "NRI turned on in /srv/conf/containerd.toml\n"
    assert result.stderr.startswith("error: cannot restart containerd.service: ")
    assert_edited_through_the_link(host / "srv" / "conf" / "config.toml", real, "containerd.toml")
    assert (host / "etc" / "containerd").is_symlink()


def test_a_relative_symlinked_config_stays_a_link(host: Path) -> None:
    (host / "etc" / "containerd-real").mkdir()
    real = host / "etc" / "containerd-real" / "config.toml"
    real.write_text(REAL_CONFIG)
    (host / CONTAINERD_CONFIG).symlink_to("../containerd-real/config.toml")
    status, out, restarted = run(host)
    assert (status, restarted) == (0, ["containerd.service"])
    assert out.splitlines()[0] == "NRI turned on in /etc/containerd-real/config.toml"
    assert_edited_through_the_link(host / CONTAINERD_CONFIG, real, "../containerd-real/config.toml")


@pytest.mark.parametrize(
    ("target", "problem"),
    [
        ("../../../{outside}", "a symbolic link leads out of the host root"),
        ("/../../{outside}", "a symbolic link leads out of the host root"),
        ("/etc/containerd/gone.toml", "a symbolic link on the way points at nothing"),
        ("/etc/containerd/config.toml", "too many symbolic links (a loop?)"),
    ],
    ids=["relative-out-of-the-root", "absolute-out-of-the-root", "dangling", "loop"],
)
def test_a_link_out_of_the_host_root_or_to_nothing_is_refused(
    host: Path, target: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    outside = host.parent / f"{host.name}-outside.toml"  # what a link out of the root would reach
    target = target.format(outside=outside.name)
    config = host / CONTAINERD_CONFIG
    config.symlink_to(target)
    before = sorted(str(path) for path in host.rglob("*"))
    try:
        outside.write_text(REAL_CONFIG)
        status, out, restarted = run(host)
        assert outside.read_text() == REAL_CONFIG, "never written"
    finally:
        outside.unlink()
    assert (status, out, restarted) == (2, "", [])
    err = capsys.readouterr().err
    assert err.startswith(f"error: /{CONTAINERD_CONFIG} under {host}: {problem}"), err
    assert err.count("\n") == 1
    assert sorted(str(path) for path in host.rglob("*")) == before, "nothing written"
    assert os.readlink(config) == target


@pytest.mark.parametrize("kind", ["not-utf-8", "directory", "fifo", "too-large"])
def test_a_config_that_cannot_be_read_is_never_replaced(
    host: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = host / CONTAINERD_CONFIG
    if kind == "not-utf-8":
        config.write_bytes(b"version = 2\n# caf\xe9\n")
    elif kind == "directory":
        config.mkdir()
    elif kind == "fifo":
        os.mkfifo(config)  # opening it must not wait for a writer
    else:
        config.write_bytes(b"# padding\n" * (1 << 19))
    before = sorted(str(path) for path in host.rglob("*"))
    status, out, restarted = run(host)
    assert (status, out, restarted) == (2, "", [])
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot read {config} ("), err
    assert err.endswith("); nothing changed: fix it, or edit it by hand\n")
    assert sorted(str(path) for path in host.rglob("*")) == before, "nothing written"


def test_running_twice_changes_nothing_the_second_time(
    host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = host / "etc" / "containerd" / "real.toml"
    real.write_text(REAL_CONFIG)
    (host / CONTAINERD_CONFIG).symlink_to("/etc/containerd/real.toml")
    assert run(host)[0] == 0
    edited, kept = real.read_bytes(), Path(f"{real}{BACKUP_SUFFIX}").read_bytes()
    files = sorted(str(path) for path in host.rglob("*"))
    # The runtime did not come back: said so, not restarted again, nothing rewritten.
    status, _, restarted = run(host)
    assert (status, restarted) == (1, [])
    assert "already has NRI on" in capsys.readouterr().err
    # The runtime came back: nothing to do.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(host / "var" / "run" / "nri" / "nri.sock"))
        server.listen()
        status, _, restarted = run(host)
        assert (status, restarted) == (0, [])
    assert (real.read_bytes(), Path(f"{real}{BACKUP_SUFFIX}").read_bytes()) == (edited, kept)
    assert sorted(str(path) for path in host.rglob("*") if path.name != "nri.sock") == files


@pytest.mark.parametrize(("runtime", "missing"), [("cri-o", "etc/crio"), ("containerd", "etc/containerd")])
def test_a_wrong_host_root_creates_nothing_and_says_so(
    tmp_path: Path, runtime: str, missing: str, capsys: pytest.CaptureFixture[str]
) -> None:
    wrong = tmp_path / "not-the-host"
    (wrong / "etc").mkdir(parents=True)
    status, out, restarted = run(wrong, runtime)
    assert (status, out, restarted) == (2, "", [])
    err = capsys.readouterr().err
    assert f"{wrong / missing} is missing; is --host-root where the host's / is mounted?" in err
    assert [path.name for path in wrong.rglob("*")] == ["etc"], "no directory made"
    status, _, _ = run(tmp_path / "absent", runtime)
    assert status == 2
    assert capsys.readouterr().err == (
        f"error: --host-root {tmp_path / 'absent'} is not a directory; give where the host's / is mounted\n"
    )
    assert not (tmp_path / "absent").exists()


def test_a_crio_drop_in_not_ours_is_refused(host: Path, capsys: pytest.CaptureFixture[str]) -> None:
    theirs = "[crio.nri]\nenable_nri = false\n"
    (host / CRIO_DROP_IN).write_text(theirs)
    status, _, restarted = run(host, "cri-o")
    assert (status, restarted) == (2, [])
    assert (host / CRIO_DROP_IN).read_text() == theirs
    assert "was not written by enable-nri" in capsys.readouterr().err


def test_the_help_says_status_1_is_a_failed_restart() -> None:
    result = run_cli("enable-nri", "--help", timeout=GUARD)
    text = " ".join(result.stdout.split())
    assert "1 when a file could not be written or the runtime could not be restarted" in text


# -- the D-Bus client, against a real bus -----------------------------------------------------------


@pytest.fixture
def bus() -> Iterator[str]:
    """A private dbus-daemon with no services (nothing is ever started on demand)."""
    with private_bus() as path:
        yield path


def test_the_bus_answers_our_calls(bus: str) -> None:
    """The bus checks every message's form before it routes it: a call it answers was well formed."""
    owner = dbus.call(
        bus, "org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "GetNameOwner",
        "org.freedesktop.DBus",
    )  # fmt: skip
    assert owner == "org.freedesktop.DBus"

    async def unique_name() -> str:
        async with dbus.connected(bus) as connection:
            return str(connection.unique_name)

    assert asyncio.run(unique_name()).startswith(":")


def test_restart_unit_reaches_the_bus_and_its_refusal_comes_back(bus: str) -> None:
    """No systemd on this bus: the bus itself refuses, naming the service we addressed."""
    with pytest.raises(dbus.BusError) as info:
        dbus.restart_unit("containerd.service", bus=bus)
    assert str(info.value).startswith("RestartUnit: org.freedesktop.DBus.Error.ServiceUnknown: ")
    assert "org.freedesktop.systemd1" in str(info.value)


def test_no_bus_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(OSError):  # noqa: PT011 - FileNotFoundError or ConnectionRefusedError
        dbus.restart_unit("containerd.service", bus=str(tmp_path / "absent"))
