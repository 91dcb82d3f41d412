"""Who the swarm's data plane connects to: up to ``max_neighbours`` run members that advertise a data
plane, chosen at random (a random graph spreads pieces well), never ourselves or a banned peer.

A member is dialed at the host of its first direct multiaddr and its record's data-plane port; one that
has only relayed (``/p2p-circuit``) addresses is reached through the data plane's libp2p fallback alone,
as is one whose port does not answer (prime_node/dataplane/dialer.py). A neighbour linked over the
fallback is tried on TCP again whenever its pause ends (``DataPlane.upgrade``)."""

from __future__ import annotations

import random

import trio

from crypto.identity import address_from_peer_id
from crypto.keys import Address
from prime_node.dataplane.dialer import dial_host
from prime_node.node.context import NodeContext
from prime_node.swarm.transport import DataPlane

MAX_NEIGHBOURS = 12


async def keep_neighbours(
    dataplane: DataPlane, node: NodeContext, *, own: Address, max_neighbours: int, rng: random.Random
) -> None:
    """Dial members until ``max_neighbours`` channels are up or being dialed; runs until cancelled."""
    while True:
        links = dataplane.links
        upgrade_fallback_links(dataplane, node)
        if len(links) + len(dataplane.dialing) < max_neighbours:
            candidates = []
            for member in node.membership.members():
                record = member.record
                if (
                    record.dataplane_port
                    and record.address != own
                    and record.address not in links
                    and record.address not in dataplane.dialing
                    and record.address not in dataplane.banned
                    and not node.policy.is_banned(member.peer_id)
                ):
                    host = dial_host(record.multiaddrs)
                    if host is not None or dataplane.p2p is not None:
                        candidates.append((record.address, host, record.dataplane_port, member.peer_id))
            rng.shuffle(candidates)
            room = max_neighbours - len(links) - len(dataplane.dialing)
            for address, host, port, peer_id in candidates[: max(room, 0)]:
                if address_from_peer_id(peer_id) == address:
                    dataplane.dial(address, host, port, peer_id=peer_id)
        await trio.sleep(0.5 if len(links) < 2 else 2.0)


def upgrade_fallback_links(dataplane: DataPlane, node: NodeContext) -> None:
    """Try TCP again to the neighbours linked over the fallback whose pause is over."""
    if not any(link.fallback for link in dataplane.links.values()):
        return
    for member in node.membership.members():
        record = member.record
        link = dataplane.links.get(record.address)
        if link is not None and link.fallback and record.dataplane_port:
            dataplane.upgrade(record.address, dial_host(record.multiaddrs), record.dataplane_port)
