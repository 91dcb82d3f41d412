"""The per-peer byte table behind the status page's ``by_peer``: sums per peer, the latest route, and a
bound on how many peers it remembers."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given

from crypto.keys import Address
from prime_node.swarm.peer_traffic import PeerTraffic, Route

PEERS = [Address(bytes([i]) * 20) for i in range(6)]


def test_bytes_add_up_per_peer_and_the_latest_route_is_shown() -> None:
    traffic = PeerTraffic()
    traffic.add(PEERS[0], Route.RELAYED, bytes_in=10)
    traffic.add(PEERS[0], Route.LIBP2P, bytes_in=5, bytes_out=7)
    traffic.add(PEERS[1], Route.TCP, bytes_out=3)
    assert traffic.status() == {
        str(PEERS[0]): {"in": 15, "out": 7, "route": "libp2p"},
        str(PEERS[1]): {"in": 0, "out": 3, "route": "tcp"},
    }


@given(st.lists(st.tuples(st.sampled_from(PEERS), st.integers(0, 1000)), max_size=60))
def test_the_table_keeps_the_most_recently_active_peers_only(events: list[tuple[Address, int]]) -> None:
    traffic = PeerTraffic(max_peers=3)
    model: dict[Address, int] = {}  # insertion order = least recently active first
    for peer, size in events:
        traffic.add(peer, Route.TCP, bytes_in=size)
        model[peer] = model.pop(peer, 0) + size
        if len(model) > 3:
            del model[next(iter(model))]  # an evicted peer starts again from zero
        assert len(traffic.status()) <= 3
    assert {peer: entry["in"] for peer, entry in traffic.status().items()} == {
        str(peer): total for peer, total in model.items()
    }
