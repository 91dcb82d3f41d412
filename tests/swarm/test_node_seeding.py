"""Seeding after a fetch (issue 15): which peers still want a version from us (``SwarmNode.peers_wanting``)
and the ``fetch --seed-until`` grammar."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prime_node.cli.seeding import SWARM_SEED_LIMIT, SeedPolicy, parse_seed_until
from prime_node.errors import NodeError
from protocol.swarm.messages import Bitfield, Have, Request
from protocol.swarm.pieceset import to_wire
from tests.swarm.test_node import FULL, MID, PIECES, node, sent


def test_peers_that_lack_pieces_want_the_version_until_they_announce_every_piece() -> None:
    seeder = node(have=FULL)
    seeder.connected("done", 0.0)
    seeder.connected("late", 0.0)
    seeder.receive("done", Bitfield(MID, to_wire(FULL, PIECES)), 0.0)
    seeder.receive("late", Bitfield(MID, to_wire(0b0011, PIECES)), 0.0)
    assert seeder.peers_wanting() == ["late"]
    seeder.receive("late", Have(MID, 2), 1.0)
    assert seeder.peers_wanting() == ["late"]
    seeder.receive("late", Have(MID, 3), 2.0)
    assert seeder.peers_wanting() == []


def test_only_peers_that_asked_recently_count_when_asked_since_is_given() -> None:
    seeder = node(have=FULL)
    for peer in ("asker", "sitter"):
        seeder.connected(peer, 0.0)
        seeder.receive(peer, Bitfield(MID, b"\x00"), 0.0)
    seeder.receive("asker", Request(MID, 1), 5.0)
    assert sorted(seeder.peers_wanting()) == ["asker", "sitter"]  # type: ignore[type-var]
    assert seeder.peers_wanting(asked_since=4.0) == ["asker"]
    assert seeder.peers_wanting(asked_since=6.0) == []
    seeder.disconnected("asker", 7.0)
    assert seeder.peers_wanting() == ["sitter"]


@pytest.mark.parametrize(
    ("text", "policy"),
    [
        ("done", SeedPolicy("done")),
        ("never", SeedPolicy("never")),
        ("swarm", SeedPolicy("swarm", SWARM_SEED_LIMIT)),
        ("swarm:45", SeedPolicy("swarm", 45.0)),
        ("Swarm:2m", SeedPolicy("swarm", 120.0)),
        ("90", SeedPolicy("duration", 90.0)),
        ("90s", SeedPolicy("duration", 90.0)),
        ("1.5h", SeedPolicy("duration", 5400.0)),
        ("0", SeedPolicy("duration", 0.0)),
    ],
)
def test_seed_until_accepts_done_swarm_never_and_durations(text: str, policy: SeedPolicy) -> None:
    assert parse_seed_until(text) == policy


@given(st.text(max_size=20))
def test_seed_until_either_parses_or_says_why_in_one_line(text: str) -> None:
    try:
        policy = parse_seed_until(text)
    except NodeError as exc:
        assert exc.reason == "bad_option" and "\n" not in str(exc)
    else:
        assert policy.mode in ("done", "never", "swarm", "duration")
        assert 0 <= policy.seconds < float("inf")


def test_a_peer_that_completes_tells_the_complete_peers_it_skipped_so_they_stop_waiting_for_it() -> None:
    seeder, fetcher = node(have=FULL), node(have=FULL & ~1)
    to_fetcher = seeder.connected("F", 0.0)
    to_seeder = fetcher.connected("S", 0.0)
    fetcher.receive("S", to_fetcher[0].message, 0.0)  # type: ignore[union-attr]
    seeder.receive("F", to_seeder[0].message, 0.0)  # type: ignore[union-attr]
    assert seeder.peers_wanting() == ["F"]
    # Another complete peer; the fetcher's last piece arrives from whichever it asked.
    fetcher.connected("other", 0.0)
    fetcher.receive("other", Bitfield(MID, to_wire(FULL, PIECES)), 0.0)
    asked = next(p for p, s in fetcher.peers.items() if 0 in s.requested_at)
    done = fetcher.piece_checked(asked, 0, True, 1.0)
    bitfields = sent(done, Bitfield)
    assert ("S", Bitfield(MID, to_wire(FULL, PIECES))) in bitfields
    assert sent(done, Have) == []  # everyone holds every piece: no `have` needed
    for peer, message in bitfields:
        if peer == "S":
            seeder.receive("F", message, 1.0)  # type: ignore[arg-type]
    assert seeder.peers_wanting() == []
