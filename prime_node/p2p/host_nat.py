"""The NAT side of a libp2p host: reachability by dial-back, relay slots, and the counters the status
screen shows (docs/nat.md). ``Libp2pHost`` owns one and forwards ``probe_reachability``, ``reserve_relay``
and ``nat_counters`` to it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from prime_node.errors import NodeError
from prime_node.p2p.interface import FramedStream
from prime_node.p2p.libp2p_exits import short
from prime_node.p2p.libp2p_streams import Libp2pByteStream, connection_closing
from prime_node.p2p.nat import DIALBACK_PROTOCOL, NatCounters, Reachability
from prime_node.p2p.nat_dialback import DIAL_TIMEOUT as DIALBACK_DIAL_TIMEOUT
from prime_node.p2p.nat_dialback import request_dialback, serve_dialback
from prime_node.p2p.nat_relay import (
    RelayParts,
    connection_kinds,
    fresh_dial_check,
    is_relayed,
    relay_clients,
    relay_refusals,
    relayed_addrs,
    reserve,
)
from protocol.reachability import DialbackLimiter, verdict

log = logging.getLogger(__name__)


class HostNat:
    """Reachability and relaying for one host; ``open_stream`` is the host's (the dial-back request
    travels on an ordinary stream)."""

    def __init__(
        self,
        host: Any,
        relay: RelayParts,
        nursery: trio.Nursery,
        open_stream: Callable[[str, str], Awaitable[FramedStream]],
    ) -> None:
        self._host = host
        self._relay = relay
        self._nursery = nursery
        self._open_stream = open_stream
        self._dialback_limiter = DialbackLimiter()

    def listen_ports(self) -> list[int]:
        ports = []
        for addr in self._host.get_transport_addrs():
            try:
                ports.append(int(addr.value_for_protocol("tcp")))
            except Exception:
                continue
        return sorted(set(ports))

    def observed_addrs(self) -> list[str]:
        manager = getattr(self._host, "_observed_addr_manager", None)
        if manager is None:
            return []
        try:
            return sorted({str(a) for a in manager.addrs(min_observers=1) if "/p2p-circuit" not in str(a)})
        except Exception:
            return []

    def relay_address(self) -> str | None:
        addrs = relayed_addrs(self._host, self._relay)
        return addrs[0] if addrs else None

    async def probe_reachability(self, peer_id: str, timeout: float) -> Reachability:
        """Ask a connected peer to dial us back (``nat_dialback.py``); never raises for network trouble."""
        relay = self.relay_address()
        try:
            stream = await self._open_stream(peer_id, DIALBACK_PROTOCOL)
        except NodeError as exc:
            return Reachability("unknown", tuple(self.observed_addrs()), relay, f"no dial-back: {exc}")
        try:
            answer = await request_dialback(stream, self.listen_ports(), timeout)
        except NodeError as exc:
            return Reachability("unknown", tuple(self.observed_addrs()), relay, f"dial-back failed: {exc}")
        finally:
            await stream.close()
        observed = tuple(sorted({answer.observed, *self.observed_addrs()} - {""}))
        status = verdict([ok for _, ok in answer.results])
        if answer.refused:
            detail = f"{peer_id} refused to dial back: {answer.refused}"
        else:
            tried = ", ".join(f"{port}: {'reached' if ok else 'unreachable'}" for port, ok in answer.results)
            detail = f"{peer_id} dialled back our observed IP on port(s) {tried}"
        return Reachability(status, observed, relay, detail)

    async def on_dialback(self, stream: Any) -> None:
        framed = FramedStream(Libp2pByteStream(stream, self._host.get_network()))
        try:
            remote = stream.get_remote_address()
            observed = (str(remote[0]), int(remote[1])) if remote else None
        except Exception:
            observed = None
        relayed = any(is_relayed(c) for c in self._swarm_conns_of(stream.muxed_conn))
        peer_id = framed.remote_peer_id

        async def dial(ip: str, port: int) -> bool:
            return await fresh_dial_check(self._host, peer_id, ip, port, DIALBACK_DIAL_TIMEOUT)

        try:
            await serve_dialback(
                framed,
                observed=observed,
                relayed=relayed,
                limiter=self._dialback_limiter,
                now=trio.current_time(),
                dial=dial,
            )
        except NodeError as exc:
            log.info("dial-back request from %s ended: %s", peer_id, exc)
        finally:
            await framed.close()

    def _swarm_conns_of(self, muxed_conn: Any) -> list[Any]:
        conns = self._host.get_network().get_connections(muxed_conn.peer_id)
        return [c for c in conns if getattr(c, "muxed_conn", None) is muxed_conn]

    async def reserve_relay(self, relay_peer_id: str) -> str:
        """Reserve a circuit-relay slot on a connected peer; our relayed multiaddr, or NodeError."""
        try:
            return await reserve(self._host, self._relay, relay_peer_id, self._nursery)
        except trio.TooSlowError as exc:
            raise NodeError(f"relay {relay_peer_id} did not answer", reason="relay_refused") from exc
        except Exception as exc:
            message = f"no relay slot on {relay_peer_id}: {short(exc)}"
            raise NodeError(message, reason="relay_refused") from exc

    def nat_counters(self) -> NatCounters:
        direct, relayed = connection_kinds(self._host)
        stats = self._relay.stats
        return NatCounters(
            direct_connections=direct,
            relayed_connections=relayed,
            relay_reservations=tuple(sorted(self._relay.reservations)),
            relayed_addrs=tuple(relayed_addrs(self._host, self._relay)),
            hole_punches_ok=stats.ok,
            hole_punches_failed=stats.failed,
            last_time_to_direct_s=stats.last_time_to_direct_s,
            relay_serving=self._relay.serving,
            relay_clients=relay_clients(self._host, self._relay),
            relay_refusals=relay_refusals(self._relay),
            dialled_in_by=self._dialled_in_by(),
        )

    def _dialled_in_by(self) -> int:
        """Peers with an open, direct connection they dialled to us (our inbound gate accepted it)."""
        from libp2p.rcmgr import Direction

        def dialled_in(connection: Any) -> bool:
            inbound = getattr(connection, "direction", None) == Direction.INBOUND
            return inbound and not connection_closing(connection) and not is_relayed(connection)

        connections = self._host.get_network().connections
        return sum(1 for conns in list(connections.values()) if any(dialled_in(c) for c in conns))
