"""Suite-wide settings. Hypothesis profiles: `dev` (default) is quick; CI=true selects `ci`. Slow tests run
first."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, settings

from prime_node.warm_start.launcher import WarmStart, enabled

T = TypeVar("T")

settings.register_profile("dev", max_examples=60, deadline=None)
settings.register_profile("ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")
# Nodes, trainers and engines that tests run in one process share the machine's cores like the demo's
# processes do: one torch thread each unless the caller says otherwise (cpu_compute.default_threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# As the demo's children have them (demo/orchestrator.child_env), so that processes tests start with that
# environment are forked warm from the same server (prime_node/warm_start/compatibility.py).
for _name, _value in {
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_name, _value)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked slow (whole processes, minutes each) first in each xdist worker's share.

    xdist's worksteal (Makefile) first splits the collection into one contiguous block per worker and
    later steals from the *tail* of a block: with every slow test at the head of the collection, the
    first worker got all of them. So each block starts with every n-th slow test (round-robin, collection
    order) and ends on short ones, and no worker is left with a run of long tests at the end. (Measured:
    no change of the suite's wall time, 1,161 s before and 1,186 s after on fresh clones; the suite is
    CPU-bound, docs/testing.md.) The order is a pure function of the collection and the worker count,
    the same in every worker, as xdist requires."""
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    fast = [item for item in items if item.get_closest_marker("slow") is None]
    items[:] = interleave_slow_first(slow, fast, workers)


def interleave_slow_first(slow: list[T], fast: list[T], workers: int) -> list[T]:
    """Blocks sized as worksteal's first split (``pending // nodes remaining``), each holding
    ``slow[k::workers]`` first, then short tests in order."""
    ordered: list[T] = []
    remaining, next_fast = len(slow) + len(fast), 0
    for k in range(workers):
        size = remaining // (workers - k)
        block = slow[k::workers]
        take = max(0, size - len(block))
        block += fast[next_fast : next_fast + take]
        next_fast += take
        ordered += block
        remaining -= len(block)
    return ordered + fast[next_fast:]


@pytest.fixture(scope="session", autouse=True)
def warm_start_server() -> Iterator[WarmStart | None]:
    """One warm-start server per test process (per xdist worker), named in the environment so that
    the processes prime-node starts itself (``--local``'s inference child) are forked from it too; tests
    start prime-node processes through ``tests/warm_cli.py``. Off with PRIME_NODE_WARM_START=0."""
    if not enabled():
        yield None
        return
    with WarmStart() as server:
        os.environ.update(server.child_env({}))
        try:
            yield server
        finally:
            for key in server.child_env({}):
                os.environ.pop(key, None)
