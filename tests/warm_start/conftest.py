"""The warm-start tests' real server: one per test module that asks for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from prime_node.warm_start.launcher import WarmStart


@pytest.fixture(scope="module")
def warm() -> Iterator[WarmStart]:
    """A real warm-start server (starting one imports torch: ~10 CPU-s, so a module shares it)."""
    with WarmStart() as server:
        yield server
