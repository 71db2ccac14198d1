"""CFS bandwidth values: the `CpuQuota` type and the text of v1 `cpu.cfs_quota_us` /
`cpu.cfs_period_us` and v2 `cpu.max`. Pure: no file access here (see `files.py`).

* v1: `cpu.cfs_quota_us` holds microseconds per period or `-1` (unlimited); the period lives in
  `cpu.cfs_period_us`.
* v2: `cpu.max` holds `"$MAX $PERIOD"`, `$MAX` being microseconds or `max` (unlimited).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, TypeGuard

from nri_plugin.cgroups._text import quote
from nri_plugin.cgroups.errors import CgroupValueError

__all__ = [
    "MAX_CFS_PERIOD_US",
    "MIN_CFS_PERIOD_US",
    "MIN_CFS_QUOTA_US",
    "CpuQuota",
    "format_cfs_quota_us",
    "format_cpu_max",
    "parse_cfs_period_us",
    "parse_cfs_quota_us",
    "parse_cpu_max",
]

# The kernel's own bounds (kernel/sched/core.c, min_cfs_quota_period / max_cfs_quota_period): a
# period from 1 ms to 1 s, a quota of at least 1 ms. Checking them here turns a wrong computation
# into a message that says what is wrong, instead of the kernel's bare EINVAL at write time.
MIN_CFS_PERIOD_US: Final = 1_000
MAX_CFS_PERIOD_US: Final = 1_000_000
MIN_CFS_QUOTA_US: Final = 1_000

# Spelling of "unlimited" in each version's file.
_V1_UNLIMITED: Final = "-1"
_V2_UNLIMITED: Final = "max"

# Plain ASCII decimal, no sign: what the kernel prints.
_DECIMAL: Final = re.compile(r"[0-9]{1,19}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_period(period: object) -> None:
    """Raise unless `period` is an int (not a bool) within the kernel's bounds."""
    if not _is_int(period) or not MIN_CFS_PERIOD_US <= period <= MAX_CFS_PERIOD_US:
        raise CgroupValueError(
            f"invalid CFS period {period!r}: expected microseconds from "
            f"{MIN_CFS_PERIOD_US} to {MAX_CFS_PERIOD_US}"
        )


def _check_quota(quota: object) -> None:
    """Raise unless `quota` is None or an int (not a bool) of at least `MIN_CFS_QUOTA_US`."""
    if quota is not None and (not _is_int(quota) or quota < MIN_CFS_QUOTA_US):
        raise CgroupValueError(
            f"invalid CFS quota {quota!r}: expected None (unlimited) or at least "
            f"{MIN_CFS_QUOTA_US} microseconds"
        )


@dataclass(frozen=True, slots=True)
class CpuQuota:
    """A CFS bandwidth limit: `quota` microseconds of CPU time per `period` microseconds.

    `quota` is None when unlimited (v1 `-1`, v2 `max`). `quota / period` is the limit in CPUs.
    Both values are checked when one is made (`CgroupValueError`).
    """

    quota: int | None
    period: int

    def __post_init__(self) -> None:
        _check_period(self.period)
        _check_quota(self.quota)

    @property
    def unlimited(self) -> bool:
        return self.quota is None

    def with_quota(self, quota: int | None) -> CpuQuota:
        """The same period with another quota."""
        return CpuQuota(quota, self.period)


def _number(text: str, what: str, expected: str) -> int:
    """`text` (stripped) as the kernel prints a number: 1 to 19 ASCII digits, no sign."""
    if _DECIMAL.fullmatch(text) is None:
        raise CgroupValueError(f"invalid {what} {quote(text)}: expected {expected}")
    return int(text)


def parse_cfs_quota_us(text: str) -> int | None:
    """v1 `cpu.cfs_quota_us` content -> microseconds, or None for `-1` (unlimited)."""
    value = text.strip()
    if _DECIMAL.fullmatch(value) is not None:
        return int(value)
    if value == _V1_UNLIMITED:
        return None
    raise CgroupValueError(f'invalid cpu.cfs_quota_us value {quote(value)}: expected microseconds or "-1"')


def format_cfs_quota_us(quota: int | None) -> str:
    """Text to write to v1 `cpu.cfs_quota_us`; None -> `-1`."""
    if quota is None:
        return _V1_UNLIMITED
    _check_quota(quota)
    return str(quota)


def parse_cfs_period_us(text: str) -> int:
    """v1 `cpu.cfs_period_us` content -> microseconds."""
    value = text.strip()
    if _DECIMAL.fullmatch(value) is None:
        raise CgroupValueError(f"invalid cpu.cfs_period_us value {quote(value)}: expected microseconds")
    return int(value)


def parse_cpu_max(text: str) -> CpuQuota:
    """v2 `cpu.max` content (``"max 100000"``, ``"200000 100000"``) -> `CpuQuota`."""
    expected = '"max 100000" or "200000 100000"'
    fields = text.strip().split(" ")
    if len(fields) != 2:
        raise CgroupValueError(f"invalid cpu.max {quote(text)}: expected {expected}")
    raw_quota, raw_period = fields
    quota = None if raw_quota == _V2_UNLIMITED else _number(raw_quota, "cpu.max quota", expected)
    return CpuQuota(quota, _number(raw_period, "cpu.max period", expected))


def format_cpu_max(quota: CpuQuota) -> str:
    """Text to write to v2 `cpu.max`, always with the period: ``"max 100000"``, ``"200000 100000"``."""
    limit = _V2_UNLIMITED if quota.quota is None else str(quota.quota)
    return f"{limit} {quota.period}"
