"""A bounded Kademlia provider lookup: whom to ask next, and when to stop. Sans-IO: the caller sends the
GET_PROVIDERS queries and reports each answer.

Why our own: py-libp2p 0.8.1's ``find_providers`` answers from the local store whenever that holds any
record for the key, and after our own ``provide`` it always does (our record), so a node that provided the
run found only itself. Without local records it walks on until it holds ``count`` records, counting a
record once per peer that returned it, so with few providers it asked every peer of the swarm (76–78
connections per node at N = 64, docs/benchmarks.md). Here the records of other providers in the local
store count, each provider counts once, and the walk asks only peers among the ``closest`` nearest the key
that it knows of (where ADD_PROVIDER puts the records), ``parallel`` at a time, at most ``max_queries``.

Peers and providers are peer IDs as bytes; distance is Kademlia's, XOR of SHA-256 digests, as in
py-libp2p's routing table.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

CLOSEST = 20
"""Kademlia's k: ADD_PROVIDER stores a record on the k peers nearest the key."""
PARALLEL = 3
MAX_QUERIES = 2 * CLOSEST


def key_digest(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


class ProviderLookup:
    """One lookup of the providers of ``key``, seen from ``me``. Feed it the peers it may start from, ask
    ``next_queries`` whom to query, report each with ``answered``; ``done`` says when to stop and
    ``providers`` what was found (distinct, ``me`` left out, in the order found)."""

    def __init__(
        self,
        key: bytes,
        me: bytes,
        *,
        want: int,
        closest: int = CLOSEST,
        parallel: int = PARALLEL,
        max_queries: int = MAX_QUERIES,
    ) -> None:
        self._target = key_digest(key)
        self.me = me
        self.want = want
        self.closest = closest
        self.parallel = parallel
        self.max_queries = max_queries
        self.known: dict[bytes, int] = {}
        """Every peer heard of (not ``me``), with its distance to the key."""
        self.queried: set[bytes] = set()
        self.in_flight: set[bytes] = set()
        self.providers: dict[bytes, None] = {}

    def add_peers(self, peers: Iterable[bytes]) -> None:
        """Peers that may be asked (the routing table's, or closer peers named in an answer)."""
        for peer in peers:
            if peer != self.me and peer not in self.known:
                self.known[peer] = key_digest(peer) ^ self._target

    def add_providers(self, providers: Iterable[bytes]) -> None:
        for provider in providers:
            if provider != self.me:
                self.providers.setdefault(provider)

    def next_queries(self) -> list[bytes]:
        """Peers to query now (each at most once): the nearest not yet asked among the ``closest``
        nearest known, up to ``parallel`` in flight and ``max_queries`` in all."""
        if self.done:
            return []
        room = min(self.parallel - len(self.in_flight), self.max_queries - len(self.queried))
        chosen = [peer for peer in self._nearest() if peer not in self.queried][: max(0, room)]
        self.queried.update(chosen)
        self.in_flight.update(chosen)
        return chosen

    def answered(self, peer: bytes, providers: list[bytes], closer: list[bytes]) -> None:
        """``peer``'s answer (both lists empty if it failed or timed out). An answer counts for at most
        ``want`` providers and ``closest`` peers, so a hostile peer's long lists cost no more than an
        honest one's."""
        self.in_flight.discard(peer)
        self.add_providers(providers[: self.want])
        self.add_peers(closer[: self.closest])

    @property
    def done(self) -> bool:
        if len(self.providers) >= self.want:
            return True
        if self.in_flight:
            return False
        return len(self.queried) >= self.max_queries or all(p in self.queried for p in self._nearest())

    def _nearest(self) -> list[bytes]:
        return sorted(self.known, key=self.known.__getitem__)[: self.closest]
