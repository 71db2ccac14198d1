"""Giving the C heap's free memory back to the system (glibc's ``malloc_trim``).

A Synchronize of thousands of containers passes megabytes through the process: the received
frames, the reassembled ttrpc message, the parsed protobuf objects. Once they are freed, glibc keeps
most of that memory for later allocations instead of returning it, so the plugin's resident size
would stay some 15-25 MiB above its idle size for good (measured: docs/performance.md). After such
a message the mux calls `release_free_memory`, which asks glibc to return every free page.

Only on glibc: elsewhere (musl, other C libraries) it does nothing and returns False.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from functools import cache

__all__ = ["release_free_memory"]


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (ValueError, OSError, AttributeError):  # not glibc, or no such symbol
        return None
    return trim


def release_free_memory() -> bool:
    """Return the heap's free pages to the system; False where that is not available (not glibc).

    Costs about a millisecond per few tens of megabytes of heap; call it after large messages, not
    per request.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
