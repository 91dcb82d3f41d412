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

When to decide first (``first_decision_due``): the decision is only as good as the membership the node
knows, so it waits for its neighbour links to fill (their records hand over the members) or, failing
that, for the membership it knows to stop growing.

Distance is XOR of SHA-256 digests of the peer ID text and the key, as in Kademlia; only agreement
matters here, not the DHT's own metric.
"""

from __future__ import annotations

from collections.abc import Iterable

from protocol.provider_lookup import key_digest

PROVIDERS = 8
DECIDE_AFTER = 3
"""Heartbeat intervals after the bootstrap answered before the first decision, with the links full."""
DECIDE_BY = 10
"""Heartbeat intervals after which a node whose links are not full decides once no new member has
appeared for one interval."""
DECIDE_LATEST = 30
"""Heartbeat intervals after which a node decides whatever it knows."""


def _digest(text: str) -> int:
    return key_digest(text.encode())


def provides_run(me: str, members: Iterable[str], key: str, *, providers: int = PROVIDERS) -> bool:
    """Whether ``me`` should announce ``key``, given the live ``members`` it knows (``me`` may be among
    them)."""
    target = _digest(key)
    mine = _digest(me) ^ target
    nearer = sum(1 for peer in set(members) - {me} if _digest(peer) ^ target < mine)
    return nearer < providers


def first_decision_due(
    since_joined: float, since_new_member: float, interval: float, *, links_full: bool
) -> bool:
    """Whether a node decides for the first time now. ``since_joined``: seconds since its bootstrap
    answered; ``since_new_member``: since the members it knows last grew; ``interval``: the heartbeat
    interval.

    A node that decided by the clock alone (``DECIDE_BY``) while a slow 64-process formation was still
    under way knew half the members, so a dozen thought themselves among the nearest: 13 ``provide``s
    instead of ~1, each a DHT walk of 20-40 connections that slowed the formation further
    (docs/benchmarks.md, issue 16). Waiting until the members it knows stop growing breaks that loop."""
    if since_joined >= DECIDE_LATEST * interval:
        return True
    if links_full:
        return since_joined >= DECIDE_AFTER * interval
    return since_joined >= DECIDE_BY * interval and since_new_member >= interval
