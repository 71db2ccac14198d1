"""The fault suite: fixtures, and the session's total of containers checked and left inconsistent."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_support import TOTALS

# The fake kubelet of the device-plugin tests, and the hostile runtime (raw requests on the real mux).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "deviceplugin"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "hostile"))


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path for long test ids is longer.
    path = Path(tempfile.mkdtemp(prefix="mcpu-f-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TOTALS["checks"]:
        terminalreporter.write_line(
            f"fault suite: {TOTALS['checks']} invariant checks walked {TOTALS['containers']} containers; "
            f"{TOTALS['inconsistent']} left inconsistent"
        )
