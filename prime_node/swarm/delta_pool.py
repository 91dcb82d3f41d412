"""The codec's thread pool: chunks coded in parallel, their results handed back in file order.

numpy's large operations, zstd, BLAKE3 and ``os.pread`` release the GIL, so one worker per core keeps the
cores busy while the calling thread reads, hashes and writes in order.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

MAX_THREADS = 8
_T = TypeVar("_T")


def workers(threads: int | None) -> int:
    """Chunks coded at once: ``threads``, or one per core (at most ``MAX_THREADS``)."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, not {threads}")
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


class Ordered:
    """Jobs run in a thread pool, their results handed back in submission order on the calling thread,
    at most ``2 * workers`` pending (memory stays at a few chunks per worker). Leaving the context cancels
    the jobs not started and waits for the others."""

    def __init__(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="delta")
        self._pending: deque[tuple[Future[Any], Callable[[Any], None]]] = deque()
        self._depth = 2 * workers

    def __enter__(self) -> Ordered:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, job: Callable[[], _T], done: Callable[[_T], None]) -> None:
        """Run ``job`` in the pool; ``done`` gets its result, in order, on this thread."""
        self._pending.append((self._pool.submit(job), done))
        while len(self._pending) > self._depth:
            self._next()

    def drain(self) -> None:
        """Hand back every pending result (re-raising the first job's exception, if any)."""
        while self._pending:
            self._next()

    def abandon(self) -> None:
        """Drop the pending jobs: cancel those not started and wait for the others (which may still be
        reading a file the caller is about to close)."""
        for future, _ in self._pending:
            future.cancel()
        for future, _ in self._pending:
            if not future.cancelled():
                future.exception()
        self._pending.clear()

    def _next(self) -> None:
        future, done = self._pending.popleft()
        done(future.result())
