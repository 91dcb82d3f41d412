"""Which circuit-relay reservations a relay grants: few per IP group, some slots kept for known members.

A reservation costs its asker one fresh key, and py-libp2p 0.8.1's relay granted the first
``max_reservations`` askers for an hour whether or not they stayed: 32 keys that connected, reserved and
left kept every NAT'd peer out (issue 35). So slots are budgeted the way inbound connections are
(``connection_admission``), by the IP group TCP proves:

- a reservation lasts while its holder is connected (the caller drops departed holders before asking);
- strangers hold at most ``per_group`` slots per IP group and ``total - reserved_known`` in all;
- known peers (members the node vouches for, its bootstrap peers) skip the group budget and may use every
  slot; when none is free, a known peer displaces the newest stranger of the most crowded group.

Pure: the caller passes the holders and acts on the decision.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.errors import InvariantError

RESERVATIONS_TOTAL = 32
RESERVATIONS_PER_GROUP = 4
RESERVATIONS_KEPT_FOR_KNOWN = 8


@dataclass(frozen=True)
class ReservationLimits:
    """A relay's reservation budget (module doc). ``per_group`` bounds strangers of one /24 (IPv4) or /48
    (IPv6); on loopback and private networks a group is one address, so tests there set it."""

    total: int = RESERVATIONS_TOTAL
    per_group: int = RESERVATIONS_PER_GROUP
    reserved_known: int = RESERVATIONS_KEPT_FOR_KNOWN

    def __post_init__(self) -> None:
        if self.total < 1 or self.per_group < 1:
            raise InvariantError("reservation budgets must be positive", reason="bad_limits")
        if not 0 <= self.reserved_known < self.total:
            raise InvariantError("reserved_known must leave strangers a slot", reason="bad_limits")


@dataclass(frozen=True)
class Holder:
    """A peer holding (or asking for) a slot: its IP group, whether it is known, and when it reserved
    (any monotonic order; only compared)."""

    peer_id: str
    group: str
    known: bool
    since: float


@dataclass(frozen=True)
class ReservationDecision:
    granted: bool
    reason: str
    evict: str | None = None
    """A stranger's peer ID whose slot the asker takes."""


def admit_reservation(
    held: Sequence[Holder], asker: Holder, limits: ReservationLimits
) -> ReservationDecision:
    """Whether ``asker`` gets a slot given the current (connected) ``held`` ones."""
    if any(h.peer_id == asker.peer_id for h in held):
        return ReservationDecision(True, "refresh")
    strangers = [h for h in held if not h.known]
    if asker.known:
        if len(held) < limits.total:
            return ReservationDecision(True, "known")
        if not strangers:
            return ReservationDecision(False, "full_of_known")
        crowded = Counter(h.group for h in strangers)
        top = max(crowded.values())
        victims = [h for h in strangers if crowded[h.group] == top]
        victim = max(victims, key=lambda h: (h.since, h.peer_id))
        return ReservationDecision(True, "known_displaces_stranger", evict=victim.peer_id)
    if sum(1 for h in strangers if h.group == asker.group) >= limits.per_group:
        return ReservationDecision(False, "group_full")
    if len(strangers) >= limits.total - limits.reserved_known or len(held) >= limits.total:
        return ReservationDecision(False, "full")
    return ReservationDecision(True, "stranger")
