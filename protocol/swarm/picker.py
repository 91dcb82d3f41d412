"""The piece picker: which piece to request from which peer.

Rarest first: among the pieces a peer offers that we still need and have not requested, pick one held by
the fewest of our peers, breaking ties uniformly at random (the RNG is injected, so runs reproduce).
Spreading rare pieces first keeps every piece available when peers leave and gives every peer something
others want. Several requests stay in flight per peer, to hide latency. Once every missing piece is
requested (end game), a piece may also be requested from a second peer; when one copy arrives, the
others are cancelled, so one slow peer cannot hold up the end of a download.

Availability is kept in buckets (``buckets[c]`` = needed pieces held by exactly ``c`` peers) of int
bitsets, so one pick is a handful of big-int operations rather than a scan over every piece.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from protocol.errors import InvariantError
from protocol.swarm.pieceset import full_set, members, random_member


@dataclass(frozen=True)
class PickerLimits:
    """How many requests may be outstanding: per peer, in all, and copies of one piece in end game."""

    per_peer: int = 1
    total: int = 16
    endgame_copies: int = 4


class PiecePicker:
    """One downloader's view of which peers hold which pieces, and what it has asked whom for."""

    def __init__(
        self, piece_count: int, rng: random.Random, *, have: int = 0, limits: PickerLimits | None = None
    ):
        self.piece_count = piece_count
        self.rng = rng
        self.limits = limits or PickerLimits()
        self.have = have & full_set(piece_count)
        self.needed = full_set(piece_count) & ~self.have
        self.pending_bits = 0
        self.pending: dict[int, set[Hashable]] = {}
        self.peer_bits: dict[Hashable, int] = {}
        self.inflight: dict[Hashable, set[int]] = {}
        self.availability = [0] * piece_count
        self.buckets: list[int] = [self.needed]
        self.outstanding = 0

    # --- what peers hold -------------------------------------------------------------------------------

    def add_peer(self, peer: Hashable, bits: int = 0) -> None:
        if peer in self.peer_bits:
            raise InvariantError(f"peer {peer!r} already added", reason="duplicate_peer")
        self.peer_bits[peer] = 0
        self.inflight[peer] = set()
        self.peer_has_all(peer, bits)

    def peer_has(self, peer: Hashable, index: int) -> None:
        """``peer`` announced piece ``index`` (a repeated announcement changes nothing)."""
        bit = 1 << index
        bits = self.peer_bits[peer]
        if bits & bit:
            return
        self.peer_bits[peer] = bits | bit
        count = self.availability[index]
        self.availability[index] = count + 1
        if self.needed & bit:  # (the +1 case of _shift, inlined: this runs once per piece per neighbour)
            buckets = self.buckets
            buckets[count] ^= bit
            if count + 1 == len(buckets):
                buckets.append(0)
            buckets[count + 1] |= bit

    def peer_has_all(self, peer: Hashable, bits: int) -> None:
        new = bits & ~self.peer_bits[peer]
        if not new:
            return
        self.peer_bits[peer] |= new
        for index in members(new):
            self._shift(index, 1 << index, +1)

    def peer_lacks(self, peer: Hashable, index: int) -> None:
        """``peer`` refused piece ``index``: stop counting it as a holder (until it announces it again)."""
        bit = 1 << index
        bits = self.peer_bits[peer]
        if bits & bit:
            self.peer_bits[peer] = bits & ~bit
            self._shift(index, bit, -1)

    def remove_peer(self, peer: Hashable) -> list[int]:
        """Forget ``peer``; returns the pieces whose requests to it are now void."""
        bits = self.peer_bits.pop(peer)
        for index in members(bits):
            self._shift(index, 1 << index, -1)
        dropped = sorted(self.inflight.pop(peer))
        self.outstanding -= len(dropped)
        for index in dropped:
            self._unpend(peer, index)
        return dropped

    def _shift(self, index: int, bit: int, delta: int) -> None:
        count = self.availability[index]
        self.availability[index] = count + delta
        if self.needed & bit:
            buckets = self.buckets
            buckets[count] ^= bit
            if count + delta == len(buckets):
                buckets.append(0)
            buckets[count + delta] |= bit

    # --- requests --------------------------------------------------------------------------------------

    def in_endgame(self) -> bool:
        return bool(self.needed) and not (self.needed & ~self.pending_bits)

    def pick(self, peer: Hashable) -> int | None:
        """The piece to request from ``peer`` next, or None. Does not record the request."""
        offered = self.peer_bits[peer] & self.needed
        fresh = offered & ~self.pending_bits
        if fresh:
            buckets = self.buckets
            for count in range(1, len(buckets)):
                candidates = buckets[count] & fresh
                if candidates:
                    return random_member(candidates, self.rng)
        if not self.in_endgame():
            return None
        asked_here = 0
        for index in self.inflight[peer]:
            asked_here |= 1 << index
        saturated = 0
        for index, askers in self.pending.items():
            if len(askers) >= self.limits.endgame_copies:
                saturated |= 1 << index
        candidates = offered & ~asked_here & ~saturated
        return random_member(candidates, self.rng) if candidates else None

    def requested(self, peer: Hashable, index: int) -> None:
        inflight = self.inflight[peer]
        if index in inflight:
            raise InvariantError(f"piece {index} already requested from {peer!r}", reason="duplicate_request")
        inflight.add(index)
        self.outstanding += 1
        self.pending.setdefault(index, set()).add(peer)
        self.pending_bits |= 1 << index

    def fill(self, peers: Iterable[Hashable]) -> list[tuple[Hashable, int]]:
        """Pick and record requests for ``peers`` (in that order) up to the limits."""
        out: list[tuple[Hashable, int]] = []
        limits = self.limits
        for peer in peers:
            if self.outstanding >= limits.total:
                break
            inflight = self.inflight[peer]
            while self.outstanding < limits.total and len(inflight) < limits.per_peer:
                index = self.pick(peer)
                if index is None:
                    break
                self.requested(peer, index)
                out.append((peer, index))
        return out

    def request_failed(self, peer: Hashable, index: int) -> None:
        """The request was rejected, timed out, cancelled by us or answered with bad bytes."""
        inflight = self.inflight.get(peer)
        if inflight is not None and index in inflight:
            inflight.discard(index)
            self.outstanding -= 1
            self._unpend(peer, index)

    def _unpend(self, peer: Hashable, index: int) -> None:
        askers = self.pending.get(index)
        if askers is None:
            return
        askers.discard(peer)
        if not askers:
            del self.pending[index]
            self.pending_bits &= ~(1 << index)

    def is_inflight(self, peer: Hashable, index: int) -> bool:
        inflight = self.inflight.get(peer)
        return inflight is not None and index in inflight

    def completed(self, index: int) -> list[Hashable]:
        """Piece ``index`` is verified and stored; returns the other peers still asked for it (to cancel)."""
        bit = 1 << index
        if self.have & bit:
            return []
        self.have |= bit
        self.needed &= ~bit
        self.buckets[self.availability[index]] &= ~bit
        askers = self.pending.pop(index, set())
        self.pending_bits &= ~bit
        for peer in askers:
            self.inflight[peer].discard(index)
        self.outstanding -= len(askers)
        return sorted(askers, key=repr)

    @property
    def complete(self) -> bool:
        return not self.needed
