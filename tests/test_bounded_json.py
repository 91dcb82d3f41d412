"""Nesting is bounded before json.loads recurses (a raised recursion limit turns deep JSON into a crash)."""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prime_node.bounded_json import loads_bounded, nesting_depth

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab,:'),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=20,
)


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@given(json_values)
def test_depth_scan_matches_the_structure_whatever_the_strings_hold(value: object) -> None:
    text = json.dumps(value)
    assert nesting_depth(text) == _depth(value)
    assert loads_bounded(text, max_depth=64) == value


def test_deep_nesting_is_refused_even_when_the_recursion_limit_is_huge() -> None:
    deep = "[" * 200_000 + "]" * 200_000
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(1_000_000)  # what a library may do process-wide (py_ecc: 100,000)
    try:
        with pytest.raises(ValueError, match="nested deeper"):
            loads_bounded(deep)
        with pytest.raises(ValueError, match="nested deeper"):
            loads_bounded(deep.encode())
    finally:
        sys.setrecursionlimit(old)
    assert loads_bounded("[" * 64 + "]" * 64) is not None
