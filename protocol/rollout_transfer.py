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
reasons: the sender is banned and the batch is fetched elsewhere). The id is a hash of the whole frame,
so most wrong bytes can only be caught once all of them arrived; but a frame is a signed envelope whose
payload starts with the batch header, and ``check_frame_start`` refuses, from its first ``FRAME_START_BYTES``,
bytes that are not an envelope of the announced size carrying the announced run, worker, policy step and
batch counter (``WRONG_START``): the common liar (zeros, another batch, a truncated or padded frame) is
cut off at its first chunk instead of after the announced size.

``HolderBook`` remembers, bounded, which peers hold which announced batch. Pure: no I/O, no clock.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

import msgpack

from crypto.digests import blake3
from crypto.keys import Address
from crypto.signatures import SIGNATURE_SIZE
from protocol.codec import WIRE_VERSION, ExactLen, IntRange, MaxLen, Message, decode, message
from protocol.envelope import MAX_DOMAIN_CHARS, NONCE_SIZE, Domain, Envelope
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from protocol.rollouts import peek_header

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
WRONG_START = "wrong_start"
BAD_BYTES = frozenset({WRONG_REPLY, CHUNK_TOO_LARGE, TOO_LONG, WRONG_BYTES, WRONG_START})

FRAME_START_BYTES = 2048
"""A frame's first bytes that ``check_frame_start`` reads: the envelope's fields before its payload (at
most ~0.7 KiB with the longest domain) and the payload's first KiB, where the batch header lies."""
_HEADER_PEEK = 1024
# The envelope's fields after its payload: signer (bin 20), timestamp (a msgpack int of 1 to 9 bytes),
# nonce and signature (bins of fixed length).
_TAIL_FIXED = len(msgpack.packb(bytes(20))) + len(msgpack.packb(bytes(NONCE_SIZE)))
_TAIL_FIXED += len(msgpack.packb(bytes(SIGNATURE_SIZE)))
_TAIL_RANGE = (_TAIL_FIXED + 1, _TAIL_FIXED + 9)


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


def check_frame_start(offer: RolloutAnnouncement, start: bytes, *, kind: str | None = None) -> None:
    """Refuse the first bytes of a download (``FRAME_START_BYTES`` of them, or the whole frame if it is
    shorter) that cannot begin the frame ``offer`` announced: an envelope (of domain ``kind`` in the
    offer's run, when given) whose payload length fits the announced size and whose batch header names the
    offer's run, worker, policy step and batch counter. RemoteProtocolError ``wrong_start``. Passing it
    proves nothing about the rest (only the id does); it cuts off the sender of any other bytes early."""
    try:
        unpacker = msgpack.Unpacker(
            raw=False,
            max_buffer_size=FRAME_START_BYTES,
            max_str_len=4 * MAX_DOMAIN_CHARS,
            max_bin_len=0,  # the payload's bin header is read by hand below
            max_array_len=6,
            max_map_len=0,
            max_ext_len=0,
        )
        unpacker.feed(start[:FRAME_START_BYTES])
        if unpacker.read_array_header() != 3 or unpacker.unpack() != WIRE_VERSION:
            raise ValueError("not a [version, type, body] frame")
        if unpacker.unpack() != Envelope.TYPE or unpacker.read_array_header() != 6:
            raise ValueError("not an envelope")
        domain = unpacker.unpack()
        if type(domain) is not str:
            raise ValueError("the domain is not a string")
        at = unpacker.tell()
    except (ValueError, msgpack.OutOfData, msgpack.FormatError, msgpack.StackError) as exc:
        raise RemoteProtocolError(f"the bytes do not start an envelope: {exc}", reason=WRONG_START) from exc
    try:
        parsed = Domain.parse(domain)
    except RemoteProtocolError as exc:
        raise RemoteProtocolError(f"an envelope of domain {domain[:80]!r}", reason=WRONG_START) from exc
    if parsed.run != offer.run_id or (kind is not None and parsed.kind != kind):
        raise RemoteProtocolError(f"an envelope of domain {domain[:80]!r}", reason=WRONG_START)
    payload_at, length = _bin_header(start, at)
    tail = offer.size - payload_at - length
    if not _TAIL_RANGE[0] <= tail <= _TAIL_RANGE[1]:
        raise RemoteProtocolError(
            f"an envelope of {length} payload bytes cannot be {offer.size} bytes long", reason=WRONG_START
        )
    try:
        header = peek_header(start[payload_at : payload_at + min(length, _HEADER_PEEK)])
    except RemoteProtocolError as exc:
        raise RemoteProtocolError(f"the payload is not a rollout batch: {exc}", reason=WRONG_START) from exc
    claimed = (header.run_id, header.worker, header.policy_step, header.batch_counter)
    if claimed != (offer.run_id, offer.worker, offer.policy_step, offer.batch_counter):
        raise RemoteProtocolError(
            f"batch {header.batch_counter} of step {header.policy_step} by {header.worker}: not the offer",
            reason=WRONG_START,
        )


def _bin_header(data: bytes, at: int) -> tuple[int, int]:
    """Where a msgpack bin starting at ``at`` has its bytes, and how many it has."""
    widths = {0xC4: 1, 0xC5: 2, 0xC6: 4}
    width = widths.get(data[at]) if at < len(data) else None
    if width is None or at + 1 + width > len(data):
        raise RemoteProtocolError("the envelope's payload is not a byte string", reason=WRONG_START)
    return at + 1 + width, int.from_bytes(data[at + 1 : at + 1 + width], "big")


class BatchDownload:
    """One attempt to receive ``size`` bytes hashing to ``batch_id`` from one peer (module doc).

    Feed the reply to ``reply``, then every chunk to ``chunk`` until it returns the verified frame.
    ``check_start`` (e.g. ``check_frame_start`` bound to the offer) is given the frame's first
    ``FRAME_START_BYTES`` (or all of a shorter frame) as soon as they arrived, and may refuse them.
    """

    def __init__(
        self,
        batch_id: bytes,
        size: int,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        check_start: Callable[[bytes], None] | None = None,
    ) -> None:
        if len(batch_id) != 32 or not 1 <= size <= MAX_ANNOUNCED_SIZE or chunk_bytes < 1:
            raise LocalProtocolError("a download needs a 32-byte id and a positive size", reason="bad_call")
        self.batch_id = batch_id
        self.size = size
        self.chunk_bytes = chunk_bytes
        self.received = 0
        self.sending = False
        self._chunks: list[bytes] = []
        self._check_start = check_start

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
        if self._check_start is not None and self.received >= min(self.size, FRAME_START_BYTES):
            check, self._check_start = self._check_start, None
            start = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
            check(start[:FRAME_START_BYTES])
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
