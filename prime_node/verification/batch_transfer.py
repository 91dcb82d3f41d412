"""Rollout batches over the data plane (I/O around protocol/rollout_transfer.py): fetch, and run the server.

Every node that produces or receives large batches runs one ``BatchTransfer``. Its ``BatchServer``
(batch_serving.py) holds frames and serves them on a ``rollouts`` listener of its own; here is fetching:

- **Fetch.** ``fetch(batch_id, size)`` asks the batch's holders (``HolderBook``: re-servers first, the
  worker last) one at a time, at most ``per_peer_fetches`` at once from one peer. A download slot (at
  most ``max_fetches``, granted round-robin across the batches' workers: ``FairSlots``) is held only
  while an attempt runs, never while a fetch waits for a holder. An attempt must get its reply within
  ``reply_timeout_s`` whatever the announced size, then every ``CHUNK_BYTES`` of the body within
  ``chunk_grace_s + CHUNK_BYTES / min_rate`` (a byte-rate floor): a holder that accepts the channel and
  never answers, or trickles, costs one slot for seconds, not minutes. Bytes are checked against the id
  as they arrive (and the frame's first bytes against the offer, given ``check_start``): a peer that sends
  anything else is reported through ``on_bad_bytes`` (the services ban it) and never asked again. A
  holder that timed out, trickled or refused the connection is not dialled again for a backoff that
  doubles with each failure in a row (``holder_backoff_s`` .. ``max_holder_backoff_s``), so one announcer
  cannot make this node open connection after connection to the port it names. The offering worker
  failing to deliver its own batch (no reply, too slow, ``missing``, connection refused) is reported
  through ``on_undelivered`` (the services charge it) and ends the fetch once no other holder is known;
  otherwise, with no holder left, the fetch waits for new ones (other nodes re-announce what they
  fetched) until ``give_up_s``.

Memory: the store's bound, plus at most ``max_fetches`` frames being received (each at most the run's
size cap), plus the channels' shared ``MemoryBudget``.

Reachability: given the node's libp2p host (``p2p``), a holder whose TCP port does not answer (behind
NAT), or whose record names no direct host, is reached over a libp2p stream carrying the same channel
(prime_node/dataplane/dialer.py), and the server takes that fallback protocol through the same accept
path as its TCP listener (prime_node/dataplane/libp2p_stream.py).
"""

from __future__ import annotations

import logging
import random
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from crypto.keys import Address, WalletKey
from prime_node.dataplane.budget import MemoryBudget
from prime_node.dataplane.channel import AuthenticatedChannel, ChannelError
from prime_node.dataplane.dialer import ChannelDialer, ChannelSettings, DialTarget, dial_host
from prime_node.dataplane.streams import TCP, StreamTransport
from prime_node.p2p.interface import P2PHost
from prime_node.verification.batch_serving import BatchServer, listen_host
from prime_node.verification.fair_slots import FairSlots
from prime_node.verification.transfer_settings import TransferSettings
from protocol.codec import encode
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.rollout_transfer import (
    BAD_BYTES,
    CHUNK_BYTES,
    MAX_CHANNEL_FRAME,
    MISSING,
    ROLLOUT_CONTEXT,
    SENDING,
    BatchDownload,
    BatchRequest,
    Holder,
    HolderBook,
    RolloutAnnouncement,
)
from protocol.scoring import Offence

if TYPE_CHECKING:
    from prime_node.node.context import NodeContext
    from prime_node.node.peers import PeerPolicy

log = logging.getLogger(__name__)


HostLookup = Callable[[Address], "str | None"]
BadBytes = Callable[[Holder, str], None]
Undelivered = Callable[[Holder, str], None]
StartCheck = Callable[[bytes], None]

# How an attempt ended without the frame; which of these back off the holder, or charge a worker.
TIMED_OUT = "timed_out"
TOO_SLOW = "too_slow"
REFUSED = "refused"
UNREACHABLE = "unreachable"
CAUGHT = "caught"
BACK_OFF = frozenset({TIMED_OUT, TOO_SLOW, REFUSED})
UNDELIVERED = frozenset({TIMED_OUT, TOO_SLOW, REFUSED, MISSING})


