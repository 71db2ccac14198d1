"""nri_plugin.common.heap: free C-heap memory goes back to the system after a large message (glibc)."""

from __future__ import annotations

import os

import pytest

from nri_plugin.common import heap

GLIBC = bool(os.confstr("CS_GNU_LIBC_VERSION")) if "CS_GNU_LIBC_VERSION" in os.confstr_names else False


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_freed_heap_memory_is_given_back() -> None:
    # 48 MiB in 64 KiB blocks (below the mmap threshold: from the heap), all freed but the last,
    # which pins the top of the heap so that glibc does not shrink it by itself.
    blocks = [bytearray(64 * 1024) for _ in range(768)]
    for block in blocks:
        block[::4096] = b"x" * len(block[::4096])  # touch every page
    pinned = blocks.pop()
    del blocks
    before = rss_mib()
    assert heap.release_free_memory() is True
    assert rss_mib() < before - 24, "most of the 48 MiB should have gone back"
    assert pinned[0] == ord("x")


def test_without_glibc_nothing_happens(monkeypatch: pytest.MonkeyPatch) -> None:
    heap._malloc_trim.cache_clear()
    monkeypatch.setattr(os, "confstr", lambda name: None)
    try:
        assert heap.release_free_memory() is False
    finally:
        monkeypatch.undo()
        heap._malloc_trim.cache_clear()
