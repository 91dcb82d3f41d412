"""Which inbound connections a node accepts: per-IP-group budgets that bound floods and Sybils.

A connection costs the attacker nothing until its handshake ends, and an identity costs nothing at all,
so budgets are kept per *IP group* (the address a connection comes from, which TCP proves), not per key:

- pending (accepted, handshake not finished): at most ``pending_per_group`` per group and
  ``pending_total`` in all. A newcomer is never refused for lack of a pending slot: it evicts the oldest
  pending connection of its own group when that group is full, else of the group holding the most;
  connections that have not sent a byte go first. A flood from one group then only churns its own
  slots, an idle flood never displaces a handshake under way, and an honest handshake, which takes
  milliseconds, is displaced only if the flood opens ``pending_total`` talking connections meanwhile.
- established: at most ``established_per_group`` inbound peers per group (one group holds at most that
  many identities at once: the Sybil bound) and ``established_total`` in all; a peer over budget is
  refused and existing ones are never displaced.
- known peers (the bootstrap peers we were told about, peers the node vouches for) skip the group
  budgets and have ``pending_reserved_known`` pending slots of their own that strangers cannot take.

Pure: callers pass connection ids, groups and ``now`` and act on the returned decisions.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from protocol.errors import InvariantError, LocalProtocolError

_LOCAL_NETWORKS = tuple(
    ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")
)


def ip_group(address: str, *, ipv4_prefix: int = 24, ipv6_prefix: int = 48) -> str:
    """The budget group of an IP address: its /24 (IPv4) or /48 (IPv6) when public, the address itself
    on loopback, private and link-local networks (the operator's own machines, where one address is one
    host), and ``host:<text>`` for anything that is not an IP address (a DNS name in a claimed address)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return f"host:{address}"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback or ip.is_link_local or any(ip in network for network in _LOCAL_NETWORKS):
        return str(ip)
    prefix = ipv4_prefix if ip.version == 4 else ipv6_prefix
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


@dataclass(frozen=True)
class ConnectionLimits:
    """Budgets for inbound connections (see the module doc). Defaults suit a home node."""

    pending_per_group: int = 8
    pending_total: int = 64
    pending_reserved_known: int = 16
    established_per_group: int = 16
    established_total: int = 192
    handshake_timeout: float = 5.0
    """Seconds an inbound connection may take to finish security and muxer negotiation."""
    ipv4_prefix: int = 24
    ipv6_prefix: int = 48

    def __post_init__(self) -> None:
        budgets = [self.pending_per_group, self.pending_total, self.established_per_group]
        if min(*budgets, self.established_total) < 1 or self.pending_reserved_known < 0:
            raise InvariantError("connection budgets must be positive", reason="bad_limits")
        if self.handshake_timeout <= 0:
            raise InvariantError("handshake_timeout must be positive", reason="bad_limits")
        if not (0 <= self.ipv4_prefix <= 32 and 0 <= self.ipv6_prefix <= 128):
            raise InvariantError("IP group prefixes out of range", reason="bad_limits")

    def group_of(self, address: str) -> str:
        return ip_group(address, ipv4_prefix=self.ipv4_prefix, ipv6_prefix=self.ipv6_prefix)


@dataclass(frozen=True)
class Admission:
    """``admitted`` or not (``reason`` says why), and the pending connections to close to make room."""

    admitted: bool
    reason: str = "ok"
    evict: tuple[int, ...] = ()


@dataclass
class _Pending:
    group: str
    started: float
    known: bool
    talking: bool = False


@dataclass
class InboundAdmission:
    """Pending and established inbound connections by group. Ids are the caller's; each id is opened
    once, may be established once, and is closed once (closing an unknown id is a no-op)."""

    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    _pending: dict[int, _Pending] = field(default_factory=dict)
    _established: dict[int, tuple[str, bool]] = field(default_factory=dict)

    def open(self, conn_id: int, group: str, now: float, *, known: bool = False) -> Admission:
        """A TCP connection was accepted; its handshake has not started."""
        if conn_id in self._pending or conn_id in self._established:
            raise LocalProtocolError(f"connection {conn_id} opened twice", reason="duplicate_connection")
        evict: list[int] = []
        if known:
            known_pending = [c for c, p in self._pending.items() if p.known]
            if len(known_pending) >= max(self.limits.pending_reserved_known, 1):
                evict.append(self._oldest(known_pending))
        else:
            strangers = [c for c, p in self._pending.items() if not p.known]
            own = [c for c in strangers if self._pending[c].group == group]
            if len(own) >= self.limits.pending_per_group:
                evict.append(self._oldest(own))
            elif len(strangers) >= self.limits.pending_total:
                evict.append(self._oldest(self._largest_group(strangers)))
        for victim in evict:
            del self._pending[victim]
        self._pending[conn_id] = _Pending(group, now, known)
        return Admission(True, "evicted_oldest" if evict else "ok", tuple(evict))

    def talking(self, conn_id: int) -> None:
        """The first bytes of ``conn_id``'s handshake arrived: evict it after the silent ones."""
        pending = self._pending.get(conn_id)
        if pending is not None:
            pending.talking = True

    def establish(self, conn_id: int, *, known: bool = False) -> Admission:
        """The handshake of ``conn_id`` finished (``known``: the authenticated peer is a known one)."""
        pending = self._pending.pop(conn_id, None)
        if pending is None:
            return Admission(False, "not_pending")
        if not known:
            strangers = [g for g, k in self._established.values() if not k]
            if sum(1 for g in strangers if g == pending.group) >= self.limits.established_per_group:
                return Admission(False, "group_full")
            if len(strangers) >= self.limits.established_total:
                return Admission(False, "inbound_full")
        self._established[conn_id] = (pending.group, known)
        return Admission(True)

    def close(self, conn_id: int) -> None:
        self._pending.pop(conn_id, None)
        self._established.pop(conn_id, None)

    def is_pending(self, conn_id: int) -> bool:
        return conn_id in self._pending

    def pending_count(self, group: str | None = None) -> int:
        return sum(1 for p in self._pending.values() if group is None or p.group == group)

    def established_count(self, group: str | None = None) -> int:
        return sum(1 for g, _ in self._established.values() if group is None or g == group)

    def _oldest(self, conn_ids: list[int]) -> int:
        return min(conn_ids, key=lambda c: (self._pending[c].talking, self._pending[c].started, c))

    def _largest_group(self, conn_ids: list[int]) -> list[int]:
        by_group: dict[str, list[int]] = {}
        for conn_id in conn_ids:
            by_group.setdefault(self._pending[conn_id].group, []).append(conn_id)
        return max(by_group.values(), key=lambda ids: (len(ids), -min(self._pending[c].started for c in ids)))
