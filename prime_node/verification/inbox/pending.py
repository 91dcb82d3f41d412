"""Batches the trainer has heard announced but not yet judged: the count its demand plans with (issue 38).

The trainer's inbox hears every rollout batch (a gossiped frame or a worker's offer) before any verdict
on it. Counting them in the demand as already had makes the demand's count of batches on their way
exact: an inferer then counts only its own batches the demand could not know of (those above the
worker's ``marks`` entry, the newest batch counter heard from it), instead of every inferer counting only
its own and several filling the same room.

Hostile announcements must not make the trainer believe it has work it has not. Only a *vouched*
worker's batches count (and are marked): one with a batch an accepting quorum of trusted validators
vouched for in this run. A fresh key costs nothing to make, so before this any number of Sybil keys,
each announcing batches it never sends, could fill the demand and starve the trainer; now each key must
first deliver verified work, and an unvouched worker's batches are simply not counted (its inferer then
counts them itself, since no mark covers them: at most one surplus batch per new worker). A vouched
worker has at most ``per_worker`` batches counted (the inbox's per-worker fetch share); a batch stops
counting when it is settled (handed to the trainer, rejected, dropped below the floor) or ``timeout_s``
after it was heard (a verdict that never comes), and at most ``max_batches`` are tracked in all (the
oldest forgotten). So a vouched key that announces batches it never delivers holds at most
``per_worker`` places for ``timeout_s``. Memory: at most ``max_batches`` batches, ``max_workers`` marks
and ``max_workers`` vouched workers.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from crypto.keys import Address

PENDING_TIMEOUT_S = 20.0
"""Seconds a heard batch counts without a verdict (the inferer's own verdict timeout)."""


@dataclass(frozen=True)
class _Pending:
    worker: Address
    policy_step: int
    heard_at: float


class PendingBatches:
    """See the module doc. Pure: callers pass ``now`` (monotonic seconds)."""

    def __init__(
        self,
        *,
        per_worker: int,
        timeout_s: float = PENDING_TIMEOUT_S,
        max_batches: int = 256,
        max_workers: int = 1024,
    ) -> None:
        if min(per_worker, max_batches, max_workers) < 1:
            raise ValueError("pending-batch bounds must be positive")
        self.per_worker = per_worker
        self.timeout_s = timeout_s
        self.max_batches = max_batches
        self.max_workers = max_workers
        self._pending: OrderedDict[bytes, _Pending] = OrderedDict()
        self._of_worker: Counter[Address] = Counter()
        self._marks: OrderedDict[Address, int] = OrderedDict()
        self._vouched: OrderedDict[Address, None] = OrderedDict()
        self.not_counted = 0
        """Batches heard beyond their worker's share (heard, marked, not counted)."""
        self.not_vouched = 0
        """Batches heard from workers with no accepted batch yet (neither counted nor marked)."""

    def vouched(self, worker: Address, counter: int | None = None) -> None:
        """An accepting quorum vouched for a batch of ``worker``'s (batch counter ``counter``): its
        announcements count from now on, and the mark covers that batch. Without the mark its inferer
        would go on counting it (and the unvouched ones before it) as on its way: a lone new inferer,
        whose batches all came before it was vouched, then waited for its own verdict timeout (20 s)
        with the trainer idle, because nothing newer was heard to move the mark."""
        self._vouched.pop(worker, None)
        self._vouched[worker] = None  # the most recently vouched last
        while len(self._vouched) > self.max_workers:
            self._vouched.popitem(last=False)
        if counter is not None:
            self._mark(worker, counter)

    def _mark(self, worker: Address, counter: int) -> None:
        mark = self._marks.pop(worker, None)
        self._marks[worker] = counter if mark is None else max(mark, counter)  # the newest heard last
        while len(self._marks) > self.max_workers:
            self._marks.popitem(last=False)

    def is_vouched(self, worker: Address) -> bool:
        return worker in self._vouched

    def heard(self, batch_id: bytes, worker: Address, policy_step: int, counter: int, now: float) -> bool:
        """A screened batch of ``worker``'s was heard (frame or offer): if its worker is vouched, mark its
        counter and count it, unless it is counted already or its worker has its share counted; whether
        it counts now."""
        if worker not in self._vouched:
            self.not_vouched += 1
            return False
        self._mark(worker, counter)
        self.expire(now)
        if batch_id in self._pending:
            return True
        if self._of_worker[worker] >= self.per_worker:
            self.not_counted += 1
            return False
        self._pending[batch_id] = _Pending(worker, policy_step, now)
        self._of_worker[worker] += 1
        while len(self._pending) > self.max_batches:
            self._drop(next(iter(self._pending)))
        return True

    def settled(self, batch_id: bytes) -> bool:
        """The batch was handed out, rejected or dropped: it no longer counts; whether it did."""
        if batch_id not in self._pending:
            return False
        self._drop(batch_id)
        return True

    def expire(self, now: float) -> bool:
        """Stop counting batches heard over ``timeout_s`` ago; whether any was."""
        expired = False
        while self._pending:
            batch_id, pending = next(iter(self._pending.items()))
            if now - pending.heard_at <= self.timeout_s:
                break
            self._drop(batch_id)
            expired = True
        return expired

    def by_policy(self, now: float) -> Counter[int]:
        """Counted batches per policy step."""
        self.expire(now)
        return Counter(p.policy_step for p in self._pending.values())

    def marks(self, most: int) -> tuple[tuple[Address, int], ...]:
        """(worker, newest counter heard), the ``most`` most recently heard workers first."""
        return tuple((w, c) for w, c in reversed(self._marks.items()))[:most]

    def __len__(self) -> int:
        return len(self._pending)

    def _drop(self, batch_id: bytes) -> None:
        pending = self._pending.pop(batch_id)
        self._of_worker[pending.worker] -= 1
        if self._of_worker[pending.worker] <= 0:
            del self._of_worker[pending.worker]
