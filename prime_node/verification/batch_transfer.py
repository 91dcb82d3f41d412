"""Rollout batches over the data plane (I/O around protocol/rollout_transfer.py): hold, serve, fetch.

Every node that produces or receives large batches runs one ``BatchTransfer``. It listens for
authenticated channels of context ``rollouts`` on a port of its own (the swarm's listener only opens
``swarm`` channels and routes their frames to checkpoint transfers; a separate context keeps the two
uses from opening each other's channels) and advertises that port inside every announcement it gossips.

- **Hold / serve.** Frames it produced or fetched and verified stay in a store bounded in bytes (oldest
  dropped first), and are served to whoever asks: one request per channel, a ``BatchReply``, then the
  frame in chunks. Uploads are bounded per peer and in all; over either bound the answer is ``busy``.
- **Fetch.** ``fetch(batch_id, size)`` asks the batch's holders (``HolderBook``: re-servers first, the
  worker last) one at a time, at most ``per_peer_fetches`` at once from one peer and ``max_fetches`` in
  all; every attempt has a deadline (``grace + size / min_rate``). Bytes are checked against the id
  (length and BLAKE3) as they arrive; a peer that sends anything else is reported through
  ``on_bad_bytes`` (the services charge it ``Offence.BAD_DATA``) and never asked for that batch again,
  and the next holder is tried. With no holder left it waits for new ones (other nodes re-announce what
  they fetched) until ``give_up_s``.

Memory: the store's bound, plus at most ``max_fetches`` frames being received (each at most the run's
size cap), plus the channels' shared ``MemoryBudget``.

Reachability: given the node's libp2p host (``p2p``), a holder whose TCP port does not answer (behind
NAT), or whose record names no direct host, is reached over a libp2p stream carrying the same channel
(prime_node/dataplane/dialer.py), and this node serves that fallback protocol through the same accept
path as its TCP listener (prime_node/dataplane/libp2p_stream.py).
"""

from __future__ import annotations

import logging
import random
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from crypto.keys import Address, WalletKey
from prime_node.dataplane.budget import MemoryBudget
from prime_node.dataplane.channel import (
    AuthenticatedChannel,
    ChannelError,
    handle_connection,
    serve_channels,
)
from prime_node.dataplane.dialer import ChannelDialer, DialTarget
from prime_node.dataplane.libp2p_stream import FallbackServer, P2PStream, fallback_protocol
from prime_node.dataplane.streams import TCP, StreamTransport
from prime_node.p2p.interface import P2PHost
from prime_node.swarm.neighbours import dial_host
from protocol.codec import decode, encode
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.rollout_transfer import (
    BAD_BYTES,
    BUSY,
    CHUNK_BYTES,
    MAX_CHANNEL_FRAME,
    MISSING,
    ROLLOUT_CONTEXT,
    SENDING,
    BatchDownload,
    BatchReply,
    BatchRequest,
    Holder,
    HolderBook,
    RolloutAnnouncement,
    chunks,
)

if TYPE_CHECKING:
    from prime_node.node.context import NodeContext

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferSettings:
    """Bounds of one node's batch transfer; the defaults suit a networked run."""

    hold_bytes: int = 256 << 20
    """Frames kept to serve (produced or fetched), all together; the oldest go first (the newest is
    always kept)."""
    max_fetches: int = 4
    """Batches being downloaded at once."""
    per_peer_fetches: int = 2
    """Downloads at once from one holder."""
    max_uploads: int = 16
    """Batches being served at once; beyond it requests are answered ``busy``."""
    per_peer_uploads: int = 2
    """Batches served at once to one peer; beyond it that peer is answered ``busy``."""
    attempt_grace_s: float = 10.0
    """Fixed part of one attempt's deadline (dial, handshake, reply)."""
    min_rate: float = 1 << 20
    """Bytes per second an attempt must average beyond the grace (4 MiB/s ~ 74 s for 64 MiB)."""
    give_up_s: float = 30.0
    """How long a fetch waits for a holder to appear once every known one failed."""
    request_timeout_s: float = 10.0
    """How long a served channel may take to send its request."""
    relayed_fallback: bool = False
    """Whether batches may move over a libp2p stream on a *relayed* connection (a relay's circuits are
    capped in bytes and carry the peers' control traffic: prime_node/dataplane/libp2p_stream.py)."""

    def __post_init__(self) -> None:
        counts = (self.max_fetches, self.per_peer_fetches, self.max_uploads, self.per_peer_uploads)
        if min(counts) < 1 or self.hold_bytes < 1 or self.min_rate <= 0:
            raise ValueError("transfer bounds must be positive")


