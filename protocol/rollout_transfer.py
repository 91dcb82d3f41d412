"""Rollout batches over the data plane, sans-IO (DESIGN §4, §5: batches of any size move like pieces).

A batch too big to ride gossip is **announced** there instead: ``RolloutAnnouncement`` names its id
(BLAKE3 of the sealed envelope frame), size, run, worker, policy step, batch counter and the data-plane
port of the node that gossiped the announcement. Gossip signs every frame with its origin's key, so an
announcement whose origin is its ``worker`` is the worker's own offer of a new batch; one gossiped by
anyone else says "I hold these bytes too" (validators and the trainer re-serve what they fetched).

The bytes come over an authenticated data-plane channel (context ``ROLLOUT_CONTEXT``): the fetcher sends
``BatchRequest``, the holder answers ``BatchReply`` (``sending``, ``missing`` or ``busy``), then, when
sending, the frame in raw chunks of at most ``CHUNK_BYTES``. ``BatchDownload`` checks them against the
announced id before anything else looks at them: a reply for another id or size, a chunk over the limit,
more bytes than announced or bytes whose hash is not the id are RemoteProtocolErrors (``BAD_BYTES``
reasons: the sender is charged and the batch is fetched elsewhere).

``HolderBook`` remembers, bounded, which peers hold which announced batch. Pure: no I/O, no clock.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated

from crypto.digests import blake3
from crypto.keys import Address
from protocol.codec import ExactLen, IntRange, MaxLen, Message, decode, message
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError

ROLLOUT_CONTEXT = "rollouts"
"""The data-plane channel context of batch fetches (a swarm handshake does not open one)."""
CHUNK_BYTES = 4 << 20
"""Largest raw chunk of a batch on the channel (the data plane's throughput sweet spot)."""
MAX_CHANNEL_FRAME = CHUNK_BYTES + 64
MAX_ANNOUNCED_SIZE = 1 << 40
MAX_HOLDERS = 16
"""Holders remembered per batch (the worker and up to 15 re-servers): enough to route around bad ones."""
_U63 = (1 << 63) - 1

SENDING = "sending"
MISSING = "missing"
BUSY = "busy"
REPLY_STATUSES = (SENDING, MISSING, BUSY)

# Refusal reasons. The first group costs the announcer nothing more than the refusal (gossip already
# charged what it could); BAD_BYTES reasons charge the peer that sent the bytes (Offence.BAD_DATA).
WRONG_RUN = "wrong_run"
SIGNER_NOT_WORKER = "signer_not_worker"
BATCH_TOO_LARGE = "batch_too_large"
FUTURE_POLICY = "future_policy"
WRONG_REPLY = "wrong_reply"
CHUNK_TOO_LARGE = "chunk_too_large"
TOO_LONG = "too_long"
WRONG_BYTES = "wrong_bytes"
BAD_BYTES = frozenset({WRONG_REPLY, CHUNK_TOO_LARGE, TOO_LONG, WRONG_BYTES})


@message("rollouts.announce", max_bytes=512)
@dataclass(frozen=True)
class RolloutAnnouncement(Message):
    """A batch's id and size on gossip; the bytes are fetched from the origin at ``port``."""

    batch_id: Annotated[bytes, ExactLen(32)]
    size: Annotated[int, IntRange(1, MAX_ANNOUNCED_SIZE)]
    run_id: Annotated[str, MaxLen(64)]
    worker: Address
    policy_step: Annotated[int, IntRange(0, _U63)]
    batch_counter: Annotated[int, IntRange(0, _U63)]
    port: Annotated[int, IntRange(1, 65535)]
    """TCP port of the gossiping node's rollout data plane, on its peer record's host."""


@message("rollouts.get", max_bytes=128)
@dataclass(frozen=True)
class BatchRequest(Message):
    batch_id: Annotated[bytes, ExactLen(32)]


@message("rollouts.reply", max_bytes=128)
@dataclass(frozen=True)
class BatchReply(Message):
    """``sending`` (the frame follows in chunks), ``missing`` (not held) or ``busy`` (ask elsewhere)."""

    batch_id: Annotated[bytes, ExactLen(32)]
    status: Annotated[str, MaxLen(16)]
    size: Annotated[int, IntRange(0, MAX_ANNOUNCED_SIZE)]


def announcement_for(
    frame: bytes, *, run_id: str, worker: Address, policy_step: int, batch_counter: int, port: int
) -> RolloutAnnouncement:
    """The announcement of a sealed batch frame (its id is BLAKE3 of the frame)."""
    return RolloutAnnouncement(blake3(frame), len(frame), run_id, worker, policy_step, batch_counter, port)


def read_announcement(payload: bytes) -> RolloutAnnouncement | None:
    """The announcement a ``rollouts`` gossip payload holds, or None if it is something else (a whole
    batch frame rides the same topic while it fits gossip)."""
    if len(payload) > RolloutAnnouncement.MAX_BYTES:
        return None
    try:
        return decode(payload, RolloutAnnouncement)
    except ProtocolError:
        return None


def screen_announcement(
    announcement: RolloutAnnouncement,
    *,
    origin: Address,
    run_id: str,
    max_size: int,
    newest_step: int | None = None,
    future_steps: int = 1,
) -> None:
    """Refuse, before any byte is fetched, a batch offer that is not its worker's, not of this run, over
    the run's size cap, or (when ``newest_step`` is given) for a policy further than ``future_steps``
    past it. RemoteProtocolError with the reason."""
    if announcement.worker != origin:
        raise RemoteProtocolError(
            f"offer of {announcement.worker}'s batch gossiped by {origin}", reason=SIGNER_NOT_WORKER
        )
    if announcement.run_id != run_id:
        raise RemoteProtocolError(f"batch of run {announcement.run_id!r}", reason=WRONG_RUN)
    if announcement.size > max_size:
        raise RemoteProtocolError(
            f"announced batch of {announcement.size} bytes, over the run's {max_size}-byte cap",
            reason=BATCH_TOO_LARGE,
        )
    if newest_step is not None and announcement.policy_step > newest_step + future_steps:
        raise RemoteProtocolError(
            f"policy {announcement.policy_step} is more than {future_steps} past {newest_step}",
            reason=FUTURE_POLICY,
        )


class BatchDownload:
    """One attempt to receive ``size`` bytes hashing to ``batch_id`` from one peer (module doc).

    Feed the reply to ``reply``, then every chunk to ``chunk`` until it returns the verified frame.
    """

    def __init__(self, batch_id: bytes, size: int, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        if len(batch_id) != 32 or not 1 <= size <= MAX_ANNOUNCED_SIZE or chunk_bytes < 1:
            raise LocalProtocolError("a download needs a 32-byte id and a positive size", reason="bad_call")
        self.batch_id = batch_id
        self.size = size
        self.chunk_bytes = chunk_bytes
        self.received = 0
        self.sending = False
        self._chunks: list[bytes] = []

    @property
    def remaining(self) -> int:
        return self.size - self.received

    def reply(self, data: bytes) -> str:
        """The holder's answer: its status (``sending``, ``missing``, ``busy``); RemoteProtocolError
        (``wrong_reply``) if it is not a reply about this batch, or announces other bytes than ours."""
        if self.sending:
            raise LocalProtocolError("reply already received", reason="bad_call")
        try:
            answer = decode(data, BatchReply)
        except ProtocolError as exc:
            raise RemoteProtocolError(f"unreadable reply: {exc}", reason=WRONG_REPLY) from exc
        if answer.batch_id != self.batch_id or answer.status not in REPLY_STATUSES:
            raise RemoteProtocolError("reply about another batch, or of unknown kind", reason=WRONG_REPLY)
        if answer.status == SENDING:
            if answer.size != self.size:
                raise RemoteProtocolError(
                    f"holder sends {answer.size} bytes, the batch has {self.size}", reason=WRONG_REPLY
                )
            self.sending = True
        return answer.status

    def chunk(self, data: bytes) -> bytes | None:
        """Add one chunk; the verified frame once all ``size`` bytes arrived, else None."""
        if not self.sending:
            raise LocalProtocolError("chunk before a sending reply", reason="bad_call")
        if not 1 <= len(data) <= self.chunk_bytes:
            raise RemoteProtocolError(
                f"chunk of {len(data)} bytes (1..{self.chunk_bytes} allowed)", reason=CHUNK_TOO_LARGE
            )
        if len(data) > self.remaining:
            raise RemoteProtocolError(f"more than the announced {self.size} bytes", reason=TOO_LONG)
        self._chunks.append(data)
        self.received += len(data)
        if self.remaining:
            return None
        frame = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks = []
        if blake3(frame) != self.batch_id:
            raise RemoteProtocolError("bytes do not hash to the announced batch id", reason=WRONG_BYTES)
        return frame


def chunks(frame: bytes, chunk_bytes: int = CHUNK_BYTES) -> list[memoryview]:
    """How a holder cuts a frame for the channel (views: no copies)."""
    view = memoryview(frame)
    return [view[i : i + chunk_bytes] for i in range(0, len(frame), chunk_bytes)]


@dataclass(frozen=True)
class Holder:
    """A peer that says it holds a batch: its wallet address, libp2p peer ID and rollout port."""

    address: Address
    peer_id: str
    port: int


@dataclass
class _Entry:
    offer: RolloutAnnouncement | None = None
    holders: OrderedDict[Address, Holder] = field(default_factory=OrderedDict)
    bad: set[Address] = field(default_factory=set)


class HolderBook:
    """Which peers hold which announced batch, for ``capacity`` batches (those no worker offered are
    forgotten first, then the oldest)."""

    def __init__(self, *, capacity: int = 1024, max_holders: int = MAX_HOLDERS) -> None:
        if capacity < 1 or max_holders < 1:
            raise LocalProtocolError("a holder book needs positive bounds", reason="bad_config")
        self.capacity = capacity
        self.max_holders = max_holders
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def heard(self, announcement: RolloutAnnouncement, holder: Holder) -> bool:
        """Record an announcement gossiped by ``holder``; True when it is a new offer from its worker.

        A re-server's announcement only adds a source (its claimed header is not trusted: the offer is
        the worker's). A peer once caught sending wrong bytes for a batch is not recorded again for it.
        """
        entry = self._entries.get(announcement.batch_id)
        if entry is None:
            while len(self._entries) >= self.capacity:
                self._evict_one()
            entry = self._entries[announcement.batch_id] = _Entry()
        new_offer = False
        if holder.address == announcement.worker and entry.offer is None:
            entry.offer = announcement
            new_offer = True
        if holder.address not in entry.bad and (
            holder.address in entry.holders or len(entry.holders) < self.max_holders
        ):
            entry.holders[holder.address] = holder
        return new_offer

    def offer(self, batch_id: bytes) -> RolloutAnnouncement | None:
        entry = self._entries.get(batch_id)
        return entry.offer if entry is not None else None

    def holders(self, batch_id: bytes) -> list[Holder]:
        entry = self._entries.get(batch_id)
        return list(entry.holders.values()) if entry is not None else []

    def candidates(self, batch_id: bytes, *, tried: set[Address], rng: random.Random) -> list[Holder]:
        """Holders not tried yet: re-servers first (in random order, to spread the load off the worker,
        whose upload is the scarce one), the worker last."""
        entry = self._entries.get(batch_id)
        if entry is None:
            return []
        worker = entry.offer.worker if entry.offer is not None else None
        others = [h for a, h in entry.holders.items() if a not in tried and a != worker]
        rng.shuffle(others)
        own = [h for a, h in entry.holders.items() if a not in tried and a == worker]
        return others + own

    def caught(self, batch_id: bytes, address: Address) -> None:
        """``address`` sent bytes that are not the batch: never ask it for this batch again."""
        entry = self._entries.get(batch_id)
        if entry is not None:
            entry.holders.pop(address, None)
            entry.bad.add(address)

    def forget(self, batch_id: bytes) -> None:
        self._entries.pop(batch_id, None)

    def _evict_one(self) -> None:
        """Drop the oldest entry that no worker offered, else the oldest: claims of holding ids nobody
        offered (anyone can gossip them) never push a real offer out."""
        for batch_id, entry in self._entries.items():
            if entry.offer is None:
                del self._entries[batch_id]
                return
        self._entries.popitem(last=False)
