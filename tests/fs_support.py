"""Helpers for tests of code that opens files: count its opens, and run it under a hang guard.

`count_opens` records every path `os.open` is given (the number of opens is what a fast path
promises). `outcome_within` runs work that might block (a FIFO where a file was expected) in a
thread: a hang becomes a test failure, not a stuck run.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest


def count_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths `os.open` is called with from now on, in order (the calls still happen)."""
    opened: list[str] = []
    real_open = os.open

    def counting(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        opened.append(path)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", counting)
    return opened


def outcome_within(seconds: float, work: Callable[[], object], release: Callable[[], None]) -> object:
    """`work`'s outcome: its value, or the exception it raised. If it is still running after
    `seconds`, `release` unblocks it and the test fails."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as exc:  # the outcome under test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        release()
        thread.join(5)
        pytest.fail(f"{work} blocked for more than {seconds} s")
    return outcome[0]
