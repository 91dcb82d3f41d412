"""The trainer's signed demand (protocol/demand.py, issue 38): codec, authority, replay, and the rules an
inferer applies to it."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto.keys import WalletKey
from protocol.codec import decode, encode
from protocol.demand import (
    MAX_WANTED,
    Demand,
    DemandBook,
    demand_domain,
    open_demand,
    seal_demand,
)
from protocol.envelope import Envelope, seal
from protocol.errors import InvariantError, ProtocolError, RemoteProtocolError

RUN = "demandtest"
TRAINER = WalletKey.generate()
NOW_MS = 1_700_000_000_000


def demand(
    sequence: int = 1,
    *,
    step: int = 10,
    floor: int = 6,
    wanted: tuple[int, ...] = (0, 0, 1, 1, 1),
    step_ms: int = 500,
    fresh: int = 1,
    run_id: str = RUN,
) -> Demand:
    return Demand(
        run_id=run_id, sequence=sequence, step=step, floor=floor, wanted=wanted, step_ms=step_ms, fresh=fresh
    )


def frame(d: Demand, key: WalletKey = TRAINER, now_ms: int = NOW_MS) -> bytes:
    return encode(seal_demand(key, d, now_ms=now_ms))


def test_a_demand_round_trips_and_its_wants_are_read_by_policy_step() -> None:
    d = demand()
    assert decode(encode(d), Demand) == d
    assert [d.wants(p) for p in range(4, 13)] == [
        0,
        0,
        0,
        0,
        1,
        1,
        1,
        1,
        1,
    ]  # below the floor 0, above step fresh


def test_a_demand_cannot_be_built_inconsistent() -> None:
    with pytest.raises(InvariantError):
        demand(floor=11)
    with pytest.raises(InvariantError):
        demand(step=2, floor=0, wanted=(1, 1, 1, 1))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_random_bytes_are_a_demand_or_a_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode(data, Demand)
    book = DemandBook(RUN, TRAINER.address)
    with pytest.raises(ProtocolError):
        book.offer(data, now_ms=NOW_MS, now=0.0)
    assert book.current is None


@settings(max_examples=100, deadline=None)
@given(
    step=st.integers(0, 1 << 40),
    lag=st.integers(0, MAX_WANTED - 1),
    wants=st.lists(st.integers(0, 1024), max_size=MAX_WANTED),
    step_ms=st.integers(0, (1 << 31) - 1),
)
def test_every_valid_demand_survives_the_wire(step: int, lag: int, wants: list[int], step_ms: int) -> None:
    floor = max(0, step - lag)
    d = Demand(
        run_id=RUN,
        sequence=step,
        step=step,
        floor=floor,
        wanted=tuple(wants[: step - floor + 1]),
        step_ms=step_ms,
        fresh=1,
    )
    opened = open_demand(decode(frame(d), Envelope), run_id=RUN, trainer=TRAINER.address, now_ms=NOW_MS)
    assert opened == d
    assert len(frame(d)) < Demand.MAX_BYTES + 512


def test_only_the_runs_trainer_is_believed_and_a_forgery_changes_nothing() -> None:
    book = DemandBook(RUN, TRAINER.address)
    real = book.offer(frame(demand(5)), now_ms=NOW_MS, now=1.0)
    forger = WalletKey.generate()
    with pytest.raises(RemoteProtocolError) as refused:
        book.offer(frame(demand(99, floor=10, wanted=(0,)), key=forger), now_ms=NOW_MS, now=2.0)
    assert refused.value.reason == "untrusted_trainer"
    # a payload with the trainer's name on it but the forger's signature is still the forger's
    forged = seal(forger, demand_domain(RUN), encode(demand(100, floor=10, wanted=(0,))), now_ms=NOW_MS)
    forged = dataclasses.replace(forged, signer=TRAINER.address)
    with pytest.raises(ProtocolError):
        book.offer(encode(forged), now_ms=NOW_MS, now=2.0)
    assert book.current == real and book.heard_at == 1.0


def test_a_replayed_or_older_demand_changes_nothing() -> None:
    book = DemandBook(RUN, TRAINER.address)
    old = frame(demand(5, floor=6))
    book.offer(frame(demand(7, floor=8, wanted=(1, 1, 1))), now_ms=NOW_MS, now=1.0)
    for again in (old, frame(demand(7, floor=0, wanted=(1,) * 11))):
        with pytest.raises(RemoteProtocolError) as refused:
            book.offer(again, now_ms=NOW_MS, now=2.0)
        assert refused.value.reason == "replayed"
    assert book.current is not None and book.current.floor == 8 and book.heard_at == 1.0
    assert book.refused == {"replayed": 2}


def test_another_run_a_future_date_or_another_domain_is_refused() -> None:
    book = DemandBook(RUN, TRAINER.address)
    other_run = seal(TRAINER, demand_domain(RUN), encode(demand(run_id="other")), now_ms=NOW_MS)
    cases = {
        "wrong_run": encode(other_run),
        "wrong_domain": frame(demand(run_id="other")),
        "from_the_future": frame(demand(), now_ms=NOW_MS + 60_000),
    }
    for reason, data in cases.items():
        with pytest.raises(RemoteProtocolError) as refused:
            book.offer(data, now_ms=NOW_MS, now=0.0)
        assert refused.value.reason == reason
    assert book.current is None


def test_the_floor_is_projected_over_the_batch_eta_but_never_above_the_newest_policy() -> None:
    book = DemandBook(RUN, TRAINER.address, max_age_s=30.0)
    assert (
        book.floor(0.0) is None
        and book.should_start(3, now=0.0, eta_s=1.0, in_flight=0).reason == "no_demand"
    )
    book.offer(frame(demand(step=10, floor=6, step_ms=500)), now_ms=NOW_MS, now=100.0)
    assert book.floor(100.0) == 6
    assert book.projected_floor(100.0, 0.0) == 6
    assert book.projected_floor(100.5, 1.0) == 9  # 1.5 s at 0.5 s per step: three steps on
    assert book.projected_floor(100.0, 60.0) == 10  # capped at the newest policy
    assert book.floor(131.0) is None  # not renewed: as if none was heard


def test_an_inferer_starts_only_wanted_batches_that_will_not_arrive_stale() -> None:
    book = DemandBook(RUN, TRAINER.address)
    book.offer(frame(demand(step=10, floor=6, wanted=(0, 0, 1, 1, 1), step_ms=500)), now_ms=NOW_MS, now=0.0)

    def start(policy: int, eta_s: float = 0.0, in_flight: int = 0) -> tuple[bool, str]:
        decision = book.should_start(policy, now=0.0, eta_s=eta_s, in_flight=in_flight)
        return decision.go, decision.reason

    assert start(10) == (True, "wanted")
    assert start(10, in_flight=1) == (False, "wants_met")  # someone's batch of it is on its way
    assert start(7) == (False, "wants_met")  # the trainer has its batch of policy 7
    assert start(8) == (True, "wanted")
    assert start(8, eta_s=1.6) == (False, "would_be_stale")  # three steps on, the floor is 9
    assert start(5) == (False, "would_be_stale")
    assert start(11) == (True, "wanted")  # a policy newer than the demand: its fresh wants


def test_a_hostile_frame_that_breaks_the_demands_rules_is_a_remote_error() -> None:
    import msgpack

    for fields in (
        [RUN, 1, 2, 5, [], 0, 1],  # floor above step
        [RUN, 1, 5, 0, [1] * 7, 0, 1],  # wants above step
        [RUN, 1, 5, 0, [2000], 0, 1],  # a want over its bound
    ):
        with pytest.raises(RemoteProtocolError):
            decode(msgpack.packb([1, "run.demand", fields]), Demand)


def test_a_batch_of_another_step_on_its_way_takes_a_place_in_the_queue_too() -> None:
    book = DemandBook(RUN, TRAINER.address)
    book.offer(frame(demand(step=10, floor=6, wanted=(0, 0, 0, 1, 0), fresh=0)), now_ms=NOW_MS, now=0.0)
    assert book.should_start(9, now=0.0, eta_s=0.0, in_flight=0, in_flight_total=0).go
    # our batch of policy 8 is on its way: the one place the trainer has left is taken
    decision = book.should_start(9, now=0.0, eta_s=0.0, in_flight=0, in_flight_total=1)
    assert (decision.go, decision.reason) == (False, "wants_met")
