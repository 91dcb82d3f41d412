"""Super-seeding against hoarders, on the sans-IO node (issue 13 item 5): a piece revealed to a peer that
never requests it (SIT), or uploaded to a peer that never lets it spread (TAKE), is opened to everyone
once its deadline passes; a peer that re-serves what it gets keeps the economy of one upload per piece."""

from __future__ import annotations

from protocol.swarm.messages import Have, Request
from protocol.swarm.swarm_node import SwarmNode, Upload
from tests.swarm.test_node import FULL, MID, node, sent

DEADLINE = 30.0  # spread_timeout: the deadline before any hop has been measured


def _origin_with(peers: list[str]) -> tuple[SwarmNode, dict[str, int]]:
    origin = node(have=FULL, super_seed=True, reveal_per_peer=1, spread_timeout=DEADLINE)
    revealed = {}
    for peer in peers:
        ((_, have),) = sent(origin.connected(peer, 0.0), Have)
        revealed[peer] = have.index  # type: ignore[attr-defined]
    return origin, revealed


def test_a_piece_revealed_to_a_peer_that_never_asks_for_it_is_opened_after_the_deadline() -> None:
    origin, revealed = _origin_with(["sitter", "honest"])
    stuck = revealed["sitter"]
    assert sent(origin.receive("honest", Request(MID, stuck), 1.0), Upload) == []  # not offered to it
    origin.tick(DEADLINE - 1)
    assert not origin.open >> stuck & 1
    opened = origin.tick(DEADLINE + 1)
    assert ("honest", Have(MID, stuck)) in sent(opened, Have)  # announced to whoever lacks it
    assert Upload("honest", stuck) in origin.receive("honest", Request(MID, stuck), DEADLINE + 2)
    assert origin.peers["sitter"].hoarding  # a strike, nothing spread: one reveal at a time from now


def test_a_piece_uploaded_to_a_peer_that_never_lets_it_spread_is_opened() -> None:
    origin, revealed = _origin_with(["taker", "honest"])
    taken = revealed["taker"]
    assert origin.receive("taker", Request(MID, taken), 1.0) == [Upload("taker", taken)]
    origin.upload_done("taker", taken, 1.0)  # it never announces the piece nor serves it
    origin.tick(1.0 + 2 * DEADLINE - 1)
    assert not origin.open >> taken & 1
    opened = origin.tick(1.0 + 2 * DEADLINE + 1)
    assert ("honest", Have(MID, taken)) in sent(opened, Have)
    assert Upload("honest", taken) in origin.receive("honest", Request(MID, taken), 2 * DEADLINE + 3)


def test_a_piece_that_spreads_is_never_opened_and_counts_for_its_holder() -> None:
    origin, revealed = _origin_with(["relay", "honest"])
    piece = revealed["relay"]
    origin.receive("relay", Request(MID, piece), 1.0)
    origin.upload_done("relay", piece, 1.0)
    origin.receive("relay", Have(MID, piece), 1.5)  # one hop measured
    origin.receive("honest", Have(MID, piece), 2.0)  # the relay served it on
    for now in (10.0, 70.0, 200.0):
        origin.tick(now)
    assert not origin.open >> piece & 1
    assert origin.peers["relay"].spread == 1 and piece not in origin.unspread
    assert origin.served[piece] == 1  # uploaded once by the origin: the relay did the rest
