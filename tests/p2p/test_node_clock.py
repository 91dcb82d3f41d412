"""The nodes of one trio run share one wall clock, also under the virtual clock tests use."""

from __future__ import annotations

import time

import trio

from prime_node.node.clock import NodeClock


async def test_a_node_started_later_under_the_virtual_clock_agrees_on_the_wall_clock(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Each clock used to read the system clock itself: a node started 120 virtual seconds after another
    ran 120 s behind it and refused its records as dated in the future (a late-joiner test failed so)."""
    first = NodeClock()
    await trio.sleep(120)
    late = NodeClock()
    assert abs(late.wall_ms() - first.wall_ms()) <= 1
    assert late.uptime() == 0 and first.uptime() >= 120


async def test_the_wall_clock_starts_from_the_system_clock_and_moves_with_trio() -> None:
    before = time.time_ns() // 1_000_000
    clock = NodeClock()
    assert before - 1 <= clock.wall_ms() <= time.time_ns() // 1_000_000 + 1
    start = clock.wall_ms()
    await trio.sleep(0.05)
    assert clock.wall_ms() - start >= 49  # 50 ms, less at most 1 for truncating to whole ms
