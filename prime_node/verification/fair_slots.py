"""A fixed number of slots granted round-robin across keys (the workers whose batches are fetched).

``trio.CapacityLimiter`` serves waiters first come, first served: a worker that announces many batches
queues ahead of everyone else. ``FairSlots`` keeps one FIFO of waiters per key and hands a freed slot to
the next key in rotation, so a worker with one batch waiting gets the next free slot whatever another
worker has queued (protocol/fair_queue.py does the same for batches waiting to be judged).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager
from typing import Generic, TypeVar

import trio

K = TypeVar("K", bound=Hashable)


class FairSlots(Generic[K]):
    """``total`` slots; ``async with slots.hold(key):`` waits for one (see the module doc)."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("FairSlots needs at least one slot")
        self.total = total
        self.used = 0
        # The key served next comes first; a key that was served moves to the end.
        self._waiting: OrderedDict[K, deque[trio.Event]] = OrderedDict()

    def waiting(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    @asynccontextmanager
    async def hold(self, key: K) -> AsyncIterator[None]:
        if self.used < self.total and not self._waiting:
            self.used += 1
        else:
            granted = trio.Event()
            self._waiting.setdefault(key, deque()).append(granted)
            try:
                await granted.wait()
            except BaseException:
                if granted.is_set():  # handed a slot just as it was cancelled: pass it on
                    self._release()
                else:
                    self._withdraw(key, granted)
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        """Hand the freed slot to the next key in rotation (``used`` stays), or free it."""
        if not self._waiting:
            self.used -= 1
            return
        key, queue = next(iter(self._waiting.items()))
        granted = queue.popleft()
        if queue:
            self._waiting.move_to_end(key)
        else:
            del self._waiting[key]
        granted.set()

    def _withdraw(self, key: K, granted: trio.Event) -> None:
        queue = self._waiting.get(key)
        if queue is not None and granted in queue:
            queue.remove(granted)
            if not queue:
                del self._waiting[key]
