"""Which members announce the run in the DHT: the few nearest the run's key, not everyone.

A DHT ``provide`` walks to the peers nearest the key (connecting to each it asks) and stores a record on
the 20 nearest. Measured with 64 processes joining a growing swarm 0.5 s apart (docs/benchmarks.md,
*Discovery*): every joiner providing held 52 libp2p connections per node instead of 19, and the swarm
formed 8.5–11.3 heartbeat intervals after the last join instead of 3.2. The records are only the way in
for a node that knows no member (DESIGN §4: neighbour records carry discovery after that), and a store
keeps 20 of them anyway. So a node provides only while it is one of the ``PROVIDERS`` members nearest the
key among those it knows (not dead), counting itself; a swarm smaller than that has every member provide.
Every node sees the same membership once formed, so they agree on the few without talking, and when one
leaves, the next nearest takes over at its next decision.

Distance is XOR of SHA-256 digests of the peer ID text and the key, as in Kademlia; only agreement
matters here, not the DHT's own metric.
"""

from __future__ import annotations

from collections.abc import Iterable

from protocol.provider_lookup import key_digest

PROVIDERS = 8


def _digest(text: str) -> int:
    return key_digest(text.encode())


def provides_run(me: str, members: Iterable[str], key: str, *, providers: int = PROVIDERS) -> bool:
    """Whether ``me`` should announce ``key``, given the live ``members`` it knows (``me`` may be among
    them)."""
    target = _digest(key)
    mine = _digest(me) ^ target
    nearer = sum(1 for peer in set(members) - {me} if _digest(peer) ^ target < mine)
    return nearer < providers
