"""The order in which waiting rollout batches are served: newest policy step first, round-robin across
workers within a step.

The rule, one for fetch slots and for the judge queue: of everything waiting, the batches claiming the
newest policy step go first, because the old ones are those about to go stale (a batch older than the
run's ``async_level`` is worth nothing to the trainer); among the waiters of that step, keys (the
batches' workers) take turns, so a worker that queues many batches of the newest step delays only its
own. With every waiter on one step (the common case) it is plain round-robin, as before.

- ``FairSlots``: a fixed number of slots (``trio.CapacityLimiter`` serves first come, first served: a
  worker that announces many batches would queue ahead of everyone else). A freed slot goes to the waiter
  the rule picks.
- ``NewestFirstQueue``: a bounded queue (pure), the judge loop's. Each key holds at most ``per_key``
  items (beyond it that key's oldest is dropped); past ``capacity`` in all, the oldest item of the key
  holding most goes, so a flooder pays for its flood before anyone else loses a place
  (protocol/fair_queue.py's bounds, with this module's order).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager
from typing import Generic, TypeVar

import trio

from protocol.errors import LocalProtocolError

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def _pick(queues: OrderedDict[K, deque[tuple[int, T]]]) -> tuple[K, int]:
    """The key and index (in its FIFO) of the entry the rule serves next: the newest step, then the first
    key in rotation that has one, then that key's oldest entry of that step."""
    best = max(step for queue in queues.values() for step, _ in queue)
    for key, queue in queues.items():
        for index, (step, _) in enumerate(queue):
            if step == best:
                return key, index
    raise AssertionError("unreachable: the best step is in some queue")


def _take(queues: OrderedDict[K, deque[tuple[int, T]]], key: K, index: int, *, rotate: bool) -> T:
    """Remove entry ``index`` of ``key``; a served key (``rotate``) moves to the end of the rotation."""
    queue = queues[key]
    _, item = queue[index]
    del queue[index]
    if not queue:
        del queues[key]
    elif rotate:
        queues.move_to_end(key)
    return item


class FairSlots(Generic[K]):
    """``total`` slots; ``async with slots.hold(key, priority=step):`` waits for one (module doc)."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("FairSlots needs at least one slot")
        self.total = total
        self.used = 0
        # The key served next comes first; a key that was served moves to the end.
        self._waiting: OrderedDict[K, deque[tuple[int, trio.Event]]] = OrderedDict()

    def waiting(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    @asynccontextmanager
    async def hold(self, key: K, *, priority: int = 0) -> AsyncIterator[None]:
        """``priority``: the policy step the waiter's batch claims (higher goes first)."""
        if self.used < self.total and not self._waiting:
            self.used += 1
        else:
            granted = trio.Event()
            self._waiting.setdefault(key, deque()).append((priority, granted))
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
        """Hand the freed slot to the waiter the rule picks (``used`` stays), or free it."""
        if not self._waiting:
            self.used -= 1
            return
        key, index = _pick(self._waiting)
        _take(self._waiting, key, index, rotate=True).set()

    def _withdraw(self, key: K, granted: trio.Event) -> None:
        queue = self._waiting.get(key)
        if queue is None:
            return
        for index, (_, event) in enumerate(queue):
            if event is granted:
                _take(self._waiting, key, index, rotate=False)
                return


class NewestFirstQueue(Generic[K, T]):
    """Items with a policy step, served by the module's rule within its bounds (pure)."""

    def __init__(self, *, capacity: int, per_key: int) -> None:
        if capacity < 1 or per_key < 1:
            raise LocalProtocolError(
                "a queue needs a positive capacity and per-key bound", reason="bad_config"
            )
        self.capacity = capacity
        self.per_key = per_key
        self._queues: OrderedDict[K, deque[tuple[int, T]]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def lengths(self) -> dict[K, int]:
        return {key: len(queue) for key, queue in self._queues.items()}

    def push(self, key: K, step: int, item: T) -> list[T]:
        """Queue ``item`` (claiming ``step``) under ``key``; returns what was dropped to keep the bounds."""
        self._queues.setdefault(key, deque()).append((step, item))
        self._size += 1
        dropped: list[T] = []
        if len(self._queues[key]) > self.per_key:
            dropped.append(self._drop(key))
        if self._size > self.capacity:
            dropped.append(self._drop(max(self._queues, key=lambda k: len(self._queues[k]))))
        return dropped

    def pop(self) -> tuple[K, T]:
        """The next item by the module's rule (LocalProtocolError ``empty`` when nothing is queued)."""
        if not self._queues:
            raise LocalProtocolError("pop from an empty queue", reason="empty")
        key, index = _pick(self._queues)
        self._size -= 1
        return key, _take(self._queues, key, index, rotate=True)

    def _drop(self, key: K) -> T:
        self._size -= 1
        return _take(self._queues, key, 0, rotate=False)
