"""Swarm wire messages. They are transport-agnostic: each is one codec frame (bytes in, bytes out), so a
libp2p stream, a raw authenticated TCP channel or the simulator can carry them.

Every message names the manifest it is about, so one connection can carry several checkpoint versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from crypto.digests import DIGEST_SIZE
from protocol.codec import ExactLen, IntRange, MaxLen, Message, message
from protocol.manifest import MAX_PIECE_SIZE, MAX_PIECES

MAX_REASON_CHARS = 32
PieceIndex = Annotated[int, IntRange(0, MAX_PIECES - 1)]
ManifestId = Annotated[bytes, ExactLen(DIGEST_SIZE)]


@message("swarm.bitfield", max_bytes=MAX_PIECES // 8 + 128)
@dataclass(frozen=True)
class Bitfield(Message):
    """The pieces the sender holds (sent on connect; later ones only add pieces)."""

    manifest_id: ManifestId
    bits: Annotated[bytes, MaxLen(MAX_PIECES // 8)]


@message("swarm.have", max_bytes=128)
@dataclass(frozen=True)
class Have(Message):
    """The sender now holds (and has verified) piece ``index``."""

    manifest_id: ManifestId
    index: PieceIndex


@message("swarm.request", max_bytes=128)
@dataclass(frozen=True)
class Request(Message):
    """Please send piece ``index``."""

    manifest_id: ManifestId
    index: PieceIndex


@message("swarm.cancel", max_bytes=128)
@dataclass(frozen=True)
class Cancel(Message):
    """Forget my request for ``index`` (I got it elsewhere)."""

    manifest_id: ManifestId
    index: PieceIndex


@message("swarm.reject", max_bytes=192)
@dataclass(frozen=True)
class Reject(Message):
    """I will not serve ``index``; ``reason``: ``missing``, ``not_offered``, ``too_many_requests``, ..."""

    manifest_id: ManifestId
    index: PieceIndex
    reason: Annotated[str, MaxLen(MAX_REASON_CHARS)]


@message("swarm.piece", max_bytes=MAX_PIECE_SIZE + 128)
@dataclass(frozen=True)
class Piece(Message):
    """The bytes of piece ``index``; the receiver checks them against the manifest before keeping them."""

    manifest_id: ManifestId
    index: PieceIndex
    data: Annotated[bytes, MaxLen(MAX_PIECE_SIZE)]


# --- Version discovery on a data-plane connection, and the gossip announcement ----------------------------
#
# One connection carries every version two peers share. A version's swarm session between two peers starts
# once each has sent the other an ``Offer`` for it (so both bitfields arrive after both sides are ready); a
# peer that does not have the manifest yet asks for it with ``ManifestRequest``. The signed manifest travels
# as the encoded ``Envelope`` (checked by the receiver with ``protocol.manifest.open_manifest``).

MAX_ENVELOPE_BYTES = 8 << 20
MAX_ANNOUNCED_ENVELOPE_BYTES = 192 << 10
"""A manifest envelope up to this size rides inside the gossip announcement (gossip payloads <= 256 KiB)."""


@message("swarm.offer", max_bytes=128)
@dataclass(frozen=True)
class Offer(Message):
    """I hold (or am fetching) this version; ``step`` is a hint, checked against the manifest later."""

    manifest_id: ManifestId
    step: Annotated[int, IntRange(0, (1 << 63) - 1)]


@message("swarm.manifest_request", max_bytes=128)
@dataclass(frozen=True)
class ManifestRequest(Message):
    """Please send the signed manifest with this id (answered only by peers that have it)."""

    manifest_id: ManifestId


@message("swarm.manifest_envelope", max_bytes=MAX_ENVELOPE_BYTES + 2048)
@dataclass(frozen=True)
class ManifestEnvelope(Message):
    """The signed manifest named ``manifest_id``: an encoded ``Envelope``."""

    manifest_id: ManifestId
    envelope: Annotated[bytes, MaxLen(MAX_ENVELOPE_BYTES + 1024)]


@message("swarm.announce", max_bytes=MAX_ANNOUNCED_ENVELOPE_BYTES + 256)
@dataclass(frozen=True)
class Announce(Message):
    """Gossip on the ``checkpoints`` topic, published by the trainer: a new version exists. ``envelope`` is
    the signed manifest when it is small enough, else empty (fetch it by id over the data plane)."""

    manifest_id: ManifestId
    run: Annotated[str, MaxLen(64)]
    step: Annotated[int, IntRange(0, (1 << 63) - 1)]
    envelope: Annotated[bytes, MaxLen(MAX_ANNOUNCED_ENVELOPE_BYTES)]
