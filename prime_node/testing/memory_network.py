"""An in-process ``P2PHost`` implementation: deterministic, instant, and runnable under ``autojump_clock``.

Every host joins one ``MemoryNetwork``. Connections are symmetric; streams are pairs of trio memory
channels; gossip floods over connections with de-duplication (like floodsub); the "DHT" is a shared
provider table that only answers hosts that are connected to at least one other host (so a lone node
discovers nothing, as on the real network). ``drop_gossip`` lets tests lose chosen messages to exercise
gap repair. Peer IDs are real wallet-key peer IDs, so signatures and identity checks behave as for real.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from crypto.identity import peer_id_from_public_key
from crypto.keys import WalletKey
from prime_node.errors import NodeError
from prime_node.p2p.interface import FramedStream, GossipHandler, GossipMessage, PeerAddresses, StreamHandler
from prime_node.p2p.nat import NatCounters, Reachability


class _MemoryByteStream:
    def __init__(
        self,
        remote_peer_id: str,
        send: trio.MemorySendChannel[bytes],
        receive: trio.MemoryReceiveChannel[bytes],
        *,
        relayed: bool = False,
        on_connection: Callable[[], bool] = lambda: True,
    ) -> None:
        self.remote_peer_id = remote_peer_id
        self.relayed = relayed
        self._on_connection = on_connection
        self._send = send
        self._receive = receive
        self._pending = b""

    async def read(self, max_bytes: int) -> bytes:
        if not self._pending:
            try:
                self._pending = await self._receive.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return b""
        chunk, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
        return chunk

    async def write(self, data: bytes) -> None:
        try:
            await self._send.send(bytes(data))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise NodeError("stream closed by the other side", reason="stream_closed") from exc

    async def close(self) -> None:
        await self._send.aclose()

    async def reset(self) -> None:
        await self._send.aclose()
        await self._receive.aclose()

    def stranded(self) -> bool:
        """Its connection was closed or replaced; like py-libp2p's, the stream itself stays open."""
        return not self._on_connection()


GossipFilter = Callable[[str, str, bytes, str], bool]


class MemoryNetwork:
    """The shared medium: who is listening, who is connected, who provides what."""

    def __init__(self) -> None:
        self.hosts: dict[str, MemoryHost] = {}
        self.providers: dict[str, set[str]] = {}
        self.refuse: set[str] = set()  # peer IDs whose inbound dials fail, to test retry paths
        self.relayed: set[frozenset[str]] = set()  # pairs of peer IDs whose streams count as relayed
        self.drop_gossip: GossipFilter | None = None  # (topic, origin, data, receiver) -> drop?
        self._message_ids = itertools.count()
        self.connection_serials = itertools.count()

    @asynccontextmanager
    async def host(self, key: WalletKey) -> AsyncIterator[MemoryHost]:
        peer_id = peer_id_from_public_key(key.public_key)
        if peer_id in self.hosts:
            raise NodeError(f"{peer_id} is already listening", reason="port_in_use")
        async with trio.open_nursery() as nursery:
            host = MemoryHost(self, peer_id, nursery)
            self.hosts[peer_id] = host
            try:
                yield host
            finally:
                del self.hosts[peer_id]
                for providers in self.providers.values():
                    providers.discard(peer_id)
                for other in list(host.connections):
                    other_host = self.hosts.get(other)
                    if other_host is not None:
                        other_host.connections.pop(peer_id, None)
                nursery.cancel_scope.cancel()

    def next_message_id(self) -> int:
        return next(self._message_ids)


