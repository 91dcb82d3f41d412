"""Which checkpoint versions a node keeps: the newest ``keep`` steps (``keep = async_level + 1``).

Inferers may run on a policy up to ``async_level`` steps old, so exactly those versions must stay
servable; anything older is dead weight on disk and in the swarm. The swarm's catalogue
(protocol/swarm/catalogue.py) applies it to the versions a running node holds, and the swarm service
deletes what it drops.

With deltas (``retained_with_deltas``): the newest ``keep`` FULL steps are kept; a delta whose target is
kept stays too (so peers holding its base can take the cheap path from us); a delta whose target is not
held yet is still to be applied, so it stays and pins its base, unless it is older than every full step
kept (nothing will need it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from protocol.errors import LocalProtocolError


class Linked(Protocol):
    """A version as the delta-aware rule sees it: ``base``/``target`` empty for a full version."""

    @property
    def step(self) -> int: ...
    @property
    def manifest_id(self) -> bytes: ...
    @property
    def base(self) -> bytes: ...
    @property
    def target(self) -> bytes: ...
    @property
    def complete(self) -> bool: ...


L = TypeVar("L", bound=Linked)


def retained_with_deltas(versions: Iterable[L], *, keep: int) -> list[L]:
    """The complete versions to drop (in the given order) under the delta-aware rule of the module doc.
    Incomplete versions are never dropped, but an incomplete delta pins its base like a pending one."""
    if keep < 1:
        raise LocalProtocolError("keep must be at least 1", reason="bad_keep")
    versions = list(versions)
    fulls = [v for v in versions if not v.base and v.complete]
    kept_steps = sorted({v.step for v in fulls}, reverse=True)[:keep]
    floor = kept_steps[-1] if len(kept_steps) == keep else -1
    held_fulls = {v.manifest_id for v in fulls}
    pending = [v for v in versions if v.base and v.target not in held_fulls and v.step >= floor]
    pinned = {v.base for v in pending}
    kept_fulls = {v.manifest_id for v in fulls if v.step in kept_steps or v.manifest_id in pinned}
    kept = kept_fulls | {v.manifest_id for v in pending}
    kept |= {v.manifest_id for v in versions if v.base and v.target in kept_fulls}
    return [v for v in versions if v.complete and v.manifest_id not in kept]