BAN_CHARGES = 8
"""Most ``BAD_DATA`` charges ``ban_peer`` makes (each is 50 of the default ban threshold's 100)."""


def ban_peer(policy: PeerPolicy, peer_id: str, reason: str) -> None:
    """Ban ``peer_id`` on the node's peer scores now: charge ``BAD_DATA`` until the score bans it (the
    scores have no ban of their own; a node configured never to ban only sees the score fall)."""
    for _ in range(BAN_CHARGES):
        policy.offence(peer_id, Offence.BAD_DATA, reason)
        if policy.is_banned(peer_id):
            return


def member_host(context: NodeContext, address: Address) -> str | None:
    """The dialable host of a run member, from its verified peer record's multiaddrs."""
    for member in context.membership.members():
        if member.record.address == address:
            return dial_host(member.record.multiaddrs)
    return None


class BatchTransfer:
    """See the module doc. ``host_of`` maps a holder's address to a host to dial; ``on_bad_bytes`` is
    told of every peer caught sending bytes that are not the batch it was asked for (it is banned from
    this data plane: never asked again, its announcements ignored); ``on_undelivered`` of every worker
    that did not deliver a batch it offered itself."""

    @classmethod
    def for_node(
        cls,
        context: NodeContext,
        key: WalletKey,
        *,
        on_bad_bytes: BadBytes | None = None,
        on_undelivered: Undelivered | None = None,
        settings: TransferSettings | None = None,
    ) -> BatchTransfer:
        """The transfer a role service runs: it dials run members at their peer records' hosts and listens
        where the node's libp2p host does."""
        return cls(
            key,
            host_of=lambda address: member_host(context, address),
            host=listen_host(context),
            on_bad_bytes=on_bad_bytes,
            on_undelivered=on_undelivered,
            settings=settings,
            p2p=context.host,
        )

    def __init__(
        self,
        key: WalletKey,
        *,
        host_of: HostLookup,
        on_bad_bytes: BadBytes | None = None,
        on_undelivered: Undelivered | None = None,
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
        self.on_undelivered = on_undelivered
        self.settings = settings or TransferSettings()
        self.transport = transport
        self.rng = rng or random.Random()
        self.book = HolderBook()
        self.counts: Counter[str] = Counter()
        self.budget = MemoryBudget()
        relayed = self.settings.relayed_fallback
        self.dialer = ChannelDialer(
            key,
            budget=self.budget,
            settings=ChannelSettings(context=ROLLOUT_CONTEXT, max_frame=MAX_CHANNEL_FRAME, relayed=relayed),
            transport=transport,
        )
        self.dialer.p2p = p2p
        self.stats = self.dialer.stats
        self.server = BatchServer(
            key,
            settings=self.settings,
            budget=self.budget,
            stats=self.stats,
            counts=self.counts,
            host=host,
            port=port,
            transport=transport,
        )
        """Holds the frames and serves them (batch_serving.py)."""
        self._fetch_slots: FairSlots[Address | bytes] = FairSlots(self.settings.max_fetches)
        self._per_peer: dict[Address, trio.CapacityLimiter] = {}
        self.banned: OrderedDict[Address, None] = OrderedDict()
        """Peers caught sending wrong bytes: never dialled again, their announcements ignored."""
        self._backoff: OrderedDict[Address, tuple[int, float]] = OrderedDict()
        """Holders that failed: (failures in a row, not dialled before this trio time)."""
        self._fetching: dict[bytes, trio.Event] = {}
        self._holders_changed = trio.Event()

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def running(self) -> bool:
        return self.server.running

    @property
    def store(self) -> OrderedDict[bytes, bytes]:
        """The frames held to serve, oldest first (the server's)."""
        return self.server.store

    @property
    def held_bytes(self) -> int:
        return self.server.held_bytes

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve held batches until cancelled; reports the bound port."""
        await self.server.run(self.dialer.p2p, task_status=task_status)

    def status(self) -> dict[str, Any]:
        return {
            "held": len(self.store),
            "held_bytes": self.held_bytes,
            "fetching": len(self._fetching),
            "attempts_running": self._fetch_slots.used,
            "attempts_waiting": self._fetch_slots.waiting(),
            "banned": len(self.banned),
            "backing_off": len(self._backoff),
            **dict(self.counts),
            **self.stats.status(),
        }

    def hold(self, batch_id: bytes, frame: bytes) -> None:
        """Keep a verified frame to serve (the caller checked that it hashes to ``batch_id``)."""
        self.server.hold(batch_id, frame)

    def heard(self, announcement: RolloutAnnouncement, origin: Address, origin_peer_id: str) -> bool:
        """An announcement arrived over gossip from ``origin``: remember it as a holder. True when it is
        the worker's own new offer (module doc of protocol/rollout_transfer.py). A banned peer's
        announcements are ignored."""
        if origin in self.banned:
            self.counts["banned_announcements"] += 1
            return False
        new = self.book.heard(announcement, Holder(origin, origin_peer_id, announcement.port))
        self._holders_changed.set()
        return new

    # -- fetching ----------------------------------------------------------------------------------------

    async def fetch(
        self, batch_id: bytes, size: int, *, check_start: StartCheck | None = None
    ) -> bytes | None:
        """The frame of an announced batch, verified against its id; None if no holder delivered it.
        ``check_start`` may refuse the frame's first bytes (``BatchDownload``)."""
        held = self.store.get(batch_id)
        if held is not None:
            return held
        running = self._fetching.get(batch_id)
        if running is not None:  # someone in this node is already fetching it: share the result
            await running.wait()
            return self.store.get(batch_id)
        done = self._fetching[batch_id] = trio.Event()
        try:
            frame = await self._fetch(batch_id, size, check_start)
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

    def ban(self, address: Address) -> None:
        """Never ask ``address`` for a batch again, and ignore its announcements."""
        self.banned[address] = None
        self.banned.move_to_end(address)
        while len(self.banned) > self.settings.max_banned:
            self.banned.popitem(last=False)

    def backing_off(self, address: Address) -> float | None:
        """Until when (trio time) ``address`` is not dialled, or None."""
        entry = self._backoff.get(address)
        if entry is None or entry[1] <= trio.current_time():
            return None
        return entry[1]

    async def _fetch(self, batch_id: bytes, size: int, check_start: StartCheck | None) -> bytes | None:
        tried: set[Address] = set()
        give_up = trio.current_time() + self.settings.give_up_s
        offer = self.book.offer(batch_id)
        owner: Address | bytes = offer.worker if offer is not None else batch_id
        worker_failed = False
        while True:
            waiting_for: list[float] = []
            candidates = []
            for holder in self.book.candidates(batch_id, tried=tried, rng=self.rng):
                until = self.backing_off(holder.address)
                if holder.address in self.banned:
                    continue
                if until is None:
                    candidates.append(holder)
                elif offer is not None and holder.address == offer.worker:
                    worker_failed = True  # it just failed to deliver another batch: not waited for
                else:
                    waiting_for.append(until)
            if not candidates:
                if worker_failed and not waiting_for:
                    log.info(
                        "the worker did not deliver batch %s, and no one else holds it", batch_id.hex()[:16]
                    )
                    return None
                if trio.current_time() >= give_up:
                    log.info("no holder delivered batch %s", batch_id.hex()[:16])
                    return None
                self._holders_changed = trio.Event()
                with trio.move_on_at(min([give_up, *waiting_for])):
                    await self._holders_changed.wait()
                continue
            holder = candidates[0]
            tried.add(holder.address)
            limiter = self._per_peer.setdefault(
                holder.address, trio.CapacityLimiter(self.settings.per_peer_fetches)
            )
            frame, failure = None, ""
            async with limiter:
                if self.backing_off(holder.address) is not None or holder.address in self.banned:
                    tried.discard(holder.address)  # failed meanwhile: wait for its backoff, not a dial
                    continue
                # Newest claimed policy first: an old batch is the one that goes stale (fair_slots.py).
                priority = offer.policy_step if offer is not None else 0
                async with self._fetch_slots.hold(owner, priority=priority):
                    frame, failure = await self._attempt(holder, batch_id, size, check_start)
            if limiter.borrowed_tokens == 0 and limiter.statistics().tasks_waiting == 0:
                self._per_peer.pop(holder.address, None)
            if frame is not None:
                self._backoff.pop(holder.address, None)
                return frame
            if failure in BACK_OFF:
                self._back_off(holder.address)
            if offer is not None and holder.address == offer.worker and failure in UNDELIVERED | {CAUGHT}:
                worker_failed = True
                if failure != CAUGHT:
                    self.counts["undelivered"] += 1
                    if self.on_undelivered is not None:
                        self.on_undelivered(holder, failure)

    def _back_off(self, address: Address) -> None:
        failures = self._backoff.pop(address, (0, 0.0))[0] + 1
        settings = self.settings
        wait = min(settings.max_holder_backoff_s, settings.holder_backoff_s * 2 ** min(failures - 1, 30))
        self._backoff[address] = (failures, trio.current_time() + wait)
        while len(self._backoff) > self.settings.max_banned:
            self._backoff.popitem(last=False)

    async def _attempt(
        self, holder: Holder, batch_id: bytes, size: int, check_start: StartCheck | None
    ) -> tuple[bytes | None, str]:
        """One holder asked once: the frame, or None and how it failed."""
        target = DialTarget(holder.address, self.host_of(holder.address), holder.port, holder.peer_id)
        if not self.dialer.may_open(target):
            self.counts["holder_unreachable"] += 1
            return None, UNREACHABLE
        channel: AuthenticatedChannel | None = None
        try:
            download = BatchDownload(batch_id, size, check_start=check_start)
            with trio.move_on_after(self.settings.reply_timeout_s):
                channel = await self.dialer.open(target)
                await channel.send_frame(encode(BatchRequest(batch_id)))
                status = download.reply(await channel.receive_frame())
                if status != SENDING:
                    self.counts[f"holder_{status}"] += 1
                    return None, status
            if not download.sending:
                self.counts["attempt_timeouts"] += 1
                log.info("batch %s: %s did not answer in time", batch_id.hex()[:16], holder.address)
                return None, TIMED_OUT
            assert channel is not None
            frame = await self._body(channel, download)
            if frame is None:
                self.counts["attempt_too_slow"] += 1
                log.info("batch %s: %s sent it too slowly", batch_id.hex()[:16], holder.address)
                return None, TOO_SLOW
            return frame, ""
        except RemoteProtocolError as exc:
            if exc.reason in BAD_BYTES:
                self._caught(holder, batch_id, exc)
                return None, CAUGHT
            self.counts["attempt_failed"] += 1
            return None, REFUSED
        except ChannelError as exc:
            self.counts["attempt_failed"] += 1
            log.info("fetching batch %s from %s failed: %s", batch_id.hex()[:16], holder.address, exc)
            return None, REFUSED
        finally:
            if channel is not None:
                with trio.CancelScope(shield=True):
                    await channel.aclose()

    async def _body(self, channel: AuthenticatedChannel, download: BatchDownload) -> bytes | None:
        """The body's chunks, each next ``CHUNK_BYTES`` within its deadline (``min_rate``); None if late."""
        settings = self.settings
        while True:
            window = min(CHUNK_BYTES, download.remaining)
            target = download.received + window
            with trio.move_on_after(settings.chunk_grace_s + window / settings.min_rate):
                while download.received < target:
                    frame = download.chunk(await channel.receive_frame())
                    if frame is not None:
                        return frame
                continue
            return None

    def _caught(self, holder: Holder, batch_id: bytes, exc: ProtocolError) -> None:
        self.counts["bad_bytes"] += 1
        self.book.caught(batch_id, holder.address)
        self.ban(holder.address)
        log.warning("peer %s sent bytes that are not batch %s: %s", holder.address, batch_id.hex()[:16], exc)
        if self.on_bad_bytes is not None:
            self.on_bad_bytes(holder, exc.reason)
