"""Linux cpu lists ("0-3,8,10-11"): parse into a frozenset of CPU ids, format canonically.

The syntax is the one `cpuset.cpus`, `/sys/devices/system/cpu/online` and Kubernetes use: items
separated by commas, each a CPU id `N` or an inclusive range `A-B` with `A <= B`. Accepted and
rejected, deliberately:

* whitespace around the whole list is ignored (files end in a newline); inside it is an error;
* the empty string (or only whitespace) is the empty set, as an empty `cpuset.cpus` reads;
* overlapping or repeated items are fine (`"0-3,2-5"`, `"1,1"`), as for the kernel;
* reversed ranges (`"3-1"`), negative numbers, empty items (`"1,"`, `"1,,2"`), signs, non-ASCII
  digits and the kernel's stride syntax (`"0-7:2"`) are errors;
* ids above `MAX_CPU` are errors, which bounds the work and the size of the result.

Set operations come from `frozenset`; `format` turns any set of ids back into the canonical text:
sorted, runs of two or more consecutive ids collapsed into a range (`{3, 4}` -> `"3-4"`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

from nri_plugin.cgroups._text import quote

__all__ = ["MAX_CPU", "MAX_CPUS", "CpusetError", "format", "parse"]

# Linux builds support at most 8192 CPUs (CONFIG_NR_CPUS tops out at 8192 with MAXSMP on x86-64),
# so ids run 0..8191. The bound keeps "0-999999999" from turning into a billion-element set.
MAX_CPUS: Final = 8192
MAX_CPU: Final = MAX_CPUS - 1

# What a cgroup file or a config value may carry around the list (not inside it).
_SURROUNDING_WHITESPACE: Final = " \t\r\n"

# One item: ASCII digits only (str.isdigit and int() would also take "٣" or "+3").
_ITEM: Final = re.compile(r"([0-9]+)(?:-([0-9]+))?")

# More digits than this cannot be a CPU id, whatever the leading zeros; checking the length first
# keeps int() away from a megabyte of digits.
_MAX_DIGITS: Final = 16

_EXAMPLE: Final = 'expected e.g. "0-3,8"'


class CpusetError(ValueError):
    """A cpu list that cannot be parsed, or a set of ids that cannot be formatted."""


def _invalid(text: str, reason: str) -> CpusetError:
    return CpusetError(f"invalid cpu list {quote(text)}: {reason}; {_EXAMPLE}")


def _cpu_id(digits: str, item: str, text: str) -> int:
    value = int(digits) if len(digits) <= _MAX_DIGITS else MAX_CPUS
    if value > MAX_CPU:
        raise _invalid(text, f"{quote(item)} names a CPU above {MAX_CPU}")
    return value


def _item_mask(item: str, text: str) -> int:
    if not item:
        raise _invalid(text, "empty item (stray comma)")
    match = _ITEM.fullmatch(item)
    if match is None:
        if any(c.isspace() for c in item):
            raise _invalid(text, f"{quote(item)} contains whitespace")
        raise _invalid(text, f"{quote(item)} is not a number or range")
    first = _cpu_id(match[1], item, text)
    last = first if match[2] is None else _cpu_id(match[2], item, text)
    if first > last:
        raise _invalid(text, f"range {quote(item)} is reversed ({first} > {last})")
    return ((1 << (last - first + 1)) - 1) << first


def parse(text: str) -> frozenset[int]:
    """Parse a Linux cpu list such as ``"0-3,8,10-11\\n"``; raise `CpusetError` if it is malformed."""
    stripped = text.strip(_SURROUNDING_WHITESPACE)
    if not stripped:
        return frozenset()
    mask = 0
    for item in stripped.split(","):
        mask |= _item_mask(item, text)
    bits = bin(mask)[:1:-1]  # least significant bit first
    return frozenset(cpu for cpu, bit in enumerate(bits) if bit == "1")


def _runs(cpus: list[int]) -> Iterable[tuple[int, int]]:
    start = previous = cpus[0]
    for cpu in cpus[1:]:
        if cpu != previous + 1:
            yield start, previous
            start = cpu
        previous = cpu
    yield start, previous


def _check_cpus(values: Iterable[object]) -> None:
    for cpu in values:
        if isinstance(cpu, bool) or not isinstance(cpu, int) or not 0 <= cpu <= MAX_CPU:
            raise CpusetError(f"cannot format cpu {cpu!r}: expected an integer from 0 to {MAX_CPU}")


# Shadows the builtin on purpose: callers write `cpuset.format(cpus)`, the module is the namespace.
def format(cpus: Iterable[int]) -> str:
    """Canonical cpu list of `cpus`: ``{0, 1, 2, 3, 8}`` -> ``"0-3,8"``, the empty set -> ``""``.

    Every id is checked first, so that the one refused is named."""
    values = set(cpus)
    if not values:
        return ""
    _check_cpus(values)
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in _runs(sorted(values)))
