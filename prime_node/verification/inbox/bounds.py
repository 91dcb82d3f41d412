"""How many announced batches a node fetches at once, per worker and in all (issue 35; inbox.py uses it).

Each worker gets at most ``per_worker`` fetches pending and ``per_worker_bytes`` reserved; beyond either
its offer is refused on arrival (``refused_worker_fetches`` / ``refused_worker_bytes``). All workers
together get ``total`` fetches and ``max_bytes`` (reserved fetches plus the frames the owner holds): past
them, a worker with fewer pending fetches evicts the newest fetch of the worker with the most, so many keys
announcing batches they never deliver delay only each other; when no one has more to give up the offer is
dropped (``dropped_backlog``). A reservation is released exactly once, when its fetch ends or is evicted
(its cancel scope is cancelled then).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import trio

from crypto.keys import Address


@dataclass(eq=False)
class Reservation:
    """One fetch in the background: what it reserved, and how to call it off."""

    worker: Address
    size: int
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    ended: bool = False


class FetchBounds:
    """See the module doc; ``counts`` is shared with the owner's counters."""

    def __init__(
        self, *, total: int, max_bytes: int, per_worker: int, per_worker_bytes: int, counts: Counter[str]
    ) -> None:
        self.total = total
        self.max_bytes = max_bytes
        self.per_worker = per_worker
        self.per_worker_bytes = per_worker_bytes
        self.counts = counts
        self.pending: dict[Address, list[Reservation]] = {}
        self.fetches_pending = 0
        self.held_bytes = 0
        """Bytes reserved by fetches plus those of the frames the owner holds (``hold`` / ``release``)."""

    def hold(self, size: int) -> None:
        self.held_bytes += size

    def release(self, size: int) -> None:
        self.held_bytes -= size

    def reserve(self, worker: Address, size: int, *, count: bool = True) -> Reservation | None:
        """A reservation for a fetch of ``size`` bytes of ``worker``'s, or None (counted when ``count``)."""
        mine = self.pending.get(worker, [])
        reason = ""
        if len(mine) >= self.per_worker:
            reason = "refused_worker_fetches"
        elif sum(p.size for p in mine) + size > self.per_worker_bytes:
            reason = "refused_worker_bytes"
        elif not self._make_room(worker, size):
            reason = "dropped_backlog"
        if reason:
            self.counts[reason] += count
            return None
        reservation = Reservation(worker, size)
        self.pending.setdefault(worker, []).append(reservation)
        self.fetches_pending += 1
        self.held_bytes += size  # reserved now: the frame is this size or refused
        return reservation

    def _make_room(self, worker: Address, size: int) -> bool:
        own = len(self.pending.get(worker, ())) + 1
        while self.fetches_pending >= self.total or self.held_bytes + size > self.max_bytes:
            others = [w for w in self.pending if w != worker and len(self.pending[w]) > own]
            if not others:
                return False
            victim = max(others, key=lambda w: len(self.pending[w]))
            self.end(self.pending[victim][-1], evicted=True)
        return True

    def end(self, reservation: Reservation, *, evicted: bool = False) -> None:
        """Release what ``reservation`` holds (once); ``evicted``: also call its fetch off."""
        if reservation.ended:
            return
        reservation.ended = True
        queue = self.pending.get(reservation.worker, [])
        if reservation in queue:
            queue.remove(reservation)
        if not queue:
            self.pending.pop(reservation.worker, None)
        self.fetches_pending -= 1
        self.held_bytes -= reservation.size  # the owner holds the frame's bytes again if it keeps it
        if evicted:
            self.counts["evicted_fetches"] += 1
            reservation.scope.cancel()
