"""Our relayed address survives the relay's peerstore entry expiring (py-libp2p raises on expired
addresses; a home node crashed on it in the NAT swarm test, building its record on a heartbeat)."""

from __future__ import annotations

import multiaddr
from libp2p.crypto.secp256k1 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStore

from prime_node.p2p.nat_relay import RelayParts, peerstore_addrs, relayed_addrs


class _Conn:
    def __init__(self, addrs: list[multiaddr.Multiaddr]) -> None:
        self.addrs = addrs

    def get_transport_addresses(self) -> list[multiaddr.Multiaddr]:
        return self.addrs


class _Network:
    def __init__(self, conns: dict[ID, list[_Conn]]) -> None:
        self.conns = conns

    def get_connections(self, peer_id: ID) -> list[_Conn]:
        return self.conns.get(peer_id, [])


class _Host:
    """The three things ``relayed_addrs`` asks of a py-libp2p host; the peerstore is py-libp2p's own."""

    def __init__(self, peerstore: PeerStore, network: _Network) -> None:
        self.peerstore, self.network = peerstore, network

    def get_peerstore(self) -> PeerStore:
        return self.peerstore

    def get_network(self) -> _Network:
        return self.network


def test_an_expired_relay_entry_falls_back_to_the_connections_address() -> None:
    relay = ID.from_pubkey(create_new_key_pair().public_key)
    store = PeerStore()
    store.add_addrs(relay, [multiaddr.Multiaddr("/ip4/203.0.113.10/tcp/4001")], 1)
    store.peer_data_map[relay].last_identified -= 10  # the 1 s TTL ran out
    assert peerstore_addrs(_Host(store, _Network({})), relay) == []
    host = _Host(store, _Network({relay: [_Conn([multiaddr.Multiaddr("/ip4/203.0.113.10/tcp/4001")])]}))
    parts = RelayParts(protocol=None, transport=None, dcutr=None, serving=False)
    parts.reservations[relay.to_base58()] = f"/p2p/{relay.to_base58()}/p2p-circuit/p2p/ME"
    assert relayed_addrs(host, parts) == [
        f"/ip4/203.0.113.10/tcp/4001/p2p/{relay.to_base58()}/p2p-circuit/p2p/ME"
    ]


def test_a_reservation_whose_relay_left_is_dropped() -> None:
    relay = ID.from_pubkey(create_new_key_pair().public_key)
    parts = RelayParts(protocol=None, transport=None, dcutr=None, serving=False)
    parts.reservations[relay.to_base58()] = "/p2p/x/p2p-circuit/p2p/ME"
    assert relayed_addrs(_Host(PeerStore(), _Network({})), parts) == [] and not parts.reservations