class MemoryHost:
    def __init__(self, network: MemoryNetwork, peer_id: str, nursery: trio.Nursery) -> None:
        self.network = network
        self._peer_id = peer_id
        self._nursery = nursery
        self.connections: dict[str, int] = {}
        """peer ID -> which connection to it is open (a stream opened on an earlier one is stranded)."""
        self.known: set[str] = set()
        """Peers the node vouches for (the in-memory network has no connection limits to exempt them from)."""
        self._handlers: dict[str, StreamHandler] = {}
        self._topics: dict[str, GossipHandler] = {}
        self._seen: set[int] = set()

    @property
    def peer_id(self) -> str:
        return self._peer_id

    def listen_multiaddrs(self) -> list[str]:
        return [f"/memory/{self._peer_id}/p2p/{self._peer_id}"]

    async def connect(self, multiaddr: str) -> str:
        parts = multiaddr.split("/")
        if len(parts) != 5 or parts[1] != "memory" or parts[3] != "p2p" or parts[2] != parts[4]:
            raise NodeError(f"bad multiaddr {multiaddr!r}", reason="bad_multiaddr")
        await self.connect_peer(PeerAddresses(parts[4], (multiaddr,)))
        return parts[4]

    async def connect_peer(self, peer: PeerAddresses) -> None:
        await trio.lowlevel.checkpoint()
        if peer.peer_id == self._peer_id:
            return
        other = self.network.hosts.get(peer.peer_id)
        if other is None or peer.peer_id in self.network.refuse:
            raise NodeError(f"cannot reach {peer.peer_id}", reason="dial_failed")
        if peer.peer_id not in self.connections:
            self.connections[peer.peer_id] = other.connections[self._peer_id] = next(
                self.network.connection_serials
            )

    async def disconnect(self, peer_id: str) -> None:
        await trio.lowlevel.checkpoint()
        self.connections.pop(peer_id, None)
        other = self.network.hosts.get(peer_id)
        if other is not None:
            other.connections.pop(self._peer_id, None)

    def connected_peers(self) -> list[str]:
        return sorted(self.connections)

    def directly_connected(self, peer_id: str) -> bool:
        return peer_id in self.connections and frozenset((self._peer_id, peer_id)) not in self.network.relayed

    def mark_known(self, peer_id: str, *, known: bool = True) -> None:
        if known:
            self.known.add(peer_id)
        else:
            self.known.discard(peer_id)

    def set_stream_handler(self, protocol_id: str, handler: StreamHandler) -> None:
        self._handlers[protocol_id] = handler

    async def open_stream(self, peer_id: str, protocol_id: str) -> FramedStream:
        await trio.lowlevel.checkpoint()
        other = self.network.hosts.get(peer_id)
        if other is None or peer_id not in self.connections:
            raise NodeError(f"not connected to {peer_id}", reason="stream_failed")
        handler = other._handlers.get(protocol_id)
        if handler is None:
            raise NodeError(f"{peer_id} does not serve {protocol_id}", reason="stream_failed")
        to_remote_send, to_remote_receive = trio.open_memory_channel[bytes](math.inf)
        to_local_send, to_local_receive = trio.open_memory_channel[bytes](math.inf)
        relayed = frozenset((self._peer_id, peer_id)) in self.network.relayed
        serial = self.connections[peer_id]
        remote_end = FramedStream(
            _MemoryByteStream(
                self._peer_id,
                to_local_send,
                to_remote_receive,
                relayed=relayed,
                on_connection=lambda: other.connections.get(self._peer_id) == serial,
            )
        )
        other._nursery.start_soon(other._serve, handler, remote_end)
        return FramedStream(
            _MemoryByteStream(
                peer_id,
                to_remote_send,
                to_local_receive,
                relayed=relayed,
                on_connection=lambda: self.connections.get(peer_id) == serial,
            )
        )

    async def _serve(self, handler: StreamHandler, stream: FramedStream) -> None:
        try:
            await handler(stream)
        except NodeError:
            pass
        finally:
            await stream.close()

    async def subscribe(self, topic: str, handler: GossipHandler) -> None:
        await trio.lowlevel.checkpoint()
        self._topics[topic] = handler

    async def publish(self, topic: str, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        message_id = self.network.next_message_id()
        self._seen.add(message_id)
        self._forward(topic, self._peer_id, data, message_id)

    def _forward(self, topic: str, origin: str, data: bytes, message_id: int) -> None:
        for peer_id in sorted(self.connections):
            other = self.network.hosts.get(peer_id)
            if other is not None and message_id not in other._seen:
                other._seen.add(message_id)
                other._nursery.start_soon(other._receive, topic, origin, data, message_id)

    async def _receive(self, topic: str, origin: str, data: bytes, message_id: int) -> None:
        self._forward(topic, origin, data, message_id)
        drop = self.network.drop_gossip
        if drop is not None and drop(topic, origin, data, self._peer_id):
            return
        handler = self._topics.get(topic)
        if handler is not None:
            await handler(GossipMessage(topic, origin, data))

    async def provide(self, key: str) -> None:
        await trio.lowlevel.checkpoint()
        self.network.providers.setdefault(key, set()).add(self._peer_id)

    async def find_providers(self, key: str) -> list[PeerAddresses]:
        await trio.lowlevel.checkpoint()
        if not self.connections:
            return []
        found = sorted(self.network.providers.get(key, set()) - {self._peer_id})
        return [PeerAddresses(p, tuple(self.network.hosts[p].listen_multiaddrs())) for p in found]

    def routing_table_size(self) -> int:
        return len(self.connections)

    async def probe_reachability(self, peer_id: str, timeout: float) -> Reachability:
        """In memory every host can reach every other: public once connected to the prober."""
        await trio.lowlevel.checkpoint()
        if peer_id not in self.connections:
            return Reachability("unknown", (), None, f"not connected to {peer_id}")
        return Reachability("public", tuple(self.listen_multiaddrs()), None, "in-memory network")

    async def reserve_relay(self, relay_peer_id: str) -> str:
        await trio.lowlevel.checkpoint()
        if relay_peer_id not in self.connections:
            raise NodeError(f"not connected to {relay_peer_id}", reason="relay_refused")
        return f"/memory/{relay_peer_id}/p2p/{relay_peer_id}/p2p-circuit/p2p/{self._peer_id}"

    def nat_counters(self) -> NatCounters:
        return NatCounters(direct_connections=len(self.connections))
