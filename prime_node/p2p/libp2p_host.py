"""py-libp2p behind our ``P2PHost`` interface: a running host over TCP + Noise + yamux, Kademlia, gossipsub.

The adapter's other parts: ``libp2p_build.py`` builds the host, ``libp2p_streams.py`` wraps its streams,
``libp2p_exits.py`` turns its failures into our errors, ``host_nat.py`` does reachability and relay slots.

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
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.lowlevel

from crypto.identity import public_key_from_peer_id
from crypto.keys import WalletKey
from prime_node.errors import NodeError
from prime_node.p2p.dht_interop import answer_with_own_addresses, offered, push_identify
from prime_node.p2p.host_nat import HostNat
from prime_node.p2p.interface import FramedStream, GossipHandler, GossipMessage, PeerAddresses, StreamHandler
from prime_node.p2p.libp2p_build import (
    HostParts,
    build_host,
    quiet_libp2p_logs,
    refuse_a_port_in_use,
    why_bind_fails,
)
from prime_node.p2p.libp2p_exits import dial_cause, failures_into, first_leaf, raise_on_exit, short
from prime_node.p2p.libp2p_streams import Libp2pByteStream, connection_closing
from prime_node.p2p.local_addresses import interface_ipv4s, without_wildcards
from prime_node.p2p.nat import DIALBACK_PROTOCOL, NatCounters, Reachability
from prime_node.p2p.nat_relay import RelayParts, dial_relayed, has_direct_connection, relayed_addrs
from prime_node.p2p.provider_lookup import find_providers as find_run_providers
from protocol.connection_admission import ConnectionLimits
from protocol.dht_key import provider_key
from protocol.relay_reservations import ReservationLimits

log = logging.getLogger(__name__)
DIAL_TIMEOUT = 10.0
DIRECT_BEFORE_RELAY_TIMEOUT = 3.0
"""How long a direct dial may take when the peer also has relayed addresses (a NAT'd peer's private
addresses often fail only after retries; its relay then still answers within a caller's deadline)."""
PROVIDER_LOOKUP_COUNT = 40  # ask for twice a store's worth, so a crowd of one group does not fill the answer


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


class Libp2pHost:
    """A running libp2p host (see the module doc). Create with ``open_libp2p_host``."""

    def __init__(self, parts: HostParts, nursery: trio.Nursery) -> None:
        self._host = parts.host
        self._pubsub = parts.pubsub
        self._dht = parts.dht
        self._known = parts.known
        self.inbound_gate = parts.gate
        self.provider_guard = parts.guard
        self._relay: RelayParts = parts.relay
        self._nursery = nursery
        self._peer_id = str(parts.host.get_id())
        self.nat = HostNat(parts.host, parts.relay, nursery, self.open_stream)
        self._identify_push_due = False
        from libp2p.custom_types import TProtocol

        self._host.set_stream_handler(TProtocol(DIALBACK_PROTOCOL), self.nat.on_dialback)
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
            raise NodeError(f"relayed dial {parsed} failed: {short(exc)}", reason="dial_failed") from exc

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
            raise NodeError(f"cannot reach {info.peer_id}: {dial_cause(exc)}", reason="dial_failed") from exc
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
        return sorted(
            str(p) for p, conns in list(connections.items()) if any(not connection_closing(c) for c in conns)
        )

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
            if connection_closing(connection):
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
            framed = FramedStream(Libp2pByteStream(stream, self._host.get_network()))
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
        await trio.lowlevel.checkpoint()
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
                f"cannot open {protocol_id} to {peer_id}: {short(exc)}", reason="stream_failed"
            ) from exc
        return FramedStream(Libp2pByteStream(stream, self._host.get_network()))

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
            raise NodeError(f"publishing on {topic} failed: {short(exc)}", reason="publish_failed") from exc

    async def provide(self, key: str) -> None:
        """Provide ``key`` (a name) under its sha2-256 multihash (protocol/dht_key.py)."""
        try:
            await self._dht.provider_store.provide(provider_key(key))
        except Exception as exc:
            raise NodeError(f"DHT provide failed: {short(exc)}", reason="dht_failed") from exc

    async def find_providers(self, key: str) -> list[PeerAddresses]:
        try:
            found = await find_run_providers(self._dht, provider_key(key), want=PROVIDER_LOOKUP_COUNT)
        except Exception as exc:
            raise NodeError(f"DHT lookup failed: {short(exc)}", reason="dht_failed") from exc
        out = []
        for info in self.provider_guard.select(list(found)):
            peer_id = str(info.peer_id)
            if peer_id != self._peer_id:
                out.append(PeerAddresses(peer_id, tuple(f"{a}" for a in info.addrs)))
        return out

    def routing_table_size(self) -> int:
        return int(self._dht.get_routing_table_size())

    # -- NAT: reachability, relays, hole punching (docs/nat.md) -----------------------------------------

    async def probe_reachability(self, peer_id: str, timeout: float) -> Reachability:
        """Ask a connected peer to dial us back (``nat_dialback.py``); never raises for network trouble."""
        return await self.nat.probe_reachability(peer_id, timeout)

    async def reserve_relay(self, relay_peer_id: str) -> str:
        """Reserve a circuit-relay slot on a connected peer; our relayed multiaddr, or NodeError."""
        return await self.nat.reserve_relay(relay_peer_id)

    def nat_counters(self) -> NatCounters:
        return self.nat.nat_counters()


def _ips_of(addrs: list[Any]) -> set[str]:
    ips = set()
    for addr in addrs:
        for protocol in ("ip4", "ip6"):
            try:
                ips.add(str(addr.value_for_protocol(protocol)))
            except Exception:
                continue
    return ips


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
    refuse_a_port_in_use(listen_addr)

    from libp2p.tools.anyio_service import background_trio_service

    parts = build_host(
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
                failures_into(failures),
                host.run(listen_addrs=[listen_addr]),
                trio.open_nursery() as nursery,
            ):
                if not host.get_network().listeners:  # py-libp2p logs a failed bind and carries on
                    raise NodeError(
                        f"cannot listen on {listen}: {why_bind_fails(listen_addr)}", reason="port_in_use"
                    )
                started = True
                async with (
                    failures_into(failures),
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
            raise_on_exit(exc, listen, started=started, body_error=body_error, failures=failures)
    if body_error is not None and failures:
        await trio.lowlevel.checkpoint_if_cancelled()  # cancelled from outside as well: that is a stop
        log.warning("the libp2p host stopped", exc_info=failures[0])
        cause = first_leaf(failures[0])
        raise NodeError(f"the libp2p host stopped: {short(cause)}", reason="host_failed") from cause
