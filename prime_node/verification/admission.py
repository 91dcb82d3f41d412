"""What the trainer and every peer do with verdicts: admit only accepted work, score down rejected workers.

``VerdictBook`` collects verdicts that already passed ``open_verdict`` (signature, freshness, replay and
a trusted signer) and answers whether a batch is admitted: at least ``quorum`` distinct trusted
validators accepted it and none of them rejected it. Memory is bounded: the oldest batches are
forgotten first. ``apply_verdict`` turns a rejection into a peer-score offence, so a worker whose
batches keep failing is cut off by every node that saw the verdicts.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from crypto.keys import Address
from protocol.scoring import Disconnect, Offence, PeerScores
from protocol.verdict import Verdict


@dataclass
class _Votes:
    accepted_by: set[Address] = field(default_factory=set)
    rejected_by: set[Address] = field(default_factory=set)
    verdict: Verdict | None = None


class VerdictBook:
    def __init__(self, *, quorum: int = 1, capacity: int = 10_000) -> None:
        if quorum < 1 or capacity < 1:
            raise ValueError("quorum and capacity must be positive")
        self.quorum = quorum
        self.capacity = capacity
        self._votes: OrderedDict[bytes, _Votes] = OrderedDict()

    def record(self, verdict: Verdict, validator: Address) -> None:
        """Remember a trusted validator's verdict; a later one on the same batch replaces its earlier."""
        votes = self._votes.get(verdict.batch_id)
        if votes is None:
            votes = self._votes[verdict.batch_id] = _Votes()
            while len(self._votes) > self.capacity:
                self._votes.popitem(last=False)
        votes.accepted_by.discard(validator)
        votes.rejected_by.discard(validator)
        (votes.accepted_by if verdict.accepted else votes.rejected_by).add(validator)
        votes.verdict = verdict

    def admitted(self, batch_id: bytes) -> bool:
        votes = self._votes.get(batch_id)
        return votes is not None and not votes.rejected_by and len(votes.accepted_by) >= self.quorum

    def verdict_of(self, batch_id: bytes) -> Verdict | None:
        """The latest verdict recorded on the batch (a rejecting one, if ``rejected``, was recorded last
        when the rejection arrived)."""
        votes = self._votes.get(batch_id)
        return None if votes is None else votes.verdict

    def rejected(self, batch_id: bytes) -> bool:
        votes = self._votes.get(batch_id)
        return votes is not None and bool(votes.rejected_by)


def apply_verdict(
    scores: PeerScores, verdict: Verdict, worker_peer_id: str, *, now: float
) -> list[Disconnect]:
    """Charge the worker's peer for a rejected batch (``Offence.BAD_DATA``); accepted work costs nothing."""
    if verdict.accepted:
        return []
    return scores.offence(worker_peer_id, Offence.BAD_DATA, now)
