"""Our front door for inbound libp2p connections: per-IP-group budgets, a short handshake deadline, slots
kept for known peers (policy in ``protocol/connection_admission.py``).

What py-libp2p 0.8.1 does on its own (libp2p/network/swarm.py, transport/tcp/tcp.py): its TCP listener
hands every accepted socket to ``Swarm._handle_inbound_connection``. That takes one of
``max_connections - min_connections`` (300 - 50 = 250) slots with ``acquire_nowait`` and closes the
socket when none is left; it has no per-IP budget; the Noise + yamux upgrade may take
``inbound_upgrade_timeout`` (10 s); and after a successful upgrade the handler waits for the *swarm* to
stop, so the slot outlives the connection. 250 idle TCP sockets (no identity, no bytes) therefore shut
every honest peer out, 10 s at a time for as long as the flooder reconnects. Its ResourceManager
counts connections globally and its ConnectionGate is an allow/deny list, so neither bounds one
address. Its dialer also blacklists a peer for 60 s after one failed dial (``_NegativePeerCache``):
a peer that refused us because it was full could not be retried for a minute.

We replace ``_handle_inbound_connection`` on our swarm instance (the listener looks it up for every
connection) with ``InboundGate.handle``: admission by IP group before any byte is read, security +
muxer under ``handshake_timeout``, the Sybil bound checked as soon as Noise names the peer, the swarm's
own ``add_conn`` after that, and the slots released when the connection closes. ``relax_dial_backoff``
shortens the dial blacklist. Both touch private py-libp2p names, which is why they live here alone;
tests/p2p/test_inbound_flood.py fails if a py-libp2p upgrade changes them.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import trio

from protocol.connection_admission import ConnectionLimits, InboundAdmission

log = logging.getLogger(__name__)
DIAL_BLACKLIST_SECONDS = 2.0
CLOSE_TIMEOUT = 1.0


class KnownPeers:
    """Peers the node vouches for (bootstrap peers it was given, peers it marks good) and their IPs.

    Known peers skip the per-group budgets; their IPs get reserved pending slots (before the handshake the
    IP is all we know)."""

    def __init__(self) -> None:
        self._peers: set[str] = set()
        self._ips: Counter[str] = Counter()
        self._ips_of: dict[str, set[str]] = {}

    def add(self, peer_id: str, ips: set[str] | frozenset[str] = frozenset()) -> None:
        self._peers.add(peer_id)
        for ip in ips - self._ips_of.setdefault(peer_id, set()):
            self._ips_of[peer_id].add(ip)
            self._ips[ip] += 1

    def discard(self, peer_id: str) -> None:
        self._peers.discard(peer_id)
        for ip in self._ips_of.pop(peer_id, set()):
            self._ips[ip] -= 1
            if self._ips[ip] <= 0:
                del self._ips[ip]

    def has_peer(self, peer_id: str) -> bool:
        return peer_id in self._peers

    def has_ip(self, ip: str) -> bool:
        return ip in self._ips


class InboundGate:
    """Accepts inbound connections for one swarm under ``limits`` (see the module doc)."""

    def __init__(self, swarm: Any, limits: ConnectionLimits, known: KnownPeers) -> None:
        self._swarm = swarm
        self.limits = limits
        self._known = known
        self._admission = InboundAdmission(limits)
        self._scopes: dict[int, trio.CancelScope] = {}
        self._ids = itertools.count()
        self.outcomes: Counter[str] = Counter()
        """How inbound connections ended: accepted, evicted, handshake_timeout, group_full, ..."""

    def install(self) -> None:
        self._swarm._handle_inbound_connection = self.handle

    def established_from(self, group: str) -> int:
        return self._admission.established_count(group)

    async def handle(self, read_write_closer: Any, maddr: Any) -> None:
        """Serve one accepted TCP connection until it closes (signature of the swarm method we replace)."""
        ip = _remote_ip(read_write_closer)
        group = self.limits.group_of(ip)
        conn_id = next(self._ids)
        decision = self._admission.open(conn_id, group, trio.current_time(), known=self._known.has_ip(ip))
        for victim in decision.evict:
            scope = self._scopes.pop(victim, None)
            if scope is not None:
                scope.cancel()
            self.outcomes["evicted"] += 1
        if decision.evict:
            log.debug("inbound from %s: pending budget of %s full, evicted the oldest", ip, group)
        scope = trio.CancelScope()
        self._scopes[conn_id] = scope
        try:
            with scope:
                await self._serve(conn_id, read_write_closer, ip, group)
        finally:
            self._scopes.pop(conn_id, None)
            self._admission.close(conn_id)

    async def _serve(self, conn_id: int, read_write_closer: Any, ip: str, group: str) -> None:
        from libp2p.network.connection.raw_connection import RawConnection

        upgrader = self._swarm.upgrader
        stream: Any = _FirstRead(read_write_closer, lambda: self._admission.talking(conn_id))
        raw: Any = RawConnection(stream, False)
        secured: Any = None
        muxed: Any = None
        try:
            with trio.move_on_after(self.limits.handshake_timeout) as deadline:
                secured = await upgrader.upgrade_security(raw, False)
                peer_id = secured.get_remote_peer()
                admitted = self._admission.establish(conn_id, known=self._known.has_peer(str(peer_id)))
                if not admitted.admitted:
                    self.outcomes[admitted.reason] += 1
                    log.info("inbound peer %s from %s refused: %s", peer_id, group, admitted.reason)
                    return
                muxed = await upgrader.upgrade_connection(secured, peer_id)
            if deadline.cancelled_caught:
                self.outcomes["handshake_timeout"] += 1
                log.debug("inbound from %s: no handshake within %.1f s", ip, self.limits.handshake_timeout)
                return
            swarm_conn = await self._swarm.add_conn(muxed, direction="inbound")
            muxed = secured = raw = None  # the swarm owns and closes them now
            self.outcomes["accepted"] += 1
            await swarm_conn.event_closed.wait()
        except Exception as exc:  # py-libp2p raises many unrelated types for a peer's bad handshake
            self.outcomes["handshake_failed"] += 1
            log.debug("inbound from %s failed: %s: %s", ip, type(exc).__name__, exc)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
                for part in (muxed, secured, raw):
                    if part is not None:
                        await _close_quietly(part)


class _FirstRead:
    """The accepted TCP stream, reporting its first successful read (the peer started its handshake)."""

    def __init__(self, stream: Any, on_first_read: Callable[[], None]) -> None:
        self._stream = stream
        self._on_first_read: Callable[[], None] | None = on_first_read

    async def read(self, n: int | None = None) -> bytes:
        data = bytes(await self._stream.read(n))
        if data and self._on_first_read is not None:
            self._on_first_read()
            self._on_first_read = None
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def relax_dial_backoff(swarm: Any) -> None:
    """py-libp2p refuses to dial a peer for 60 s after one failed dial; make that a short pause."""
    from libp2p.network.swarm import _NegativePeerCache

    swarm._negative_peer_cache = _NegativePeerCache(ttl=DIAL_BLACKLIST_SECONDS)


def _remote_ip(read_write_closer: Any) -> str:
    try:
        remote = read_write_closer.get_remote_address()
    except Exception:
        remote = None
    return str(remote[0]) if remote else "unknown"


async def _close_quietly(part: Any) -> None:
    try:
        await part.close()
    except Exception:
        log.debug("closing %s failed", type(part).__name__, exc_info=True)
