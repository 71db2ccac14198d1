"""The layers hold: import-linter's contracts, what importing a module really loads, what the domain
imports, package ``__init__``s that import nothing, and the seams between the domain, NRI and the
daemon (docs/design.md, "Layers")."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nri_plugin.daemon import logs as daemon_logs
from nri_plugin.mixedcpu import logfields
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin
from nri_plugin.nri import handlers

ROOT = Path(__file__).resolve().parents[1]
DOMAIN = ROOT / "nri_plugin" / "mixedcpu"

# Modules that must stay free of I/O machinery: importing them may not load any of IO_MODULES.
PURE_MODULES = (
    "nri_plugin.ttrpc.protocol",
    "nri_plugin.ttrpc.errors",
    "nri_plugin.ttrpc.buffer",
    "nri_plugin.nri.events",
    "nri_plugin.nri.handlers",
    "nri_plugin.nri.errors",
    "nri_plugin.nri.routes",
    "nri_plugin.nri.identity",
    "nri_plugin.nri.connection",
    "nri_plugin.deviceplugin.registration",
    "nri_plugin.mixedcpu.policy",
    "nri_plugin.deviceplugin.marker",
    "nri_plugin.mixedcpu.books",
    "nri_plugin.mixedcpu.baselines",
    "nri_plugin.mixedcpu.status",
    "nri_plugin.common.backoff",
    "nri_plugin.dra.slices",
)
IO_MODULES = ("asyncio", "socket", "selectors", "grpc", "structlog", "prometheus_client")
# What importing a module may not load at all (by name prefix): the contracts see import statements,
# this sees what really comes, lazy and dynamic imports included.
NOT_LOADED_BY = {
    "nri_plugin.mixedcpu.policy": ("nri_plugin.mixedcpu.store", "nri_plugin.daemon"),
    "nri_plugin.mixedcpu.baselines": (
        "nri_plugin.mixedcpu.store",
        "nri_plugin.mixedcpu.quota",
        "nri_plugin.daemon",
    ),
    "nri_plugin.mixedcpu.plugin": ("nri_plugin.daemon",),
}


def test_import_linter_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run(
        [str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = re.search(r"Contracts: (\d+) kept, (\d+) broken", result.stdout)
    assert summary is not None, result.stdout
    assert int(summary[1]) >= 9
    assert int(summary[2]) == 0


def _loaded_after_import(module: str) -> set[str]:
    """Every module in `sys.modules` once `module` is imported, in a fresh interpreter."""
    code = f"import sys, json; import {module}; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    return set(json.loads(result.stdout))


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_loads_no_io_machinery(module: str) -> None:
    loaded = _loaded_after_import(module)
    assert not loaded & set(IO_MODULES), f"importing {module} loads {sorted(loaded & set(IO_MODULES))}"


@pytest.mark.parametrize(("module", "prefixes"), NOT_LOADED_BY.items())
def test_module_loads_nothing_of_what_it_must_not_reach(module: str, prefixes: tuple[str, ...]) -> None:
    """The policy loads neither the store nor the daemon; the plugin, nothing of the daemon."""
    assert {m for m in _loaded_after_import(module) if m.startswith(prefixes)} == set()


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
def test_the_domain_imports_no_transport(path: Path) -> None:
    """Not even ttrpc's sans-I/O modules: the domain speaks to NRI's seam. (The layers contract keeps
    the daemon out of the domain; it cannot keep ttrpc out, which NRI's own modules import, so the
    domain's contract names only ``ttrpc.aio``: this checks the domain's own import statements.)"""
    assert {m for m in _imports(path) if m.startswith("nri_plugin.ttrpc")} == set()


@pytest.mark.parametrize("path", sorted(DOMAIN.glob("*.py")), ids=lambda p: p.name)
def test_the_domain_uses_the_cgroups_library_not_its_internals(path: Path) -> None:
    # `cgroups.cpuset` and `cgroups.quota` are public and pure: the policy takes cpu lists, and the
    # baseline arithmetic CFS limits, from them rather than through the package, whose __init__
    # brings the file modules (import-linter's contracts for the pure modules).
    pure = {"nri_plugin.cgroups.cpuset", "nri_plugin.cgroups.quota"}
    internals = {m for m in _imports(path) if m.startswith("nri_plugin.cgroups.") and m not in pure}
    assert internals == set()


def _package_inits() -> list[Path]:
    return sorted((ROOT / "nri_plugin").rglob("__init__.py"))


@pytest.mark.parametrize("init", _package_inits(), ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_package_init_has_no_side_effects(init: Path) -> None:
    """A package ``__init__`` holds a docstring and constants; it imports nothing (so importing one
    module of a layer never loads the rest of it) and calls nothing. `cgroups` is a library with a
    public API of pure re-exports, so its ``__init__`` may import its own modules, nothing else."""
    tree = ast.parse(init.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if init.parent.name == "cgroups" and isinstance(node, ast.ImportFrom | ast.Import):
            names = [a.name for a in node.names]
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else names
            assert all(m == "nri_plugin.cgroups" or m.startswith("nri_plugin.cgroups.") for m in modules), (
                ast.unparse(node)
            )
            continue
        assert isinstance(node, ast.Assign | ast.AnnAssign), f"{init}: {ast.unparse(node)}"
        assert not any(isinstance(n, ast.Call) for n in ast.walk(node)), f"{init}: {ast.unparse(node)}"


# -- the seams -----------------------------------------------------------------------------------------


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
        "StartContainer",  # containerd makes the cgroup here: the healer's grace (issue 25)
        "UpdateContainer",
        "StopContainer",
        "RemoveContainer",
        "UpdatePodSandbox",  # in-place pod resize (issue 12)
        "StopPodSandbox",
        "RemovePodSandbox",
    }


def _methods(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}
