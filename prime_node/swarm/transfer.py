"""One checkpoint version's transfer on this node: a SwarmNode wired to its bytes (a PieceStore, or for
the origin the original directory) and to a transport given as two callbacks.

This is the whole of the swarm that a transport has to know about: report connections, hand over each
received frame as bytes, call ``tick`` now and then, and deliver the frames passed to ``send``. The data
plane (prime_node/swarm/transport.py, over TCP or in-memory streams) and the synchronous loopback of the
tests (prime_node/testing/swarm_loopback.py) both drive it the same way.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Protocol

from prime_node.swarm.checkpoint_pieces import read_piece_from_files
from protocol.codec import Message, decode_any, encode
from protocol.dataplane import DigestedFrame, Frame
from protocol.errors import RemoteProtocolError
from protocol.manifest import Manifest
from protocol.piece_frames import (
    decode_digested_piece,
    decode_indexed,
    decode_piece,
    encode_indexed,
    piece_frame,
)
from protocol.swarm.messages import Cancel, Have, Piece, Reject, Request
from protocol.swarm.pieceset import full_set
from protocol.swarm.spread import SpreadMemory
from protocol.swarm.swarm_node import (
    Action,
    Completed,
    Disconnect,
    Send,
    SwarmConfig,
    SwarmNode,
    Upload,
    Verify,
)

log = logging.getLogger(__name__)

SendFrame = Callable[[Hashable, Frame], None]
ClosePeer = Callable[[Hashable, str], None]


def decode_frame(frame: Frame, max_bytes: int = Piece.MAX_BYTES) -> tuple[Message, bytes | None]:
    """One swarm frame: pieces, ``have``s, requests and cancels (almost every frame) without the general
    codec's passes, anything else through it; and for a piece that came as a digested frame, the BLAKE3
    of its data as the channel computed it on receipt (None otherwise). RemoteProtocolError if it is not
    a message."""
    if isinstance(frame, DigestedFrame):
        piece = decode_digested_piece(frame)
        if piece is not None:
            return piece, frame.digest
        frame = frame.joined()
    return decode_piece(frame) or decode_indexed(frame) or decode_any(frame, max_bytes=max_bytes), None


def encode_message(message: Message) -> bytes:
    """``encode(message)``, with ``have``, request and cancel on their own fast path."""
    if isinstance(message, Have | Request | Cancel):
        return encode_indexed(message)
    return encode(message)


class PieceSource(Protocol):
    """Where a transfer's verified pieces are kept."""

    have: int

    def read(self, index: int) -> bytes: ...

    def write(self, index: int, data: bytes, *, digest: bytes | None = None) -> bool: ...


class OriginDirectory:
    """The origin's pieces, read straight from the directory it shared (it holds them all)."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.directory = directory
        self.manifest = manifest
        self.have = full_set(manifest.piece_count)

    def read(self, index: int) -> bytes:
        return read_piece_from_files(self.directory, self.manifest, index)

    def write(self, index: int, data: bytes, *, digest: bytes | None = None) -> bool:
        return self.manifest.piece_is_valid(index, data, digest=digest)


class CheckpointTransfer:
    """See the module doc. ``on_complete`` runs once, when every piece is verified and stored."""

    def __init__(
        self,
        manifest: Manifest,
        pieces: PieceSource,
        *,
        send: SendFrame,
        close: ClosePeer,
        rng: random.Random,
        config: SwarmConfig | None = None,
        on_complete: Callable[[], None] | None = None,
        upload: bool = True,
        memory: SpreadMemory | None = None,
    ) -> None:
        """``memory``: super-seeding's hop time and peers' records from this node's earlier versions."""
        self.manifest = manifest
        self.manifest_id = manifest.id()
        self.pieces = pieces
        self._send = send
        self._close = close
        self._on_complete = on_complete
        self.upload = upload
        self.node = SwarmNode(
            self.manifest_id, manifest.piece_count, rng=rng, config=config, have=pieces.have, memory=memory
        )
        self.completed = self.node.complete
        self.bytes_in = 0
        self.bytes_out = 0
        self._received_digest: tuple[Hashable, int, bytes] | None = None
        """(peer, index, BLAKE3) of the piece being handled, if the channel hashed it on receipt."""

    def connected(self, peer: Hashable, now: float) -> None:
        self._run(self.node.connected(peer, now), now)

    def disconnected(self, peer: Hashable, now: float) -> None:
        self._run(self.node.disconnected(peer, now), now)

    def tick(self, now: float) -> None:
        self._run(self.node.tick(now), now)

    def frame(self, peer: Hashable, data: Frame, now: float) -> None:
        """One frame received from ``peer``. Undecodable bytes ban the peer."""
        self.bytes_in += len(data)
        try:
            message, digest = decode_frame(data)
        except RemoteProtocolError as exc:
            log.warning("banning %s: undecodable frame (%s: %s)", peer, exc.reason, exc)
            self._run(self.node.ban(peer, exc.reason, now), now)
            return
        self.receive(peer, message, now, digest=digest)

    def receive(self, peer: Hashable, message: Message, now: float, *, digest: bytes | None = None) -> None:
        """One message already decoded by a transport that routes several versions over one connection;
        ``digest``: a piece's BLAKE3 as the channel computed it on receipt (``decode_frame``)."""
        if not self.upload and isinstance(message, Request):
            # A leecher serves nobody: whoever asks is refused (once per piece; it then asks elsewhere).
            self._emit(peer, encode(Reject(self.manifest_id, message.index, "missing")))
            return
        if digest is not None and isinstance(message, Piece):
            self._received_digest = (peer, message.index, digest)
        try:
            self._run(self.node.receive(peer, message, now), now)
        finally:
            self._received_digest = None

    def _run(self, actions: list[Action], now: float) -> None:
        queue = deque(actions)
        last: tuple[Message, bytes] | None = None  # a verified piece's one `have` goes to many peers
        while queue:
            action = queue.popleft()
            if isinstance(action, Send):
                # A leecher still tells the truth about what it holds (``have``, bitfield): a
                # super-seeding origin reveals each peer only pieces it lacks, so hiding them stalls the
                # download. A neighbour that asks a leecher is refused once per piece and asks elsewhere.
                if last is None or last[0] is not action.message:
                    last = (action.message, encode_message(action.message))
                self._emit(action.peer, last[1])
            elif isinstance(action, Upload):
                # The MAC covers the piece's hash from the manifest, not the piece: no hashing here.
                data = self.pieces.read(action.index)
                piece_hash = self.manifest.piece_hash(action.index)
                self._emit(action.peer, piece_frame(self.manifest_id, action.index, data, piece_hash))
                queue += self.node.upload_done(action.peer, action.index, now)
            elif isinstance(action, Verify):
                got = self._received_digest  # the channel's digest of this very piece, if it came digested
                digest = got[2] if got is not None and got[:2] == (action.peer, action.index) else None
                valid = self.pieces.write(action.index, action.data, digest=digest)
                if not valid:
                    log.warning(
                        "piece %d from %s fails its hash: banning the peer", action.index, action.peer
                    )
                queue += self.node.piece_checked(action.peer, action.index, valid, now)
            elif isinstance(action, Disconnect):
                log.info("disconnecting %s: %s", action.peer, action.reason)
                self._close(action.peer, action.reason)
            elif isinstance(action, Completed) and not self.completed:
                self.completed = True
                if self._on_complete is not None:
                    self._on_complete()
            # AbortUpload: frames go out whole as soon as they are made, so there is nothing to stop.

    def _emit(self, peer: Hashable, frame: Frame) -> None:
        self.bytes_out += len(frame)
        self._send(peer, frame)
