"""Reachability behind NAT, as the rest of the node sees it (docs/nat.md explains the whole path).

A home peer usually cannot be dialled: its router drops unsolicited inbound TCP. It finds out by asking a
peer to *dial it back* (``nat_dialback.py``: the server dials only the requester's own observed IP, on at
most a few ports, rate-limited), reserves a circuit-relay v2 slot on a public peer when the answer is
"private", advertises ``/p2p/RELAY/p2p-circuit/p2p/ME``, and upgrades relayed connections to direct ones
by hole punching (DCUtR). This module holds the results as plain data and the call ``doctor`` makes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

ReachabilityStatus = Literal["public", "private", "unknown"]
DIALBACK_PROTOCOL = "/prime-node/dialback/1.0.0"


@dataclass(frozen=True)
class Reachability:
    """What one probe found. ``observed_addrs``: how the probing peer saw us (our public address behind a
    NAT); ``relay``: our relayed multiaddr if we hold a reservation; ``detail``: one line for humans."""

    status: ReachabilityStatus
    observed_addrs: tuple[str, ...]
    relay: str | None
    detail: str


@dataclass(frozen=True)
class NatCounters:
    """Connection and hole-punch counts of a running host (the status API's "reachability" section)."""

    direct_connections: int = 0
    relayed_connections: int = 0
    relay_reservations: tuple[str, ...] = ()
    relayed_addrs: tuple[str, ...] = ()
    hole_punches_ok: int = 0
    hole_punches_failed: int = 0
    last_time_to_direct_s: float | None = None
    """Seconds from a relayed connection's opening to the direct one hole punching made (the latest)."""
    relay_serving: bool = False
    """Whether this host serves as a relay for others (hop)."""
    relay_clients: int = 0
    """As a relay: peers holding a slot on us that are still connected."""
    relay_refusals: int = 0
    """As a relay: reservation requests refused (budget per IP group or in all, a claim for another peer)."""
    dialled_in_by: int = 0
    """Peers holding a direct (not relayed) connection that they dialled to us: evidence that others can
    reach us, which ``protocol.reachability.combine`` weighs against a failed dial-back."""


class ReachabilityProber(Protocol):
    """What ``probe_reachability`` needs of a host (every ``P2PHost`` has it; interface.py imports this
    module, so it is not named here)."""

    async def probe_reachability(self, peer_id: str, timeout: float) -> Reachability: ...


async def probe_reachability(host: ReachabilityProber, peer_id: str, timeout: float) -> Reachability:
    """Ask ``peer_id`` (a running host must already be connected to it, e.g. a bootstrap peer) to dial us
    back; never raises for network trouble: an unanswered probe is ``unknown`` with the reason in
    ``detail``."""
    return await host.probe_reachability(peer_id, timeout)
