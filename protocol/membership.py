"""Who is alive: healthy → unhealthy → dead, from two kinds of evidence.

A pure state machine keyed by peer ID; every call passes ``now`` (seconds, any monotonic origin).

- **Beats** (``heard``): a frame from a *neighbour* on its direct link (DESIGN §4: a node exchanges
  heartbeats with a bounded set of D neighbours). A neighbour is healthy while its last beat is younger
  than ``unhealthy_after``, unhealthy until ``dead_after``, then dead.
- **Records** (``heard_record``): the peer's own signed record, issued at ``issued_at`` (on our clock)
  and relayed to us by anyone. Everyone who is not our neighbour is known this way. The record says how
  often its owner re-issues it (``refresh``); it stays healthy for ``RECORD_UNHEALTHY`` refreshes and dies
  after ``RECORD_DEAD`` of them, so membership of non-neighbours ages out with the records.

A record counts for liveness only when it was issued after the peer's last beat: a neighbour that is
killed mid-link goes unhealthy within ``unhealthy_after`` although its last record may be minutes younger
than that window; a neighbour that only dropped the link (``unlinked``) is judged by its records again.
A peer is forgotten once every kind of evidence is older than its forget window, so memory stays
bounded by the live swarm (and by ``max_members``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

from protocol.errors import LocalProtocolError

R = TypeVar("R")
RECORD_UNHEALTHY = 2.5
"""Refresh periods without a fresh record before a non-neighbour is unhealthy (one lost refresh is normal)."""
RECORD_DEAD = 5.0
RECORD_FORGET = 10.0


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
    """The newest evidence that counts (a beat, or a record issued after the last beat)."""
    first_heard: float
    record: R
    heartbeats: int = 1
    last_beat: float | None = None
    last_record: float | None = None
    refresh: float = 0.0

    @property
    def is_neighbour_evidence(self) -> bool:
        """True while the peer is judged by its beats (it is, or just was, our neighbour)."""
        return self.last_beat is not None and (self.last_record is None or self.last_record <= self.last_beat)


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
        """A beat from neighbour ``peer_id`` (``record``: its newest record we hold)."""
        member = self._members.get(peer_id)
        if member is None:
            return self._add(Member(peer_id, PeerState.HEALTHY, now, now, record, last_beat=now))
        member.last_beat = max(member.last_beat or now, now)
        member.record = record
        member.heartbeats += 1
        return self._settle(member, now)

    def heard_record(
        self, peer_id: str, record: R, *, issued_at: float, refresh: float, now: float
    ) -> list[StateChanged]:
        """``peer_id``'s own record, issued at ``issued_at`` (our clock), re-issued every ``refresh`` s.

        The caller passes only records newer than the one it holds; one issued in the future counts as
        issued now."""
        if refresh <= 0:
            raise LocalProtocolError("a record's refresh period must be positive", reason="bad_refresh")
        issued_at = min(issued_at, now)
        member = self._members.get(peer_id)
        if member is None:
            fresh = Member(peer_id, PeerState.HEALTHY, issued_at, now, record, 0, None, issued_at, refresh)
            fresh.state = self._state_of(fresh, now)
            if fresh.state is PeerState.DEAD:
                return []  # nothing to learn from a record that is already dead
            return self._add(fresh)
        member.record = record
        member.refresh = refresh
        member.last_record = max(member.last_record or issued_at, issued_at)
        return self._settle(member, now)

    def unlinked(self, peer_id: str, now: float) -> list[StateChanged]:
        """Our direct link to the peer ended while the peer is known alive (it said ``bye``, or answered
        a hello after the link was lost): judge it by records."""
        member = self._members.get(peer_id)
        if member is None or member.last_beat is None:
            return []
        member.last_beat = None
        if member.last_record is None:
            # No record to judge by: remember the last beat as a record that must be refreshed soon.
            member.last_record, member.refresh = member.last_heard, member.refresh or self.config.dead_after
        return self._settle(member, now)

    def tick(self, now: float) -> list[StateChanged]:
        changes: list[StateChanged] = []
        for member in list(self._members.values()):
            if self._forgettable(member, now):
                del self._members[member.peer_id]
                changes.append(StateChanged(member.peer_id, member.state, None))
                continue
            changes += self._settle(member, now, may_improve=False)
        return changes

    def remove(self, peer_id: str) -> list[StateChanged]:
        """Drop a peer at once (it was banned, say)."""
        member = self._members.pop(peer_id, None)
        return [] if member is None else [StateChanged(peer_id, member.state, None)]

    # -- rules -------------------------------------------------------------------------------------------

    def _add(self, member: Member[R]) -> list[StateChanged]:
        if len(self._members) >= self.max_members and not self._evict_one():
            return []  # full of live peers: a newcomer waits until someone dies
        self._members[member.peer_id] = member
        return [StateChanged(member.peer_id, None, member.state)]

    def _settle(self, member: Member[R], now: float, *, may_improve: bool = True) -> list[StateChanged]:
        """Move ``member`` to the state its evidence gives; ``tick`` only ever worsens a state (a state
        improves only on new evidence)."""
        member.last_heard = self._evidence(member)
        target = self._state_of(member, now)
        if target is member.state or (not may_improve and _rank(target) < _rank(member.state)):
            return []
        before, member.state = member.state, target
        return [StateChanged(member.peer_id, before, target)]

    def _evidence(self, member: Member[R]) -> float:
        if member.is_neighbour_evidence:
            assert member.last_beat is not None
            return member.last_beat
        assert member.last_record is not None
        return member.last_record

    def _windows(self, member: Member[R]) -> tuple[float, float, float]:
        if member.is_neighbour_evidence:
            return self.config.unhealthy_after, self.config.dead_after, self.config.forget_after
        refresh = member.refresh
        forget = max(self.config.forget_after, RECORD_FORGET * refresh)
        return RECORD_UNHEALTHY * refresh, RECORD_DEAD * refresh, forget

    def _state_of(self, member: Member[R], now: float) -> PeerState:
        unhealthy_after, dead_after, _ = self._windows(member)
        silent_for = now - self._evidence(member)
        if silent_for >= dead_after:
            return PeerState.DEAD
        if silent_for >= unhealthy_after:
            return PeerState.UNHEALTHY
        return PeerState.HEALTHY

    def _forgettable(self, member: Member[R], now: float) -> bool:
        return now - self._evidence(member) >= self._windows(member)[2]

    def _evict_one(self) -> bool:
        dead = [m for m in self._members.values() if m.state is PeerState.DEAD]
        if not dead:
            return False
        del self._members[min(dead, key=lambda m: m.last_heard).peer_id]
        return True


def _rank(state: PeerState) -> int:
    return {PeerState.HEALTHY: 0, PeerState.UNHEALTHY: 1, PeerState.DEAD: 2}[state]
