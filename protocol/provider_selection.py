"""Which DHT provider records a node keeps and which it dials: bounded per IP group, known peers first.

A provider record costs one fresh identity, so a Sybil can fill a key's record list (Kademlia keeps 20)
and crowd out the honest providers. Records are therefore budgeted per IP group (see
``protocol.connection_admission.ip_group``) the way connections are: at most ``per_group`` records of one
group, known peers exempt, and a newcomer from a scarce group displaces a record of the most crowded
group when the list is full. Lookups keep the same bound and list known peers first, then the rest
round-robin across groups so that one crowded group cannot take the first places.

Pure: callers describe each record as a ``ProviderCandidate`` and act on the returned decisions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from protocol.errors import InvariantError


@dataclass(frozen=True)
class ProviderCandidate:
    peer_id: str
    group: str
    known: bool = False


@dataclass(frozen=True)
class ProviderDecision:
    """Store the newcomer or not, and which stored record (by peer ID) to drop first."""

    store: bool
    evict: str | None = None
    reason: str = "ok"


def select_providers(
    candidates: Sequence[ProviderCandidate], *, per_group: int, limit: int
) -> list[ProviderCandidate]:
    """Known peers first (in the given order), then the others round-robin across groups in order of first
    appearance, each group contributing at most ``per_group``; duplicates dropped; at most ``limit``."""
    if per_group < 1 or limit < 0:
        raise InvariantError("per_group must be positive and limit non-negative", reason="bad_limits")
    seen: set[str] = set()
    known: list[ProviderCandidate] = []
    queues: dict[str, list[ProviderCandidate]] = {}
    for candidate in candidates:
        if candidate.peer_id in seen:
            continue
        seen.add(candidate.peer_id)
        if candidate.known:
            known.append(candidate)
        else:
            queue = queues.setdefault(candidate.group, [])
            if len(queue) < per_group:
                queue.append(candidate)
    chosen = known[:limit]
    depth = 0
    while len(chosen) < limit and any(depth < len(q) for q in queues.values()):
        for queue in queues.values():
            if depth < len(queue) and len(chosen) < limit:
                chosen.append(queue[depth])
        depth += 1
    return chosen


def admit_provider(
    stored: Sequence[ProviderCandidate], newcomer: ProviderCandidate, *, capacity: int, per_group: int
) -> ProviderDecision:
    """Whether a key's record list (``stored``, oldest first) takes ``newcomer``, and what it drops."""
    if capacity < 1 or per_group < 1:
        raise InvariantError("capacity and per_group must be positive", reason="bad_limits")
    if any(s.peer_id == newcomer.peer_id for s in stored):
        return ProviderDecision(True, reason="refresh")
    counts: dict[str, int] = {}
    for record in stored:
        if not record.known:
            counts[record.group] = counts.get(record.group, 0) + 1
    own = counts.get(newcomer.group, 0)
    if not newcomer.known and own >= per_group:
        return ProviderDecision(False, reason="group_full")
    if len(stored) < capacity:
        return ProviderDecision(True)
    if not counts:
        return ProviderDecision(False, reason="full_of_known")
    crowded = max(counts, key=lambda g: counts[g])
    if not newcomer.known and counts[crowded] <= own + 1:
        return ProviderDecision(False, reason="full")
    victim = next(s.peer_id for s in stored if s.group == crowded and not s.known)
    return ProviderDecision(True, evict=victim, reason="displaced")
