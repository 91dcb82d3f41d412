"""Rules for NAT reachability: who may ask us for a dial-back, what the answers mean, which relay to try.

A dial-back server dials a TCP connection to whoever asks, so it could be turned into a reflector that
knocks on third parties. Three rules keep it harmless: it only ever dials the *requester's own observed
IP* (the caller enforces that), at most ``MAX_DIALBACK_PORTS`` ports per request, and requests are
rate-limited per peer and in total (``DialbackLimiter``). Whom to ask follows ``probe_order``: bootstrap
peers first, then the other connected peers in an order of the asking node's own, so the swarm's requests
spread over its peers instead of all landing on the same few. Relays are tried in the order given, and
one that refused us waits ``RELAY_RETRY_AFTER`` before it is tried again.

Pure: callers pass ``now`` (seconds from any monotonic clock) and act on the answers.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

Status = Literal["public", "private", "unknown"]

MAX_DIALBACK_PORTS = 4
PER_PEER_INTERVAL = 20.0  # one dial-back per peer per this many seconds
GLOBAL_BURST = 8  # dial-backs in any GLOBAL_WINDOW, all peers together
GLOBAL_WINDOW = 60.0
TRACKED_PEERS = 1024  # the per-peer table forgets the oldest beyond this
RELAY_RETRY_AFTER = 60.0
INBOUND_EVIDENCE = 2
"""Peers holding a direct connection they dialled to us: with this many, one failed dial-back is not
enough to call ourselves private (``combine``)."""
PRIVATE_EVIDENCE = 2
"""Failed dial-backs in a row that make a node private despite ``INBOUND_EVIDENCE``."""


@dataclass
class DialbackLimiter:
    """Admission of dial-back requests: one per peer per ``per_peer_interval`` and ``global_burst`` per
    ``global_window`` in all. Memory is bounded by ``tracked_peers``."""

    per_peer_interval: float = PER_PEER_INTERVAL
    global_burst: int = GLOBAL_BURST
    global_window: float = GLOBAL_WINDOW
    tracked_peers: int = TRACKED_PEERS
    _last: OrderedDict[str, float] = field(default_factory=OrderedDict)
    _recent: list[float] = field(default_factory=list)

    def allow(self, peer_id: str, now: float) -> bool:
        """Whether to serve ``peer_id`` now; an allowed request is counted."""
        last = self._last.get(peer_id)
        if last is not None and now - last < self.per_peer_interval:
            return False
        self._recent = [t for t in self._recent if now - t < self.global_window]
        if len(self._recent) >= self.global_burst:
            return False
        self._recent.append(now)
        self._last[peer_id] = now
        self._last.move_to_end(peer_id)
        while len(self._last) > self.tracked_peers:
            self._last.popitem(last=False)
        return True


def probe_order(
    own_peer_id: str, preferred: Sequence[str], connected: Iterable[str], limit: int
) -> list[str]:
    """At most ``limit`` connected peers to ask for a dial-back: the ``preferred`` (bootstrap) ones first,
    in their order, then the others ranked by a hash of both peer IDs. The rank is stable for one node
    and differs between nodes; sorted by ID instead, every node's first choice after a bootstrap that
    rate-limited it was the same peer, which then spent seconds dialling back half a 64-node swarm and
    lost all its neighbours' beats meanwhile."""
    connected = set(connected)
    first = [peer for peer in dict.fromkeys(preferred) if peer in connected]
    others = connected.difference(first)

    def rank(peer: str) -> bytes:
        return hashlib.blake2b(f"{own_peer_id}/{peer}".encode(), digest_size=8).digest()

    return (first + sorted(others, key=lambda peer: (rank(peer), peer)))[:limit]


def dialback_ports(ports: Iterable[int]) -> list[int]:
    """The ports a request may name: valid TCP ports, deduplicated, at most ``MAX_DIALBACK_PORTS``."""
    out: list[int] = []
    for port in ports:
        if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 and port not in out:
            out.append(port)
        if len(out) == MAX_DIALBACK_PORTS:
            break
    return out


def verdict(dial_results: Sequence[bool]) -> Status:
    """A server's answer as a status: reachable if any dial-back reached us, private if it tried and
    none did, unknown if it tried nothing (it refused or we named no port)."""
    if any(dial_results):
        return "public"
    return "private" if dial_results else "unknown"


def combine(verdicts: Iterable[Status], *, failed_in_a_row: int, dialled_in_by: int) -> Status:
    """Several servers' verdicts: one success is proof of reachability (a dial-back came in). Private
    needs none that succeeded and at least one failure; ``failed_in_a_row`` counts the "private" answers
    since the last "public" from any servers. A node that ``dialled_in_by`` ``INBOUND_EVIDENCE`` or more
    peers hold direct connections to (they reached it) needs ``PRIVATE_EVIDENCE`` failures in a row: one
    dial-back can time out on a loaded machine, and the saturated public bootstrap of a 64-process swarm
    took a single timeout for proof, reserved a relay slot it did not need and re-issued its record. A
    NAT'd home has no such connections before its relay, so one failure still settles it at once."""
    seen = set(verdicts)
    if "public" in seen:
        return "public"
    needed = PRIVATE_EVIDENCE if dialled_in_by >= INBOUND_EVIDENCE else 1
    return "private" if "private" in seen and failed_in_a_row >= needed else "unknown"


def should_reserve(status: Status, reserved: bool, enabled: bool) -> bool:
    """A node reserves a relay slot only when it knows it is unreachable (unknown: ask again first)."""
    return enabled and status == "private" and not reserved


@dataclass
class RelayPicker:
    """Which relay to try next: candidates in the caller's order, skipping ones that refused us within
    ``retry_after`` seconds. Memory is bounded by the candidates the caller keeps passing."""

    retry_after: float = RELAY_RETRY_AFTER
    _failed_at: dict[str, float] = field(default_factory=dict)

    def pick(self, candidates: Sequence[str], now: float) -> str | None:
        for peer_id in candidates:
            failed = self._failed_at.get(peer_id)
            if failed is None or now - failed >= self.retry_after:
                return peer_id
        return None

    def failed(self, peer_id: str, now: float) -> None:
        self._failed_at[peer_id] = now
        if len(self._failed_at) > TRACKED_PEERS:
            oldest = min(self._failed_at, key=self._failed_at.__getitem__)
            del self._failed_at[oldest]

    def succeeded(self, peer_id: str) -> None:
        self._failed_at.pop(peer_id, None)
