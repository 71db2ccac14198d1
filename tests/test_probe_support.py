"""The probes tests' daemon helper (`probe_support`) reads all of a process's stderr, whatever its
line lengths: a reader that gave up on a line over asyncio's 64 KiB line limit left the daemon
blocked on the full pipe, which looked like a daemon fault (issue 32)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from mixedcpu_support import stream_lines
from probe_support import GUARD, bound_address, collect

# Lines around the one `bound_address` looks for: longer than the stream's line limit and than the
# pipe's buffer, before it and after it, and a last line without its newline.
_WRITER = """
import sys
sys.stderr.write("x" * 70_000 + "\\n")
sys.stderr.write("serving metrics and probes on 127.0.0.1:8080\\n")
sys.stderr.write("y" * 2_000_000 + "\\n")
sys.stderr.write("\\n")
sys.stderr.write("end\\n")
sys.stderr.write("no newline")
"""


@pytest.mark.asyncio
async def test_the_helper_reads_stderr_lines_of_any_length() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _WRITER, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        assert proc.stderr is not None
        lines = stream_lines(proc.stderr)
        seen: list[str] = []
        assert await bound_address(lines, seen) == ("127.0.0.1", 8080)
        await asyncio.wait_for(collect(lines, seen), GUARD)
        assert await asyncio.wait_for(proc.wait(), GUARD) == 0, "the writer never blocked"
        assert [len(line) for line in seen] == [70_000, 44, 2_000_000, 0, 3, 10]
        assert seen[2] == "y" * 2_000_000
    finally:
        if proc.returncode is None:
            proc.kill()
            await asyncio.wait_for(proc.wait(), GUARD)


@pytest.mark.asyncio
async def test_a_writer_that_ends_before_the_address_is_said_so() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys; sys.stderr.write('z' * 100_000)", stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    seen: list[str] = []
    with pytest.raises(AssertionError, match="the daemon ended before serving its probes"):
        await bound_address(stream_lines(proc.stderr), seen)
    assert await asyncio.wait_for(proc.wait(), GUARD) == 0
    assert [len(line) for line in seen] == [100_000]
