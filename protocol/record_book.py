"""Signed peer records spreading over the neighbour overlay: which to keep, which to pass on, to whom.

Every node re-issues its own record (a ``PeerRecord`` in an Envelope it signed) every *refresh* period
and whenever what it says changes. Records travel between neighbours only, piggybacked on heartbeat
frames: a node passes each record it has not passed before to every neighbour except the one it came
from. So a record reaches everyone in a few hops, and in a quiet swarm no frames are sent beyond the
heartbeats themselves (DESIGN §4: per-node control traffic O(D)).

The refresh period grows with the swarm (``refresh_interval``): the swarm as a whole re-issues about
``refresh_budget`` records per second whatever its size, so the records a node receives per second stay
bounded as N grows; the price is that a peer that died without a neighbour noticing ages out more slowly
in a large swarm. The owner writes its period into the record (``PeerRecord.refresh_s``); receivers clamp
it to ``[min_refresh, max_refresh]`` so a record cannot make itself immortal.

The book is keyed by peer ID and holds at most ``max_records`` entries; the caller verifies signatures
(``consider`` first says whether a record is worth verifying, so stale copies cost nothing).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum

from protocol.errors import LocalProtocolError

MAX_RECORDS_PER_FRAME = 64


@dataclass(frozen=True)
class RecordBookConfig:
    refresh_budget: float = 2.0
    """Records per second the whole swarm re-issues, spread over its members."""
    min_refresh: float = 30.0
    max_refresh: float = 7200.0
    max_skew_ms: int = 30_000
    max_records: int = 10_000

    def __post_init__(self) -> None:
        if not (
            self.refresh_budget > 0 and 0 < self.min_refresh <= self.max_refresh and self.max_records > 0
        ):
            raise LocalProtocolError("bad record book limits", reason="bad_config")


def refresh_interval(known_peers: int, config: RecordBookConfig) -> float:
    """How often a node re-issues its record when it knows ``known_peers`` others."""
    return min(max((known_peers + 1) / config.refresh_budget, config.min_refresh), config.max_refresh)


def clamp_refresh(claimed_s: int, config: RecordBookConfig) -> float:
    """The refresh period a receiver believes (a record's own claim, within the book's bounds)."""
    return min(max(float(claimed_s), config.min_refresh), config.max_refresh)


class Offer(StrEnum):
    NEW = "new"
    """Newer than what we hold (or the first from this peer): verify it, then ``store``."""
    KNOWN = "known"
    """We hold this issue or a newer one: drop it, nothing to verify."""
    FROM_THE_FUTURE = "from_the_future"
    """Issued further ahead of our clock than envelopes may be: refuse it."""
    TOO_OLD = "too_old"
    """Older than any record can live: drop it (a slow path, not an offence)."""
    OWN = "own"
    """Our own record coming back: drop it."""


@dataclass
class StoredRecord:
    peer_id: str
    issued_ms: int
    envelope: bytes
    """The encoded Envelope exactly as its owner signed it (what we pass on)."""


@dataclass
class _Link:
    pending: OrderedDict[str, int] = field(default_factory=OrderedDict)
    """peer ID -> issue (ms) still to send on this link; a newer issue replaces an older one."""


class RecordBook:
    """Who said what about themselves, and what each neighbour still has to hear (see the module doc)."""

    def __init__(self, own_peer_id: str, config: RecordBookConfig = RecordBookConfig()) -> None:
        self.own_peer_id = own_peer_id
        self.config = config
        self._records: dict[str, StoredRecord] = {}
        self._by_envelope: dict[bytes, StoredRecord] = {}
        """The same records keyed by their exact bytes: a copy of one we hold is known without decoding."""
        self._links: dict[str, _Link] = {}

    def __len__(self) -> int:
        return len(self._records)

    def get(self, peer_id: str) -> StoredRecord | None:
        return self._records.get(peer_id)

    def holding(self, envelope: bytes) -> StoredRecord | None:
        """The record held whose signed bytes are exactly ``envelope`` (verified when it was stored), or
        None. Most records a node receives are copies of ones it holds, one from each neighbour: this
        spares each copy a decode."""
        return self._by_envelope.get(envelope)

    def peer_ids(self) -> list[str]:
        return sorted(self._records)

    def consider(self, peer_id: str, issued_ms: int, now_ms: int) -> Offer:
        """Is a record of ``peer_id`` issued at ``issued_ms`` worth verifying?"""
        if peer_id == self.own_peer_id:
            return Offer.OWN
        if issued_ms > now_ms + self.config.max_skew_ms:
            return Offer.FROM_THE_FUTURE
        if now_ms - issued_ms > 1000 * RECORD_LIFETIME_REFRESHES * self.config.max_refresh:
            return Offer.TOO_OLD
        held = self._records.get(peer_id)
        if held is not None and held.issued_ms >= issued_ms:
            return Offer.KNOWN
        return Offer.NEW

    def store(self, peer_id: str, issued_ms: int, envelope: bytes, *, came_from: str | None) -> bool:
        """Keep a verified record newer than the one held and queue it for every neighbour but
        ``came_from``. Returns False when the book is full of other peers (the caller may ``forget`` dead
        ones first). Our own record is stored with ``came_from=None`` like any other."""
        held = self._records.get(peer_id)
        if held is not None and held.issued_ms >= issued_ms:
            return True
        if held is None and len(self._records) >= self.config.max_records:
            return False
        if held is not None:
            self._by_envelope.pop(held.envelope, None)
        stored = self._records[peer_id] = StoredRecord(peer_id, issued_ms, envelope)
        self._by_envelope[envelope] = stored
        for neighbour, link in self._links.items():
            if neighbour in (came_from, peer_id):
                continue
            link.pending[peer_id] = issued_ms
            link.pending.move_to_end(peer_id)
        if came_from is not None and came_from in self._links:
            self._links[came_from].pending.pop(peer_id, None)  # it has this one (or a newer)
        return True

    def seen_from(self, neighbour: str, peer_id: str, issued_ms: int) -> None:
        """``neighbour`` passed us this issue (a duplicate): it need not hear it back from us."""
        link = self._links.get(neighbour)
        if link is not None and link.pending.get(peer_id, issued_ms + 1) <= issued_ms:
            del link.pending[peer_id]

    def forget(self, peer_id: str) -> None:
        held = self._records.pop(peer_id, None)
        if held is not None:
            self._by_envelope.pop(held.envelope, None)
        for link in self._links.values():
            link.pending.pop(peer_id, None)

    # -- links -------------------------------------------------------------------------------------------

    def link_up(self, neighbour: str, rng: random.Random) -> None:
        """A new neighbour: it gets every record we hold (in random order, so that a large table sent in
        several frames spreads different records first on different links), ours first."""
        link = self._links.setdefault(neighbour, _Link())
        others = [p for p in self._records if p not in (neighbour, self.own_peer_id)]
        rng.shuffle(others)
        order = ([self.own_peer_id] if self.own_peer_id in self._records else []) + others
        for peer_id in order:
            link.pending[peer_id] = self._records[peer_id].issued_ms

    def link_down(self, neighbour: str) -> None:
        self._links.pop(neighbour, None)

    def links(self) -> list[str]:
        return sorted(self._links)

    def pending_count(self, neighbour: str) -> int:
        link = self._links.get(neighbour)
        return len(link.pending) if link else 0

    def take(self, neighbour: str, limit: int = MAX_RECORDS_PER_FRAME) -> list[bytes]:
        """Up to ``limit`` queued records for ``neighbour``, oldest queued first, removed from its queue."""
        link = self._links.get(neighbour)
        if link is None:
            return []
        taken: list[bytes] = []
        while link.pending and len(taken) < limit:
            peer_id, issued_ms = link.pending.popitem(last=False)
            held = self._records.get(peer_id)
            if held is not None and held.issued_ms == issued_ms:
                taken.append(held.envelope)
        return taken

    def sample(self, count: int, rng: random.Random, *, excluding: str = "") -> list[bytes]:
        """``count`` random records (ours included): what a busy node hands a peer it refuses, so the peer
        learns others to link with."""
        candidates = [p for p in self._records if p != excluding]
        chosen = rng.sample(candidates, min(count, len(candidates)))
        return [self._records[p].envelope for p in chosen]


RECORD_LIFETIME_REFRESHES = 10
"""No record older than this many of the longest refresh periods is worth anything (protocol/membership.py
forgets peers after ``RECORD_FORGET`` refreshes)."""
