"""The demand's ``heard`` marks (issue 38): per worker, the newest batch counter the trainer had heard
announced, so an inferer counts only its own batches the demand cannot count yet."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto.keys import WalletKey
from protocol.codec import decode, encode
from protocol.demand import MAX_HEARD, Demand, DemandBook, Heard, seal_demand
from protocol.errors import InvariantError, LocalProtocolError, ProtocolError

RUN = "demandheard"
TRAINER = WalletKey.generate()
WORKERS = [WalletKey.generate().address for _ in range(MAX_HEARD + 1)]
NOW_MS = 1_700_000_000_000


def demand(heard: tuple[Heard, ...], sequence: int = 1) -> Demand:
    return Demand(
        run_id=RUN,
        sequence=sequence,
        step=10,
        floor=6,
        wanted=(0, 0, 1, 1, 1),
        step_ms=500,
        fresh=1,
        heard=heard,
    )


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, MAX_HEARD - 1), st.integers(0, (1 << 63) - 1)), max_size=MAX_HEARD))
def test_marks_survive_the_wire_and_are_read_per_worker(marks: list[tuple[int, int]]) -> None:
    unique = {WORKERS[w]: c for w, c in marks}
    d = demand(tuple(Heard(w, c) for w, c in unique.items()))
    assert decode(encode(d), Demand) == d
    assert len(encode(seal_demand(TRAINER, d, now_ms=NOW_MS))) <= 2 * Demand.MAX_BYTES
    for worker in WORKERS:
        assert d.heard_of(worker) == unique.get(worker)


def test_a_demand_names_each_worker_once_and_at_most_max_heard() -> None:
    with pytest.raises(InvariantError):
        demand((Heard(WORKERS[0], 1), Heard(WORKERS[0], 2)))
    with pytest.raises(LocalProtocolError):
        encode(demand(tuple(Heard(w, 1) for w in WORKERS)))  # one worker too many


def test_a_forged_demand_with_marks_changes_nothing() -> None:
    book = DemandBook(RUN, TRAINER.address)
    real = book.offer(
        encode(seal_demand(TRAINER, demand((Heard(WORKERS[0], 5),)), now_ms=NOW_MS)), now_ms=NOW_MS, now=1.0
    )
    forged = demand((Heard(WORKERS[0], 1 << 40),), sequence=2)  # would make the inferer count nothing
    with pytest.raises(ProtocolError):
        book.offer(encode(seal_demand(WalletKey.generate(), forged, now_ms=NOW_MS)), now_ms=NOW_MS, now=2.0)
    assert book.live(2.0) == real and real.heard_of(WORKERS[0]) == 5
