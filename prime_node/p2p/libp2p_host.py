"""The one place py-libp2p is used: a ``P2PHost`` over TCP + Noise + yamux, Kademlia and gossipsub.

Choices forced by what py-libp2p 0.8.1 does (DESIGN §11):
- Noise is the *only* security transport: the default host also accepts plaintext.
- yamux is the only muxer; ``max_connections_per_peer=1`` avoids a 250 ms wait on every dial.
- The node identity is the wallet's secp256k1 key, so a Noise-authenticated peer ID names an address.
- The Kademlia DHT runs in server mode on every full node. A key is provided under the sha2-256 multihash
  of its name (protocol/dht_key.py) and our own record in its answers carries our addresses
  (``dht_interop.py``): what go and js peers need to store our providers and dial us.
- gossipsub's own spam limit (10 msg/s per forwarder and topic) would silently stop *forwarding* of a busy
  topic; we raise it and do flood control ourselves, per origin, in protocol/scoring.py.
- The ``libp2p`` logger reports expected failures (a peer went away) at ERROR; we cap it at CRITICAL
  unless the user asks for debug logs.
- Its inbound path has no per-IP budget and its dialer blacklists a peer for 60 s after one failed dial:
  ``inbound_gate.py`` replaces both, ``provider_guard.py`` bounds DHT provider records per IP group.
- Its swarm skips ``/p2p-circuit`` addresses, so relayed dials, reservations and hole punching go through
  ``nat_relay.py``; reachability is our own dial-back probe (``nat_dialback.py``, docs/nat.md).

One module over 400 lines on purpose: it is the whole adapter to py-libp2p, so everything that knows the
library's quirks (bind errors, stream ends, gossipsub and Kademlia set-up) stays behind one interface.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from crypto.identity import public_key_from_peer_id
from crypto.keys import WalletKey
from prime_node.errors import NodeError, first_node_error
from prime_node.p2p.dht_interop import answer_with_own_addresses, offered, push_identify
from prime_node.p2p.inbound_gate import InboundGate, KnownPeers, relax_dial_backoff
from prime_node.p2p.interface import FramedStream, GossipHandler, GossipMessage, PeerAddresses, StreamHandler
from prime_node.p2p.local_addresses import interface_ipv4s, without_wildcards
from prime_node.p2p.nat import DIALBACK_PROTOCOL, NatCounters, Reachability
from prime_node.p2p.nat_dialback import DIAL_TIMEOUT as DIALBACK_DIAL_TIMEOUT
from prime_node.p2p.nat_dialback import request_dialback, serve_dialback
from prime_node.p2p.nat_relay import (
    RelayParts,
    build_relay_parts,
    connection_kinds,
    dial_relayed,
    fresh_dial_check,
    has_direct_connection,
    is_relayed,
    relay_clients,
    relay_refusals,
    relayed_addrs,
    reserve,
)
from prime_node.p2p.port_check import ensure_port_free
from prime_node.p2p.provider_guard import ProviderGuard
from prime_node.p2p.provider_lookup import find_providers as find_run_providers
from prime_node.p2p.yamux_tuning import credit_per_half_window, tune_yamux, whole_writes
from protocol.connection_admission import ConnectionLimits
from protocol.dht_key import provider_key
from protocol.reachability import DialbackLimiter, verdict
from protocol.relay_reservations import ReservationLimits

log = logging.getLogger(__name__)
GOSSIPSUB_PROTOCOL = "/meshsub/1.1.0"
DIAL_TIMEOUT = 10.0
DIRECT_BEFORE_RELAY_TIMEOUT = 3.0
"""How long a direct dial may take when the peer also has relayed addresses (a NAT'd peer's private
addresses often fail only after retries; its relay then still answers within a caller's deadline)."""
NEVER_TRIM = 10.0**9
GOSSIP_PRUNE_BACKOFF = 10
# A GRAFT this soon after a PRUNE is a flood. py-libp2p's default equals the backoff it announces in that
# PRUNE, but the pruned peer rounds the backoff down to whole seconds and grafts again up to 1 s early, so
# honest peers were "flooding" each other: each GRAFT refused, penalised and answered with a PRUNE that
# restarted the cycle (~2.5 GRAFT/PRUNE per second per node in an idle 16-node swarm).
GOSSIP_GRAFT_FLOOD_THRESHOLD = GOSSIP_PRUNE_BACKOFF - 2.0
"""Gossipsub heartbeat once every mesh is settled: its lazy IHAVE gossip, not publishing, waits on it."""
PROVIDER_LOOKUP_COUNT = 40  # ask for twice a store's worth, so a crowd of one group does not fill the answer


def quiet_libp2p_logs() -> None:
    """py-libp2p logs routine peer churn at ERROR; keep it out of the user's terminal.

    Call after importing libp2p: its import configures the ``libp2p`` logger (no propagation, no
    handler, so Python's last-resort handler would print bare lines to stderr).
    """
    import libp2p  # noqa: F401  (its import resets the logger we adjust here)

    if not logging.getLogger("prime_node").isEnabledFor(logging.DEBUG):
        for name in ("libp2p", "multiaddr"):
            logger = logging.getLogger(name)
            logger.setLevel(logging.CRITICAL)
            if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
                logger.addHandler(logging.NullHandler())


def parse_multiaddr(text: str, *, need_peer_id: bool) -> Any:
    """A Multiaddr, or NodeError(bad_multiaddr) with one clear line."""
    import multiaddr

    try:
        parsed = multiaddr.Multiaddr(text)
    except Exception as exc:  # the multiaddr package raises several unrelated types
        raise NodeError(f"bad multiaddr {text!r}: {exc}", reason="bad_multiaddr") from exc
    if need_peer_id:
        try:
            peer_id = parsed.value_for_protocol("p2p")
        except Exception:
            peer_id = None
        if not peer_id:
            raise NodeError(f"multiaddr {text!r} must end in /p2p/<peer id>", reason="bad_multiaddr")
        try:
            public_key_from_peer_id(str(peer_id))
        except Exception as exc:
            raise NodeError(
                f"multiaddr {text!r} does not name a wallet-key peer: {exc}", reason="bad_multiaddr"
            ) from exc
    return parsed


class _Libp2pByteStream:
    def __init__(self, stream: Any, network: Any) -> None:
        self._stream = stream
        self._network = network
        self.remote_peer_id = str(stream.muxed_conn.peer_id)
        self.relayed = _is_relayed(stream)

    def stranded(self) -> bool:
        """Its yamux connection closed or is no longer one of the swarm's connections to the peer. Seen in
        py-libp2p 0.8.1: when two peers dial each other at once one connection is dropped, and a stream
        on it neither delivers nor fails."""
        try:
            connection = self._stream.muxed_conn
            if connection.is_closed:
                return True
            live = self._network.get_connections(connection.peer_id)
            return all(getattr(c, "muxed_conn", None) is not connection for c in live)
        except Exception:
            log.debug("could not tell whether a stream is stranded", exc_info=True)
            return False

    async def read(self, max_bytes: int) -> bytes:
        try:
            return bytes(await self._stream.read(max_bytes))
        except Exception as exc:
            if _is_end_of_stream(exc):
                return b""
            raise NodeError(f"stream read failed: {type(exc).__name__}", reason="stream_closed") from exc

    async def write(self, data: bytes) -> None:
        try:
            await self._stream.write(data)
        except Exception as exc:
            raise NodeError(f"stream write failed: {type(exc).__name__}", reason="stream_closed") from exc

    async def close(self) -> None:
        try:
            await self._stream.close()
        except Exception:
            log.debug("closing a stream failed", exc_info=True)

    async def reset(self) -> None:
        try:
            await self._stream.reset()
        except Exception:
            log.debug("resetting a stream failed", exc_info=True)


def _closing(connection: Any) -> bool:
    """Whether a swarm connection is closed or closing (its own flag, or its muxer's)."""
    try:
        muxer = connection.muxed_conn
        shutting_down = getattr(muxer, "event_shutting_down", None)
        return bool(
            connection.is_closed or muxer.is_closed or (shutting_down is not None and shutting_down.is_set())
        )
    except Exception:
        return False


def _is_relayed(stream: Any) -> bool:
    """Whether a stream's connection goes through a circuit relay (py-libp2p marks the raw connection
    ``ConnectionType.RELAYED``; yamux and Noise pass the question down to it)."""
    try:
        from libp2p.connection_types import ConnectionType

        return bool(stream.muxed_conn.get_connection_type() == ConnectionType.RELAYED)
    except Exception:
        return False


def _is_end_of_stream(exc: Exception) -> bool:
    return type(exc).__name__ in {
        "StreamEOF",
        "StreamClosed",
        "StreamReset",
        "MuxedStreamEOF",
        "MuxedStreamReset",
    }


class Libp2pHost:
    """A running libp2p host (see the module doc). Create with ``open_libp2p_host``."""

    def __init__(self, parts: _HostParts, nursery: trio.Nursery) -> None:
        self._host = parts.host
        self._pubsub = parts.pubsub
        self._dht = parts.dht
        self._known = parts.known
        self.inbound_gate = parts.gate
        self.provider_guard = parts.guard
        self._relay: RelayParts = parts.relay
        self._nursery = nursery
        self._peer_id = str(parts.host.get_id())
        self._dialback_limiter = DialbackLimiter()
        self._identify_push_due = False
        from libp2p.custom_types import TProtocol

        self._host.set_stream_handler(TProtocol(DIALBACK_PROTOCOL), self._on_dialback)
        answer_with_own_addresses(self._dht, self._dialable_addrs)

    @property
    def peer_id(self) -> str:
        return self._peer_id

    def listen_multiaddrs(self) -> list[str]:
        suffix = f"/p2p/{self._peer_id}"
        out = []
        for addr in self._host.get_addrs():
            text = str(addr)
            out.append(text if text.endswith(suffix) else text + suffix)
        # Relayed addresses last (a peer that can dial us directly should), but within the first eight
        # (what a peer record carries).
        relayed = relayed_addrs(self._host, self._relay)
        return sorted(set(out))[: 8 - len(relayed)] + relayed if relayed else sorted(set(out))

    def _dialable_addrs(self) -> list[str]:
        """Our addresses as a DHT record carries them: no ``/p2p/<us>`` suffix, the wildcard listen
        address replaced by this machine's interface addresses."""
        suffix = f"/p2p/{self._peer_id}"
        bare = [a.removesuffix(suffix) for a in self.listen_multiaddrs()]
        return without_wildcards(bare, interface_ipv4s())

    def offers(self, peer_id: str, protocol_id: str) -> bool | None:
        """Whether ``peer_id`` serves ``protocol_id`` by its identify; None while that is not known."""
        return offered(self._host, peer_id, protocol_id)

    async def connect(self, multiaddr: str) -> str:
        from libp2p.peer.peerinfo import info_from_p2p_addr

        parsed = parse_multiaddr(multiaddr, need_peer_id=True)
        if "/p2p-circuit" in multiaddr:
            await self._dial_relayed(parsed)
            return multiaddr.rsplit("/p2p/", 1)[1]
        info = info_from_p2p_addr(parsed)
        await self._dial(info)
        # A peer we were given by address (a bootstrap peer) is known: it keeps its slots at our door.
        self._known.add(str(info.peer_id), _ips_of(info.addrs))
        return str(info.peer_id)

    def mark_known(self, peer_id: str, *, known: bool = True) -> None:
        """Vouch for a peer (or stop): known peers skip the per-IP budgets and come first in lookups."""
        if not known:
            self._known.discard(peer_id)
            return
        from libp2p.peer.id import ID

        ips = set()
        for conn in self._host.get_network().get_connections(ID.from_base58(peer_id)):
            remote = conn.muxed_conn.get_remote_address()
            if remote:
                ips.add(str(remote[0]))
        self._known.add(peer_id, ips)

    async def connect_peer(self, peer: PeerAddresses) -> None:
        from libp2p.peer.id import ID
        from libp2p.peer.peerinfo import PeerInfo

        direct = [parse_multiaddr(a, need_peer_id=False) for a in peer.multiaddrs if "/p2p-circuit" not in a]
        relayed = [a for a in peer.multiaddrs if "/p2p-circuit" in a and a.endswith(f"/p2p/{peer.peer_id}")]
        try:
            if not direct:
                raise NodeError(f"no direct address for {peer.peer_id}", reason="dial_failed")
            timeout = DIRECT_BEFORE_RELAY_TIMEOUT if relayed else DIAL_TIMEOUT
            await self._dial(PeerInfo(ID.from_base58(peer.peer_id), direct), timeout)
        except NodeError:
            # Behind a NAT: reach it through its relay (hole punching then upgrades the connection).
            for text in relayed[:2]:
                try:
                    await self._dial_relayed(parse_multiaddr(text, need_peer_id=True))
                    return
                except NodeError as exc:
                    log.debug("relayed dial to %s via %s failed: %s", peer.peer_id, text, exc)
            raise

    async def _dial_relayed(self, parsed: Any) -> None:
        """Dial ``.../p2p/RELAY/p2p-circuit/p2p/PEER``; NodeError(dial_failed) if the relay or peer fails."""
        if str(parsed).endswith(f"/p2p/{self._peer_id}"):
            return
        try:
            with trio.fail_after(DIAL_TIMEOUT):
                await dial_relayed(self._host, self._relay, parsed)
        except trio.TooSlowError as exc:
            raise NodeError(f"relayed dial {parsed} timed out", reason="dial_failed") from exc
        except Exception as exc:
            raise NodeError(f"relayed dial {parsed} failed: {_short(exc)}", reason="dial_failed") from exc

    async def _dial(self, info: Any, timeout: float = DIAL_TIMEOUT) -> None:
        if str(info.peer_id) == self._peer_id:
            return
        self._host.get_peerstore().add_addrs(info.peer_id, info.addrs, 3600)
        # A dial we ask for is never refused from py-libp2p's failed-dial cache: the peer may have been
        # full a moment ago (its callers retry with their own backoff).
        network = self._host.get_network()
        network.unblock_peer(info.peer_id)
        self._forget_closed_connections(info.peer_id)
        try:
            with trio.fail_after(timeout):
                await self._host.connect(info)
        except trio.TooSlowError as exc:
            raise NodeError(f"dialing {info.peer_id} timed out", reason="dial_failed") from exc
        except Exception as exc:
            raise NodeError(f"cannot reach {info.peer_id}: {_dial_cause(exc)}", reason="dial_failed") from exc
        finally:
            network.unblock_peer(info.peer_id)
        try:
            await self._dht.routing_table.add_peer(info.peer_id)
        except Exception:
            log.debug("adding %s to the routing table failed", info.peer_id, exc_info=True)

    async def disconnect(self, peer_id: str) -> None:
        from libp2p.peer.id import ID

        try:
            await self._host.disconnect(ID.from_base58(peer_id))
        except Exception:
            log.debug("disconnecting %s failed", peer_id, exc_info=True)

    def connected_peers(self) -> list[str]:
        """Peers with a connection that is not closing (see ``_forget_closed_connections``)."""
        connections = self._host.get_network().connections
        return sorted(str(p) for p, conns in list(connections.items()) if any(not _closing(c) for c in conns))

    def _forget_closed_connections(self, peer_id: Any) -> None:
        """Drop the swarm's closing (or closed) connections to ``peer_id`` from its records.

        py-libp2p 0.8.1 keeps a connection in the swarm's records until its close has finished (the
        muxer's close, the streams' resets, a 0.1 s pause, then the notifications: seconds on a loaded
        machine), and meanwhile ``connect`` dials nothing and ``new_stream`` fails with "No valid
        connections". A peer whose only connection dropped looked unreachable for that long: the link
        re-ask failed and the peer was judged dead by its last beat (docs/benchmarks.md, issue 16). The
        close goes on regardless; removing a connection twice is harmless."""
        network = self._host.get_network()
        for connection in list(network.get_connections(peer_id)):
            if _closing(connection):
                network.remove_conn(connection)

    def directly_connected(self, peer_id: str) -> bool:
        try:
            return has_direct_connection(self._host, peer_id)
        except Exception:  # a malformed ID, or py-libp2p's bookkeeping mid-change: not known to be direct
            log.debug("could not tell whether %s is directly connected", peer_id, exc_info=True)
            return False

    def set_stream_handler(self, protocol_id: str, handler: StreamHandler) -> None:
        from libp2p.custom_types import TProtocol

        async def on_stream(stream: Any) -> None:
            framed = FramedStream(_Libp2pByteStream(stream, self._host.get_network()))
            try:
                await handler(framed)
            except NodeError as exc:
                log.info("stream %s from %s ended: %s", protocol_id, framed.remote_peer_id, exc)
            finally:
                await framed.close()

        self._host.set_stream_handler(TProtocol(protocol_id), on_stream)
        if not self._identify_push_due:  # one push for the handlers a role sets together
            self._identify_push_due = True
            try:
                self._nursery.start_soon(self._push_identify)
            except RuntimeError:  # the host is stopping
                log.debug("no identify push: the host is stopping")

    async def _push_identify(self) -> None:
        await trio.sleep(0)
        self._identify_push_due = False
        await push_identify(self._host)

    async def open_stream(self, peer_id: str, protocol_id: str) -> FramedStream:
        from libp2p.custom_types import TProtocol
        from libp2p.peer.id import ID

        try:
            remote = ID.from_base58(peer_id)
            self._forget_closed_connections(remote)
            with trio.fail_after(DIAL_TIMEOUT):
                stream = await self._host.new_stream(remote, [TProtocol(protocol_id)])
        except trio.TooSlowError as exc:
            raise NodeError(f"opening {protocol_id} to {peer_id} timed out", reason="stream_failed") from exc
        except Exception as exc:
            raise NodeError(
                f"cannot open {protocol_id} to {peer_id}: {_short(exc)}", reason="stream_failed"
            ) from exc
        return FramedStream(_Libp2pByteStream(stream, self._host.get_network()))

    async def subscribe(self, topic: str, handler: GossipHandler) -> None:
        subscription = await self._pubsub.subscribe(topic)
        self._nursery.start_soon(self._deliver, topic, subscription, handler)

    async def _deliver(self, topic: str, subscription: Any, handler: GossipHandler) -> None:
        from libp2p.peer.id import ID

        while True:
            message = await subscription.get()
            try:
                origin = str(ID(message.from_id))
            except Exception:
                log.debug("gossip message with an unreadable origin on %s", topic)
                continue
            if origin == self._peer_id:
                continue
            await handler(GossipMessage(topic, origin, bytes(message.data)))

    async def publish(self, topic: str, data: bytes) -> None:
        try:
            await self._pubsub.publish(topic, data)
        except Exception as exc:
            raise NodeError(f"publishing on {topic} failed: {_short(exc)}", reason="publish_failed") from exc

    async def provide(self, key: str) -> None:
        """Provide ``key`` (a name) under its sha2-256 multihash (protocol/dht_key.py)."""
        try:
            await self._dht.provider_store.provide(provider_key(key))
        except Exception as exc:
            raise NodeError(f"DHT provide failed: {_short(exc)}", reason="dht_failed") from exc

    async def find_providers(self, key: str) -> list[PeerAddresses]:
        try:
            found = await find_run_providers(self._dht, provider_key(key), want=PROVIDER_LOOKUP_COUNT)
        except Exception as exc:
            raise NodeError(f"DHT lookup failed: {_short(exc)}", reason="dht_failed") from exc
        out = []
        for info in self.provider_guard.select(list(found)):
            peer_id = str(info.peer_id)
            if peer_id != self._peer_id:
                out.append(PeerAddresses(peer_id, tuple(f"{a}" for a in info.addrs)))
        return out

    def routing_table_size(self) -> int:
        return int(self._dht.get_routing_table_size())

    # -- NAT: reachability, relays, hole punching (docs/nat.md) -----------------------------------------

    def _listen_ports(self) -> list[int]:
        ports = []
        for addr in self._host.get_transport_addrs():
            try:
                ports.append(int(addr.value_for_protocol("tcp")))
            except Exception:
                continue
        return sorted(set(ports))

    def _observed_addrs(self) -> list[str]:
        manager = getattr(self._host, "_observed_addr_manager", None)
        if manager is None:
            return []
        try:
            return sorted({str(a) for a in manager.addrs(min_observers=1) if "/p2p-circuit" not in str(a)})
        except Exception:
            return []

    def _relay_address(self) -> str | None:
        addrs = relayed_addrs(self._host, self._relay)
        return addrs[0] if addrs else None

    async def probe_reachability(self, peer_id: str, timeout: float) -> Reachability:
        """Ask a connected peer to dial us back (``nat_dialback.py``); never raises for network trouble."""
        relay = self._relay_address()
        try:
            stream = await self.open_stream(peer_id, DIALBACK_PROTOCOL)
        except NodeError as exc:
            return Reachability("unknown", tuple(self._observed_addrs()), relay, f"no dial-back: {exc}")
        try:
            answer = await request_dialback(stream, self._listen_ports(), timeout)
        except NodeError as exc:
            return Reachability("unknown", tuple(self._observed_addrs()), relay, f"dial-back failed: {exc}")
        finally:
            await stream.close()
        observed = tuple(sorted({answer.observed, *self._observed_addrs()} - {""}))
        status = verdict([ok for _, ok in answer.results])
        if answer.refused:
            detail = f"{peer_id} refused to dial back: {answer.refused}"
        else:
            tried = ", ".join(f"{port}: {'reached' if ok else 'unreachable'}" for port, ok in answer.results)
            detail = f"{peer_id} dialled back our observed IP on port(s) {tried}"
        return Reachability(status, observed, relay, detail)

    async def _on_dialback(self, stream: Any) -> None:
        framed = FramedStream(_Libp2pByteStream(stream, self._host.get_network()))
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
            message = f"no relay slot on {relay_peer_id}: {_short(exc)}"
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
            return inbound and not _closing(connection) and not is_relayed(connection)

        connections = self._host.get_network().connections
        return sum(1 for conns in list(connections.values()) if any(dialled_in(c) for c in conns))


def _ips_of(addrs: list[Any]) -> set[str]:
    ips = set()
    for addr in addrs:
        for protocol in ("ip4", "ip6"):
            try:
                ips.add(str(addr.value_for_protocol(protocol)))
            except Exception:
                continue
    return ips


def _raise_on_exit(
    exc: BaseException,
    listen: str,
    *,
    started: bool,
    body_error: BaseException | None,
    failures: list[BaseException],
) -> None:
    """What leaves ``open_libp2p_host`` when ``exc`` ends its host: the caller's own error; a clear
    NodeError for a host that could not start; a cancellation from outside. Returns (the context then ends
    quietly, or raises ``host_failed`` if the host failed under the caller) for what libp2p reports while
    shutting down."""
    if body_error is not None and not _only_cancelled(body_error):
        raise body_error from None  # the caller's own error
    if not started:
        own = first_node_error(exc)
        if own is not None:
            raise own from None
        bind = _bind_error(exc)
        if bind is not None:
            raise NodeError(f"cannot listen on {listen}: {bind.strerror}", reason="port_in_use") from None
        if isinstance(exc, Exception):
            raise NodeError(
                f"cannot start the libp2p host on {listen}: {_short(exc)}", reason="listen_failed"
            ) from exc
        raise exc
    # A py-libp2p service that fails cancels the code running inside its context (the caller's body):
    # that is the host failing, not the caller stopping, so the body's cancellation must not end the
    # context quietly (``open_libp2p_host`` raises it once out of its teardown scope). While shutting down
    # the services sometimes spawn tasks into closing nurseries: log that, and let a cancellation from
    # outside go on its way.
    if body_error is not None and failures:
        return
    if isinstance(exc, BaseExceptionGroup):
        cancelled, rest = exc.split(trio.Cancelled)
        if rest is not None:
            log.debug("libp2p reported errors while shutting down: %r", rest)
        if cancelled is not None:
            raise cancelled from None
    elif isinstance(exc, trio.Cancelled | KeyboardInterrupt):
        raise exc
    else:
        log.debug("libp2p reported an error while shutting down: %r", exc)


@asynccontextmanager
async def _failures_into(failures: list[BaseException]) -> AsyncIterator[None]:
    """Note what leaves the block other than cancellation (a py-libp2p service that failed: its context
    cancels the code inside it, so the caller sees only ``Cancelled``), and let it go on its way."""
    try:
        yield
    except BaseException as exc:
        rest = exc.split(trio.Cancelled)[1] if isinstance(exc, BaseExceptionGroup) else exc
        if rest is not None and not isinstance(rest, trio.Cancelled):
            failures.append(rest)
        raise


def _only_cancelled(exc: BaseException) -> bool:
    return isinstance(exc, trio.Cancelled) or (
        isinstance(exc, BaseExceptionGroup) and exc.split(trio.Cancelled)[1] is None
    )


def _first_leaf(exc: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups: the one worth a line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _dial_cause(exc: BaseException, depth: int = 8) -> str:
    """What made a dial fail, in the operating system's words where there are some ("connection
    refused"), not py-libp2p's wrapper ("no addresses established a successful connection (with
    exceptions)"): the first OSError with an error number down its causes, else its own first line."""
    pending: list[tuple[BaseException, int]] = [(exc, 0)]
    seen: set[int] = set()
    while pending:
        current, level = pending.pop(0)
        if id(current) in seen or level > depth:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None and current.strerror:
            return current.strerror.lower()
        children = [*(getattr(current, "errors", None) or ()), *(getattr(current, "exceptions", None) or ())]
        children += [c for c in (current.__cause__, current.__context__) if c is not None]
        pending += [(child, level + 1) for child in children if isinstance(child, BaseException)]
    return _short(exc)


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]


def _gossipsub(heartbeat_interval: int) -> Any:
    from libp2p.custom_types import TProtocol
    from libp2p.pubsub.gossipsub import GossipSub

    router = GossipSub(
        protocols=[TProtocol(GOSSIPSUB_PROTOCOL)],
        degree=6,
        degree_low=4,
        degree_high=12,
        heartbeat_interval=heartbeat_interval,
        prune_back_off=GOSSIP_PRUNE_BACKOFF,
        max_messages_per_topic_per_second=1000.0,
        # Its "v2.0" extras measure IP diversity and adapt degrees; with peers that share an IP (one machine,
        # one data centre, loopback) they shrink meshes and heartbeats go missing. Off: our own scoring rules.
        adaptive_gossip_enabled=False,
        eclipse_protection_enabled=False,
    )
    router.graft_flood_threshold = GOSSIP_GRAFT_FLOOD_THRESHOLD
    # Its peer scorer with default parameters scores every peer 0 and gates nothing (thresholds -inf,
    # weights 0); what it does do is "opportunistic grafting" on every heartbeat: 2 more peers per topic
    # whenever they score >= half the mesh median (0 >= 0), so meshes grow past degree_high each few
    # seconds and are pruned back: endless GRAFT/PRUNE traffic in an idle swarm. Misbehaviour is scored by
    # our own peer policy; with no scorer its mesh upkeep is the plain gossipsub one.
    router.scorer = None
    return router


def _bind_error(exc: BaseException) -> OSError | None:
    """The OSError inside whatever py-libp2p wrapped it in, if any."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (
            errno.EADDRINUSE,
            errno.EADDRNOTAVAIL,
            errno.EACCES,
        ):
            return current
        if isinstance(current, BaseExceptionGroup):
            stack.extend(current.exceptions)
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                stack.append(linked)
    return None


def _refuse_a_port_in_use(listen_addr: Any) -> None:
    """py-libp2p's listener sets SO_REUSEPORT, so a second node would bind a port in use and share it
    (``port_check``): refuse that before the host starts."""
    for protocol in ("ip4", "ip6"):
        try:
            host = listen_addr.value_for_protocol(protocol)
            port = int(listen_addr.value_for_protocol("tcp"))
        except Exception:
            continue
        ensure_port_free(host, port)
        return


def _why_bind_fails(listen_addr: Any) -> str:
    """Reproduce the bind py-libp2p attempted, to tell the user why it failed."""
    try:
        host = listen_addr.value_for_protocol("ip4")
        port = int(listen_addr.value_for_protocol("tcp"))
        with socket.socket() as probe:
            probe.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    except Exception:
        return "the address cannot be bound"
    return "the transport refused it"


def _resource_manager() -> Any:
    """py-libp2p's resource manager without its global circuit breaker and load shedding: after five
    failures anywhere (routine churn) the breaker refuses every new connection for 60 s, which stalls
    discovery. Stream, connection and memory limits stay on; our own scoring handles abusive peers."""
    from libp2p.rcmgr.manager import ResourceManager

    return ResourceManager(enable_circuit_breaker=False, enable_graceful_degradation=False)


@dataclass(frozen=True)
class _HostParts:
    host: Any
    pubsub: Any
    gossipsub: Any
    dht: Any
    known: KnownPeers
    gate: InboundGate
    guard: ProviderGuard
    relay: RelayParts


def _build_host(
    key: WalletKey,
    listen_addr: Any,
    gossip_heartbeat_interval: int,
    limits: ConnectionLimits,
    *,
    relay_service: bool = False,
    hole_punching: bool = True,
    relay_reservations: ReservationLimits | None = None,
) -> _HostParts:
    """The host (Noise only, yamux only, one connection per peer) behind our inbound gate, pubsub,
    gossipsub, a server-mode DHT whose provider store is budgeted per IP group, and circuit relay v2 (a
    relay for others if ``relay_service``) with DCUtR hole punching if ``hole_punching``."""
    from libp2p import create_yamux_muxer_option, new_host
    from libp2p.crypto.secp256k1 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
    from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
    from libp2p.network.config import ConnectionConfig
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport

    from prime_node.p2p.gossip_router import LeanPubsub

    # yamux closer to go-yamux (prime_node/p2p/yamux_tuning.py): fewer window updates, and a message is
    # written whole or its stream ends.
    if tune_yamux(os.environ):
        credit_per_half_window()
    whole_writes()
    key_pair = create_new_key_pair(key.secret)
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt=create_yamux_muxer_option(),
        # One connection per peer keeps dials fast (no 250 ms wait for extra connections). When two peers
        # dial each other at once, py-libp2p later "trims" one connection and resets every stream on it;
        # an endless grace period turns that off (at worst a pair keeps two connections).
        connection_config=ConnectionConfig(
            max_connections_per_peer=1,
            grace_period=NEVER_TRIM,
            inbound_upgrade_timeout=limits.handshake_timeout,
        ),
        listen_addrs=[listen_addr],
        resource_manager=_resource_manager(),
    )
    swarm = host.get_network()
    known = KnownPeers()
    gate = InboundGate(swarm, limits, known)
    gate.install()
    relax_dial_backoff(swarm)
    _contain_stream_failures(host)
    gossipsub = _gossipsub(gossip_heartbeat_interval)
    pubsub = LeanPubsub(host, gossipsub)
    dht = KadDHT(host, DHTMode.SERVER)
    guard = ProviderGuard(swarm, dht.provider_store, limits, known)
    guard.install()
    relay = build_relay_parts(
        host,
        relay_service=relay_service,
        hole_punching=hole_punching,
        reservations=relay_reservations,
        is_known=known.has_peer,
        group_of=limits.group_of,
    )
    return _HostParts(host, pubsub, gossipsub, dht, known, gate, guard, relay)


def _contain_stream_failures(host: Any) -> None:
    """An error in the handler of one inbound stream ends that stream, not the host. py-libp2p runs every
    handler (its own: identify, DHT, relay, DCUtR, pubsub; and ours) inside the connection's service, so an
    exception a handler lets escape, e.g. on bytes a peer chose, failed the whole host."""
    dispatch = host._swarm_stream_handler

    async def contained(stream: Any) -> None:
        try:
            await dispatch(stream)
        except Exception as exc:
            peer = getattr(getattr(stream, "muxed_conn", None), "peer_id", "?")
            log.info("resetting a stream from %s: its handler failed: %s", peer, _short(exc))
            with contextlib.suppress(Exception):
                await stream.reset()

    host.get_network().set_stream_handler(contained)


@asynccontextmanager
async def _maybe_service(service: Any | None) -> AsyncIterator[None]:
    if service is None:
        yield
        return
    from libp2p.tools.anyio_service import background_trio_service

    async with background_trio_service(service):
        yield


@asynccontextmanager
async def open_libp2p_host(
    key: WalletKey,
    listen: str = "/ip4/127.0.0.1/tcp/0",
    *,
    gossip_heartbeat_interval: int = 1,
    limits: ConnectionLimits | None = None,
    relay_service: bool = False,
    hole_punching: bool = True,
    relay_reservations: ReservationLimits | None = None,
) -> AsyncIterator[Libp2pHost]:
    """Start a host with the wallet's identity listening on ``listen``; stop it on exit. ``limits``: the
    inbound budgets per IP group (protocol/connection_admission.py); defaults suit a home node.
    ``relay_service``: relay for NAT'd peers (bounded, control traffic only; ``relay_reservations``: its
    slot budget, protocol/relay_reservations.py); ``hole_punching``: DCUtR."""
    quiet_libp2p_logs()
    listen_addr = parse_multiaddr(listen, need_peer_id=False)
    if "/tcp/" not in listen:
        raise NodeError(f"listen address {listen!r} must be TCP (/ip4/.../tcp/PORT)", reason="bad_multiaddr")
    _refuse_a_port_in_use(listen_addr)

    from libp2p.tools.anyio_service import background_trio_service

    parts = _build_host(
        key,
        listen_addr,
        gossip_heartbeat_interval,
        limits or ConnectionLimits(),
        relay_service=relay_service,
        hole_punching=hole_punching,
        relay_reservations=relay_reservations,
    )
    host = parts.host
    started = False
    body_error: BaseException | None = None
    failures: list[BaseException] = []
    # Teardown always runs cancelled: py-libp2p's services can wait a long time for peers to answer
    # while closing, and an error in the caller's code must not leave the node hanging.
    with trio.CancelScope() as teardown:
        try:
            async with (
                _failures_into(failures),
                host.run(listen_addrs=[listen_addr]),
                trio.open_nursery() as nursery,
            ):
                if not host.get_network().listeners:  # py-libp2p logs a failed bind and carries on
                    raise NodeError(
                        f"cannot listen on {listen}: {_why_bind_fails(listen_addr)}", reason="port_in_use"
                    )
                started = True
                async with (
                    _failures_into(failures),
                    background_trio_service(parts.pubsub),
                    background_trio_service(parts.gossipsub),
                    background_trio_service(parts.dht),
                    background_trio_service(parts.relay.protocol),
                    _maybe_service(parts.relay.dcutr),
                ):
                    await parts.pubsub.wait_until_ready()
                    try:
                        yield Libp2pHost(parts, nursery)
                    except BaseException as exc:
                        body_error = exc
                        raise
                    finally:
                        teardown.cancel()
        except BaseException as exc:
            _raise_on_exit(exc, listen, started=started, body_error=body_error, failures=failures)
    if body_error is not None and failures:
        await trio.lowlevel.checkpoint_if_cancelled()  # cancelled from outside as well: that is a stop
        log.warning("the libp2p host stopped", exc_info=failures[0])
        cause = _first_leaf(failures[0])
        raise NodeError(f"the libp2p host stopped: {_short(cause)}", reason="host_failed") from cause
