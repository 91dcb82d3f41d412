"""Who the swarm's data plane connects to: up to ``max_neighbours`` run members that advertise a data
plane, chosen at random (a random graph spreads pieces well), never ourselves or a banned peer."""

from __future__ import annotations

import random

import trio

from crypto.identity import address_from_peer_id
from crypto.keys import Address
from prime_node.node.context import NodeContext
from prime_node.swarm.transport import DataPlane

MAX_NEIGHBOURS = 12


async def keep_neighbours(
    dataplane: DataPlane, node: NodeContext, *, own: Address, max_neighbours: int, rng: random.Random
) -> None:
    """Dial members until ``max_neighbours`` channels are up or being dialed; runs until cancelled."""
    while True:
        links = dataplane.links
        if len(links) + len(dataplane.dialing) < max_neighbours:
            candidates = []
            for member in node.membership.members():
                record = member.record
                if (
                    record.dataplane_port
                    and record.address != own
                    and record.address not in links
                    and record.address not in dataplane.banned
                    and not node.policy.is_banned(member.peer_id)
                ):
                    host = dial_host(record.multiaddrs)
                    if host is not None:
                        candidates.append((record.address, host, record.dataplane_port, member.peer_id))
            rng.shuffle(candidates)
            room = max_neighbours - len(links) - len(dataplane.dialing)
            for address, host, port, peer_id in candidates[: max(room, 0)]:
                if address_from_peer_id(peer_id) == address:
                    dataplane.dial(address, host, port)
        await trio.sleep(0.5 if len(links) < 2 else 2.0)


def dial_host(multiaddrs: tuple[str, ...]) -> str | None:
    """The first usable IPv4/IPv6/DNS host among a peer's multiaddrs."""
    for multiaddr in multiaddrs:
        parts = multiaddr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6"):
            host = parts[2]
            if host not in ("0.0.0.0", "::"):
                return host
    return None
