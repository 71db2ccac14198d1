"""The layers hold: import-linter's contracts, what importing a pure module really loads, and package
``__init__``s that import nothing (docs/design.md, "Layers")."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

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
    "nri_plugin.common.backoff",
)
IO_MODULES = ("asyncio", "socket", "selectors", "grpc", "structlog", "prometheus_client")


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


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_loads_no_io_machinery(module: str) -> None:
    code = f"import sys, json; import {module}; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    loaded = set(json.loads(result.stdout))
    assert not loaded & set(IO_MODULES), f"importing {module} loads {sorted(loaded & set(IO_MODULES))}"


def _package_inits() -> list[Path]:
    return sorted([*(ROOT / "nri_plugin").rglob("__init__.py"), ROOT / "cgroups" / "__init__.py"])


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
            assert all(m == "cgroups" or m.startswith("cgroups.") for m in modules), ast.unparse(node)
            continue
        assert isinstance(node, ast.Assign | ast.AnnAssign), f"{init}: {ast.unparse(node)}"
        assert not any(isinstance(n, ast.Call) for n in ast.walk(node)), f"{init}: {ast.unparse(node)}"
