"""Which checkpoint versions a node keeps: the newest ``keep`` steps (``keep = async_level + 1``).

Inferers may run on a policy up to ``async_level`` steps old, so exactly those versions must stay
servable; anything older is dead weight on disk and in the swarm. One rule, used by the swarm's
catalogue (protocol/swarm/catalogue.py) for the versions a running node holds and by
prime_node/swarm/retention.py for a piece store root on disk.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from protocol.errors import LocalProtocolError


class Stepped(Protocol):
    @property
    def step(self) -> int: ...


V = TypeVar("V", bound=Stepped)


@dataclass(frozen=True, order=True)
class HeldVersion:
    run: str
    step: int
    manifest_id: bytes


def keep_count(async_level: int) -> int:
    if async_level < 0:
        raise LocalProtocolError("async level cannot be negative", reason="bad_async_level")
    return async_level + 1


def beyond_newest(versions: Iterable[V], *, keep: int) -> list[V]:
    """The versions whose step is not among the newest ``keep`` distinct steps (in the given order)."""
    if keep < 1:
        raise LocalProtocolError("keep must be at least 1", reason="bad_keep")
    versions = list(versions)
    kept_steps = set(sorted({v.step for v in versions}, reverse=True)[:keep])
    return [v for v in versions if v.step not in kept_steps]


def versions_to_drop(held: Iterable[HeldVersion], *, async_level: int) -> list[HeldVersion]:
    """The versions beyond the newest ``async_level + 1`` steps of their run, oldest first."""
    keep = keep_count(async_level)
    by_run: dict[str, list[HeldVersion]] = {}
    for version in held:
        by_run.setdefault(version.run, []).append(version)
    drop: list[HeldVersion] = []
    for versions in by_run.values():
        drop += beyond_newest(versions, keep=keep)
    return sorted(drop)
