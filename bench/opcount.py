"""Python bytecodes run per asking CreateContainer, by file and by function: a count, not a time.

Usage: python bench/opcount.py [--calls N] [--top N] [--warm N]

The same in-process path as `asking_create.py` (each request the first container of a new pod that
asks, bytes in through the multiplexer to the reply written, on a fake cgroup v1 tree), traced with
``sys.settrace`` and per-opcode events after `--warm` untraced requests. A count does not move with
the machine's load, so two trees compared with it differ only by what they run: a change that takes
bytecodes off the path shows here whatever else the shared machine is doing. It does not see what
C code costs (protobuf, system calls, the interpreter's own work per call): pair it with
`asking_create.py` (CPU time) or ``valgrind --tool=cachegrind`` (all instructions).

The previous request's info line, written at the next event (`LaterLines`), is counted with it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

from asking_create import SHARED_CPUS, _frames, answered, fake_layout, plugin_behind_trunk
from workload import fake_node, realistic_pod

from nri_plugin.daemon.logs import configure_logging
from nri_plugin.mixedcpu.plugin import MixedCpuPlugin, TrustedSources
from nri_plugin.mixedcpu.store import StateStore

Where = tuple[str, int, str]
_ROOT = str(Path(__file__).resolve().parent.parent) + os.sep


class OpcodeCounter:
    """Counts the bytecodes each function runs while installed (``with counter:``). Code compiled
    from a string (a dataclass's generated ``__init__``) is named by the class it builds."""

    def __init__(self) -> None:
        self.counts: collections.Counter[Where] = collections.Counter()

    def __enter__(self) -> OpcodeCounter:
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)

    def total(self) -> int:
        return sum(self.counts.values())

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return self._opcode

    def _opcode(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.counts[_where(frame)] += 1
        return self._opcode


def _where(frame: FrameType) -> Where:
    code = frame.f_code
    if code.co_filename == "<string>":
        owner = type(frame.f_locals.get("self"))
        return (f"<generated> {owner.__module__}", 0, f"{owner.__qualname__}.{code.co_name}")
    return (code.co_filename.removeprefix(_ROOT), code.co_firstlineno, code.co_name)


def count(calls: int, warm: int) -> OpcodeCounter:
    """The bytecodes of `calls` asking creations, after `warm` untraced ones."""
    with tempfile.TemporaryDirectory(prefix="opcount-") as tmp:
        return asyncio.run(_count(Path(tmp), calls, warm))


async def _count(root: Path, calls: int, warm: int) -> OpcodeCounter:
    pods = warm + calls
    cgroup_root, state_dir = fake_node(root, pods)
    parents = [realistic_pod(n).linux.cgroup_parent for n in range(pods)]
    plugin = MixedCpuPlugin(
        shared=SHARED_CPUS,
        layout=fake_layout(cgroup_root),
        store=StateStore(state_dir),
        trusted=TrustedSources(pod_annotation=True),
    )
    trunk, transport = plugin_behind_trunk(plugin)
    frames = _frames(parents, 0)
    for n, frame in enumerate(frames[:warm], 1):
        trunk.data_received(frame)
        await answered(transport, n)
    counter = OpcodeCounter()
    with counter:
        for n, frame in enumerate(frames[warm:], warm + 1):
            trunk.data_received(frame)
            await answered(transport, n)
    assert transport.written == pods, "every request must be answered without waiting"
    assert plugin.books.shared_containers == pods, "every container was given shared CPUs"
    plugin.flush()
    return counter


def report(counter: OpcodeCounter, calls: int, top: int) -> None:
    print(f"bytecodes per asking CreateContainer: {counter.total() / calls:,.0f} ({calls} traced)\n")
    print_tables(counter, calls, top, per="creation")


def print_tables(counter: OpcodeCounter, calls: int, top: int, *, per: str) -> None:
    """The counts per call (`per` names one) by file, with each file's share, then the `top` functions."""
    total = max(counter.total(), 1)
    by_file: collections.Counter[str] = collections.Counter()
    for (path, _, _), n in counter.counts.items():
        by_file[path] += n
    print(f"| file | bytecodes per {per} | share |\n|---|---|---|")
    for path, n in by_file.most_common():
        print(f"| {path} | {n / calls:,.0f} | {n / total:.0%} |")
    print(f"\n| function (top {top}) | bytecodes per {per} |\n|---|---|")
    for (path, line, name), n in counter.counts.most_common(top):
        print(f"| `{path}:{line} {name}` | {n / calls:,.0f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="asking creations traced (20)")
    parser.add_argument("--warm", type=int, default=50, help="untraced creations before them (50)")
    parser.add_argument("--top", type=int, default=40, help="functions listed (40)")
    args = parser.parse_args(argv)
    # As asking_create.py: the daemon's logging at info, its lines to /dev/null.
    devnull = open(os.devnull, "w")  # noqa: SIM115 - open for the whole run
    configure_logging("info", "json", stream=devnull, cache_loggers=True, node="bench-node")
    report(count(args.calls, args.warm), args.calls, args.top)


if __name__ == "__main__":
    main()
