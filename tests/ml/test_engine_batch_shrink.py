"""How generation's batch sheds finished samples (``engine._retire_finished``): every live sample keeps its
row, a finished one is never generated for again, and shrinking the KV cache is amortised."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from prime_node.ml.engine import _retire_finished


@given(st.lists(st.integers(0, 40), min_size=1, max_size=300))
def test_live_samples_keep_their_rows_and_the_cache_is_copied_a_bounded_number_of_times(
    finish_step: list[int],
) -> None:
    """Sample i generates until step ``finish_step[i]``, as the engine's loop runs it."""
    samples = len(finish_step)
    active = list(range(samples))
    copied_rows = 0
    for step in range(max(finish_step) + 1):
        keep = [row for row, index in enumerate(active) if index >= 0 and finish_step[index] > step]
        if not keep:
            break
        before = {active[row] for row in keep}
        active, kept = _retire_finished(active, keep)
        assert {index for index in active if index >= 0} == before  # exactly the live samples remain
        if kept is not None:
            copied_rows += len(kept)
            assert -1 not in active and len(active) == len(kept)  # a shrink drops every finished row
        else:
            assert 4 * len(before) >= 3 * len(active)  # at least 3/4 of the rows still generate
    # Each shrink keeps under 3/4 of the rows the previous one kept: a geometric series.
    assert copied_rows <= 3 * samples
