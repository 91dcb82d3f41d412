"""Items waiting, beside the work queue, for the policy step they claim; each leaves when ready or expires.

A validator cannot check a batch before it holds the claimed policy checkpoint, and waiting for it in the
check loop lets one sender stall every other (issue 13). Such items wait here instead, bounded per key
and in total. Beyond ``per_key`` the *new* item is refused: the waiting ones are nearer their step (or
their deadline, where a sender that claimed a step nobody published pays for it), so a flood cannot push
its own old claims out before they expire. Beyond ``capacity`` the newest item of the key holding most
goes. ``sweep`` hands back the items whose step became ready and those whose deadline passed. Pure: the
caller passes the time and says which steps are ready.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from protocol.errors import LocalProtocolError

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


@dataclass(frozen=True)
class Waiting(Generic[K, T]):
    key: K
    step: int
    item: T
    since: float
    deadline: float


class WaitingRoom(Generic[K, T]):
    """See the module doc."""

    def __init__(self, *, capacity: int, per_key: int) -> None:
        if capacity < 1 or per_key < 1:
            raise LocalProtocolError(
                "a waiting room needs a positive capacity and per-key bound", reason="bad_config"
            )
        self.capacity = capacity
        self.per_key = per_key
        self._by_key: dict[K, deque[Waiting[K, T]]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def park(self, key: K, step: int, item: T, *, now: float, deadline: float) -> list[Waiting[K, T]]:
        """Let ``item`` wait for ``step`` until ``deadline``; returns what was dropped to keep the bounds
        (``item`` itself when its key already has ``per_key`` waiting)."""
        queue = self._by_key.setdefault(key, deque())
        queue.append(Waiting(key, step, item, now, deadline))
        self._size += 1
        dropped: list[Waiting[K, T]] = []
        if len(queue) > self.per_key:
            dropped.append(self._take_newest(key))
        if self._size > self.capacity:
            dropped.append(self._take_newest(max(self._by_key, key=lambda k: len(self._by_key[k]))))
        return dropped

    def next_deadline(self) -> float | None:
        return min((w.deadline for queue in self._by_key.values() for w in queue), default=None)

    def sweep(
        self, now: float, ready: Callable[[int], bool]
    ) -> tuple[list[Waiting[K, T]], list[Waiting[K, T]]]:
        """(items whose step is ready, items past their deadline), each in arrival order; both leave.

        ``ready`` is asked once per distinct step waited for."""
        answers: dict[int, bool] = {}
        released: list[Waiting[K, T]] = []
        expired: list[Waiting[K, T]] = []
        for key in list(self._by_key):
            kept: deque[Waiting[K, T]] = deque()
            for waiting in self._by_key[key]:
                if waiting.step not in answers:
                    answers[waiting.step] = ready(waiting.step)
                if answers[waiting.step]:
                    released.append(waiting)
                elif now >= waiting.deadline:
                    expired.append(waiting)
                else:
                    kept.append(waiting)
            if kept:
                self._by_key[key] = kept
            else:
                del self._by_key[key]
        self._size -= len(released) + len(expired)
        released.sort(key=lambda w: w.since)
        expired.sort(key=lambda w: w.since)
        return released, expired

    def _take_newest(self, key: K) -> Waiting[K, T]:
        queue = self._by_key[key]
        waiting = queue.pop()
        self._size -= 1
        if not queue:
            del self._by_key[key]
        return waiting
