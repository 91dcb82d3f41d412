"""The neighbour overlay: each node keeps between ``degree`` and ``max_degree`` direct links, and the
frames those links carry.

A node opens links on its own until it has ``degree`` of them, to random peers it knows are healthy; it
accepts links others open until it has ``max_degree``, and refuses beyond that (a refusal carries a
random sample of the records it holds, so the refused peer learns whom else to ask). Both ends of a link
send a frame every heartbeat interval (the beat: liveness of a neighbour) and piggyback the peer records
the other end has not heard yet (protocol/record_book.py). Random choices over the whole known swarm keep
the overlay an expander, so records cross it in O(log N) hops.

Frames (one ``NeighbourFrame`` per length-prefixed stream frame):
- ``hello``: the opener's own signed record: "be my neighbour";
- ``welcome`` / ``busy``: the answer, with the answerer's record (welcome) or a sample (busy, then close);
- ``beat``: liveness, plus queued records;
- ``bye``: the sender drops the link on purpose (judge it by its records from now on).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated

from protocol.codec import IntRange, MaxLen, Message, message
from protocol.errors import InvariantError, LocalProtocolError
from protocol.record_book import MAX_RECORDS_PER_FRAME

MAX_RECORD_ENVELOPE = 6144
MAX_NEIGHBOUR_FRAME = MAX_RECORDS_PER_FRAME * (MAX_RECORD_ENVELOPE + 8) + 256
BUSY_SAMPLE = 16


def next_beat_at(now: float, interval: float) -> float:
    """When a link's next beat is due: the first multiple of ``interval`` after ``now`` (on the node's own
    clock). Every link of a node beats on the same grid, so one wake-up sends all their beats; each beat
    from its own timer cost the node a run-loop wake-up of its own, and an idle node's CPU is mostly
    those wake-ups (docs/benchmarks.md, issue 16). A beat sent early (urgent records) keeps its link on
    the grid."""
    if interval <= 0:
        raise LocalProtocolError("the heartbeat interval must be positive", reason="bad_config")
    # Grid points are always ``k * interval`` for an integer k, so two links on the same point compute the
    # same float (``due + interval`` can differ from ``(k + 1) * interval`` in the last bit).
    k = math.floor(now / interval) + 1
    due = k * interval
    return due if due > now else (k + 1) * interval  # ``now`` on a grid point may divide to just under it


class FrameKind(StrEnum):
    HELLO = "hello"
    WELCOME = "welcome"
    BUSY = "busy"
    BEAT = "beat"
    BYE = "bye"


@message("p2p.neighbour_frame", max_bytes=MAX_NEIGHBOUR_FRAME)
@dataclass(frozen=True)
class NeighbourFrame(Message):
    kind: Annotated[str, MaxLen(8)]
    sent_ms: Annotated[int, IntRange(0, (1 << 63) - 1)]
    """The sender's wall clock (for latency and skew display only: the link is authenticated, the
    records inside are signed, this number proves nothing)."""
    records: Annotated[
        tuple[Annotated[bytes, MaxLen(MAX_RECORD_ENVELOPE)], ...], MaxLen(MAX_RECORDS_PER_FRAME)
    ]

    def __post_init__(self) -> None:
        if self.kind not in FrameKind.__members__.values():
            raise InvariantError(
                f"unknown neighbour frame kind {self.kind[:8]!r}", reason="bad_neighbour_frame"
            )


@dataclass(frozen=True)
class OverlayConfig:
    degree: int = 8
    max_degree: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.degree <= self.max_degree:
            raise LocalProtocolError("overlay needs 1 <= degree <= max_degree", reason="bad_config")


@dataclass
class Overlay:
    """Which peers are our neighbours, and whom to ask next."""

    own_peer_id: str
    config: OverlayConfig = field(default_factory=OverlayConfig)
    links: set[str] = field(default_factory=set)
    opening: set[str] = field(default_factory=set)
    """Peers we sent a hello to and await an answer from."""
    accepting: set[str] = field(default_factory=set)
    """Peers whose hello we accepted while our welcome goes out (their slot is held meanwhile)."""
    refused_by: dict[str, float] = field(default_factory=dict)
    """peer ID -> until when it is not asked again (it refused us, or could not be reached)."""
    failures: dict[str, int] = field(default_factory=dict)
    """peer ID -> attempts in a row that failed without an answer (their pause doubles)."""

    def slots(self) -> set[str]:
        """Peers holding a slot: linked, or a link to them is being opened or accepted. Every path to a
        link reserves its slot first, so links never outnumber ``max_degree``, even when an outbound
        attempt to a peer is refused while that peer's own hello to us is being accepted."""
        return self.links | self.opening | self.accepting

    def wanted(self) -> int:
        """How many more links to open now."""
        return max(0, self.config.degree - len(self.slots()))

    def choose(self, healthy: Iterable[str], now: float, rng: random.Random) -> list[str]:
        """Random healthy peers to open links to (not linked, not being opened, not recently refusing)."""
        for peer_id, until in list(self.refused_by.items()):
            if now >= until:
                del self.refused_by[peer_id]
        candidates = self.candidates(healthy)
        return rng.sample(candidates, min(self.wanted(), len(candidates)))

    def candidates(self, healthy: Iterable[str]) -> list[str]:
        """The peers among ``healthy`` a link could be opened to now."""
        return sorted(
            p
            for p in healthy
            if p != self.own_peer_id
            and p not in self.links
            and p not in self.opening
            and p not in self.accepting
            and p not in self.refused_by
        )

    def short_of_candidates(self, healthy: Iterable[str]) -> bool:
        """Wants more links than ``healthy`` peers could fill (then a DHT lookup may find others)."""
        return self.wanted() > len(self.candidates(healthy))

    def may_leave(self, peer_id: str) -> bool:
        """May we hang up on ``peer_id``, a bootstrap we joined through? Only once our links are full
        elsewhere and it holds no slot: hanging up while a link with it is being opened or accepted (its
        hello, or our re-ask after a lost link) cut that link, and the live peer was judged dead by its
        last beat."""
        return peer_id not in self.slots() and len(self.links) >= self.config.degree

    def accepts(self, peer_id: str) -> bool:
        """Take a link a peer opened to us? (Links we are opening count: they may all succeed.)"""
        if peer_id == self.own_peer_id:
            return False
        slots = self.slots()
        return peer_id in slots or len(slots) < self.config.max_degree

    def room_for(self, peer_id: str) -> bool:
        """May a link we opened, now accepted, stand? (Inbound links may have filled us meanwhile.)"""
        return peer_id in self.links or len(self.slots() - {peer_id}) < self.config.max_degree

    def refused(self, peer_id: str, now: float, *, answered: bool = True) -> None:
        """``peer_id`` said busy (``answered``: not asked again for ``REFUSAL_MEMORY`` s), or the attempt
        failed without an answer (a busy or unreachable peer: retried after 2 s, doubling up to the same
        limit, so a node whose only peer is a loaded bootstrap keeps trying)."""
        self.opening.discard(peer_id)
        if answered:
            pause = REFUSAL_MEMORY
        else:
            self.failures[peer_id] = failures = self.failures.get(peer_id, 0) + 1
            pause = min(FAILURE_PAUSE * 2 ** (failures - 1), REFUSAL_MEMORY)
        self.refused_by[peer_id] = now + pause
        if len(self.refused_by) > 4 * self.config.max_degree:
            del self.refused_by[min(self.refused_by, key=self.refused_by.__getitem__)]
        while len(self.failures) > 4 * self.config.max_degree:
            del self.failures[next(iter(self.failures))]

    def linked(self, peer_id: str, *, inbound: bool) -> None:
        """A link stands; it takes over the slot its own attempt held (``inbound``: our welcome, else our
        hello). An attempt the other way to the same peer keeps its slot until it ends on its own."""
        (self.accepting if inbound else self.opening).discard(peer_id)
        self.failures.pop(peer_id, None)
        self.links.add(peer_id)

    def unlinked(self, peer_id: str) -> None:
        """A link ended (an attempt still under way to the same peer keeps its own slot)."""
        self.links.discard(peer_id)


REFUSAL_MEMORY = 30.0
FAILURE_PAUSE = 2.0
REFILL_PAUSE = 0.25
"""Heartbeat intervals after an attempt ended without a link before a node that still wants links asks
other peers (not at its next beat: the first members of a swarm fill their slots first, and a joiner
learns of them first, from its bootstrap's refusal sample)."""
