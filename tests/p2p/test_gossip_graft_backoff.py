"""The gossipsub router the host builds: a peer that waits out the PRUNE backoff it was given is not
treated as a GRAFT flooder (py-libp2p stores that backoff rounded down to whole seconds, so the GRAFT can
come up to 1 s early), while a GRAFT right after a PRUNE still is."""

from __future__ import annotations

import time

from libp2p.peer.id import ID

from crypto.keys import WalletKey
from prime_node.p2p.libp2p_build import GOSSIP_PRUNE_BACKOFF, gossipsub_router

TOPIC = "prime-node/test/heartbeats"


def _peer() -> ID:
    from libp2p.crypto.secp256k1 import create_new_key_pair

    return ID.from_pubkey(create_new_key_pair(WalletKey.generate().secret).public_key)


def test_graft_after_the_rounded_backoff_is_accepted() -> None:
    router = gossipsub_router(1)
    peer = _peer()
    # The pruned peer's own backoff: int(time.time()) + backoff, i.e. as little as backoff - 1 s.
    router.graft_flood_tracking[peer][TOPIC] = time.time() - (GOSSIP_PRUNE_BACKOFF - 1) - 0.01
    assert router._check_graft_flood_protection(peer, TOPIC)


def test_graft_soon_after_a_prune_is_still_a_flood() -> None:
    router = gossipsub_router(1)
    peer = _peer()
    router.graft_flood_tracking[peer][TOPIC] = time.time() - 1.0
    assert not router._check_graft_flood_protection(peer, TOPIC)
    router.graft_flood_tracking[peer][TOPIC] = time.time() - GOSSIP_PRUNE_BACKOFF / 2
    assert not router._check_graft_flood_protection(peer, TOPIC)


class _Pubsub:
    """What the router's mesh upkeep reads from its pubsub: which peers subscribe to which topic."""

    def __init__(self, peer_topics: dict[str, set[ID]]) -> None:
        self.peer_topics = peer_topics


def test_a_settled_mesh_is_left_alone() -> None:
    """Once the mesh is between degree_low and degree_high, heartbeats neither graft nor prune anyone.
    (py-libp2p's default peer scorer "opportunistically" grafted 2 more peers per topic on every heartbeat,
    so an idle swarm's meshes kept overflowing and being pruned back.)"""
    from libp2p.custom_types import TProtocol

    router = gossipsub_router(1)
    peers = [_peer() for _ in range(15)]
    router.pubsub = _Pubsub({TOPIC: set(peers)})
    for peer in peers:
        router.peer_protocol[peer] = TProtocol("/meshsub/1.1.0")
    router.mesh[TOPIC] = set(peers[: router.degree])
    for _ in range(20):
        grafts, prunes = router.mesh_heartbeat()
        assert not grafts and not prunes
    assert router.mesh[TOPIC] == set(peers[: router.degree])


def test_a_thin_mesh_is_topped_up_to_the_degree() -> None:
    """Below degree_low the plain gossipsub upkeep still grafts up to the target degree."""
    from libp2p.custom_types import TProtocol

    router = gossipsub_router(1)
    peers = [_peer() for _ in range(15)]
    router.pubsub = _Pubsub({TOPIC: set(peers)})
    for peer in peers:
        router.peer_protocol[peer] = TProtocol("/meshsub/1.1.0")
    router.mesh[TOPIC] = set(peers[:2])
    grafts, prunes = router.mesh_heartbeat()
    assert len(grafts) == router.degree - 2 and not prunes
    assert len(router.mesh[TOPIC]) == router.degree
