"""The slow tests are shared out over the xdist workers' first blocks (tests/conftest.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import interleave_slow_first


def _worksteal_blocks(order: list[str], workers: int) -> list[list[str]]:
    """xdist's worksteal first split: contiguous, ``pending // nodes remaining`` each."""
    blocks, pending = [], list(order)
    for k in range(workers):
        size = len(pending) // (workers - k)
        blocks.append(pending[:size])
        del pending[:size]
    return blocks


@given(st.integers(0, 40), st.integers(0, 400), st.integers(1, 4))
def test_every_worker_starts_with_its_share_of_the_slow_tests(
    slow_count: int, fast_count: int, workers: int
) -> None:
    slow = [f"slow{i}" for i in range(slow_count)]
    fast = [f"fast{i}" for i in range(fast_count)]
    order = interleave_slow_first(slow, fast, workers)
    assert sorted(order) == sorted(slow + fast)  # a permutation: nothing lost, nothing twice
    blocks = _worksteal_blocks(order, workers)
    if fast_count >= slow_count * workers:  # the suite's case: far more short tests than long ones
        for k, block in enumerate(blocks):
            share = slow[k::workers]
            assert block[: len(share)] == share
            assert not set(block[len(share) :]) & set(slow)
