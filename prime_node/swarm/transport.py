"""The weight swarm's data plane: wallet-authenticated channels (prime_node/dataplane/channel.py) to a
bounded set of neighbours, one channel per peer pair, each with a bounded send queue.

The swarm above it sees only peers (wallet addresses) and frames (``bytes``, or a piece as a
``DigestedFrame``): ``on_up(peer)``, ``on_frame(peer, frame)``, ``on_down(peer)``, and ``send(peer, frame)``
which never blocks (CheckpointTransfer's callbacks
are synchronous). A frame that would overflow a peer's queue closes that peer: a neighbour that cannot keep
up is worth less than the memory it would pin. Every queued byte and every byte of a frame being received
is also reserved from one ``MemoryBudget`` shared by all channels (prime_node/dataplane/budget.py): when
it is spent, the channel holding the most is closed, so N peers that never read pin the budget, not N
queues. A peer that stops reading is closed by the channel's frame deadlines as well.

If two peers dial each other at once, both channels complete; both ends keep the one dialed by the
smaller address and close the other, so exactly one survives without any negotiation. A direct (TCP)
channel always wins over a fallback one (below), whoever dialed it; both ends see the same route.

Streams come from a ``StreamTransport`` (prime_node/dataplane/streams.py): TCP unless told otherwise;
tests pass prime_node/testing/memory_streams.py's network and run whole swarms under ``autojump_clock``.
Once ``attach`` gave it the node's libp2p host, a dial whose TCP port does not reach the peer falls back
to a libp2p stream (prime_node/dataplane/dialer.py), and the plane serves that fallback protocol too:
inbound fallback streams go through the same ``_accept`` as TCP connections (inbound limit, handshake,
budget), and must prove the wallet address of the libp2p peer that opened them.

A channel that fails on a frame its peer sent (a MAC that does not check, a malformed head, an oversized
frame: ``FRAME_FAULTS``) proves nothing about who altered the bytes, so the peer is not banned; but it is
not dialled or accepted again for a pause that doubles with each such failure (``faults``, from
``FAULT_PAUSE`` up to ``FAULT_PAUSE_CAP``). A holder whose stored copy rotted, or a peer that sends
garbage on purpose, then costs each neighbour a few frames an hour instead of one per reconnect.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from crypto.keys import Address, WalletKey
from prime_node.dataplane.budget import MemoryBudget
from prime_node.dataplane.channel import (
    DEFAULT_CONTEXT,
    DEFAULT_DEADLINES,
    AuthenticatedChannel,
    ChannelError,
)
from prime_node.dataplane.connect import accept_channel, open_listeners
from prime_node.dataplane.dialer import ChannelDialer, ChannelSettings, DialTarget
from prime_node.dataplane.libp2p_stream import FallbackServer, P2PStream, RouteStats, fallback_protocol
from prime_node.dataplane.route_memo import RouteMemo
from prime_node.dataplane.streams import TCP, StreamTransport
from prime_node.p2p.interface import P2PHost
from prime_node.swarm.peer_traffic import PeerTraffic, Route
from protocol.dataplane import Frame, FrameDeadlines

log = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 64 << 20
"""Per channel: four of the largest pieces. Honest peers ask for one piece at a time per version."""
MAX_QUEUED_FRAMES = 4096
DEFAULT_MAX_INBOUND = 32
MAX_BATCH_FRAMES = 256
MAX_BATCH_BYTES = 4 << 20
"""One channel write carries at most this much (several small frames, or one piece and what follows it):
its deadline is that of a frame of the batch's length."""
FRAME_FAULTS = frozenset({"bad_mac", "bad_frame_head", "frame_too_large"})
"""Why a channel failed when the fault is in the frames its peer sent (see the module doc)."""
FAULT_PAUSE = 30.0
FAULT_PAUSE_CAP = 3600.0


@dataclass
class Link:
    """One live channel to ``peer`` and its outgoing queue; ``queued_bytes`` (the queue and the frame
    being sent) are reserved from the plane's budget through the channel's account."""

    peer: Address
    channel: AuthenticatedChannel
    dialer: Address
    fallback: bool = False
    """The channel runs over a libp2p stream (the peer's TCP port did not reach it)."""
    route: Route = Route.TCP
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    queue: deque[Frame] = field(default_factory=deque)
    queued_bytes: int = 0
    wake: trio.Event = field(default_factory=trio.Event)
    alive: bool = True


@dataclass(frozen=True)
class DataPlaneSettings:
    """``max_inbound``: channels accepted at once; ``deadlines``: how long a frame may stall in either
    direction; ``relayed_fallback``: the libp2p fallback may use relayed connections."""

    max_inbound: int = DEFAULT_MAX_INBOUND
    deadlines: FrameDeadlines = DEFAULT_DEADLINES
    relayed_fallback: bool = False


