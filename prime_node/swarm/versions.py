"""The swarm service's per-version and per-manifest records, the checks on a manifest a peer sends, and
the status view of a version. The bookkeeping of who offered what lives in protocol/swarm/catalogue.py;
these records hold what the catalogue must not: transfers, stores, paths and trio events."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from crypto.digests import blake3
from crypto.keys import Address
from prime_node.errors import NodeError
from prime_node.swarm.piece_store import PieceStore
from prime_node.swarm.transfer import CheckpointTransfer
from protocol.codec import decode
from protocol.envelope import Envelope
from protocol.errors import RemoteProtocolError
from protocol.manifest import Manifest, open_manifest
from protocol.swarm.messages import ManifestEnvelope

AVAILABILITY_BINS = 64


@dataclass
class Version:
    """One checkpoint version this node holds, seeds or fetches."""

    manifest: Manifest
    envelope: Envelope
    transfer: CheckpointTransfer
    store: PieceStore | None
    path: Path | None
    origin: bool
    resumed_pieces: int = 0
    target: Path | None = None
    """Where a fetched version is to be written (None: inside the store)."""
    done: trio.Event = field(default_factory=trio.Event)
    error: NodeError | None = None

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def state(self) -> str:
        if self.origin:
            return "seeding"
        return "complete" if self.path is not None else "fetching"

    def status(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "kind": "delta" if self.manifest.is_delta else "full",
            "manifest_id": self.manifest.id().hex(),
            "pieces": self.manifest.piece_count,
            "have": self.transfer.node.have.bit_count(),
            "state": self.state,
            "availability": availability(self),
        }


@dataclass
class ManifestWait:
    """Callers of ``get_manifest`` waiting for one manifest, and the outcome."""

    found: trio.Event = field(default_factory=trio.Event)
    result: tuple[Envelope, Manifest] | None = None
    error: NodeError | None = None


def open_known(envelope: Envelope, mid: bytes, trainer: Address | None) -> Manifest:
    """A manifest we hold, checked again for ``trainer`` (any signer when None, the id pins it)."""
    try:
        return open_manifest(envelope, trainer=trainer or envelope.signer, expected_id=mid)
    except RemoteProtocolError as exc:
        raise NodeError(f"refusing manifest {mid.hex()}: {exc}", reason=exc.reason) from exc


def open_sent(message: ManifestEnvelope, trainer: Address | None) -> tuple[Envelope, Manifest]:
    """The manifest a peer sent for ``message.manifest_id``. RemoteProtocolError ``wrong_signer`` means
    the id itself is not the trainer's (the manifest it pins names another signer: the sender is honest,
    and no peer can ever send a trainer-signed one); any other reason, a lying sender. A peer that signs
    the trainer's own manifest with its key is one of those (``inconsistent_manifest``): it must not make
    a fetch give up on a manifest an honest peer is about to send."""
    mid = message.manifest_id
    envelope = decode(message.envelope, Envelope)
    if blake3(envelope.payload) != mid:
        raise RemoteProtocolError("manifest does not have the requested id", reason="wrong_manifest_id")
    if trainer is not None and envelope.signer != trainer:
        named = decode(envelope.payload, Manifest).signer
        if named != envelope.signer:
            raise RemoteProtocolError(
                f"manifest names signer {named} but is signed by {envelope.signer}",
                reason="inconsistent_manifest",
            )
    return envelope, open_manifest(envelope, trainer=trainer or envelope.signer, expected_id=mid)


def availability(version: Version) -> list[int]:
    """Peers holding each piece, bucketed into at most AVAILABILITY_BINS bins (min over each bin)."""
    count = version.manifest.piece_count
    bits = list(version.transfer.node.picker.peer_bits.values())
    bins = min(AVAILABILITY_BINS, count)
    width = math.ceil(count / bins)
    result = []
    for start in range(0, count, width):
        end = min(start + width, count)
        mask = ((1 << (end - start)) - 1) << start
        if end - start <= 64:
            result.append(min(sum(1 for b in bits if b >> i & 1) for i in range(start, end)))
        else:  # wide bins (over 4,096 pieces): peers holding the whole bin, a lower bound of the minimum
            result.append(sum(1 for b in bits if b & mask == mask))
    return result
