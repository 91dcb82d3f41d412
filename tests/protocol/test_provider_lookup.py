"""``ProviderLookup`` on a simulated Kademlia swarm: records live on the peers nearest the key (as
ADD_PROVIDER puts them); a lookup from any peer finds them within its query bound, never reports itself,
and stops once it has what it wants."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.provider_lookup import CLOSEST, MAX_QUERIES, PARALLEL, ProviderLookup, key_digest

KEY = b"/prime-node/run/test"


class Swarm:
    """``size`` peers; each knows ``known`` random others plus its nearest neighbours in XOR space (a
    routing table's shape), and the ``CLOSEST`` peers nearest the key hold every provider's record."""

    def __init__(self, size: int, providers: int, known: int, rng: random.Random) -> None:
        self.peers = [rng.randbytes(34) for _ in range(size)]
        self.providers = set(rng.sample(self.peers, providers))
        self.holders = set(by_distance(self.peers, key_digest(KEY))[:CLOSEST])
        self.tables: dict[bytes, set[bytes]] = {}
        for peer in self.peers:
            close = by_distance(self.peers, key_digest(peer))[1:9]  # [0] is the peer itself
            self.tables[peer] = (set(close) | set(rng.sample(self.peers, known))) - {peer}

    def answer(self, peer: bytes) -> tuple[list[bytes], list[bytes]]:
        records = sorted(self.providers) if peer in self.holders else []
        closer = by_distance(list(self.tables[peer]), key_digest(KEY))[:CLOSEST]
        return records, closer


def by_distance(peers: list[bytes], target: int) -> list[bytes]:
    return sorted(peers, key=lambda peer: key_digest(peer) ^ target)


def run(swarm: Swarm, me: bytes, want: int, rng: random.Random) -> ProviderLookup:
    lookup = ProviderLookup(KEY, me, want=want)
    lookup.add_providers([me] if me in swarm.providers else [])  # our own record, as after `provide`
    lookup.add_peers(swarm.tables[me])
    pending: list[bytes] = []
    while not lookup.done:
        pending += lookup.next_queries()
        assert len(lookup.in_flight) <= PARALLEL
        peer = pending.pop(rng.randrange(len(pending)))  # answers come back in any order
        lookup.answered(peer, *swarm.answer(peer))
    return lookup


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(30, 300),
    providers=st.integers(1, 25),
    known=st.integers(3, 20),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_lookup_finds_the_providers_within_its_bound(
    size: int, providers: int, known: int, seed: int
) -> None:
    rng = random.Random(seed)
    swarm = Swarm(size, providers, known, rng)
    me = rng.choice(sorted(swarm.providers))  # a provider looking for the others: the case py-libp2p missed
    lookup = run(swarm, me, want=40, rng=rng)
    assert set(lookup.providers) == swarm.providers - {me}
    assert len(lookup.queried) <= MAX_QUERIES
    assert not lookup.in_flight


def test_it_stops_as_soon_as_it_has_enough() -> None:
    rng = random.Random(1)
    swarm = Swarm(200, 25, 10, rng)
    me = next(p for p in swarm.peers if p not in swarm.providers)
    lookup = run(swarm, me, want=5, rng=rng)
    assert len(lookup.providers) >= 5
    assert len(lookup.queried) < CLOSEST


def test_local_records_count_and_each_provider_counts_once() -> None:
    lookup = ProviderLookup(KEY, b"me", want=2)
    lookup.add_providers([b"me", b"a", b"a"])
    lookup.add_peers([b"p", b"me"])
    assert list(lookup.providers) == [b"a"] and not lookup.done
    assert lookup.next_queries() == [b"p"]
    assert lookup.next_queries() == []  # nobody else to ask while p is out
    lookup.answered(b"p", [b"a", b"b"], [b"me"])
    assert lookup.done and list(lookup.providers) == [b"a", b"b"]


def test_with_no_one_to_ask_it_is_done_at_once() -> None:
    lookup = ProviderLookup(KEY, b"me", want=1)
    assert lookup.done and lookup.next_queries() == []


def test_a_long_answer_counts_no_more_than_an_honest_one() -> None:
    lookup = ProviderLookup(KEY, b"me", want=3)
    lookup.add_peers([b"liar"])
    lookup.next_queries()
    lookup.answered(b"liar", [bytes([i]) for i in range(100)], [b"peer%d" % i for i in range(10_000)])
    assert len(lookup.providers) == 3
    assert len(lookup.known) == 1 + CLOSEST
