"""The DRA client libraries (lightkube, httpx2 under it) are the ``[dra]`` extra: a daemon installed
without them runs with DRA off, and ``[dra] enabled = true`` is then a config error saying what to
install. .ci/run proves the rest: the wheel installed without the extra runs ``demo`` and
``demo --dra``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nri_plugin.daemon.config import ConfigError, parse_config
from nri_plugin.daemon.wiring import DRA_CLIENT_MODULES, build_dra
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key

ROOT = Path(__file__).resolve().parents[2]
# Every module the daemon imports with DRA off, and the DRA kubelet plugin the demo runs.
WITHOUT_THE_CLIENT = (
    "nri_plugin.daemon.cli",
    "nri_plugin.daemon.wiring",
    "nri_plugin.daemon.check",
    "nri_plugin.daemon.status",
    "nri_plugin.daemon.demo_dra",
    "nri_plugin.dra.kubeletplugin",
)


def test_dra_enabled_without_its_client_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in DRA_CLIENT_MODULES or name in (
            "nri_plugin.dra.frontdoor",
            "nri_plugin.dra.apiserver",
        ):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lightkube", None)  # import lightkube: ModuleNotFoundError
    config = parse_config(
        {"shared_cpuset": "0-1", "dra": {"enabled": True, "node_name": "n"}}, source="c.toml"
    )
    with pytest.raises(ConfigError) as info:
        build_dra(config, load_or_create_host_key(tmp_path), {})
    assert str(info.value) == (
        "c.toml: [dra] enabled = true needs the DRA client libraries, which this installation lacks "
        "(no module lightkube): pip install 'mixed-cpu-nri-plugin[dra]' (the image has them), or set "
        "[dra] enabled = false"
    )


def test_the_daemon_imports_no_dra_client_until_dra_is_on() -> None:
    """In a fresh interpreter where lightkube and httpx2 cannot be imported at all."""
    code = (
        "import sys, importlib\n"
        f"for name in {sorted(DRA_CLIENT_MODULES)!r}: sys.modules[name] = None\n"
        f"for module in {WITHOUT_THE_CLIENT!r}: importlib.import_module(module)\n"
        "print('imported')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert (result.returncode, result.stdout) == (0, "imported\n"), result.stderr
