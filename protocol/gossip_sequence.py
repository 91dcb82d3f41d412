"""Per-sender sequence numbers for lossy gossip, and the gap detection that drives repair.

Gossip may drop, delay or reorder messages. Every frame a sender publishes on a topic carries the
sender's *epoch* (when it started, so a restart is recognised) and a sequence number counting up from
0. A receiver feeds each arriving frame to a ``SequenceTracker``, which answers with actions: deliver
it, ignore it (a duplicate or from an old epoch), and — when numbers were skipped — request the missing
ones directly from the sender. Gaps not repaired within ``repair_timeout`` are given up: gossip stays
lossy, but anything recoverable is recovered. Memory is bounded per sender and in senders.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated

from protocol.codec import IntRange, MaxLen, Message, message
from protocol.errors import InvariantError, LocalProtocolError

MAX_TOPIC_CHARS = 128
MAX_GOSSIP_PAYLOAD = 256 << 10
MAX_REPAIR_SPAN = 64
_U63 = IntRange(0, (1 << 63) - 1)


@message("p2p.gossip_frame", max_bytes=MAX_GOSSIP_PAYLOAD + 512)
@dataclass(frozen=True)
class GossipFrame(Message):
    """One gossip message: it rides inside an Envelope signed by its origin."""

    topic: Annotated[str, MaxLen(MAX_TOPIC_CHARS)]
    epoch_ms: Annotated[int, _U63]
    sequence: Annotated[int, _U63]
    payload: Annotated[bytes, MaxLen(MAX_GOSSIP_PAYLOAD)]


@message("p2p.repair_request", max_bytes=512)
@dataclass(frozen=True)
class RepairRequest(Message):
    """Ask a sender, over a direct stream, for its own frames ``first..last`` (inclusive) on ``topic``."""

    topic: Annotated[str, MaxLen(MAX_TOPIC_CHARS)]
    epoch_ms: Annotated[int, _U63]
    first: Annotated[int, _U63]
    last: Annotated[int, _U63]

    def __post_init__(self) -> None:
        if not self.first <= self.last < self.first + MAX_REPAIR_SPAN:
            raise InvariantError(
                f"repair span must be 1..{MAX_REPAIR_SPAN} sequence numbers", reason="bad_repair_request"
            )


@dataclass(frozen=True)
class Deliver:
    """Hand the frame to the application."""

    sender: str
    sequence: int
    repaired: bool


@dataclass(frozen=True)
class Ignore:
    """Drop the frame: ``duplicate`` or ``old_epoch``."""

    sender: str
    reason: str


@dataclass(frozen=True)
class RequestMissing:
    """Ask ``sender`` directly for ``first..last`` of ``epoch_ms``."""

    sender: str
    epoch_ms: int
    first: int
    last: int


Action = Deliver | Ignore | RequestMissing


@dataclass
class _SenderState:
    epoch_ms: int
    next_expected: int
    missing: dict[int, float] = field(default_factory=dict)  # sequence -> when the gap was seen


class SequenceTracker:
    """Tracks what has arrived from each sender on one topic (see the module doc)."""

    def __init__(
        self, *, max_gap: int = MAX_REPAIR_SPAN, max_senders: int = 4096, repair_timeout: float = 10.0
    ) -> None:
        if not 1 <= max_gap <= MAX_REPAIR_SPAN or max_senders < 1 or repair_timeout <= 0:
            raise LocalProtocolError("bad sequence tracker limits", reason="bad_config")
        self.max_gap = max_gap
        self.max_senders = max_senders
        self.repair_timeout = repair_timeout
        self.gaps_given_up = 0
        self._senders: OrderedDict[str, _SenderState] = OrderedDict()

    def missing(self, sender: str) -> list[int]:
        state = self._senders.get(sender)
        return sorted(state.missing) if state else []

    def observe(self, sender: str, epoch_ms: int, sequence: int, now: float) -> list[Action]:
        state = self._senders.get(sender)
        if state is None or epoch_ms > state.epoch_ms:
            # First contact or a restart: start from here, no history is owed.
            self._senders[sender] = _SenderState(epoch_ms, sequence + 1)
            self._senders.move_to_end(sender)
            while len(self._senders) > self.max_senders:
                self._senders.popitem(last=False)
            return [Deliver(sender, sequence, repaired=False)]
        self._senders.move_to_end(sender)
        if epoch_ms < state.epoch_ms:
            return [Ignore(sender, "old_epoch")]
        if sequence < state.next_expected:
            if state.missing.pop(sequence, None) is not None:
                return [Deliver(sender, sequence, repaired=True)]
            return [Ignore(sender, "duplicate")]
        first_missing = max(state.next_expected, sequence - self.max_gap)
        self.gaps_given_up += first_missing - state.next_expected
        for missing in range(first_missing, sequence):
            state.missing[missing] = now
        while len(state.missing) > self.max_gap:
            del state.missing[min(state.missing)]
            self.gaps_given_up += 1
        state.next_expected = sequence + 1
        actions: list[Action] = [Deliver(sender, sequence, repaired=False)]
        if first_missing < sequence:
            actions.append(RequestMissing(sender, epoch_ms, first_missing, sequence - 1))
        return actions

    def expire(self, now: float) -> int:
        """Give up gaps older than ``repair_timeout``; returns how many were given up."""
        given_up = 0
        for state in self._senders.values():
            stale = [seq for seq, seen in state.missing.items() if now - seen >= self.repair_timeout]
            for seq in stale:
                del state.missing[seq]
            given_up += len(stale)
        self.gaps_given_up += given_up
        return given_up

    def forget(self, sender: str) -> None:
        self._senders.pop(sender, None)
