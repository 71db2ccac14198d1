"""The mixed-CPU domain's place among the layers: what it may import, and its seam with the stub."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from nri_plugin.daemon import logs as daemon_logs
from nri_plugin.mixedcpu import logfields
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin
from nri_plugin.nri import handlers

ROOT = Path(__file__).resolve().parent.parent
DOMAIN = ROOT / "nri_plugin" / "mixedcpu"


def _imports(path: Path) -> set[str]:
    """The modules a source file imports, at any level of its code."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            found.add(node.module)
    return found


@pytest.mark.parametrize("path", sorted(DOMAIN.glob("*.py")), ids=lambda p: p.name)
def test_the_domain_imports_no_transport_and_nothing_of_the_daemon(path: Path) -> None:
    upward = {m for m in _imports(path) if m.startswith(("nri_plugin.ttrpc", "nri_plugin.daemon"))}
    assert upward == set()


@pytest.mark.parametrize("path", sorted(DOMAIN.glob("*.py")), ids=lambda p: p.name)
def test_the_domain_uses_the_cgroups_library_not_its_internals(path: Path) -> None:
    # `cgroups.cpuset` is public and pure: the policy takes cpu lists from it rather than through the
    # package, whose __init__ brings the file modules (import-linter's policy contract).
    internals = {m for m in _imports(path) if m.startswith("cgroups.") and m != "cgroups.cpuset"}
    assert internals == set()


def _loaded_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    )
    return set(result.stdout.split())


def test_the_policy_loads_no_io_framework() -> None:
    loaded = _loaded_after_import("nri_plugin.mixedcpu.policy")
    assert {"asyncio", "socket", "grpc", "structlog"} & loaded == set()
    assert {m for m in loaded if m.startswith(("nri_plugin.mixedcpu.store", "nri_plugin.daemon"))} == set()


def test_the_plugin_loads_nothing_of_the_daemon() -> None:
    loaded = _loaded_after_import("nri_plugin.mixedcpu.plugin")
    assert {m for m in loaded if m.startswith("nri_plugin.daemon")} == set()


def test_the_event_field_is_the_one_the_daemon_renders() -> None:
    assert logfields.EVENT_NAME == daemon_logs.EVENT_NAME


def test_the_plugin_declares_the_handlers_it_has() -> None:
    """It subclasses the protocol of every NRI handler it defines (so mypy checks each signature
    against NRI's), and of no other."""
    protocols = {
        name: value
        for name, value in vars(handlers).items()
        if isinstance(value, type)
        and getattr(value, "_is_protocol", False)
        and value.__module__ == handlers.__name__
    }
    declared = {name for name, protocol in protocols.items() if protocol in MixedCpuPlugin.__mro__}
    defined = {
        name
        for name, protocol in protocols.items()
        if any(method in vars(MixedCpuPlugin) for method in _methods(protocol))
    }
    assert declared == defined
    assert declared == {
        "Configure",
        "Synchronize",
        "Shutdown",
        "CreateContainer",
        "UpdateContainer",
        "StopContainer",
        "RemoveContainer",
        "UpdatePodSandbox",  # in-place pod resize (issue 12)
        "StopPodSandbox",
        "RemovePodSandbox",
    }


def _methods(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}
