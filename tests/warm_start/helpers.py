"""Waits the warm-start tests share, on processes that end (the server fixture is in conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

HANG_GUARD_S = 120.0
"""A deadline against a hang only: every wait here ends in well under a second when nothing is wrong."""


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
