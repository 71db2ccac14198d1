"""`wait_until`, the suite's wait for a condition with a bounded guard."""

from __future__ import annotations

import asyncio

import pytest
from wait_support import wait_until


@pytest.mark.asyncio
async def test_wait_until_returns_once_the_condition_holds() -> None:
    flag = asyncio.Event()
    asyncio.get_running_loop().call_later(0.02, flag.set)
    await wait_until(flag.is_set, timeout=5.0)
    assert flag.is_set()


@pytest.mark.asyncio
async def test_wait_until_fails_naming_the_condition_after_its_guard() -> None:
    with pytest.raises(AssertionError, match=r"not true within 0.05 s: the flag was set"):
        await wait_until(lambda: False, timeout=0.05, what="the flag was set")
