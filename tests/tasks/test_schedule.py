"""The task schedule is a pure, deterministic function a validator can recompute."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crypto.keys import Address
from protocol import schedule
from protocol.errors import LocalProtocolError

addresses = st.binary(min_size=20, max_size=20).map(Address)
u64 = st.integers(0, (1 << 64) - 1)


@given(addresses, u64, u64, u64, st.integers(1, 5000), st.integers(1, 40), st.integers(1, 8))
def test_draw_is_deterministic_distinct_and_in_range(
    worker: Address, step: int, counter: int, seed: int, pool: int, groups: int, group_size: int
) -> None:
    groups = min(groups, pool)
    first = schedule.draw(worker, step, counter, seed, pool_size=pool, groups=groups, group_size=group_size)
    again = schedule.draw(
        Address(worker.raw), step, counter, seed, pool_size=pool, groups=groups, group_size=group_size
    )
    assert first == again
    assert len(first.task_indices) == groups == len(set(first.task_indices))
    assert all(0 <= i < pool for i in first.task_indices)
    assert len(first.seeds) == groups and all(len(g) == group_size for g in first.seeds)
    assert all(0 <= s < (1 << 63) for g in first.seeds for s in g)


@given(addresses, u64, u64, u64)
def test_every_input_changes_the_draw(worker: Address, step: int, counter: int, seed: int) -> None:
    def indices(w: Address, p: int, b: int, s: int) -> tuple[int, ...]:
        return schedule.task_indices(w, p, b, s, pool_size=1 << 40, count=4)

    base = indices(worker, step, counter, seed)
    other_worker = Address(bytes([worker.raw[0] ^ 1]) + worker.raw[1:])
    assert indices(other_worker, step, counter, seed) != base
    assert indices(worker, step ^ 1, counter, seed) != base
    assert indices(worker, step, counter ^ 1, seed) != base
    assert indices(worker, step, counter, seed ^ 1) != base
    seeds = {schedule.sample_seed(worker, step, counter, seed, g, j) for g in range(3) for j in range(3)}
    assert len(seeds) == 9


def test_known_answer_pins_the_rule() -> None:
    """A fixed vector: any change to the hashing rule breaks validators and must be a new version."""
    worker = Address(bytes(range(20)))
    assert schedule.task_indices(worker, 3, 1, 42, pool_size=1000, count=3) == schedule.task_indices(
        worker, 3, 1, 42, pool_size=1000, count=3
    )
    import hashlib
    import struct

    data = b"prime-node/schedule/v1/tasks\x00" + worker.raw + struct.pack(">QQQQ", 3, 1, 42, 0)
    expected_first = int.from_bytes(hashlib.sha256(data).digest()[:16], "big") % 1000
    assert schedule.task_indices(worker, 3, 1, 42, pool_size=1000, count=1) == (expected_first,)
    data = b"prime-node/schedule/v1/sample\x00" + worker.raw + struct.pack(">QQQQQ", 3, 1, 42, 2, 5)
    assert (
        schedule.sample_seed(worker, 3, 1, 42, 2, 5)
        == int.from_bytes(hashlib.sha256(data).digest()[:16], "big") >> 65
    )


def test_impossible_draws_are_local_errors() -> None:
    worker = Address(b"\x01" * 20)
    with pytest.raises(LocalProtocolError):
        schedule.task_indices(worker, 0, 0, 0, pool_size=3, count=4)
    with pytest.raises(LocalProtocolError):
        schedule.task_indices(worker, -1, 0, 0, pool_size=3, count=1)
