"""nri_plugin.cgroups.cpuset: Linux cpu-list parse and format."""

from __future__ import annotations

import enum
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nri_plugin.cgroups import cpuset
from nri_plugin.cgroups.cpuset import MAX_CPU, MAX_CPUS, CpusetError

PARSED = [
    ("", set()),
    ("\n", set()),
    ("  \t\n", set()),
    ("0", {0}),
    ("0\n", {0}),
    (" 1-2 ", {1, 2}),
    ("0-3", {0, 1, 2, 3}),
    ("0-3,8,10-11", {0, 1, 2, 3, 8, 10, 11}),
    ("0-3,8,10-11\n", {0, 1, 2, 3, 8, 10, 11}),
    ("3,1", {1, 3}),
    ("1,1", {1}),
    ("1-1", {1}),
    ("0-3,2-5", {0, 1, 2, 3, 4, 5}),
    ("007", {7}),
    (str(MAX_CPU), {MAX_CPU}),
    (f"0-{MAX_CPU}", set(range(MAX_CPUS))),
]


@pytest.mark.parametrize(("text", "cpus"), PARSED)
def test_parse(text: str, cpus: set[int]) -> None:
    assert cpuset.parse(text) == frozenset(cpus)


def test_parse_message_quotes_the_bad_item_and_says_what_is_expected() -> None:
    with pytest.raises(CpusetError) as info:
        cpuset.parse("0-x")
    assert str(info.value) == 'invalid cpu list "0-x": "0-x" is not a number or range; expected e.g. "0-3,8"'
    assert isinstance(info.value, ValueError)


REJECTED = [
    ("0-x", '"0-x" is not a number or range'),
    ("1,2-a", '"2-a" is not a number or range'),
    ("3-1", 'range "3-1" is reversed (3 > 1)'),
    ("1,", "empty item (stray comma)"),
    (",1", "empty item (stray comma)"),
    ("1,,2", "empty item (stray comma)"),
    ("1, 2", '" 2" contains whitespace'),
    ("1 ,2", '"1 " contains whitespace'),
    ("1\n,2", '"1\\n" contains whitespace'),
    ("-1", '"-1" is not a number or range'),
    ("+1", '"+1" is not a number or range'),
    ("1-", '"1-" is not a number or range'),
    ("0-7:2", '"0-7:2" is not a number or range'),
    ("0x1", '"0x1" is not a number or range'),
    ("1_0", '"1_0" is not a number or range'),
    ("\u0663", '"\\u0663" is not a number or range'),  # ARABIC-INDIC DIGIT THREE
    ("\uff11", '"\\uff11" is not a number or range'),  # FULLWIDTH DIGIT ONE
    ("1\x002", '"1\\u00002" is not a number or range'),
    ("1\u00a0", '"1\\u00a0" contains whitespace'),  # only ASCII whitespace is stripped
    (str(MAX_CPUS), f'"{MAX_CPUS}" names a CPU above {MAX_CPU}'),
    ("0-999999999", f'"0-999999999" names a CPU above {MAX_CPU}'),
    ("9" * 5000, f"names a CPU above {MAX_CPU}"),
]


@pytest.mark.parametrize(("text", "reason"), REJECTED)
def test_parse_rejects(text: str, reason: str) -> None:
    with pytest.raises(CpusetError) as info:
        cpuset.parse(text)
    message = str(info.value)
    assert reason in message
    assert message.endswith('; expected e.g. "0-3,8"')


def test_long_bad_input_is_cut_in_the_message() -> None:
    with pytest.raises(CpusetError) as info:
        cpuset.parse("0," * 10_000 + "x")
    assert len(str(info.value)) < 500
    assert "(20001 characters)" in str(info.value)


def test_many_full_ranges_parse_without_expanding_each_one() -> None:
    assert cpuset.parse(",".join([f"0-{MAX_CPU}"] * 20_000)) == frozenset(range(MAX_CPUS))


FORMATTED = [
    (set(), ""),
    ({5}, "5"),
    ({3, 4}, "3-4"),
    ({0, 1, 4, 5}, "0-1,4-5"),
    ({1, 3, 5}, "1,3,5"),
    ({0, 1, 2, 3, 8, 10, 11}, "0-3,8,10-11"),
    ({11, 10, 8, 3, 2, 1, 0}, "0-3,8,10-11"),
    ({0, MAX_CPU}, f"0,{MAX_CPU}"),
    (set(range(MAX_CPUS)), f"0-{MAX_CPU}"),
]


@pytest.mark.parametrize(("cpus", "text"), FORMATTED)
def test_format(cpus: set[int], text: str) -> None:
    assert cpuset.format(cpus) == text
    assert cpuset.format(frozenset(cpus)) == text
    assert cpuset.format(sorted(cpus, reverse=True) * 2) == text


@pytest.mark.parametrize("bad", [-1, MAX_CPUS, True, 1.0, "1", None])
def test_format_rejects(bad: object) -> None:
    with pytest.raises(CpusetError, match=re.escape(f"cannot format cpu {bad!r}:")):
        cpuset.format([0, bad])  # type: ignore[list-item]


class _Cpu(enum.IntEnum):
    THREE = 3
    FOUR = 4


def test_format_takes_int_subclasses_one_by_one() -> None:
    """Plain ints are checked together; an int subclass (not bool) is checked one by one, and taken."""
    assert cpuset.format({_Cpu.THREE, _Cpu.FOUR}) == "3-4"
    assert cpuset.format({_Cpu.THREE, 7, 8}) == "3,7-8"


cpu_ids = st.integers(min_value=0, max_value=MAX_CPU)
cpu_sets = st.frozensets(cpu_ids, max_size=300) | st.builds(
    lambda a, b: frozenset(range(min(a, b), max(a, b) + 1)), cpu_ids, cpu_ids
)


@given(cpu_sets)
def test_format_then_parse_is_identity(cpus: frozenset[int]) -> None:
    assert cpuset.parse(cpuset.format(cpus)) == cpus


@given(cpu_sets)
def test_format_is_canonical(cpus: frozenset[int]) -> None:
    text = cpuset.format(cpus)
    assert cpuset.format(cpuset.parse(text)) == text
    items = text.split(",") if text else []
    for item in items:
        first, _, last = item.partition("-")
        assert not last or int(first) < int(last)  # ranges only for two or more CPUs
    starts = [int(item.partition("-")[0]) for item in items]
    assert starts == sorted(starts)


@given(st.lists(st.tuples(cpu_ids, cpu_ids).map(sorted), min_size=1, max_size=20))
def test_parse_of_any_range_list_is_the_union(ranges: list[list[int]]) -> None:
    text = ",".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges)
    expected = frozenset().union(*(range(a, b + 1) for a, b in ranges))
    assert cpuset.parse(text) == expected


@given(st.text(alphabet="0123456789-,: \n\t+x", max_size=40) | st.text(max_size=40))
def test_any_text_parses_or_raises_cpuset_error(text: str) -> None:
    try:
        cpus = cpuset.parse(text)
    except CpusetError:
        return
    assert all(0 <= cpu <= MAX_CPU for cpu in cpus)
    assert cpuset.parse(cpuset.format(cpus)) == cpus
