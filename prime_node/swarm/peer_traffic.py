"""Data-plane bytes per peer and route, kept after the peer's channel closes.

A checkpoint's pieces come from many peers over three routes: a direct TCP channel, a libp2p stream on a
direct (hole-punched) connection, or a libp2p stream through a relay. Totals alone cannot say whether
two peers behind NAT traded pieces with each other, nor who a node uploads to; this table can, for the
status page and the NAT tests. It keeps the ``MAX_PEERS`` peers most recently active, so a node that
meets thousands of peers over a run holds a bounded table.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from crypto.keys import Address

MAX_PEERS = 64


class Route(StrEnum):
    TCP = "tcp"
    LIBP2P = "libp2p"
    """A fallback stream on a direct libp2p connection (e.g. hole-punched)."""
    RELAYED = "relayed"
    """A fallback stream on a relayed libp2p connection (only where relayed fallback is allowed)."""


@dataclass
class PeerBytes:
    bytes_in: int = 0
    bytes_out: int = 0
    route: Route = Route.TCP
    """The route of the latest channel to this peer."""


class PeerTraffic:
    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        self.max_peers = max_peers
        self._peers: OrderedDict[Address, PeerBytes] = OrderedDict()

    def add(self, peer: Address, route: Route, *, bytes_in: int = 0, bytes_out: int = 0) -> None:
        entry = self._peers.pop(peer, None) or PeerBytes()
        entry.bytes_in += bytes_in
        entry.bytes_out += bytes_out
        entry.route = route
        self._peers[peer] = entry  # most recently active last
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)

    def get(self, peer: Address) -> PeerBytes | None:
        return self._peers.get(peer)

    def status(self) -> dict[str, dict[str, Any]]:
        """``{address: {"in", "out", "route"}}``, for the status API."""
        return {
            str(peer): {"in": entry.bytes_in, "out": entry.bytes_out, "route": entry.route.value}
            for peer, entry in self._peers.items()
        }
