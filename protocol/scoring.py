"""Local peer scores: misbehaviour costs points, new keys must earn their budget, and a peer below the
threshold is cut off for a while.

Pure: the caller reports events with ``now`` (seconds) and acts on the returned actions. Each peer's
score starts at 0, drops by a fixed penalty per offence (invalid signature, malformed frame, a message
signed by someone else, flooding, unsolicited repair frames, ...), recovers by ``recovery_per_second``
toward 0 while the peer behaves, and is capped at 0 (good behaviour earns no credit to spend on later
abuse). Flooding is measured here too: more than ``flood_limit`` messages inside one ``flood_window`` is
an offence, charged once per window, and gossip beyond the limit is dropped. When a score falls to
``ban_threshold`` or below the peer is banned for ``ban_duration``: the node disconnects it and ignores
its messages and dials until the ban ends.

Bans are per key and a key costs nothing, so a key must *earn* its budget (Sybil bound). A key we have
not heard from before is on probation: its gossip is limited to ``probation_rate`` per second (bursts of
``probation_burst``), and all keys on probation together share one newcomer budget of ``newcomer_rate``
per second (bursts of ``newcomer_burst``) — however many fresh keys an attacker makes, together they get
no more than that, and a peer that earned its place is never slowed by them. A key leaves probation once
it has been known ``probation_seconds`` *and* ``probation_contributions`` of its messages were verified
and delivered (``credit``) *and* its score is clean; since contributions only pass through the newcomer
budget, at most ``newcomer_rate / probation_contributions`` keys per second can graduate. A ban sends a
key back to probation. ``vouch`` exempts keys the run itself names (trainer, trusted validators).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from protocol.errors import LocalProtocolError


class Offence(StrEnum):
    INVALID_SIGNATURE = "invalid_signature"
    SIGNER_MISMATCH = "signer_mismatch"
    MALFORMED = "malformed"
    FLOOD = "flood"
    STALE = "stale"
    BAD_DATA = "bad_data"
    UNSOLICITED = "unsolicited"


DEFAULT_PENALTIES = {
    Offence.INVALID_SIGNATURE: 40.0,
    Offence.SIGNER_MISMATCH: 40.0,
    Offence.MALFORMED: 20.0,
    Offence.FLOOD: 30.0,
    Offence.STALE: 2.0,
    Offence.BAD_DATA: 50.0,
    Offence.UNSOLICITED: 20.0,
}


@dataclass(frozen=True)
class ScoringConfig:
    ban_threshold: float = -100.0
    ban_duration: float = 300.0
    recovery_per_second: float = 1.0
    flood_limit: int = 20
    flood_window: float = 1.0
    penalties: dict[Offence, float] = field(default_factory=lambda: dict(DEFAULT_PENALTIES))
    probation_seconds: float = 30.0
    """How long a new key is known before it may leave probation."""
    probation_contributions: int = 10
    """How many of its gossip messages must have been verified and delivered before it may leave."""
    probation_rate: float = 10.0
    """Gossip messages per second one key on probation may have accepted: half a flood_limit (an honest
    demo inferer sends under 2: a rollout announcement per policy step and a peer record every 5 s)."""
    probation_burst: int = 20
    newcomer_rate: float = 20.0
    """Gossip messages per second all keys on probation together may have accepted: one flood_limit."""
    newcomer_burst: int = 40

    def __post_init__(self) -> None:
        if self.ban_threshold >= 0 or self.ban_duration <= 0 or self.recovery_per_second < 0:
            raise LocalProtocolError("bad scoring thresholds", reason="bad_config")
        if self.flood_limit < 1 or self.flood_window <= 0:
            raise LocalProtocolError("bad flood limits", reason="bad_config")
        if set(self.penalties) != set(Offence) or any(p <= 0 for p in self.penalties.values()):
            raise LocalProtocolError("every offence needs a positive penalty", reason="bad_config")
        if self.probation_seconds < 0 or self.probation_contributions < 0:
            raise LocalProtocolError("bad probation terms", reason="bad_config")
        if (
            min(self.probation_rate, self.newcomer_rate) <= 0
            or min(self.probation_burst, self.newcomer_burst) < 1
        ):
            raise LocalProtocolError("bad probation budgets", reason="bad_config")


class Admission(StrEnum):
    """What to do with one gossip message (only ``ACCEPT`` is processed; the others are dropped)."""

    ACCEPT = "accept"
    BANNED = "banned"  # the sender is banned (perhaps by this very message)
    FLOOD = "flood"  # over flood_limit in this window: charged once per window
    PROBATION = "probation"  # a key on probation over its own budget: not charged
    NEWCOMERS = "newcomers"  # the shared newcomer budget is spent: not the sender's fault, not charged


@dataclass(frozen=True)
class Disconnect:
    """Close the connection to ``peer_id`` and refuse it until ``until``."""

    peer_id: str
    until: float


@dataclass
class _Bucket:
    """A token bucket: ``rate`` tokens per second, at most ``burst`` held."""

    tokens: float
    updated: float

    def refill(self, rate: float, burst: int, now: float) -> None:
        if now > self.updated:
            self.tokens = min(float(burst), self.tokens + (now - self.updated) * rate)
            self.updated = now


@dataclass
class _Peer:
    score: float = 0.0
    updated: float = 0.0
    window_start: float = 0.0
    window_count: int = 0
    flood_charged: bool = False
    banned_until: float | None = None
    offences: dict[str, int] = field(default_factory=dict)
    first_seen: float = 0.0
    last_seen: float = 0.0
    contributions: int = 0
    established: bool = False
    vouched: bool = False
    budget: _Bucket = field(default_factory=lambda: _Bucket(0.0, 0.0))


class PeerScores:
    def __init__(self, config: ScoringConfig = ScoringConfig(), *, max_peers: int = 10_000) -> None:
        self.config = config
        self.max_peers = max_peers
        self._peers: dict[str, _Peer] = {}
        self._newcomers = _Bucket(float(config.newcomer_burst), 0.0)

    def score(self, peer_id: str, now: float) -> float:
        peer = self._peers.get(peer_id)
        if peer is None:
            return 0.0
        self._recover(peer, now)
        return peer.score

    def offences(self, peer_id: str) -> dict[str, int]:
        peer = self._peers.get(peer_id)
        return dict(peer.offences) if peer else {}

    def is_banned(self, peer_id: str, now: float) -> bool:
        peer = self._peers.get(peer_id)
        return peer is not None and peer.banned_until is not None and now < peer.banned_until

    def banned(self, now: float) -> list[str]:
        return sorted(p for p in self._peers if self.is_banned(p, now))

    def on_probation(self, peer_id: str, now: float) -> bool:
        """True for a key that has not (yet, or again) earned the full budget; unknown keys included."""
        peer = self._peers.get(peer_id)
        return peer is None or not self._established(peer, now)

    def tracked(self) -> int:
        """How many peers are remembered (bounded by ``max_peers``)."""
        return len(self._peers)

    def contributions(self, peer_id: str) -> int:
        peer = self._peers.get(peer_id)
        return peer.contributions if peer else 0

    def message(self, peer_id: str, now: float) -> list[Disconnect]:
        """Count one message from ``peer_id``; charges a flood offence once per window over the limit."""
        peer = self._peer(peer_id, now)
        if now - peer.window_start >= self.config.flood_window or now < peer.window_start:
            peer.window_start, peer.window_count, peer.flood_charged = now, 0, False
        peer.window_count += 1
        if peer.window_count > self.config.flood_limit and not peer.flood_charged:
            peer.flood_charged = True
            return self.offence(peer_id, Offence.FLOOD, now)
        return []

    def admit(self, peer_id: str, now: float) -> tuple[Admission, list[Disconnect]]:
        """Count one gossip message and decide whether it may be processed (see ``Admission``)."""
        if self.is_banned(peer_id, now):
            return Admission.BANNED, []
        actions = self.message(peer_id, now)
        if actions or self.is_banned(peer_id, now):
            return Admission.BANNED, actions
        peer = self._peers[peer_id]
        if peer.window_count > self.config.flood_limit:
            return Admission.FLOOD, []
        if self._established(peer, now):
            return Admission.ACCEPT, []
        config = self.config
        peer.budget.refill(config.probation_rate, config.probation_burst, now)
        self._newcomers.refill(config.newcomer_rate, config.newcomer_burst, now)
        if peer.budget.tokens < 1:
            return Admission.PROBATION, []
        if self._newcomers.tokens < 1:
            return Admission.NEWCOMERS, []
        peer.budget.tokens -= 1
        self._newcomers.tokens -= 1
        return Admission.ACCEPT, []

    def credit(self, peer_id: str, now: float) -> None:
        """One of the peer's messages was verified and delivered: progress toward leaving probation."""
        peer = self._peer(peer_id, now)
        peer.contributions += 1

    def vouch(self, peer_id: str, now: float) -> None:
        """Exempt a key the run itself names (trainer, trusted validators) from probation."""
        self._peer(peer_id, now).vouched = True

    def offence(self, peer_id: str, offence: Offence, now: float) -> list[Disconnect]:
        peer = self._peer(peer_id, now)
        self._recover(peer, now)
        peer.score -= self.config.penalties[offence]
        peer.offences[offence.value] = peer.offences.get(offence.value, 0) + 1
        if peer.score <= self.config.ban_threshold and not self.is_banned(peer_id, now):
            peer.banned_until = now + self.config.ban_duration
            peer.established, peer.contributions = False, 0  # a banned key earns its place again
            return [Disconnect(peer_id, peer.banned_until)]
        return []

    def expire(self, now: float) -> list[str]:
        """Lift ended bans (the score restarts at the threshold's half, the key on probation) and drop
        recovered peers on probation that fell silent; keys that earned their place are kept."""
        lifted: list[str] = []
        idle_after = max(self.config.flood_window, self.config.probation_seconds)
        for peer_id, peer in list(self._peers.items()):
            if peer.banned_until is not None and now >= peer.banned_until:
                peer.banned_until = None
                peer.score = self.config.ban_threshold / 2
                peer.updated = peer.first_seen = now
                lifted.append(peer_id)
            elif peer.banned_until is None:
                self._recover(peer, now)
                if (
                    peer.score == 0.0
                    and not (peer.established or peer.vouched)
                    and now - peer.last_seen >= idle_after
                ):
                    del self._peers[peer_id]
        return lifted

    def _established(self, peer: _Peer, now: float) -> bool:
        if peer.vouched or peer.established:
            return True
        self._recover(peer, now)
        peer.established = (
            peer.contributions >= self.config.probation_contributions
            and now - peer.first_seen >= self.config.probation_seconds
            and peer.score == 0.0
            and peer.banned_until is None
        )
        return peer.established

    def _peer(self, peer_id: str, now: float) -> _Peer:
        peer = self._peers.get(peer_id)
        if peer is None:
            if len(self._peers) >= self.max_peers:
                self.expire(now)
            if len(self._peers) >= self.max_peers:
                # Forget a clean newcomer with the least progress first: bans, penalties and earned
                # places are what must be kept (fresh keys must not push an established peer out).
                peers = self._peers
                del peers[max(peers, key=lambda p: _eviction_rank(peers[p]))]
            burst = float(self.config.probation_burst)
            peer = _Peer(updated=now, window_start=now, first_seen=now, budget=_Bucket(burst, now))
            self._peers[peer_id] = peer
        peer.last_seen = max(peer.last_seen, now)
        return peer

    def _recover(self, peer: _Peer, now: float) -> None:
        if peer.banned_until is None and now > peer.updated:
            peer.score = min(0.0, peer.score + (now - peer.updated) * self.config.recovery_per_second)
        peer.updated = max(peer.updated, now)


def _eviction_rank(peer: _Peer) -> tuple[bool, bool, float, int]:
    """Higher is forgotten first: unbanned, on probation, clean score, few contributions."""
    return (
        peer.banned_until is None,
        not (peer.established or peer.vouched),
        peer.score,
        -peer.contributions,
    )
