"""The node's only source of time: trio's clock, so tests can run whole swarms under ``autojump_clock``.

Signed envelopes need wall-clock milliseconds; the system clock is read once per trio run and advanced
with trio's monotonic clock from then on. Once per *run*, not per node: under a virtual clock a node
started 60 virtual seconds after the others, reading the system clock itself, would run 60 s behind
them and refuse their records as dated in the future (> 30 s ahead). All nodes of one run agree, as
nodes on synchronized machines do; a process runs one node, so there nothing changes.
"""

from __future__ import annotations

import time

import trio
from trio.lowlevel import RunVar

_RUN_WALL_ORIGIN: RunVar[tuple[float, int]] = RunVar("prime_node_run_wall_origin")
"""(trio time, wall-clock ms) read together at the first ``NodeClock`` of the trio run."""


class NodeClock:
    def __init__(self) -> None:
        self._origin = trio.current_time()
        try:
            run_origin, run_wall_ms = _RUN_WALL_ORIGIN.get()
        except LookupError:
            run_origin, run_wall_ms = self._origin, time.time_ns() // 1_000_000
            _RUN_WALL_ORIGIN.set((run_origin, run_wall_ms))
        self._wall_origin_ms = run_wall_ms + int((self._origin - run_origin) * 1000)

    def now(self) -> float:
        """Monotonic seconds (trio's clock)."""
        return trio.current_time()

    def uptime(self) -> float:
        return trio.current_time() - self._origin

    def wall_ms(self) -> int:
        return self._wall_origin_ms + int((trio.current_time() - self._origin) * 1000)
