"""New keys must earn their budget (protocol/scoring.py): a Sybil's fresh keys share one newcomer budget,
each is held to a probation budget, and none of it slows a peer that earned its place."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from protocol.errors import LocalProtocolError
from protocol.scoring import Admission, Offence, PeerScores, ScoringConfig

CONFIG = ScoringConfig(
    flood_limit=20,
    probation_seconds=30.0,
    probation_contributions=10,
    probation_rate=4.0,
    probation_burst=6,
    newcomer_rate=10.0,
    newcomer_burst=15,
)

# (which fresh key, seconds since the previous message)
traffic = st.lists(st.tuples(st.integers(0, 9), st.floats(0.0, 0.5)), max_size=400)


def _earn(scores: PeerScores, peer: str, now: float) -> float:
    """Take ``peer`` through probation honestly: one message a second, each delivered and credited."""
    for _ in range(max(CONFIG.probation_contributions, int(CONFIG.probation_seconds)) + 1):
        assert scores.admit(peer, now)[0] is Admission.ACCEPT
        scores.credit(peer, now)
        now += 1.0
    assert not scores.on_probation(peer, now)
    return now


@given(traffic)
def test_fresh_keys_together_never_get_more_than_the_newcomer_budget(events: list[tuple[int, float]]) -> None:
    scores = PeerScores(CONFIG)
    now, total = 0.0, 0
    accepted = [0] * 10
    first_seen: dict[int, float] = {}
    for key, dt in events:
        now += dt
        first_seen.setdefault(key, now)
        admission, _ = scores.admit(f"sybil{key}", now)
        if admission is Admission.ACCEPT:
            total += 1
            accepted[key] += 1
            scores.credit(f"sybil{key}", now)
        assert total <= CONFIG.newcomer_burst + CONFIG.newcomer_rate * now + 1e-9
        assert (
            accepted[key] <= CONFIG.probation_burst + CONFIG.probation_rate * (now - first_seen[key]) + 1e-9
        )
        # Dropping a new key's surplus is not an offence: only flooding past flood_limit is charged.
        assert admission is not Admission.BANNED


@given(traffic, st.integers(1, CONFIG.flood_limit))
@settings(max_examples=50)
def test_a_peer_that_earned_its_place_keeps_its_full_budget_whatever_newcomers_do(
    events: list[tuple[int, float]], per_window: int
) -> None:
    scores = PeerScores(CONFIG)
    now = _earn(scores, "honest", 0.0)
    window_end = now + CONFIG.flood_window
    sent = 0
    for key, dt in events:
        now += dt
        scores.admit(f"sybil{key}", now)
        if now >= window_end:
            window_end, sent = now + CONFIG.flood_window, 0
        if sent < per_window:
            sent += 1
            assert scores.admit("honest", now)[0] is Admission.ACCEPT
    assert scores.score("honest", now) == 0.0


@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=60))
def test_a_key_leaves_probation_only_after_its_time_and_its_contributions(gaps: list[float]) -> None:
    scores = PeerScores(CONFIG)
    now, credited = 0.0, 0
    first_seen = gaps[0]
    for gap in gaps:
        now += gap
        if scores.admit("new", now)[0] is Admission.ACCEPT:
            scores.credit("new", now)
            credited += 1
        earned = credited >= CONFIG.probation_contributions and now - first_seen >= CONFIG.probation_seconds
        assert scores.on_probation("new", now) == (not earned)


def test_a_probationary_key_is_held_to_its_budget_and_graduates_to_the_full_one() -> None:
    scores = PeerScores(CONFIG)
    admitted = [scores.admit("new", 0.0)[0] for _ in range(CONFIG.flood_limit)]
    assert admitted.count(Admission.ACCEPT) == CONFIG.probation_burst
    assert set(admitted[CONFIG.probation_burst :]) == {Admission.PROBATION}
    assert scores.score("new", 0.0) == 0.0  # held back, not charged
    now = _earn(scores, "new", 5.0)
    admitted = [scores.admit("new", now)[0] for _ in range(CONFIG.flood_limit + 1)]
    assert admitted.count(Admission.ACCEPT) == CONFIG.flood_limit
    assert admitted[-1] is Admission.FLOOD and scores.offences("new") == {"flood": 1}


def test_when_newcomers_spent_the_shared_budget_the_next_new_key_waits_its_turn() -> None:
    scores = PeerScores(CONFIG)
    spent = [scores.admit(f"k{i}", 0.0)[0] for i in range(CONFIG.newcomer_burst)]
    assert spent.count(Admission.ACCEPT) == CONFIG.newcomer_burst
    assert scores.admit("late", 0.0)[0] is Admission.NEWCOMERS
    assert scores.admit("late", 1.0)[0] is Admission.ACCEPT  # the budget refills with time


def test_a_ban_sends_a_key_back_to_probation_and_a_vouched_key_never_is() -> None:
    scores = PeerScores(CONFIG)
    now = _earn(scores, "peer", 0.0)
    for _ in range(3):
        scores.offence("peer", Offence.BAD_DATA, now)
    assert scores.is_banned("peer", now) and scores.on_probation("peer", now)
    assert scores.expire(now + CONFIG.ban_duration) == ["peer"]
    assert scores.on_probation("peer", now + CONFIG.ban_duration)
    assert scores.contributions("peer") == 0
    scores.vouch("trainer", 0.0)
    assert not scores.on_probation("trainer", 0.0)
    assert all(scores.admit("trainer", 0.0)[0] is Admission.ACCEPT for _ in range(CONFIG.flood_limit))


@given(st.integers(50, 400))
@settings(max_examples=10)
def test_fresh_keys_cannot_push_an_established_peer_out_of_memory(sybils: int) -> None:
    scores = PeerScores(CONFIG, max_peers=20)
    now = _earn(scores, "honest", 0.0)
    for i in range(sybils):
        scores.admit(f"sybil{i}", now)
        scores.expire(now)
    assert scores.tracked() <= 20 and not scores.on_probation("honest", now)
    assert scores.contributions("honest") > 0


def test_an_idle_newcomer_is_forgotten_and_an_established_peer_is_kept() -> None:
    scores = PeerScores(CONFIG)
    now = _earn(scores, "honest", 0.0)
    scores.admit("passer-by", now)
    later = now + CONFIG.probation_seconds + 1
    scores.expire(later)
    assert scores.contributions("honest") > 0 and not scores.on_probation("honest", later)
    assert scores.tracked() == 1 and scores.on_probation("passer-by", later)


@pytest.mark.parametrize(
    "bad",
    [
        {"probation_rate": 0.0},
        {"newcomer_rate": -1.0},
        {"probation_burst": 0},
        {"newcomer_burst": 0},
        {"probation_seconds": -1.0},
        {"probation_contributions": -1},
    ],
)
def test_bad_probation_terms_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(LocalProtocolError):
        ScoringConfig(**bad)  # type: ignore[arg-type]
