"""The peer-to-peer interface everything above the transport talks to.

Two implementations: ``prime_node.p2p.libp2p_host.Libp2pHost`` (py-libp2p: TCP + Noise + yamux, Kademlia,
gossipsub) and ``prime_node.testing.memory_network.MemoryHost`` (in-process, deterministic, for fast
tests). Peer IDs are libp2p's base58 strings; a peer ID the interface reports for a connection or a
stream has been authenticated by the transport (Noise proves the key, so the address follows).

Streams carry length-prefixed frames (``u32`` big-endian length, then the bytes): bulk data moves on
streams with this framing, never on gossip (gossip drops bursts; see DESIGN §11).
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from prime_node.errors import NodeError
from prime_node.p2p.nat import NatCounters, Reachability

FRAME_HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 1 << 20


@dataclass(frozen=True)
class GossipMessage:
    """A gossip message as delivered: ``origin`` is the transport-verified peer ID of its publisher."""

    topic: str
    origin: str
    data: bytes


@dataclass(frozen=True)
class PeerAddresses:
    peer_id: str
    multiaddrs: tuple[str, ...]


class StreamClosedError(NodeError):
    """The other side closed or reset the stream, or a frame broke the framing rules."""

    def __init__(self, message: str, *, reason: str = "stream_closed") -> None:
        super().__init__(message, reason=reason)


class ByteStream(Protocol):
    """The raw byte pipe an implementation provides; ``FramedStream`` adds framing on top."""

    remote_peer_id: str
    relayed: bool
    """The stream runs over a relayed (circuit-relay) connection, not a direct one: every byte also
    crosses the relay's links (the data plane counts those bytes apart)."""

    async def read(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes``; b"" at end of stream."""
        ...

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...

    async def reset(self) -> None: ...

    def stranded(self) -> bool:
        """The connection this stream ran over is gone (closed, or dropped for another connection to the
        same peer) while the stream itself never failed: it will neither deliver nor fail."""
        ...


class FramedStream:
    """Length-prefixed frames over a ByteStream. Oversized or truncated frames raise StreamClosed."""

    def __init__(self, raw: ByteStream) -> None:
        self.raw = raw
        self.remote_peer_id = raw.remote_peer_id
        self._buffer = bytearray()
        self.bytes_read = 0
        self.bytes_written = 0

    async def send_frame(self, data: bytes) -> None:
        await self.raw.write(FRAME_HEADER.pack(len(data)) + data)
        self.bytes_written += FRAME_HEADER.size + len(data)

    async def receive_frame(self, max_bytes: int = DEFAULT_MAX_FRAME) -> bytes | None:
        """The next frame, or None at a clean end of stream (between frames)."""
        if not await self._fill(FRAME_HEADER.size, allow_eof=True):
            return None
        (length,) = FRAME_HEADER.unpack(self._buffer[: FRAME_HEADER.size])
        if length > max_bytes:
            raise StreamClosedError(f"frame of {length} bytes exceeds {max_bytes}", reason="frame_too_large")
        del self._buffer[: FRAME_HEADER.size]
        await self._fill(length, allow_eof=False)
        frame = bytes(self._buffer[:length])
        del self._buffer[:length]
        return frame

    async def _fill(self, size: int, *, allow_eof: bool) -> bool:
        while len(self._buffer) < size:
            chunk = await self.raw.read(max(size - len(self._buffer), 1 << 16))
            if not chunk:
                if allow_eof and not self._buffer:
                    return False
                raise StreamClosedError("stream ended inside a frame", reason="truncated_frame")
            self.bytes_read += len(chunk)
            self._buffer += chunk
        return True

    async def close(self) -> None:
        await self.raw.close()

    def stranded(self) -> bool:
        """See ``ByteStream.stranded``."""
        return self.raw.stranded()

    async def reset(self) -> None:
        await self.raw.reset()


StreamHandler = Callable[[FramedStream], Awaitable[None]]
GossipHandler = Callable[[GossipMessage], Awaitable[None]]


class P2PHost(Protocol):
    """A running peer-to-peer host (see the module doc). Obtained from an implementation's ``open``."""

    @property
    def peer_id(self) -> str: ...

    def listen_multiaddrs(self) -> list[str]:
        """Full ``/p2p/`` multiaddrs others can dial."""
        ...

    async def connect(self, multiaddr: str) -> str:
        """Dial a full ``/p2p/`` multiaddr; returns the authenticated peer ID. NodeError if it fails."""
        ...

    async def connect_peer(self, peer: PeerAddresses) -> None: ...

    async def disconnect(self, peer_id: str) -> None: ...

    def connected_peers(self) -> list[str]: ...

    def directly_connected(self, peer_id: str) -> bool:
        """A connection to ``peer_id`` that no relay carries is open (dialled, or hole-punched)."""
        ...

    def set_stream_handler(self, protocol_id: str, handler: StreamHandler) -> None:
        """Serve ``protocol_id``: ``handler`` runs once per inbound stream and owns it."""
        ...

    async def open_stream(self, peer_id: str, protocol_id: str) -> FramedStream: ...

    async def subscribe(self, topic: str, handler: GossipHandler) -> None:
        """Deliver every message on ``topic`` (from other peers) to ``handler``, in arrival order."""
        ...

    async def publish(self, topic: str, data: bytes) -> None: ...

    async def provide(self, key: str) -> None:
        """Announce in the DHT that this host provides ``key`` (e.g. a run)."""
        ...

    async def find_providers(self, key: str) -> list[PeerAddresses]: ...

    def routing_table_size(self) -> int: ...

    def mark_known(self, peer_id: str, *, known: bool = True) -> None:
        """Vouch for a peer (or stop): a known peer keeps its connection slots when strangers flood us."""
        ...

    async def probe_reachability(self, peer_id: str, timeout: float) -> Reachability:
        """Ask a connected peer to dial us back (prime_node/p2p/nat.py); network trouble is "unknown"."""
        ...

    async def reserve_relay(self, relay_peer_id: str) -> str:
        """Reserve a circuit-relay slot on a connected peer; our relayed multiaddr, or NodeError."""
        ...

    def nat_counters(self) -> NatCounters:
        """Direct vs relayed connections, relay reservations, hole punches (for the status API)."""
        ...


HostFactory = Callable[[], AbstractAsyncContextManager[P2PHost]]
