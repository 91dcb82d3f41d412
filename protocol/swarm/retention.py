"""Which checkpoint versions a node keeps: the newest ``async_level + 1`` steps of each run.

Inferers may run on a policy up to ``async_level`` steps old, so exactly those versions must stay
servable; anything older is dead weight on disk and in the swarm.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class HeldVersion:
    run: str
    step: int
    manifest_id: bytes


def keep_count(async_level: int) -> int:
    if async_level < 0:
        raise ValueError("async level cannot be negative")
    return async_level + 1


def versions_to_drop(held: Iterable[HeldVersion], *, async_level: int) -> list[HeldVersion]:
    """The versions beyond the newest ``async_level + 1`` steps of their run, oldest first."""
    keep = keep_count(async_level)
    by_run: dict[str, list[HeldVersion]] = {}
    for version in held:
        by_run.setdefault(version.run, []).append(version)
    drop: list[HeldVersion] = []
    for versions in by_run.values():
        steps = sorted({v.step for v in versions}, reverse=True)
        kept_steps = set(steps[:keep])
        drop += [v for v in versions if v.step not in kept_steps]
    return sorted(drop)