class DataPlane:
    """Channels to neighbours (see the module doc). ``run`` listens; ``dial`` opens one more.
    ``budget`` bounds the memory of all its channels together."""

    def __init__(
        self,
        key: WalletKey,
        *,
        on_up: Callable[[Address], None],
        on_frame: Callable[[Address, Frame], None],
        on_down: Callable[[Address], None],
        transport: StreamTransport = TCP,
        budget: MemoryBudget | None = None,
        settings: DataPlaneSettings | None = None,
    ) -> None:
        settings = settings or DataPlaneSettings()
        deadlines, relayed_fallback = settings.deadlines, settings.relayed_fallback
        self.key = key
        self.transport = transport
        self.on_up = on_up
        self.on_frame = on_frame
        self.on_down = on_down
        self.max_inbound = settings.max_inbound
        self.budget = budget or MemoryBudget()
        self.deadlines = deadlines
        self.links: dict[Address, Link] = {}
        self.banned: set[Address] = set()
        self.faults = RouteMemo(base=FAULT_PAUSE, cap=FAULT_PAUSE_CAP)
        """Peers whose frames failed a channel, and until when they are neither dialled nor accepted."""
        self.dialing: set[Address] = set()
        self.inbound = 0
        self.refused = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.stats = RouteStats()
        self.traffic = PeerTraffic()
        self.dialer = ChannelDialer(
            key,
            budget=self.budget,
            settings=ChannelSettings(deadlines=deadlines, relayed=relayed_fallback),
            transport=transport,
            stats=self.stats,
        )
        self._fallback = FallbackServer(
            fallback_protocol(DEFAULT_CONTEXT), self._accept_fallback, self.stats, relayed=relayed_fallback
        )
        self._nursery: trio.Nursery | None = None

    def attach(self, host: P2PHost) -> None:
        """Use ``host`` for the libp2p fallback, both ways (before ``run``: it serves the protocol)."""
        self.dialer.p2p = host

    @property
    def p2p(self) -> P2PHost | None:
        return self.dialer.p2p

    # --- lifecycle ------------------------------------------------------------------------------------

    async def run(self, host: str, port: int, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host:port`` until cancelled; reports the bound port."""
        listeners, bound_port = await open_listeners(self.transport, host, port)
        async with trio.open_nursery() as nursery:
            if self.p2p is not None:
                await nursery.start(lambda task_status: self._fallback.run(self.p2p, task_status=task_status))
            self._nursery = nursery
            task_status.started(bound_port)
            await trio.serve_listeners(self._accept, listeners, handler_nursery=nursery)

    def dial(self, peer: Address, host: str | None, port: int, *, peer_id: str | None = None) -> None:
        """Open a channel to ``peer`` in the background (no-op if one exists or is being opened): at
        ``host:port`` over TCP, else (``host`` None, or it does not answer) over a libp2p stream to
        ``peer_id`` if one is given and a host is attached."""
        if self._nursery is None or peer in self.links or peer in self.dialing or peer in self.banned:
            return
        if not self.faults.may_try(peer, trio.current_time()):
            return
        target = DialTarget(peer, host, port, peer_id)
        if not self.dialer.may_open(target):
            return
        self.dialing.add(peer)
        self._nursery.start_soon(self._dial, target)

    def upgrade(self, peer: Address, host: str | None, port: int) -> bool:
        """If ``peer``'s link runs over the fallback and its TCP pause is over, try ``host:port`` again in
        the background; a TCP channel that comes up replaces the fallback one (``_adopt``). True if tried."""
        link = self.links.get(peer)
        target = DialTarget(peer, host, port)
        if (
            self._nursery is None
            or link is None
            or not link.fallback
            or not target.direct
            or peer in self.dialing
            or not self.dialer.memo.may_try(peer, trio.current_time())
        ):
            return False
        self.dialing.add(peer)
        self._nursery.start_soon(self._dial, target)
        return True

    # --- sending --------------------------------------------------------------------------------------

    def send(self, peer: Address, frame: Frame) -> None:
        link = self.links.get(peer)
        if link is None or not link.alive:
            return
        if link.queued_bytes + len(frame) > MAX_QUEUED_BYTES or len(link.queue) >= MAX_QUEUED_FRAMES:
            log.warning("closing %s: its send queue is full (%d bytes)", peer, link.queued_bytes)
            self.close(peer)
            return
        if not link.channel.account.reserve(len(frame)):
            self.close(peer)  # the budget is spent and this channel holds the most (logged there)
            return
        link.queue.append(frame)
        link.queued_bytes += len(frame)
        link.wake.set()

    def close(self, peer: Address) -> None:
        """Drop the channel to ``peer`` now (``on_down`` runs before this returns)."""
        link = self.links.get(peer)
        if link is not None:
            self._drop(link)

    def ban(self, peer: Address) -> None:
        """Close ``peer`` and refuse its channels from now on."""
        self.banned.add(peer)
        self.close(peer)

    # --- internals ------------------------------------------------------------------------------------

    async def _dial(self, target: DialTarget) -> None:
        try:
            channel = await self.dialer.open(target)
        except ChannelError as exc:
            log.info(
                "data plane: cannot open a channel to %s at %s:%d: %s", target.address, target.host,
                target.port, exc,
            )  # fmt: skip
            return
        finally:
            self.dialing.discard(target.address)
        await self._serve(channel, dialer=self.key.address)

    async def _accept(self, stream: trio.abc.Stream, expected_peer: Address | None = None) -> None:
        """One inbound connection (TCP, or a fallback stream whose libp2p peer is ``expected_peer``)."""
        if self.inbound >= self.max_inbound or expected_peer in self.banned:
            self.refused += 1
            log.debug("data plane: refusing a connection (%d inbound already)", self.inbound)
            await stream.aclose()
            return
        self.inbound += 1
        try:
            try:
                channel = await accept_channel(
                    stream,
                    self.key,
                    expected_peer=expected_peer,
                    deadlines=self.deadlines,
                    budget=self.budget,
                )
            except ChannelError:
                return
            await self._serve(channel, dialer=channel.remote)
        finally:
            self.inbound -= 1

    async def _accept_fallback(self, stream: P2PStream, peer: Address) -> None:
        await self._accept(stream, expected_peer=peer)

    async def _serve(self, channel: AuthenticatedChannel, *, dialer: Address) -> None:
        peer = channel.remote
        try:
            link = self._adopt(channel, dialer)
            if link is None:
                return
            with link.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._sender, link)
                    try:
                        async for frame in channel.frames():
                            self.bytes_in += len(frame)
                            self.traffic.add(peer, link.route, bytes_in=len(frame))
                            self.on_frame(peer, frame)
                            if not link.alive:
                                break
                    except ChannelError as exc:
                        log.info("data plane: channel to %s failed: %s", peer, exc)
                        if exc.reason in FRAME_FAULTS:
                            self._pause_faulty(peer, exc.reason)
                    nursery.cancel_scope.cancel()
            self._drop(link)
        finally:
            with trio.CancelScope(shield=True):
                await channel.aclose()

    def _pause_faulty(self, peer: Address, reason: str) -> None:
        now = trio.current_time()
        until = self.faults.failed(peer, now)
        log.warning(
            "data plane: %s sent a frame that failed (%s): no channel with it for %.0f s",
            peer,
            reason,
            until - now,
        )

    def _adopt(self, channel: AuthenticatedChannel, dialer: Address) -> Link | None:
        peer = channel.remote
        if peer in self.banned or peer == self.key.address:
            return None
        if not self.faults.may_try(peer, trio.current_time()):
            log.debug("data plane: refusing a channel from %s (its frames failed recently)", peer)
            return None
        preferred = min(self.key.address.raw, peer.raw)
        fallback = isinstance(channel.stream, P2PStream)
        existing = self.links.get(peer)
        if existing is not None:
            # Both ends rank the two channels alike: direct before fallback, then the preferred dialer's.
            rank = (fallback, dialer.raw != preferred)
            if rank >= (existing.fallback, existing.dialer.raw != preferred):
                return None  # keep the channel we have
            self._drop(existing)
        route = Route.TCP
        if isinstance(channel.stream, P2PStream):
            route = Route.RELAYED if channel.stream.relayed else Route.LIBP2P
        link = Link(peer, channel, dialer, fallback, route)
        channel.on_evict = lambda: self._drop(
            link
        )  # evicted by the budget (logged there): free the queue now
        self.links[peer] = link
        self.on_up(peer)
        return link

    def _drop(self, link: Link) -> None:
        if not link.alive:
            return
        link.alive = False
        link.scope.cancel()
        link.wake.set()
        link.queue.clear()
        link.channel.account.release(link.queued_bytes)  # the frame being sent, if any, is cancelled too
        link.queued_bytes = 0
        if self.links.get(link.peer) is link:
            del self.links[link.peer]
            self.on_down(link.peer)

    async def _sender(self, link: Link) -> None:
        """Send the queue in batches (every queued frame up to ``MAX_BATCH_FRAMES`` / ``MAX_BATCH_BYTES``
        goes out in one channel write): a piece and the ``have``s queued behind it cost one system call."""
        try:
            while link.alive:
                if not link.queue:
                    link.wake = trio.Event()
                    await link.wake.wait()
                    continue
                batch = _next_batch(link.queue)  # stays queued (and reserved) until it is sent
                await link.channel.send_frames(batch)
                size = sum(len(frame) for frame in batch)
                self.bytes_out += size
                self.traffic.add(link.peer, link.route, bytes_out=size)
                if not link.alive:  # dropped meanwhile: the queue is already cleared and released
                    break
                for _ in batch:
                    link.queue.popleft()
                link.queued_bytes -= size
                link.channel.account.release(size)
        except ChannelError as exc:
            log.info("data plane: sending to %s failed: %s", link.peer, exc)
        self._drop(link)


def _next_batch(queue: deque[Frame]) -> list[Frame]:
    """The frames at the head of ``queue`` that go out together (at least one)."""
    batch: list[Frame] = []
    size = 0
    for frame in queue:
        if batch and (len(batch) == MAX_BATCH_FRAMES or size + len(frame) > MAX_BATCH_BYTES):
            break
        batch.append(frame)
        size += len(frame)
    return batch
