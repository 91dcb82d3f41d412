"""The serving half of a node's batch transfer: hold verified rollout batch frames and serve them to peers.

Frames a node produced or fetched and verified stay in a store bounded in bytes (oldest dropped first),
and are served to whoever asks on the node's listener for authenticated channels of context ``rollouts``
(a port of its own, advertised in every announcement it gossips: the swarm's listener only opens
``swarm`` channels and routes their frames to checkpoint transfers; a separate context keeps the two
uses from opening each other's channels): one request per channel, a ``BatchReply``, then the frame in
chunks.
Uploads are bounded per peer and in all; over either bound the answer is ``busy``. Given the node's
libp2p host, the same accept path also serves the fallback protocol, for peers that cannot reach the TCP
port (prime_node/dataplane/libp2p_stream.py). Fetching lives in batch_transfer.py, which runs one of
these.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Any

import trio

from crypto.keys import Address, WalletKey
from prime_node.dataplane.budget import MemoryBudget
from prime_node.dataplane.channel import AuthenticatedChannel, ChannelError
from prime_node.dataplane.connect import handle_connection, serve_channels
from prime_node.dataplane.libp2p_stream import FallbackServer, P2PStream, RouteStats, fallback_protocol
from prime_node.dataplane.streams import TCP, StreamTransport
from prime_node.p2p.interface import P2PHost
from prime_node.verification.transfer_settings import TransferSettings
from protocol.codec import decode, encode
from protocol.errors import ProtocolError
from protocol.rollout_transfer import (
    BUSY,
    CHUNK_BYTES,
    MAX_CHANNEL_FRAME,
    MISSING,
    ROLLOUT_CONTEXT,
    SENDING,
    BatchReply,
    BatchRequest,
    chunks,
)

if TYPE_CHECKING:
    from prime_node.node.context import NodeContext

log = logging.getLogger(__name__)


def listen_host(context: NodeContext) -> str:
    """Where our batch listener binds: where libp2p listens (loopback stays loopback, else all addresses),
    as the weight swarm's data plane does."""
    addresses = context.host.listen_multiaddrs()
    if addresses and all(address.startswith("/ip4/127.") for address in addresses):
        return "127.0.0.1"
    return "0.0.0.0"


class BatchServer:
    """See the module doc. ``counts`` and ``stats`` are shared with the transfer that runs it (one status)."""

    def __init__(
        self,
        key: WalletKey,
        *,
        settings: TransferSettings,
        budget: MemoryBudget,
        stats: RouteStats,
        counts: Counter[str],
        host: str = "0.0.0.0",
        port: int = 0,
        transport: StreamTransport = TCP,
    ) -> None:
        self.key = key
        self.settings = settings
        self.budget = budget
        self.stats = stats
        self.counts = counts
        self.listen_host = host
        self.listen_port = port
        self.transport = transport
        self.store: OrderedDict[bytes, bytes] = OrderedDict()
        self.held_bytes = 0
        self._uploads: Counter[Address] = Counter()
        self._fallback = FallbackServer(
            fallback_protocol(ROLLOUT_CONTEXT),
            self._accept_fallback,
            stats,
            relayed=settings.relayed_fallback,
        )
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise ChannelError("the batch transfer is not listening", reason="not_running")
        return self._port

    @property
    def running(self) -> bool:
        return self._port is not None

    async def run(self, p2p: P2PHost | None, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve held batches until cancelled (also over ``p2p``'s fallback protocol); reports the port."""

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
            if p2p is not None:
                await nursery.start(lambda task_status: self._fallback.run(p2p, task_status=task_status))
            task_status.started(self._port)

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
