"""What a super-seeding node learns about its swarm across versions (sans-IO, no clock).

Each version's ``SwarmNode`` is new, but the swarm it seeds to is mostly the same peers on the same
links. Without this memory every version started with the longest spread deadline (nothing measured
yet), so hoarders given a new version's first reveals held it for that whole deadline (issue 35: 26 s
where the fetch took 2 s without them), and with no piece left for an honest peer nothing on that
version could measure a hop to shorten it. So the node keeps, across versions:

- one hop's time (our upload to the receiver's ``have``): a moving average per peer, and the median of
  those over the peers remembered, so one slow or lying peer cannot stretch everyone's deadline; a new
  version's deadline starts from it;
- per peer, the pieces it made spread and the deadlines it missed: peers that re-served before get
  reveals first, peers that hoarded before start with one reveal at a time.

Peer ids are whatever the caller uses (hostile keys are free to make), so at most ``max_peers`` records
are kept, the least recently touched dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

MAX_PEERS_REMEMBERED = 4096
HOP_WEIGHT = 0.2
"""Weight of a new hop sample in the moving average."""


@dataclass(slots=True)
class PeerRecord:
    hop: float = 0.0
    """Moving average of its hops (0: none measured)."""
    spread: int = 0
    """Pieces we sent it first that another peer then announced (it re-served them)."""
    strikes: int = 0
    """Spread deadlines it missed."""


class SpreadMemory:
    """See the module doc. One per node, shared by the ``SwarmNode`` of every version it seeds."""

    def __init__(self, max_peers: int = MAX_PEERS_REMEMBERED) -> None:
        self.max_peers = max_peers
        self.hop_time = 0.0
        """The median of the remembered peers' hop averages, in seconds (0: never measured)."""
        self.hops = 0
        """Hop samples ever taken."""
        self.proven_peers = 0
        """Peers remembered as ``proven``."""
        self._peers: OrderedDict[Hashable, PeerRecord] = OrderedDict()

    def hop(self, peer: Hashable, sample: float) -> None:
        """One hop measured: ``sample`` seconds from our upload to ``peer``'s ``have``."""
        sample = max(sample, 0.0)
        record = self._touch(peer)
        record.hop = sample if not record.hop else (1 - HOP_WEIGHT) * record.hop + HOP_WEIGHT * sample
        self.hops += 1
        self._hop_median()

    def spread(self, peer: Hashable) -> None:
        """A piece we sent ``peer`` first was then announced by another peer."""
        self._count(peer, spread=1)

    def strike(self, peer: Hashable) -> None:
        """``peer`` missed a spread deadline."""
        self._count(peer, strikes=1)

    def record(self, peer: Hashable) -> PeerRecord | None:
        return self._peers.get(peer)

    def proven(self, peer: Hashable) -> bool:
        """It made pieces spread before, more than it missed deadlines."""
        record = self._peers.get(peer)
        return record is not None and record.spread > record.strikes

    def hoarded(self, peer: Hashable) -> bool:
        """It missed more deadlines than it made pieces spread."""
        record = self._peers.get(peer)
        return record is not None and record.strikes > record.spread

    def standing(self, peer: Hashable) -> int:
        """Reveal order: 0 for proven peers, 1 for unknown or even ones, 2 for hoarders."""
        return 0 if self.proven(peer) else 2 if self.hoarded(peer) else 1

    def __len__(self) -> int:
        return len(self._peers)

    def _hop_median(self) -> None:
        hops = sorted(record.hop for record in self._peers.values() if record.hop)
        if hops:
            middle = len(hops) // 2
            self.hop_time = hops[middle] if len(hops) % 2 else (hops[middle - 1] + hops[middle]) / 2

    def _touch(self, peer: Hashable) -> PeerRecord:
        record = self._peers.get(peer)
        if record is not None:
            self._peers.move_to_end(peer)
            return record
        record = self._peers[peer] = PeerRecord()
        dropped_hop = False
        while len(self._peers) > self.max_peers:
            _, dropped = self._peers.popitem(last=False)
            self.proven_peers -= dropped.spread > dropped.strikes
            dropped_hop |= bool(dropped.hop)
        if dropped_hop:
            self._hop_median()
        return record

    def _count(self, peer: Hashable, *, spread: int = 0, strikes: int = 0) -> None:
        record = self._touch(peer)
        was = record.spread > record.strikes
        record.spread += spread
        record.strikes += strikes
        self.proven_peers += (record.spread > record.strikes) - was
