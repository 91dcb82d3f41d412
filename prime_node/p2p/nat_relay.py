"""Circuit relay v2 and hole punching (DCUtR) from py-libp2p 0.8.1, wired for our hosts.

Used only by ``libp2p_host.py`` (it knows py-libp2p's internals; the rest of the node sees
``nat.NatCounters``). What we take from py-libp2p and why:
- ``CircuitV2Protocol``: every host accepts relayed connections (STOP); a host with the relay service on
  also relays for others (HOP) within ``relay_limits()``: few reservations and circuits, each circuit
  capped in bytes and time, so a relay carries control traffic, never pieces. Its reservations were free
  for the taking (issue 35: 32 keys that reserved and left held every slot for an hour), so
  ``GuardedReservations`` replaces its resource manager's admission: a slot lasts while its holder keeps
  a direct connection, strangers get few per IP group and some slots are kept for known members
  (``protocol.relay_reservations``), and a RESERVE naming another peer than the connection's is refused
  (py-libp2p believed the message, so one connection could fill every slot with made-up IDs).
- ``CircuitV2Transport``: dials ``/p2p/RELAY/p2p-circuit/p2p/PEER`` and makes reservations. Its CLIENT
  role would reserve on every relayed dial, so it is off; we reserve explicitly.
- ``DCUtRProtocol``: every 2 s it tries to turn relayed connections into direct ones (TCP simultaneous
  open from our listen port to the peer's predicted address: its NAT's public IP and its listen port).
  ``CountingDCUtR`` counts the outcomes and the time from relayed to direct.
- The swarm never trims (libp2p_host's ``NEVER_TRIM``), so a direct connection lives beside the relayed
  one, new streams prefer it, and DCUtR closes the relayed one after a grace period.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from protocol.connection_admission import ip_group
from protocol.relay_reservations import Holder, ReservationLimits, admit_reservation

log = logging.getLogger(__name__)
RESERVE_TIMEOUT = 10.0
RELAY_CIRCUIT_BYTES = 4 << 20
RELAY_CIRCUIT_SECONDS = 3600
RELAY_MAX_CIRCUITS = 32
RELAY_MAX_RESERVATIONS = ReservationLimits().total
UNILATERAL_DIAL_TIMEOUT = 2.0
MAX_UNILATERAL_ADDRS = 8


def relay_limits(reservations: ReservationLimits | None = None) -> Any:
    from libp2p.relay.circuit_v2.resources import RelayLimits

    return RelayLimits(
        duration=RELAY_CIRCUIT_SECONDS,
        data=RELAY_CIRCUIT_BYTES,
        max_circuit_conns=RELAY_MAX_CIRCUITS,
        max_reservations=(reservations or ReservationLimits()).total,
    )


def _live_direct_ip(host: Any, peer_id: Any) -> str | None:
    """The remote IP of a direct connection to ``peer_id`` that is not closing (None if it has none)."""
    for conn in host.get_network().get_connections(peer_id):
        try:
            muxer = conn.muxed_conn
            shutting_down = getattr(muxer, "event_shutting_down", None)
            if conn.is_closed or muxer.is_closed or (shutting_down is not None and shutting_down.is_set()):
                continue
            if is_relayed(conn):
                continue
            remote = muxer.get_remote_address()
        except Exception:
            log.debug("no remote address for %s", peer_id, exc_info=True)
            continue
        if remote:
            return str(remote[0])
    return None


def _guarded_reservations(
    host: Any,
    libp2p_limits: Any,
    limits: ReservationLimits,
    is_known: Callable[[str], bool],
    group_of: Callable[[str], str],
    outcomes: Counter[str],
) -> Any:
    from libp2p.relay.circuit_v2.resources import RelayResourceManager

    class GuardedReservations(RelayResourceManager):
        """py-libp2p's reservation store with our admission (module doc). Departed holders are dropped
        whenever someone asks for a slot: that is the only time the count matters."""

        def __init__(self) -> None:
            super().__init__(libp2p_limits, host)
            self._since: dict[Any, float] = {}

        def _holder(self, peer_id: Any, since: float) -> Holder | None:
            ip = _live_direct_ip(host, peer_id)
            if ip is None:
                return None
            return Holder(str(peer_id), group_of(ip), is_known(str(peer_id)), since)

        def _drop_departed(self) -> list[Holder]:
            """The holders still connected directly; the others lose their slot now."""
            held = []
            for peer_id in list(self._reservations):
                holder = self._holder(peer_id, self._since.get(peer_id, 0.0))
                if holder is None:
                    self._drop(peer_id, "departed")
                else:
                    held.append(holder)
            return held

        def _drop(self, peer_id: Any, why: str) -> None:
            self._reservations.pop(peer_id, None)
            self._since.pop(peer_id, None)
            outcomes[why] += 1
            log.debug("relay reservation of %s dropped: %s", peer_id, why)

        def can_accept_reservation(self, peer_id: Any) -> bool:
            self._clean_expired()
            for gone in set(self._since) - set(self._reservations):
                del self._since[gone]
            held = self._drop_departed()
            asker = self._holder(peer_id, trio.current_time())
            if asker is None:
                outcomes["not_direct"] += 1
                return False
            decision = admit_reservation(held, asker, limits)
            outcomes[decision.reason] += 1
            if decision.evict is not None:
                victim = next(p for p in self._reservations if str(p) == decision.evict)
                self._drop(victim, "displaced")
            if not decision.granted:
                log.info("relay reservation for %s refused: %s", peer_id, decision.reason)
            return decision.granted

        def create_reservation(self, peer_id: Any) -> Any:
            self._since[peer_id] = trio.current_time()
            return super().create_reservation(peer_id)

    return GuardedReservations()


def _guarded_protocol(
    host: Any, libp2p_limits: Any, *, allow_hop: bool, resources: Any, outcomes: Counter[str]
) -> Any:
    from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
    from libp2p.relay.circuit_v2.protocol_buffer import StatusCode

    class GuardedCircuitV2(CircuitV2Protocol):
        """Reservations only for the peer at the other end of the connection (module doc)."""

        async def _handle_reserve(self, stream: Any, msg: Any) -> None:
            sender = stream.muxed_conn.peer_id
            if msg.HasField("peer") and msg.peer.id and bytes(msg.peer.id) != sender.to_bytes():
                outcomes["claims_another_peer"] += 1
                log.info("relay reservation from %s refused: it named another peer", sender)
                await self._send_status(stream, StatusCode.PERMISSION_DENIED, "reserve for yourself only")
                return
            await super()._handle_reserve(stream, msg)

    protocol = GuardedCircuitV2(host, limits=libp2p_limits, allow_hop=allow_hop)
    protocol.resource_manager = resources
    return protocol


@dataclass
class HolePunchStats:
    ok: int = 0
    failed: int = 0
    last_time_to_direct_s: float | None = None


def _relayed_since(host: Any, peer_id: Any) -> float | None:
    """When the oldest relayed connection to ``peer_id`` opened (py-libp2p's wall-clock stamp)."""
    stamps = [
        float(getattr(conn, "_created_at", 0.0))
        for conn in host.get_network().get_connections(peer_id)
        if is_relayed(conn)
    ]
    return min(stamps) if stamps else None


def _counting_dcutr(host: Any, stats: HolePunchStats) -> Any:
    from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

    class CountingDCUtR(DCUtRProtocol):
        """DCUtR that records each hole punch's outcome (both the initiating and the answering side)."""

        async def _try_unilateral_upgrade(self, peer_id: Any) -> bool:
            """py-libp2p's step 0 (a plain dial to the peer's known addresses) with a short deadline: a
            NAT'd peer's private addresses fail only after the 10 s dial timeout, which would delay the
            hole punch that follows by as much."""
            addrs = [a for a in peerstore_addrs(self.host, peer_id) if "/p2p-circuit" not in str(a)]
            if not addrs:
                return False
            with trio.move_on_after(UNILATERAL_DIAL_TIMEOUT):
                async with trio.open_nursery() as nursery:
                    for addr in addrs[:MAX_UNILATERAL_ADDRS]:
                        nursery.start_soon(self._dial_peer, peer_id, addr)
            return bool(await self._verify_direct_connection(peer_id))

        async def _perform_hole_punch(self, peer_id: Any, addrs: Any, as_responder: bool = False) -> bool:
            since = _relayed_since(self.host, peer_id)
            ok = bool(await super()._perform_hole_punch(peer_id, addrs, as_responder))
            if ok:
                stats.ok += 1
                if since is not None:
                    stats.last_time_to_direct_s = max(0.0, time.time() - since)
            else:
                stats.failed += 1
            log.info("hole punch to %s %s", peer_id, "succeeded" if ok else "failed")
            return ok

    return CountingDCUtR(host)


@dataclass
class RelayParts:
    """The relay protocol, transport and hole puncher of one host, and what they have done."""

    protocol: Any
    transport: Any
    dcutr: Any | None
    serving: bool
    stats: HolePunchStats = field(default_factory=HolePunchStats)
    reservations: dict[str, str] = field(default_factory=dict)
    """relay peer ID -> our relayed multiaddr through it."""
    reservation_outcomes: Counter[str] = field(default_factory=Counter)
    """As a relay: reservation requests by outcome (``protocol.relay_reservations`` reasons, and
    ``departed``/``displaced`` for slots dropped)."""


def build_relay_parts(
    host: Any,
    *,
    relay_service: bool,
    hole_punching: bool,
    reservations: ReservationLimits | None = None,
    is_known: Callable[[str], bool] = lambda peer_id: False,
    group_of: Callable[[str], str] = ip_group,
) -> RelayParts:
    """``reservations``: the relay's slot budget; ``is_known``: whether a peer is one the node vouches for
    (it skips the per-group budget); ``group_of``: an IP's budget group."""
    from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
    from libp2p.relay.circuit_v2.transport import CircuitV2Transport

    budget = reservations or ReservationLimits()
    limits = relay_limits(budget)
    outcomes: Counter[str] = Counter()
    resources = _guarded_reservations(host, limits, budget, is_known, group_of, outcomes)
    protocol = _guarded_protocol(
        host, limits, allow_hop=relay_service, resources=resources, outcomes=outcomes
    )
    roles = RelayRole.STOP | (RelayRole.HOP if relay_service else RelayRole(0))
    transport = CircuitV2Transport(host, protocol, RelayConfig(roles=roles, limits=limits))
    stats = HolePunchStats()
    dcutr = _counting_dcutr(host, stats) if hole_punching else None
    return RelayParts(protocol, transport, dcutr, relay_service, stats, reservation_outcomes=outcomes)


REFUSALS = ("group_full", "full", "full_of_known", "not_direct", "claims_another_peer")


def relay_clients(host: Any, parts: RelayParts) -> int:
    """As a relay: the peers holding a slot on us that are still connected directly."""
    if not parts.serving:
        return 0
    held = list(parts.protocol.resource_manager._reservations)
    return sum(1 for peer_id in held if _live_direct_ip(host, peer_id) is not None)


def relay_refusals(parts: RelayParts) -> int:
    return sum(parts.reservation_outcomes[reason] for reason in REFUSALS)


def is_relayed(conn: Any) -> bool:
    try:
        addrs = conn.get_transport_addresses()
    except Exception:
        return False
    return bool(addrs) and all("/p2p-circuit" in str(a) for a in addrs)


def connection_kinds(host: Any) -> tuple[int, int]:
    """(peers with a direct connection, peers reached only through a relay)."""
    direct = relayed = 0
    for found in list(host.get_network().connections.values()):
        conns = found if isinstance(found, list) else [found]
        if any(not is_relayed(c) for c in conns):
            direct += 1
        elif conns:
            relayed += 1
    return direct, relayed


def has_direct_connection(host: Any, peer_id: str) -> bool:
    """Whether one of the host's connections to ``peer_id`` (base58) goes through no relay."""
    from libp2p.peer.id import ID

    return any(not is_relayed(c) for c in host.get_network().get_connections(ID.from_base58(peer_id)))


async def reserve(host: Any, parts: RelayParts, relay_peer_id: str, nursery: trio.Nursery) -> str:
    """Reserve a slot on a connected relay; our relayed multiaddr, or ConnectionError why not."""
    from libp2p.peer.id import ID
    from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID

    relay = ID.from_base58(relay_peer_id)
    with trio.fail_after(RESERVE_TIMEOUT):
        stream = await host.new_stream(relay, [PROTOCOL_ID])
        try:
            ok = await parts.transport.reserve(stream, relay, nursery)
        finally:
            await stream.close()
    if not ok:
        parts.reservations.pop(relay_peer_id, None)  # a refused refresh: the slot is gone
        raise ConnectionError(f"relay {relay_peer_id} refused the reservation")
    address = f"/p2p/{relay_peer_id}/p2p-circuit/p2p/{host.get_id()}"
    parts.reservations[relay_peer_id] = address
    return address


def peerstore_addrs(host: Any, peer_id: Any) -> list[Any]:
    """The peerstore's addresses of ``peer_id``; none once they expired (py-libp2p raises then, which
    must not end the node: a home node's record is built from its relay's addresses every heartbeat)."""
    from libp2p.peer.peerstore import PeerStoreError

    try:
        return list(host.get_peerstore().addrs(peer_id))
    except PeerStoreError:
        return []


def relayed_addrs(host: Any, parts: RelayParts) -> list[str]:
    """Our relayed multiaddrs with the relay's own transport address in front (dialable by anyone who
    can reach the relay), for reservations whose relay is still connected. The relay's address is the
    one our connection to it runs on, else the peerstore's."""
    from libp2p.peer.id import ID

    out: list[str] = []
    for relay_peer_id, address in list(parts.reservations.items()):
        relay = ID.from_base58(relay_peer_id)
        conns = host.get_network().get_connections(relay)
        if not conns:
            parts.reservations.pop(relay_peer_id, None)
            continue
        seen = [a for conn in conns for a in conn.get_transport_addresses()] + peerstore_addrs(host, relay)
        known = {str(a).split("/p2p/")[0] for a in seen}
        usable = {a for a in known if "/p2p-circuit" not in a and a and not a.startswith("/ip4/0.0.0.0/")}
        routable = {a for a in usable if not a.startswith("/ip4/127.")} or usable
        out.extend(f"{prefix}{address}" for prefix in sorted(routable)[:2])
        if not routable:
            out.append(address)
    return out


async def dial_relayed(host: Any, parts: RelayParts, multiaddr: Any) -> None:
    """Connect through a relay (``.../p2p/RELAY/p2p-circuit/p2p/PEER``); the connection joins the swarm."""
    await parts.transport.dial(multiaddr)


async def fresh_dial_check(host: Any, peer_id: str, ip: str, port: int, timeout: float) -> bool:
    """Whether a *new* TCP connection to ip:port reaches ``peer_id`` (Noise proves it); the connection is
    closed at once and never joins the swarm."""
    import multiaddr
    from libp2p.peer.id import ID

    family = "ip6" if ":" in ip else "ip4"
    addr = multiaddr.Multiaddr(f"/{family}/{ip}/tcp/{port}")
    swarm = host.get_network()
    raw = None
    with trio.move_on_after(timeout):
        try:
            transport = swarm.transport_manager.transport_for_dialing(addr)
            raw = await transport.dial(addr)
            secured = await swarm.upgrader.upgrade_security(raw, True, ID.from_base58(peer_id))
            ok = str(secured.get_remote_peer()) == peer_id
            await secured.close()
            return ok
        except Exception as exc:
            log.debug("dial-back to %s:%d failed: %s", ip, port, exc)
        finally:
            if raw is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    try:
                        await raw.close()
                    except Exception:
                        log.debug("closing a dial-back connection failed", exc_info=True)
    return False
