"""SwarmNode, one event at a time: the per-connection protocol, bans, cancels, timeouts, super-seeding."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec import decode_any, encode
from protocol.errors import LocalProtocolError
from protocol.swarm.messages import Bitfield, Cancel, Have, Piece, Reject, Request
from protocol.swarm.picker import PickerLimits
from protocol.swarm.pieceset import to_wire
from protocol.swarm.swarm_node import (
    AbortUpload,
    Action,
    Completed,
    Disconnect,
    Send,
    SwarmConfig,
    SwarmNode,
    Upload,
    Verify,
)

MID = bytes(range(32))
PIECES = 4
FULL = (1 << PIECES) - 1


def node(have: int = 0, **config: object) -> SwarmNode:
    return SwarmNode(MID, PIECES, rng=random.Random(0), config=SwarmConfig(**config), have=have)  # type: ignore[arg-type]


def sent(actions: list[Action], kind: type) -> list[tuple[object, object]]:
    return [(a.peer, a.message) for a in actions if isinstance(a, Send) and isinstance(a.message, kind)]


def test_messages_round_trip_through_the_codec() -> None:
    for message in (
        Bitfield(MID, b"\x0f"),
        Have(MID, 3),
        Request(MID, 1),
        Cancel(MID, 2),
        Reject(MID, 0, "missing"),
        Piece(MID, 1, b"bytes"),
    ):
        assert decode_any(encode(message)) == message
    with pytest.raises(LocalProtocolError):
        encode(Have(b"short", 1))


def test_download_from_a_seed_end_to_end() -> None:
    seed, leecher = node(have=FULL), node()
    to_leecher = seed.connected("L", 0.0)
    assert sent(to_leecher, Bitfield) == [("L", Bitfield(MID, to_wire(FULL, PIECES)))]
    assert sent(leecher.connected("S", 0.0), Bitfield) == [("S", Bitfield(MID, b"\x00"))]
    requests = sent(leecher.receive("S", to_leecher[0].message, 0.0), Request)  # type: ignore[union-attr]
    assert len(requests) == PickerLimits().per_peer
    completed = False
    for _ in range(PIECES):
        (_, request), *_ = requests
        assert isinstance(request, Request)
        uploads = seed.receive("L", request, 0.1)
        assert uploads == [Upload("L", request.index)]
        piece = Piece(MID, request.index, b"data")
        verify = leecher.receive("S", piece, 0.2)
        assert verify == [Verify("S", request.index, b"data")]
        seed.upload_done("L", request.index, 0.2)
        after = leecher.piece_checked("S", request.index, True, 0.3)
        assert not sent(after, Have)  # the seed holds everything: no point telling it
        completed = completed or any(isinstance(a, Completed) for a in after)
        requests = sent(after, Request)
    assert completed and leecher.complete and leecher.have == FULL


def test_have_goes_to_peers_that_lack_pieces() -> None:
    a = node(have=0b0001)
    a.connected("b", 0.0)
    a.receive("b", Bitfield(MID, b"\x02"), 0.0)
    a.receive("b", Request(MID, 0), 0.0)
    actions = a.piece_checked("b", 1, True, 0.0)
    assert ("b", Have(MID, 1)) in sent(actions, Have)


def test_requests_for_missing_pieces_and_too_many_requests_are_rejected() -> None:
    seed = node(have=0b0011, max_requests_from_peer=1, upload_slots=1)
    seed.connected("p", 0.0)
    assert sent(seed.receive("p", Request(MID, 3), 0.0), Reject) == [("p", Reject(MID, 3, "missing"))]
    assert seed.receive("p", Request(MID, 0), 0.0) == [Upload("p", 0)]
    assert sent(seed.receive("p", Request(MID, 1), 0.0), Reject) == [
        ("p", Reject(MID, 1, "too_many_requests"))
    ]
    assert sent(seed.receive("p", Request(bytes(32), 0), 0.0), Reject)[0][1].reason == "wrong_manifest"  # type: ignore[attr-defined]


def test_cancel_aborts_a_running_upload_and_frees_the_slot() -> None:
    seed = node(have=FULL, upload_slots=1)
    seed.connected("p", 0.0)
    seed.connected("q", 0.0)
    assert seed.receive("p", Request(MID, 0), 0.0) == [Upload("p", 0)]
    assert seed.receive("q", Request(MID, 1), 0.0) == []  # queued behind the one slot
    assert seed.receive("p", Cancel(MID, 0), 0.0) == [AbortUpload("p", 0), Upload("q", 1)]


def test_serving_prefers_the_peer_with_fewest_pieces() -> None:
    seed = node(have=FULL, upload_slots=1)
    for peer in ("busy", "rich", "poor"):
        seed.connected(peer, 0.0)
    seed.receive("rich", Bitfield(MID, b"\x07"), 0.0)
    assert seed.receive("busy", Request(MID, 0), 0.0) == [Upload("busy", 0)]
    seed.receive("rich", Request(MID, 3), 0.0)
    seed.receive("poor", Request(MID, 1), 0.0)
    assert seed.upload_done("busy", 0, 1.0) == [Upload("poor", 1)]


def test_a_corrupt_piece_bans_its_sender_and_the_piece_is_asked_elsewhere() -> None:
    me = node(limits=PickerLimits(per_peer=1, total=1))
    for peer in ("bad", "good"):
        me.connected(peer, 0.0)
    first = sent(me.receive("bad", Bitfield(MID, b"\x01"), 0.0), Request)
    assert first == [("bad", Request(MID, 0))]
    me.receive("good", Bitfield(MID, b"\x01"), 0.0)
    assert me.receive("bad", Piece(MID, 0, b"junk"), 1.0) == [Verify("bad", 0, b"junk")]
    actions = me.piece_checked("bad", 0, False, 1.0)
    assert Disconnect("bad", "corrupt_piece") in actions
    assert sent(actions, Request) == [("good", Request(MID, 0))]
    assert me.banned == {"bad"}
    assert me.connected("bad", 2.0) == [Disconnect("bad", "banned")]


def test_unsolicited_pieces_and_bad_bitfields_ban_the_peer() -> None:
    me = node()
    me.connected("pushy", 0.0)
    assert Disconnect("pushy", "unsolicited_piece") in me.receive("pushy", Piece(MID, 2, b"x"), 0.0)
    me.connected("garbled", 0.0)
    assert Disconnect("garbled", "bad_bitfield") in me.receive("garbled", Bitfield(MID, b"\xff"), 0.0)
    me.connected("outside", 0.0)
    assert Disconnect("outside", "bad_index") in me.receive("outside", Have(MID, PIECES), 0.0)
    assert me.banned == {"pushy", "garbled", "outside"}


def test_a_late_duplicate_after_cancel_is_ignored() -> None:
    me = node(limits=PickerLimits(per_peer=PIECES, total=2 * PIECES, endgame_copies=2))
    me.connected("a", 0.0)
    me.connected("b", 0.0)
    assert len(sent(me.receive("a", Bitfield(MID, b"\x0f"), 0.0), Request)) == PIECES
    # Every missing piece is now requested: end game, so b is asked for the same pieces too.
    assert len(sent(me.receive("b", Bitfield(MID, b"\x0f"), 0.0), Request)) == PIECES
    me.receive("a", Piece(MID, 0, b"x"), 1.0)
    actions = me.piece_checked("a", 0, True, 1.0)
    assert sent(actions, Cancel) == [("b", Cancel(MID, 0))]
    assert me.receive("b", Piece(MID, 0, b"x"), 1.1) == []
    assert not me.banned


def test_rejected_requests_are_asked_elsewhere() -> None:
    me = node(limits=PickerLimits(per_peer=1, total=1))
    me.connected("liar", 0.0)
    me.connected("honest", 0.0)
    me.receive("liar", Bitfield(MID, b"\x01"), 0.0)
    me.receive("honest", Bitfield(MID, b"\x01"), 0.0)
    holder = next(peer for peer, s in me.picker.inflight.items() if s)
    other = "honest" if holder == "liar" else "liar"
    actions = me.receive(holder, Reject(MID, 0, "missing"), 1.0)
    assert sent(actions, Request) == [(other, Request(MID, 0))]


def test_timeouts_cancel_and_then_disconnect() -> None:
    me = node(request_timeout=10.0, max_timeouts=2, limits=PickerLimits(per_peer=1, total=1))
    me.connected("sleepy", 0.0)
    me.receive("sleepy", Bitfield(MID, b"\x03"), 0.0)
    first = me.tick(11.0)
    assert sent(first, Cancel) and sent(first, Request)  # cancelled, then asked again (only holder)
    second = me.tick(22.0)
    assert Disconnect("sleepy", "unresponsive") in second
    assert "sleepy" not in me.peers


def test_super_seeding_reveals_distinct_pieces_and_refuses_others() -> None:
    origin = node(have=FULL, super_seed=True, reveal_per_peer=1)
    revealed = {}
    for peer in ("a", "b", "c", "d"):
        actions = origin.connected(peer, 0.0)
        assert sent(actions, Bitfield) == [(peer, Bitfield(MID, b"\x00"))]
        ((_, have),) = sent(actions, Have)
        revealed[peer] = have.index  # type: ignore[attr-defined]
    assert sorted(revealed.values()) == list(range(PIECES))  # each piece offered to exactly one peer
    other = next(i for i in range(PIECES) if i != revealed["a"])
    assert sent(origin.receive("a", Request(MID, other), 0.0), Reject) == [
        ("a", Reject(MID, other, "not_offered"))
    ]
    origin.connected("e", 0.0)
    assert not origin.peers["e"].revealed  # nothing unserved is left to offer it yet
    for peer, index in revealed.items():
        assert origin.receive(peer, Request(MID, index), 0.0) == [Upload(peer, index)]
        origin.upload_done(peer, index, 1.0)
    assert origin.served == [1] * PIECES
    assert origin.peers["e"].revealed  # second pass: now everyone is offered pieces


message_strategy = st.one_of(
    st.builds(Bitfield, st.just(MID), st.binary(max_size=2)),
    st.builds(Have, st.sampled_from([MID, bytes(32)]), st.integers(0, PIECES + 2)),
    st.builds(Request, st.just(MID), st.integers(0, PIECES + 2)),
    st.builds(Cancel, st.just(MID), st.integers(0, PIECES + 2)),
    st.builds(Reject, st.just(MID), st.integers(0, PIECES + 2), st.sampled_from(["missing", "x"])),
    st.builds(Piece, st.just(MID), st.integers(0, PIECES + 2), st.binary(max_size=4)),
)


@settings(max_examples=150, deadline=None)
@given(
    have=st.integers(0, FULL),
    super_seed=st.booleans(),
    events=st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.one_of(
                message_strategy,
                st.sampled_from(["join", "leave", "uploaded"]),
                st.booleans(),
                st.floats(0, 1000),
            ),
        ),
        max_size=40,
    ),
)
def test_hostile_message_sequences_never_crash_or_break_invariants(
    have: int, super_seed: bool, events: list[tuple[str, object]]
) -> None:
    me = node(have=FULL if super_seed else have, super_seed=super_seed, request_timeout=50.0)
    now = 0.0
    for peer, event in events:
        if event == "join":
            me.connected(peer, now)
        elif event == "leave":
            me.disconnected(peer, now)
        elif event == "uploaded":  # the transport finished sending the oldest upload in progress
            for p, index in sorted(me.uploads.active)[:1]:
                me.upload_done(p, index, now)
        elif isinstance(event, bool):  # the caller's verdict on whatever it was last asked to verify
            for p, index in [(p, i) for p, s in me.picker.inflight.items() for i in s][:1]:
                me.piece_checked(p, index, event, now)
        elif isinstance(event, float):
            now += event
            me.tick(now)
        else:
            me.receive(peer, event, now)  # type: ignore[arg-type]
        picker = me.picker
        assert set(picker.peer_bits) == set(me.peers) == set(picker.inflight)
        assert not me.banned & set(me.peers)
        assert picker.outstanding == sum(len(s) for s in picker.inflight.values()) <= picker.limits.total
        assert not picker.pending_bits & picker.have
        assert len(me.uploads.active) <= me.config.upload_slots
        assert all(n <= me.config.max_requests_from_peer for n in me.uploads.per_peer_count.values())
        assert all(peer in me.peers for peer, _ in me.uploads.active)
        if super_seed:
            assert me.reveals == [sum(i in s.revealed for s in me.peers.values()) for i in range(PIECES)]
