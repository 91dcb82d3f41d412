"""Who is alive: healthy → unhealthy → dead on missed heartbeats.

A pure state machine keyed by peer ID. The node calls ``heard`` for every verified heartbeat and
``tick`` on a timer, always passing ``now`` (seconds, any monotonic origin). A peer is *healthy* while
its last heartbeat is younger than ``unhealthy_after``, *unhealthy* until ``dead_after``, then *dead*;
dead peers are forgotten after ``forget_after`` so memory stays bounded by the live swarm. A heartbeat
from an unhealthy or dead peer makes it healthy again.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

from protocol.errors import LocalProtocolError

R = TypeVar("R")


class PeerState(StrEnum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DEAD = "dead"


@dataclass(frozen=True)
class MembershipConfig:
    unhealthy_after: float = 6.0
    dead_after: float = 15.0
    forget_after: float = 120.0

    def __post_init__(self) -> None:
        if not 0 < self.unhealthy_after < self.dead_after <= self.forget_after:
            raise LocalProtocolError(
                "membership needs 0 < unhealthy_after < dead_after <= forget_after", reason="bad_config"
            )


@dataclass(frozen=True)
class StateChanged:
    """``peer_id`` moved from ``before`` (None: newly seen) to ``after`` (None: forgotten)."""

    peer_id: str
    before: PeerState | None
    after: PeerState | None


@dataclass
class Member(Generic[R]):
    peer_id: str
    state: PeerState
    last_heard: float
    first_heard: float
    record: R
    heartbeats: int = 1


class Membership(Generic[R]):
    """The table of known peers and their liveness (see the module doc)."""

    def __init__(self, config: MembershipConfig = MembershipConfig(), *, max_members: int = 10_000) -> None:
        self.config = config
        self.max_members = max_members
        self._members: dict[str, Member[R]] = {}

    def __len__(self) -> int:
        return len(self._members)

    def get(self, peer_id: str) -> Member[R] | None:
        return self._members.get(peer_id)

    def members(self) -> list[Member[R]]:
        return sorted(self._members.values(), key=lambda m: m.peer_id)

    def in_state(self, state: PeerState) -> list[str]:
        return sorted(m.peer_id for m in self._members.values() if m.state is state)

    def heard(self, peer_id: str, record: R, now: float) -> list[StateChanged]:
        member = self._members.get(peer_id)
        if member is None:
            if len(self._members) >= self.max_members and not self._evict_one():
                return []  # full of live peers: a newcomer waits until someone dies
            self._members[peer_id] = Member(peer_id, PeerState.HEALTHY, now, now, record)
            return [StateChanged(peer_id, None, PeerState.HEALTHY)]
        member.last_heard = max(member.last_heard, now)
        member.record = record
        member.heartbeats += 1
        if member.state is PeerState.HEALTHY:
            return []
        before, member.state = member.state, PeerState.HEALTHY
        return [StateChanged(peer_id, before, PeerState.HEALTHY)]

    def tick(self, now: float) -> list[StateChanged]:
        changes: list[StateChanged] = []
        for member in list(self._members.values()):
            silent_for = now - member.last_heard
            if silent_for >= self.config.forget_after:
                del self._members[member.peer_id]
                changes.append(StateChanged(member.peer_id, member.state, None))
                continue
            target = self._state_for(silent_for)
            if target is not member.state and _rank(target) > _rank(member.state):
                changes.append(StateChanged(member.peer_id, member.state, target))
                member.state = target
        return changes

    def remove(self, peer_id: str) -> list[StateChanged]:
        """Drop a peer at once (it was banned, say)."""
        member = self._members.pop(peer_id, None)
        return [] if member is None else [StateChanged(peer_id, member.state, None)]

    def _state_for(self, silent_for: float) -> PeerState:
        if silent_for >= self.config.dead_after:
            return PeerState.DEAD
        if silent_for >= self.config.unhealthy_after:
            return PeerState.UNHEALTHY
        return PeerState.HEALTHY

    def _evict_one(self) -> bool:
        dead = [m for m in self._members.values() if m.state is PeerState.DEAD]
        if not dead:
            return False
        del self._members[min(dead, key=lambda m: m.last_heard).peer_id]
        return True


def _rank(state: PeerState) -> int:
    return {PeerState.HEALTHY: 0, PeerState.UNHEALTHY: 1, PeerState.DEAD: 2}[state]
