"""What other libp2p implementations need from our DHT and identify (issue 36, item 11; docs/protocol.md).

- **Our own addresses in our DHT answers.** Asked FIND_NODE for its own ID, py-libp2p 0.8.1 lists the node
  first, as the spec wants, but with the addresses its peerstore holds for itself: none. go-libp2p drops an
  address-less record, so a standard ``findPeer`` stopped there with nothing to dial.
  ``answer_with_own_addresses`` fills that record with the addresses the node can be dialled at, as they
  are when the answer is written (a relay slot taken later shows up).
- **Which protocols a peer offers**, from its identify (``offered``): a peer whose identify lists protocols
  but not ours is not asked for ours; a peer still being identified may be.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)


@runtime_checkable
class KnowsOfferedProtocols(Protocol):
    """A host that can tell from identify whether a peer serves a protocol (``Libp2pHost.offers``)."""

    def offers(self, peer_id: str, protocol_id: str) -> bool | None:
        """True or False once the peer's identify arrived, None while it is not known."""
        ...


def answer_with_own_addresses(dht: Any, own_addrs: Callable[[], list[str]]) -> None:
    """Give our own record in the DHT's answers (FIND_NODE for our ID) the addresses ``own_addrs`` names
    (multiaddrs without the ``/p2p/<us>`` suffix), where the peerstore gave it none."""
    from multiaddr import Multiaddr

    fill = dht._add_closer_peers_to_response  # py-libp2p 0.8.1's one writer of closerPeers
    me = dht.host.get_id().to_bytes()

    def with_own_addresses(response: Any, closest_peers: Any, exclude_peer_id: Any = None) -> None:
        fill(response, closest_peers, exclude_peer_id)
        for peer in response.closerPeers:
            if bytes(peer.id) == me and not peer.addrs:
                try:
                    peer.addrs.extend(Multiaddr(text).to_bytes() for text in own_addrs())
                except Exception:
                    log.debug("could not add our own addresses to a DHT answer", exc_info=True)

    dht._add_closer_peers_to_response = with_own_addresses


def offered(host: Any, peer_id: str, protocol_id: str) -> bool | None:
    """Whether ``peer_id`` serves ``protocol_id`` by its last identify (kept current by identify push);
    None until identify finished on the live connection, or when it listed no protocols at all."""
    from libp2p.peer.id import ID

    try:
        peer = ID.from_base58(peer_id)
        if peer not in host._identified_peers:  # set when identify finished, cleared on disconnect
            return None
        protocols = {str(p) for p in host.get_peerstore().get_protocols(peer)}
    except Exception:
        return None
    return (protocol_id in protocols) if protocols else None


async def push_identify(host: Any) -> None:
    """Tell connected peers our protocols changed (identify push, as go-libp2p does when a handler is
    added): py-libp2p pushes only when its listen addresses change, so a peer identified before a
    handler was set would go on thinking we lack it."""
    try:
        await host._push_identify_to_all_peers()
    except Exception:
        log.debug("identify push failed", exc_info=True)
