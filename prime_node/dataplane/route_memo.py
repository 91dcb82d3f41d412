"""Which peers' data-plane ports did not answer, and until when we do not try them again.

A peer behind NAT advertises a port nobody outside can reach; a dial there is refused or, worse, runs
into a timeout. Its channels go over a libp2p stream instead (libp2p_stream.py), and this memo makes that
the first choice for a while, so every dial does not pay the timeout again. The pause doubles with each
failure in a row (``base`` up to ``cap``) and one success forgets the peer: a peer that opened its port
(or moved) is back on TCP after at most ``cap`` seconds. The dialer keeps a second memo for peers whose
only libp2p connection is relayed (no bulk bytes there), so it does not open and drop a stream to them
on every pass of the neighbour loop. The swarm's data plane keeps a third, with longer pauses, for peers
whose frames failed a channel (prime_node/swarm/transport.py). Pure bookkeeping: the caller passes the
time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from crypto.keys import Address

RETRY_BASE = 60.0
"""Seconds without a TCP try after the first failure."""
RETRY_CAP = 900.0
"""The longest pause between TCP tries, however often they failed."""
MAX_PEERS = 4096
"""Peers remembered at once (the oldest failure is forgotten first): bounded whatever peers advertise."""


@dataclass
class _Failure:
    count: int
    retry_at: float


class RouteMemo:
    """See the module doc."""

    def __init__(
        self, *, base: float = RETRY_BASE, cap: float = RETRY_CAP, max_peers: int = MAX_PEERS
    ) -> None:
        self.base = base
        self.cap = cap
        self.max_peers = max_peers
        self._failures: OrderedDict[Address, _Failure] = OrderedDict()

    def may_try(self, peer: Address, now: float) -> bool:
        """Whether the route this memo is about (TCP to ``peer``'s port) is worth a try at ``now``."""
        failure = self._failures.get(peer)
        return failure is None or now >= failure.retry_at

    def failed(self, peer: Address, now: float) -> float:
        """The route to ``peer`` failed at ``now``: the time of the next try."""
        failure = self._failures.pop(peer, None)
        count = 1 if failure is None else failure.count + 1
        pause = min(self.cap, self.base * 2.0 ** min(count - 1, 32))
        self._failures[peer] = _Failure(count, now + pause)
        while len(self._failures) > self.max_peers:
            self._failures.popitem(last=False)
        return now + pause

    def succeeded(self, peer: Address) -> None:
        """The route to ``peer`` worked: forget its failures."""
        self._failures.pop(peer, None)

    def __len__(self) -> int:
        return len(self._failures)
