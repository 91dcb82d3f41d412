"""Membership and scoring as hypothesis state machines: invariants hold for any sequence of events."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from protocol.membership import Membership, MembershipConfig, PeerState
from protocol.scoring import Offence, PeerScores, ScoringConfig

PEERS = [f"peer{i}" for i in range(5)]
CONFIG = MembershipConfig(unhealthy_after=3.0, dead_after=8.0, forget_after=20.0)


class MembershipMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.membership: Membership[int] = Membership(CONFIG)
        self.now = 0.0
        self.last_heard: dict[str, float] = {}

    @rule(peer=st.sampled_from(PEERS), record=st.integers())
    def heartbeat(self, peer: str, record: int) -> None:
        changes = self.membership.heard(peer, record, self.now)
        was_known = peer in self.last_heard
        self.last_heard[peer] = self.now
        member = self.membership.get(peer)
        assert member is not None and member.state is PeerState.HEALTHY and member.record == record
        assert all(c.after is PeerState.HEALTHY for c in changes)
        assert (not was_known) == any(c.before is None for c in changes)

    @rule(dt=st.floats(min_value=0.0, max_value=10.0))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule()
    def tick(self) -> None:
        for change in self.membership.tick(self.now):
            if change.after is None:
                del self.last_heard[change.peer_id]
        for peer, heard in self.last_heard.items():
            silent = self.now - heard
            member = self.membership.get(peer)
            assert member is not None
            expected = (
                PeerState.DEAD
                if silent >= CONFIG.dead_after
                else PeerState.UNHEALTHY
                if silent >= CONFIG.unhealthy_after
                else PeerState.HEALTHY
            )
            assert member.state is expected

    @precondition(lambda self: bool(self.last_heard))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        peer = data.draw(st.sampled_from(sorted(self.last_heard)))
        assert self.membership.remove(peer)
        del self.last_heard[peer]

    @invariant()
    def table_matches_model(self) -> None:
        assert {m.peer_id for m in self.membership.members()} == set(self.last_heard)

    @invariant()
    def states_never_skip_back_without_a_heartbeat(self) -> None:
        for member in self.membership.members():
            if member.state is not PeerState.HEALTHY:
                assert self.now - member.last_heard >= CONFIG.unhealthy_after


TestMembership = MembershipMachine.TestCase

SCORING = ScoringConfig(ban_threshold=-100.0, ban_duration=30.0, recovery_per_second=1.0, flood_limit=5)


class ScoringMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.scores = PeerScores(SCORING)
        self.now = 0.0
        self.ban_ends: dict[str, float] = {}

    @rule(peer=st.sampled_from(PEERS), offence=st.sampled_from(list(Offence)))
    def offend(self, peer: str, offence: Offence) -> None:
        before = self.scores.score(peer, self.now)
        banned_before = self.scores.is_banned(peer, self.now)
        actions = self.scores.offence(peer, offence, self.now)
        after = self.scores.score(peer, self.now)
        assert after == before - SCORING.penalties[offence]
        if actions:
            assert not banned_before and after <= SCORING.ban_threshold
            assert [a.peer_id for a in actions] == [peer]
            self.ban_ends[peer] = actions[0].until
        assert self.scores.is_banned(peer, self.now) == (banned_before or bool(actions))

    @rule(peer=st.sampled_from(PEERS), count=st.integers(1, 12))
    def burst(self, peer: str, count: int) -> None:
        for _ in range(count):
            for action in self.scores.message(peer, self.now):
                self.ban_ends[peer] = action.until

    @rule(dt=st.floats(min_value=0.0, max_value=20.0))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule()
    def expire(self) -> None:
        lifted = self.scores.expire(self.now)
        for peer in lifted:
            assert self.now >= self.ban_ends.pop(peer)

    @invariant()
    def scores_never_positive_and_bans_consistent(self) -> None:
        for peer in PEERS:
            assert self.scores.score(peer, self.now) <= 0.0
            if self.scores.is_banned(peer, self.now):
                assert self.now < self.ban_ends[peer]
                assert self.scores.score(peer, self.now) <= SCORING.ban_threshold


TestScoring = ScoringMachine.TestCase


def test_a_flood_is_charged_once_per_window() -> None:
    scores = PeerScores(SCORING)
    for _ in range(SCORING.flood_limit * 3):
        scores.message("p", 0.0)
    assert scores.offences("p") == {"flood": 1}
    scores.message("p", 1.5)  # a new window: a single message is fine
    assert scores.offences("p") == {"flood": 1}
    assert scores.score("p", 1.5) == -SCORING.penalties[Offence.FLOOD] + 1.5


def test_a_banned_peer_is_released_after_the_ban() -> None:
    scores = PeerScores(SCORING)
    actions = []
    for _ in range(3):
        actions += scores.offence("p", Offence.INVALID_SIGNATURE, 0.0)
    assert len(actions) == 1 and actions[0].until == SCORING.ban_duration
    assert scores.is_banned("p", 10.0)
    assert scores.expire(SCORING.ban_duration) == ["p"]
    assert not scores.is_banned("p", SCORING.ban_duration)


def test_membership_walks_healthy_unhealthy_dead_and_back() -> None:
    membership: Membership[str] = Membership(CONFIG)
    membership.heard("a", "r1", 0.0)
    assert [c.after for c in membership.tick(3.0)] == [PeerState.UNHEALTHY]
    assert [c.after for c in membership.tick(8.0)] == [PeerState.DEAD]
    assert [(c.before, c.after) for c in membership.heard("a", "r2", 9.0)] == [
        (PeerState.DEAD, PeerState.HEALTHY)
    ]
    assert [c.after for c in membership.tick(29.0)] == [None]
    assert len(membership) == 0
