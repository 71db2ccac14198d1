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
