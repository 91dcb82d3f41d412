"""The node's only source of time: trio's clock, so tests can run whole swarms under ``autojump_clock``.

Signed envelopes need wall-clock milliseconds; we read the system clock once at start and advance it with
trio's monotonic clock from then on.
"""

from __future__ import annotations

import time

import trio


class NodeClock:
    def __init__(self) -> None:
        self._origin = trio.current_time()
        self._wall_origin_ms = time.time_ns() // 1_000_000

    def now(self) -> float:
        """Monotonic seconds (trio's clock)."""
        return trio.current_time()

    def uptime(self) -> float:
        return trio.current_time() - self._origin

    def wall_ms(self) -> int:
        return self._wall_origin_ms + int((trio.current_time() - self._origin) * 1000)
