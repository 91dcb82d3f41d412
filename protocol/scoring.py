"""Local peer scores: misbehaviour costs points, and a peer below the threshold is cut off for a while.

Pure: the caller reports events with ``now`` (seconds) and acts on the returned actions. Each peer's
score starts at 0, drops by a fixed penalty per offence (invalid signature, malformed frame, a message
signed by someone else, flooding, ...), recovers by ``recovery_per_second`` toward 0 while the peer
behaves, and is capped at 0 (good behaviour earns no credit to spend on later abuse). Flooding is
measured here too: more than ``flood_limit`` messages inside one ``flood_window`` is an offence, charged
once per window. When a score falls to ``ban_threshold`` or below the peer is banned for
``ban_duration``: the node disconnects it and ignores its messages and dials until the ban ends.
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


DEFAULT_PENALTIES = {
    Offence.INVALID_SIGNATURE: 40.0,
    Offence.SIGNER_MISMATCH: 40.0,
    Offence.MALFORMED: 20.0,
    Offence.FLOOD: 30.0,
    Offence.STALE: 2.0,
    Offence.BAD_DATA: 50.0,
}


@dataclass(frozen=True)
class ScoringConfig:
    ban_threshold: float = -100.0
    ban_duration: float = 300.0
    recovery_per_second: float = 1.0
    flood_limit: int = 20
    flood_window: float = 1.0
    penalties: dict[Offence, float] = field(default_factory=lambda: dict(DEFAULT_PENALTIES))

    def __post_init__(self) -> None:
        if self.ban_threshold >= 0 or self.ban_duration <= 0 or self.recovery_per_second < 0:
            raise LocalProtocolError("bad scoring thresholds", reason="bad_config")
        if self.flood_limit < 1 or self.flood_window <= 0:
            raise LocalProtocolError("bad flood limits", reason="bad_config")
        if set(self.penalties) != set(Offence) or any(p <= 0 for p in self.penalties.values()):
            raise LocalProtocolError("every offence needs a positive penalty", reason="bad_config")


@dataclass(frozen=True)
class Disconnect:
    """Close the connection to ``peer_id`` and refuse it until ``until``."""

    peer_id: str
    until: float


@dataclass
class _Peer:
    score: float = 0.0
    updated: float = 0.0
    window_start: float = 0.0
    window_count: int = 0
    flood_charged: bool = False
    banned_until: float | None = None
    offences: dict[str, int] = field(default_factory=dict)


class PeerScores:
    def __init__(self, config: ScoringConfig = ScoringConfig(), *, max_peers: int = 10_000) -> None:
        self.config = config
        self.max_peers = max_peers
        self._peers: dict[str, _Peer] = {}

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

    def offence(self, peer_id: str, offence: Offence, now: float) -> list[Disconnect]:
        peer = self._peer(peer_id, now)
        self._recover(peer, now)
        peer.score -= self.config.penalties[offence]
        peer.offences[offence.value] = peer.offences.get(offence.value, 0) + 1
        if peer.score <= self.config.ban_threshold and not self.is_banned(peer_id, now):
            peer.banned_until = now + self.config.ban_duration
            return [Disconnect(peer_id, peer.banned_until)]
        return []

    def expire(self, now: float) -> list[str]:
        """Lift ended bans (the score restarts at the threshold's half) and drop recovered, idle peers."""
        lifted: list[str] = []
        for peer_id, peer in list(self._peers.items()):
            if peer.banned_until is not None and now >= peer.banned_until:
                peer.banned_until = None
                peer.score = self.config.ban_threshold / 2
                peer.updated = now
                lifted.append(peer_id)
            elif peer.banned_until is None:
                self._recover(peer, now)
                if peer.score == 0.0 and now - peer.window_start >= self.config.flood_window:
                    del self._peers[peer_id]
        return lifted

    def _peer(self, peer_id: str, now: float) -> _Peer:
        peer = self._peers.get(peer_id)
        if peer is None:
            if len(self._peers) >= self.max_peers:
                self.expire(now)
            if len(self._peers) >= self.max_peers:
                # Forget the best-behaved peer we track: bans and penalties are what must be kept.
                peers = self._peers
                del peers[max(peers, key=lambda p: (peers[p].banned_until is None, peers[p].score))]
            peer = _Peer(updated=now, window_start=now)
            self._peers[peer_id] = peer
        return peer

    def _recover(self, peer: _Peer, now: float) -> None:
        if peer.banned_until is None and now > peer.updated:
            peer.score = min(0.0, peer.score + (now - peer.updated) * self.config.recovery_per_second)
        peer.updated = max(peer.updated, now)
