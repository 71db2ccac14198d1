#!/usr/bin/env python3
"""Use the CPUs that mixed-cpu-nri-plugin gives a container: busy threads on the isolated CPUs,
light threads on the shared ones, and a report of where each thread was allowed to run and where
it did run.

Runs inside a container that requested ``workload.openshift.io/enable-shared-cpus: 1``. The plugin
sets two variables there, each a Linux CPU list such as ``4-5`` or ``0-1,50``:

* ``OPENSHIFT_ISOLATED_CPUS``: the container's exclusive CPUs, for latency-critical work;
* ``OPENSHIFT_SHARED_CPUS``: the node's shared pool, for housekeeping.

Each thread pins itself with ``os.sched_setaffinity(0, cpus)``: on Linux, pid 0 means the calling
thread, so one thread's call leaves the others alone. A busy ("poll") thread spins the way a
poll-mode packet loop would; a light ("housekeeping") thread wakes up now and then. Every thread
samples the CPU it is on (field 39, "processor", of ``/proc/self/task/<tid>/stat``).

Python's GIL lets one thread run Python code at a time, so busy threads here take turns; a real
poll loop is native code. The placement shown is the same.

Standard library only, Python 3.9 or newer, Linux. Exit status 0 after the report; 2 with one line
on stderr when the variables are missing or malformed, or name CPUs this process may not use.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

SHARED_ENV = "OPENSHIFT_SHARED_CPUS"
ISOLATED_ENV = "OPENSHIFT_ISOLATED_CPUS"
RESOURCE = "workload.openshift.io/enable-shared-cpus"
HINT = (
    f"this pod did not get the node's shared CPUs: check that the container requests {RESOURCE}: 1 "
    "in resources.requests and resources.limits, and read the mixed-cpu-nri-plugin logs on its node"
)
SET_BY_PLUGIN = (
    f"mixed-cpu-nri-plugin sets both variables in a container that requests {RESOURCE}: 1; remove "
    "any value the pod spec gives them"
)
PROCESSOR_FIELD = 39  # of /proc/<pid>/task/<tid>/stat, counting from 1
LIGHT_INTERVAL = 0.05  # seconds a housekeeping thread sleeps between rounds
BUSY_SAMPLE_EVERY = 20_000  # loop iterations between two samples of a busy thread
MAX_CPU = 65535  # far above any machine's CPU count; bounds what a malformed list can cost


class DemoError(Exception):
    """Something the user must fix; the message is the whole explanation, on one line."""


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPUs of a Linux CPU list ("0-3,8,10-11"); ValueError if it is not one or is empty."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(part)
        low, high = int(first), int(last) if dash else int(first)
        if high < low or high > MAX_CPU:
            raise ValueError(part)
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """The shortest Linux CPU list for `cpus`, e.g. {0, 1, 2, 5} -> "0-2,5"; "" when empty."""
    ranges: list[str] = []
    ordered = sorted(cpus)
    start = 0
    for i, cpu in enumerate(ordered):
        if i + 1 == len(ordered) or ordered[i + 1] != cpu + 1:
            low = ordered[start]
            ranges.append(str(low) if low == cpu else f"{low}-{cpu}")
            start = i + 1
    return ",".join(ranges)


def cpus_from_env(name: str) -> frozenset[int]:
    text = os.environ.get(name)
    if text is None:
        raise DemoError(f"{name} is not set; {HINT}")
    try:
        return parse_cpu_list(text)
    except ValueError:
        raise DemoError(f"{name}={text!r} is not a CPU list such as 0-1,50; {SET_BY_PLUGIN}") from None


def check_cpus(isolated: frozenset[int], shared: frozenset[int], allowed: frozenset[int]) -> None:
    overlap = isolated & shared
    if overlap:
        raise DemoError(
            f"{ISOLATED_ENV} and {SHARED_ENV} both list CPUs {format_cpu_list(overlap)}; {SET_BY_PLUGIN}"
        )
    for name, cpus in ((ISOLATED_ENV, isolated), (SHARED_ENV, shared)):
        missing = cpus - allowed
        if missing:
            raise DemoError(
                f"{name} lists CPUs {format_cpu_list(missing)}, which this process may not use (it may "
                f"use {format_cpu_list(allowed)}); {HINT}"
            )


def current_cpu(tid: int) -> int:
    """The CPU the thread `tid` of this process last ran on."""
    with open(f"/proc/self/task/{tid}/stat", encoding="ascii", errors="replace") as file:
        text = file.read()
    # Field 2, the command name, is in parentheses and may hold spaces or ')': split after the last.
    fields = text[text.rindex(")") + 1 :].split()
    return int(fields[PROCESSOR_FIELD - 3])


class Worker(threading.Thread):
    """A thread that pins itself to `cpus`, then works until `deadline` and records where it ran."""

    def __init__(
        self, name: str, kind: str, cpus: frozenset[int], deadline: float, pinned: threading.Barrier
    ) -> None:
        super().__init__(name=name, daemon=True)
        self.kind = kind
        self.cpus = cpus
        self.deadline = deadline
        self.pinned = pinned
        self.tid = 0
        self.allowed: frozenset[int] = frozenset()
        self.ran_on: dict[int, int] = {}  # CPU -> samples seen there
        self.rounds = 0
        self.error: str | None = None

    def sample(self) -> None:
        cpu = current_cpu(self.tid)
        self.ran_on[cpu] = self.ran_on.get(cpu, 0) + 1

    def run(self) -> None:
        self.tid = threading.get_native_id()
        try:
            os.sched_setaffinity(0, self.cpus)  # 0: the calling thread only
        except OSError as exc:
            self.error = str(exc)
        self.pinned.wait()  # no thread works before every thread has pinned itself (or failed to)
        if self.error is not None:
            return
        try:
            self.sample()
            if self.kind == "busy":
                self.poll()
            else:
                self.housekeep()
            # Read after all the threads pinned themselves: each still has its own set.
            self.allowed = frozenset(os.sched_getaffinity(0))
        except (OSError, ValueError) as exc:
            self.error = str(exc)

    def poll(self) -> None:
        counter = 0
        while time.monotonic() < self.deadline:
            for _ in range(BUSY_SAMPLE_EVERY):
                counter += 1
            self.rounds += 1
            self.sample()

    def housekeep(self) -> None:
        while time.monotonic() < self.deadline:
            self.rounds += 1
            self.sample()
            time.sleep(LIGHT_INTERVAL)

    def report(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "tid": self.tid,
            "pinned_to": sorted(self.cpus),
            "allowed": sorted(self.allowed),
            "ran_on": {str(cpu): count for cpu, count in sorted(self.ran_on.items())},
            "rounds": self.rounds,
        }


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    if not hasattr(os, "sched_setaffinity"):
        raise DemoError("this demo needs Linux (os.sched_setaffinity); run it in a Linux container")
    isolated = cpus_from_env(ISOLATED_ENV)
    shared = cpus_from_env(SHARED_ENV)
    allowed = frozenset(os.sched_getaffinity(0))
    check_cpus(isolated, shared, allowed)
    deadline = time.monotonic() + args.seconds
    pinned = threading.Barrier(args.busy_threads + args.light_threads)
    workers = [Worker(f"poll-{i}", "busy", isolated, deadline, pinned) for i in range(args.busy_threads)]
    workers += [
        Worker(f"housekeeping-{i}", "light", shared, deadline, pinned) for i in range(args.light_threads)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for worker in workers:
        if worker.error is not None:
            raise DemoError(
                f"thread {worker.name} could not pin itself to CPUs {format_cpu_list(worker.cpus)}: "
                f"{worker.error}; {HINT}"
            )
    return {
        "isolated_cpus": sorted(isolated),
        "shared_cpus": sorted(shared),
        "process_allowed_cpus": sorted(allowed),
        "seconds": args.seconds,
        "threads": [worker.report() for worker in workers],
    }


def print_text(result: dict[str, Any]) -> None:
    def cpus(values: list[int] | list[str]) -> str:
        return format_cpu_list({int(v) for v in values}) or "-"

    print(f"{ISOLATED_ENV}={cpus(result['isolated_cpus'])}  {SHARED_ENV}={cpus(result['shared_cpus'])}")
    print(f"the process may run on CPUs {cpus(result['process_allowed_cpus'])}")
    rows = [("thread", "kind", "tid", "allowed", "ran on (samples)", "rounds")]
    for thread in result["threads"]:
        ran_on = ", ".join(f"{cpu} ({count})" for cpu, count in thread["ran_on"].items())
        rows.append(
            (
                thread["name"],
                thread["kind"],
                str(thread["tid"]),
                cpus(thread["allowed"]),
                ran_on,
                str(thread["rounds"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return value


def count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=f"Pin busy threads to ${ISOLATED_ENV} and light threads to ${SHARED_ENV}, "
        "and report where each thread may run and did run."
    )
    parser.add_argument("--seconds", type=positive_float, default=5.0, help="how long to run (default 5)")
    parser.add_argument("--busy-threads", type=count, default=2, help="busy poll threads (default 2)")
    parser.add_argument(
        "--light-threads", type=count, default=2, help="light housekeeping threads (default 2)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run_demo(args)
    except DemoError as exc:
        print(f"shared_cpus_demo: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print_text(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