HostLookup = Callable[[Address], "str | None"]
BadBytes = Callable[[Holder, str], None]


def listen_host(context: NodeContext) -> str:
    """Where our batch listener binds: where libp2p listens (loopback stays loopback, else all addresses),
    as the weight swarm's data plane does."""
    addresses = context.host.listen_multiaddrs()
    if addresses and all(address.startswith("/ip4/127.") for address in addresses):
        return "127.0.0.1"
    return "0.0.0.0"


def member_host(context: NodeContext, address: Address) -> str | None:
    """The dialable host of a run member, from its verified peer record's multiaddrs."""
    for member in context.membership.members():
        if member.record.address == address:
            return dial_host(member.record.multiaddrs)
    return None


class BatchTransfer:
    """See the module doc. ``host_of`` maps a holder's address to a host to dial; ``on_bad_bytes`` is
    told of every peer caught sending bytes that are not the batch it was asked for."""

    @classmethod
    def for_node(
        cls,
        context: NodeContext,
        key: WalletKey,
        *,
        on_bad_bytes: BadBytes | None = None,
        settings: TransferSettings | None = None,
    ) -> BatchTransfer:
        """The transfer a role service runs: it dials run members at their peer records' hosts and listens
        where the node's libp2p host does."""
        return cls(
            key,
            host_of=lambda address: member_host(context, address),
            host=listen_host(context),
            on_bad_bytes=on_bad_bytes,
            settings=settings,
            p2p=context.host,
        )

    def __init__(
        self,
        key: WalletKey,
        *,
        host_of: HostLookup,
        on_bad_bytes: BadBytes | None = None,
        host: str = "0.0.0.0",
        port: int = 0,
        settings: TransferSettings | None = None,
        transport: StreamTransport = TCP,
        rng: random.Random | None = None,
        p2p: P2PHost | None = None,
    ) -> None:
        self.key = key
        self.host_of = host_of
        self.on_bad_bytes = on_bad_bytes
        self.listen_host = host
        self.listen_port = port
        self.settings = settings or TransferSettings()
        self.transport = transport
        self.rng = rng or random.Random()
        self.book = HolderBook()
        self.store: OrderedDict[bytes, bytes] = OrderedDict()
        self.held_bytes = 0
        self.counts: Counter[str] = Counter()
        self.budget = MemoryBudget()
        relayed = self.settings.relayed_fallback
        self.dialer = ChannelDialer(
            key,
            context=ROLLOUT_CONTEXT,
            transport=transport,
            budget=self.budget,
            max_frame=MAX_CHANNEL_FRAME,
            relayed=relayed,
        )
        self.dialer.p2p = p2p
        self.stats = self.dialer.stats
        self._fallback = FallbackServer(
            fallback_protocol(ROLLOUT_CONTEXT), self._accept_fallback, self.stats, relayed=relayed
        )
        self._fetch_slots = trio.CapacityLimiter(self.settings.max_fetches)
        self._per_peer: dict[Address, trio.CapacityLimiter] = {}
        self._fetching: dict[bytes, trio.Event] = {}
        self._uploads: Counter[Address] = Counter()
        self._holders_changed = trio.Event()
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise ChannelError("the batch transfer is not listening", reason="not_running")
        return self._port

    @property
    def running(self) -> bool:
        return self._port is not None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve held batches until cancelled; reports the bound port."""

        async with trio.open_nursery() as nursery:
            self._port = await nursery.start(
                lambda task_status: serve_channels(
                    self.key,
                    self._serve,
                    host=self.listen_host,
                    port=self.listen_port,
                    context=ROLLOUT_CONTEXT,
                    max_frame=MAX_CHANNEL_FRAME,
                    budget=self.budget,
                    transport=self.transport,
                    task_status=task_status,
                )
            )
            p2p = self.dialer.p2p
            if p2p is not None:
                await nursery.start(lambda task_status: self._fallback.run(p2p, task_status=task_status))
            task_status.started(self._port)

    def status(self) -> dict[str, Any]:
        return {
            "held": len(self.store),
            "held_bytes": self.held_bytes,
            "fetching": len(self._fetching),
            **dict(self.counts),
            **self.stats.status(),
        }

    # -- holding -----------------------------------------------------------------------------------------

    def hold(self, batch_id: bytes, frame: bytes) -> None:
        """Keep a verified frame to serve (the caller checked that it hashes to ``batch_id``)."""
        if batch_id in self.store:
            self.store.move_to_end(batch_id)
            return
        self.store[batch_id] = frame
        self.held_bytes += len(frame)
        while self.held_bytes > self.settings.hold_bytes and len(self.store) > 1:
            _, dropped = self.store.popitem(last=False)
            self.held_bytes -= len(dropped)

    def heard(self, announcement: RolloutAnnouncement, origin: Address, origin_peer_id: str) -> bool:
        """An announcement arrived over gossip from ``origin``: remember it as a holder. True when it is
        the worker's own new offer (module doc of protocol/rollout_transfer.py)."""
        new = self.book.heard(announcement, Holder(origin, origin_peer_id, announcement.port))
        self._holders_changed.set()
        return new

    # -- fetching ----------------------------------------------------------------------------------------

    async def fetch(self, batch_id: bytes, size: int) -> bytes | None:
        """The frame of an announced batch, verified against its id; None if no holder delivered it."""
        held = self.store.get(batch_id)
        if held is not None:
            return held
        running = self._fetching.get(batch_id)
        if running is not None:  # someone in this node is already fetching it: share the result
            await running.wait()
            return self.store.get(batch_id)
        done = self._fetching[batch_id] = trio.Event()
        try:
            async with self._fetch_slots:
                frame = await self._fetch(batch_id, size)
            if frame is not None:
                self.hold(batch_id, frame)
                self.counts["fetched"] += 1
                self.counts["fetched_bytes"] += len(frame)
            else:
                self.counts["fetch_failed"] += 1
            return frame
        finally:
            del self._fetching[batch_id]
            done.set()

    async def _fetch(self, batch_id: bytes, size: int) -> bytes | None:
        tried: set[Address] = set()
        give_up = trio.current_time() + self.settings.give_up_s
        while True:
            candidates = self.book.candidates(batch_id, tried=tried, rng=self.rng)
            if not candidates:
                if trio.current_time() >= give_up:
                    log.info("no holder delivered batch %s", batch_id.hex()[:16])
                    return None
                self._holders_changed = trio.Event()
                with trio.move_on_at(give_up):
                    await self._holders_changed.wait()
                continue
            holder = candidates[0]
            tried.add(holder.address)
            limiter = self._per_peer.setdefault(
                holder.address, trio.CapacityLimiter(self.settings.per_peer_fetches)
            )
            async with limiter:
                frame = await self._attempt(holder, batch_id, size)
            if limiter.borrowed_tokens == 0 and limiter.statistics().tasks_waiting == 0:
                self._per_peer.pop(holder.address, None)
            if frame is not None:
                return frame

    async def _attempt(self, holder: Holder, batch_id: bytes, size: int) -> bytes | None:
        target = DialTarget(holder.address, self.host_of(holder.address), holder.port, holder.peer_id)
        if not self.dialer.may_open(target):
            self.counts["holder_unreachable"] += 1
            return None
        deadline = self.settings.attempt_grace_s + size / self.settings.min_rate
        channel: AuthenticatedChannel | None = None
        with trio.move_on_after(deadline) as scope:
            try:
                channel = await self.dialer.open(target)
                return await self._download(channel, holder, batch_id, size)
            except RemoteProtocolError as exc:
                if exc.reason in BAD_BYTES:
                    self._caught(holder, batch_id, exc)
                else:
                    self.counts["attempt_failed"] += 1
                return None
            except ChannelError as exc:
                self.counts["attempt_failed"] += 1
                log.info("fetching batch %s from %s failed: %s", batch_id.hex()[:16], holder.address, exc)
                return None
            finally:
                if channel is not None:
                    with trio.CancelScope(shield=True):
                        await channel.aclose()
        if scope.cancelled_caught:
            self.counts["attempt_timeouts"] += 1
            log.info("fetching batch %s from %s timed out", batch_id.hex()[:16], holder.address)
        return None

    async def _download(
        self, channel: AuthenticatedChannel, holder: Holder, batch_id: bytes, size: int
    ) -> bytes | None:
        download = BatchDownload(batch_id, size)
        await channel.send_frame(encode(BatchRequest(batch_id)))
        status = download.reply(await channel.receive_frame())
        if status != SENDING:
            self.counts[f"holder_{status}"] += 1
            return None
        while True:
            frame = download.chunk(await channel.receive_frame())
            if frame is not None:
                return frame

    def _caught(self, holder: Holder, batch_id: bytes, exc: ProtocolError) -> None:
        self.counts["bad_bytes"] += 1
        self.book.caught(batch_id, holder.address)
        log.warning("peer %s sent bytes that are not batch %s: %s", holder.address, batch_id.hex()[:16], exc)
        if self.on_bad_bytes is not None:
            self.on_bad_bytes(holder, exc.reason)

    # -- serving -----------------------------------------------------------------------------------------

    async def _accept_fallback(self, stream: P2PStream, peer: Address) -> None:
        """A fallback stream: the same path as a connection to our TCP listener, from ``peer`` only."""
        await handle_connection(
            stream,
            self.key,
            self._serve,
            expected_peer=peer,
            context=ROLLOUT_CONTEXT,
            max_frame=MAX_CHANNEL_FRAME,
            budget=self.budget,
        )

    async def _serve(self, channel: AuthenticatedChannel) -> None:
        peer = channel.remote
        request: BatchRequest | None = None
        with trio.move_on_after(self.settings.request_timeout_s):
            try:
                request = decode(await channel.receive_frame(), BatchRequest)
            except ProtocolError as exc:
                log.info("unreadable batch request from %s: %s", peer, exc)
                self.counts["bad_requests"] += 1
                return
        if request is None:
            return
        frame = self.store.get(request.batch_id)
        if frame is None:
            await channel.send_frame(encode(BatchReply(request.batch_id, MISSING, 0)))
            return
        settings = self.settings
        if (
            sum(self._uploads.values()) >= settings.max_uploads
            or self._uploads[peer] >= settings.per_peer_uploads
        ):
            self.counts["busy"] += 1
            await channel.send_frame(encode(BatchReply(request.batch_id, BUSY, 0)))
            return
        self._uploads[peer] += 1
        try:
            await channel.send_frame(encode(BatchReply(request.batch_id, SENDING, len(frame))))
            for piece in chunks(frame, CHUNK_BYTES):
                await channel.send_frame(bytes(piece) if len(frame) > CHUNK_BYTES else frame)
            self.counts["served"] += 1
            self.counts["served_bytes"] += len(frame)
        finally:
            self._uploads[peer] -= 1
            if not self._uploads[peer]:
                del self._uploads[peer]
