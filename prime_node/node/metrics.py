"""Counters and a short event log for the status API: plain data, no I/O."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Event:
    at: float
    kind: str
    text: str


@dataclass
class NodeMetrics:
    """Monotonic counters (``name`` → count, ``name_bytes`` → bytes) and the recent events."""

    counters: Counter[str] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)
    events: deque[Event] = field(default_factory=lambda: deque(maxlen=200))

    def count(self, name: str, size: int = 0, times: int = 1) -> None:
        self.counters[name] += times
        if size:
            self.counters[name + "_bytes"] += size

    def reject(self, reason: str) -> None:
        self.rejections[reason] += 1

    def event(self, at: float, kind: str, text: str) -> None:
        self.events.append(Event(at, kind, text))
