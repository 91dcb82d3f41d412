"""The piece picker: a hypothesis state machine plus targeted cases (rarest first, end game)."""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from protocol.swarm.picker import PickerLimits, PiecePicker
from protocol.swarm.pieceset import from_indices, members, nth_member, random_member

PIECES = 12
PEERS = st.integers(0, 5)


class PickerMachine(RuleBasedStateMachine):
    """Peers come and go with arbitrary pieces; requests are answered, refused or lost at random."""

    @initialize(
        seed=st.integers(0, 2**32),
        have=st.integers(0, (1 << PIECES) - 1),
        per_peer=st.integers(1, 3),
        total=st.integers(1, 8),
        copies=st.integers(1, 3),
    )
    def start(self, seed: int, have: int, per_peer: int, total: int, copies: int) -> None:
        limits = PickerLimits(per_peer=per_peer, total=total, endgame_copies=copies)
        self.picker = PiecePicker(PIECES, random.Random(seed), have=have, limits=limits)
        self.peers: dict[int, int] = {}  # our model: what each connected peer holds
        self.have = have

    @rule(peer=PEERS, bits=st.integers(0, (1 << PIECES) - 1))
    def connect(self, peer: int, bits: int) -> None:
        if peer in self.peers:
            return
        self.picker.add_peer(peer, bits)
        self.peers[peer] = bits

    @precondition(lambda self: self.peers)
    @rule(data=st.data(), index=st.integers(0, PIECES - 1))
    def announce(self, data: st.DataObject, index: int) -> None:
        peer = data.draw(st.sampled_from(sorted(self.peers)))
        self.picker.peer_has(peer, index)
        self.peers[peer] |= 1 << index

    @precondition(lambda self: self.peers)
    @rule(data=st.data())
    def disconnect(self, data: st.DataObject) -> None:
        peer = data.draw(st.sampled_from(sorted(self.peers)))
        self.picker.remove_peer(peer)
        del self.peers[peer]

    @rule()
    def fill(self) -> None:
        for peer, index in self.picker.fill(sorted(self.peers)):
            assert not self.have >> index & 1, "asked for a piece we hold"
            assert isinstance(peer, int) and self.peers[peer] >> index & 1, (
                "asked a peer that lacks the piece"
            )

    @precondition(lambda self: self.picker.outstanding)
    @rule(data=st.data(), outcome=st.sampled_from(["arrives", "refused"]))
    def answer(self, data: st.DataObject, outcome: str) -> None:
        pairs = sorted((p, i) for p, s in self.picker.inflight.items() for i in s)
        peer, index = data.draw(st.sampled_from(pairs))
        if outcome == "arrives":
            others = self.picker.completed(index)
            assert peer in others
            self.have |= 1 << index
        else:
            self.picker.request_failed(peer, index)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "picker"):
            return
        picker = self.picker
        assert picker.have == self.have
        assert picker.outstanding == sum(len(s) for s in picker.inflight.values())
        assert picker.outstanding <= picker.limits.total
        pending = 0
        for peer, inflight in picker.inflight.items():
            assert len(inflight) <= picker.limits.per_peer
            for index in inflight:
                assert peer in picker.pending[index]
                pending |= 1 << index
        assert pending == picker.pending_bits
        assert not pending & self.have
        for index in range(PIECES):
            holders = sum(1 for bits in self.peers.values() if bits >> index & 1)
            assert picker.availability[index] == holders
            if not self.have >> index & 1:
                assert picker.buckets[holders] >> index & 1

    def teardown(self) -> None:
        """Whenever the live peers together hold every missing piece, answering requests completes."""
        if not hasattr(self, "picker"):
            return
        union = 0
        for bits in self.peers.values():
            union |= bits
        if (union | self.have) != (1 << PIECES) - 1:
            return
        for _ in range(10 * PIECES):
            self.fill()
            if self.picker.complete:
                break
            pairs = sorted((p, i) for p, s in self.picker.inflight.items() for i in s)
            assert pairs, "nothing requested although the peers hold what is missing"
            self.picker.completed(pairs[0][1])
            self.have |= 1 << pairs[0][1]
        assert self.picker.complete


TestPickerMachine = PickerMachine.TestCase
TestPickerMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


def test_rarest_first_with_random_tie_break() -> None:
    chosen = set()
    for seed in range(40):
        picker = PiecePicker(6, random.Random(seed), limits=PickerLimits(per_peer=1, total=1))
        picker.add_peer("a", from_indices(range(6)))
        picker.add_peer("b", from_indices([0, 1, 2, 3]))
        picker.add_peer("c", from_indices([0, 1]))
        # Pieces 4 and 5 are held by one peer only: always one of them first, each sometimes.
        index = picker.pick("a")
        assert index in (4, 5)
        chosen.add(index)
    assert chosen == {4, 5}


def test_end_game_duplicates_then_cancels() -> None:
    picker = PiecePicker(2, random.Random(1), limits=PickerLimits(per_peer=2, total=8, endgame_copies=2))
    picker.add_peer("slow", 0b11)
    picker.add_peer("fast", 0b11)
    first = picker.fill(["slow"])
    assert sorted(i for _, i in first) == [0, 1]
    assert picker.in_endgame()
    second = picker.fill(["fast"])
    assert sorted(i for _, i in second) == [0, 1]  # duplicates, each from the other peer
    assert picker.fill(["slow", "fast"]) == []  # copies capped at 2
    assert picker.completed(0) == ["fast", "slow"]  # the caller cancels the one that did not deliver
    assert picker.pending_bits == 0b10


def test_bit_helpers() -> None:
    rng = random.Random(5)
    for _ in range(200):
        bits = rng.getrandbits(70) | 1
        listed = members(bits)
        assert listed == [i for i in range(70) if bits >> i & 1]
        n = rng.randrange(len(listed))
        assert nth_member(bits, n) == listed[n]
        assert random_member(bits, rng) in listed
