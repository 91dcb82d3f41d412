"""The data plane's fallback: the same authenticated channel over a libp2p stream, for peers whose TCP
data-plane port cannot be reached (behind NAT, once libp2p has a direct or relayed connection to them).

``P2PStream`` makes a libp2p stream's raw byte pipe (``FramedStream.raw``, no framing used) a
``trio.abc.Stream``, which is all the channel needs; it counts the bytes it moves (``RouteStats``), apart
for streams on relayed connections. ``FallbackServer`` serves the fallback protocol of one data-plane
listener and hands each inbound stream to that listener's own accept path, so it meets the same
admission rules (inbound count, handshake deadline, memory budget) as a TCP connection; the transport
already authenticated the stream's peer, so its channel must prove that same wallet address.
The dialing side is dialer.py. Throughput is libp2p's (Noise + yamux, ~0.1 GB/s, docs/dataplane.md):
the fallback is the exception, TCP the rule.

A stream on a *relayed* libp2p connection is refused unless ``relayed`` is allowed: relays carry control
traffic, not bulk bytes (DESIGN §4), and each relayed circuit is capped in bytes (prime_node/p2p/
nat_relay.py), so a piece stream would use up the circuit that carries the peers' gossip and heartbeats.
Such peers wait for hole punching to give them a direct connection (then the fallback works).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from crypto.identity import address_from_peer_id
from crypto.keys import Address
from prime_node.errors import NodeError
from prime_node.p2p.interface import ByteStream, FramedStream, P2PHost

log = logging.getLogger(__name__)

PROTOCOL_PREFIX = "/prime-node/dataplane/1/"
READ_SIZE = 256 << 10
"""Largest read asked of the libp2p stream when the caller does not say (yamux hands out ~64 KiB)."""
CLOSE_TIMEOUT = 5.0
"""How long closing (a yamux FIN) may take before the stream is reset instead."""


def fallback_protocol(context: str) -> str:
    """The libp2p protocol that carries data-plane channels of ``context`` (``swarm``, ``rollouts``): one
    per listener, as each listens on its own TCP port."""
    return PROTOCOL_PREFIX + context


@dataclass
class RouteStats:
    """How one data plane's channels went: direct TCP or the libp2p fallback (bytes as on the stream)."""

    tcp_channels: int = 0
    tcp_failures: int = 0
    fallback_channels: int = 0
    """Channels this side opened over the fallback."""
    fallback_failures: int = 0
    fallback_streams_in: int = 0
    """Fallback streams peers opened to us (before their handshake: refused ones count too)."""
    relayed_refused: int = 0
    """Fallback streams (either way) not used because their libp2p connection is relayed."""
    fallback_bytes_in: int = 0
    fallback_bytes_out: int = 0
    relayed_bytes_in: int = 0
    relayed_bytes_out: int = 0

    def status(self) -> dict[str, int]:
        """For a status section: ``dataplane_fallback_bytes`` (both directions, relayed included) and
        ``dataplane_relayed_bytes`` (the part on relayed libp2p connections)."""
        return {
            "dataplane_tcp_channels": self.tcp_channels,
            "dataplane_tcp_failures": self.tcp_failures,
            "dataplane_fallback_channels": self.fallback_channels,
            "dataplane_fallback_failures": self.fallback_failures,
            "dataplane_fallback_streams_in": self.fallback_streams_in,
            "dataplane_relayed_refused": self.relayed_refused,
            "dataplane_fallback_bytes": self.fallback_bytes_in + self.fallback_bytes_out,
            "dataplane_fallback_bytes_in": self.fallback_bytes_in,
            "dataplane_fallback_bytes_out": self.fallback_bytes_out,
            "dataplane_relayed_bytes": self.relayed_bytes_in + self.relayed_bytes_out,
        }


class P2PStream(trio.abc.Stream):
    """A libp2p stream's raw byte pipe as a ``trio.abc.Stream`` (see the module doc). A failure of the
    pipe reads as ``BrokenResourceError``, a use after ``aclose`` as ``ClosedResourceError``, as on TCP."""

    def __init__(self, raw: ByteStream, stats: RouteStats) -> None:
        self.raw = raw
        self.remote_peer_id = raw.remote_peer_id
        self.relayed = raw.relayed
        self._stats = stats
        self._pending = b""
        self._closed = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the stream is closed")
        chunk = bytes(data)
        try:
            await self.raw.write(chunk)
        except NodeError as exc:
            raise trio.BrokenResourceError(str(exc)) from exc
        self._stats.fallback_bytes_out += len(chunk)
        if self.relayed:
            self._stats.relayed_bytes_out += len(chunk)

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._closed:
            raise trio.ClosedResourceError("the stream is closed")
        limit = READ_SIZE if max_bytes is None else max_bytes
        if not self._pending:
            try:
                self._pending = await self.raw.read(limit)
            except NodeError as exc:
                raise trio.BrokenResourceError(str(exc)) from exc
            if self._closed:
                raise trio.ClosedResourceError("the stream is closed")
            self._stats.fallback_bytes_in += len(self._pending)
            if self.relayed:
                self._stats.relayed_bytes_in += len(self._pending)
        chunk, self._pending = self._pending[:limit], self._pending[limit:]
        return chunk

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            with trio.move_on_after(CLOSE_TIMEOUT) as scope:
                await self.raw.close()
            if scope.cancelled_caught:
                await self.raw.reset()


Accept = Callable[[P2PStream, Address], Awaitable[None]]
"""A listener's accept path: an inbound stream and the wallet address its libp2p peer ID names."""


class FallbackServer:
    """Serves ``fallback_protocol(context)`` on a libp2p host while ``run`` runs (module doc);
    ``relayed``: also streams on relayed connections."""

    def __init__(self, protocol_id: str, accept: Accept, stats: RouteStats, *, relayed: bool = False) -> None:
        self.protocol_id = protocol_id
        self.relayed = relayed
        self._accept = accept
        self._stats = stats
        self._nursery: trio.Nursery | None = None

    async def run(self, host: P2PHost, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Take the protocol's streams until cancelled (afterwards the handler closes them at once)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                host.set_stream_handler(self.protocol_id, self._on_stream)
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None

    async def _on_stream(self, framed: FramedStream) -> None:
        """Run the accept path in our nursery (it stops with the data plane, not with libp2p), while the
        host's handler task waits; if the host drops the stream first, the accept path is cancelled."""
        nursery = self._nursery
        if nursery is None:
            return  # the data plane stopped: the host closes the stream
        try:
            peer = address_from_peer_id(framed.remote_peer_id)
        except Exception:
            log.info(
                "data plane: refusing a fallback stream from %s (not a wallet key)", framed.remote_peer_id
            )
            return
        self._stats.fallback_streams_in += 1
        if framed.raw.relayed and not self.relayed:
            self._stats.relayed_refused += 1
            log.debug("data plane: refusing a fallback stream from %s over a relay", peer)
            await framed.reset()
            return
        stream = P2PStream(framed.raw, self._stats)
        done = trio.Event()
        scope = trio.CancelScope()

        async def serve() -> None:
            try:
                with scope:
                    await self._accept(stream, peer)
            finally:
                await stream.aclose()
                done.set()

        nursery.start_soon(serve)
        try:
            await done.wait()
        finally:
            scope.cancel()
