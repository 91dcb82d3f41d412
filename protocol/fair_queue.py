"""A bounded queue served round-robin across senders, so one sender's flood delays only its own items.

Each key (a worker's address) has its own FIFO of at most ``per_key`` items; beyond it that key's oldest
item is dropped. Past ``capacity`` items in all, the oldest item of the longest FIFO goes: a flooder pays
for its flood before anyone else loses a slot. ``pop`` takes one item from each key in turn. Pure: the
caller counts and reports what ``push`` returns as dropped.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Generic, TypeVar

from protocol.errors import LocalProtocolError

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class FairQueue(Generic[K, T]):
    """See the module doc."""

    def __init__(self, *, capacity: int, per_key: int) -> None:
        if capacity < 1 or per_key < 1:
            raise LocalProtocolError(
                "a fair queue needs a positive capacity and per-key bound", reason="bad_config"
            )
        self.capacity = capacity
        self.per_key = per_key
        # Rotation order: the key served next comes first; a key that was served moves to the end.
        self._queues: OrderedDict[K, deque[T]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def lengths(self) -> dict[K, int]:
        return {key: len(queue) for key, queue in self._queues.items()}

    def push(self, key: K, item: T) -> list[T]:
        """Append ``item`` to ``key``'s FIFO; returns the items dropped to keep the bounds (oldest first)."""
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
        queue.append(item)
        self._size += 1
        dropped: list[T] = []
        if len(queue) > self.per_key:
            dropped.append(self._take(key))
        if self._size > self.capacity:
            longest = max(self._queues, key=lambda k: len(self._queues[k]))
            dropped.append(self._take(longest))
        return dropped

    def pop(self) -> tuple[K, T]:
        """The next key's oldest item (LocalProtocolError ``empty`` when nothing is queued)."""
        if not self._queues:
            raise LocalProtocolError("pop from an empty fair queue", reason="empty")
        key = next(iter(self._queues))
        item = self._take(key)
        if key in self._queues:
            self._queues.move_to_end(key)
        return key, item

    def _take(self, key: K) -> T:
        queue = self._queues[key]
        item = queue.popleft()
        self._size -= 1
        if not queue:
            del self._queues[key]
        return item
