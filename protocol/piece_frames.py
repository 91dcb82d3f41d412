"""Swarm messages framed without the general codec: the piece, and have / request / cancel.

These are the data plane's commonest frames, each with a fixed canonical encoding, so they are built and
read here byte by byte and accepted only if they are exactly what ``protocol.codec.encode`` would write.
"""

from __future__ import annotations

from crypto.digests import DIGEST_SIZE
from protocol.codec import encode
from protocol.dataplane import DigestedFrame
from protocol.manifest import MAX_PIECE_SIZE, MAX_PIECES
from protocol.swarm.messages import Cancel, Have, Piece, Request

# ``swarm.piece`` is the one large message, and the general codec handles its body three times on receipt
# (msgpack copies it out, the canonical check re-encodes and compares it) and twice on sending. Its
# canonical form is fixed: [1, "swarm.piece", [manifest_id, index, data]] with msgpack's shortest int and
# bin headers. ``piece_frame`` sends it as a digested frame, the canonical head apart from the data (so the
# data is never copied into a frame); ``decode_digested_piece`` and ``decode_piece`` (the same bytes as one
# plain frame) accept a frame only if it is byte for byte ``encode(Piece(...))`` of what they return
# (anything else is None: hand it to ``protocol.codec.decode_any``, which decides).

_PIECE_PREFIX = b"\x93\x01\xab" + Piece.TYPE.encode() + b"\x93\xc4" + bytes([DIGEST_SIZE])
_PIECE_INDEX_AT = len(_PIECE_PREFIX) + DIGEST_SIZE


def _uint(value: int) -> bytes:
    """msgpack's shortest form of a non-negative int (what ``msgpack.packb`` writes)."""
    if value < 0x80:
        return bytes([value])
    if value < 1 << 8:
        return b"\xcc" + value.to_bytes(1, "big")
    if value < 1 << 16:
        return b"\xcd" + value.to_bytes(2, "big")
    return b"\xce" + value.to_bytes(4, "big")


def _bin_header(length: int) -> bytes:
    if length < 1 << 8:
        return b"\xc4" + length.to_bytes(1, "big")
    if length < 1 << 16:
        return b"\xc5" + length.to_bytes(2, "big")
    return b"\xc6" + length.to_bytes(4, "big")


def _piece_head(manifest_id: bytes, index: int, length: int) -> bytes | None:
    """The bytes of a canonical piece frame before its data, or None if the fields break Piece's bounds."""
    if len(manifest_id) != DIGEST_SIZE or not 0 <= index < MAX_PIECES or length > MAX_PIECE_SIZE:
        return None
    return _PIECE_PREFIX + manifest_id + _uint(index) + _bin_header(length)


def _parse_piece_head(frame: bytes) -> tuple[bytes, int, int, int] | None:
    """(manifest_id, index, data offset, data length) if ``frame`` starts with a canonical piece head."""
    if not frame.startswith(_PIECE_PREFIX) or len(frame) < _PIECE_INDEX_AT + 2:
        return None
    manifest_id = frame[len(_PIECE_PREFIX) : _PIECE_INDEX_AT]
    marker = frame[_PIECE_INDEX_AT]
    index_size = 0 if marker < 0x80 else {0xCC: 1, 0xCD: 2, 0xCE: 4}.get(marker, -1)
    if index_size < 0:
        return None
    index_end = _PIECE_INDEX_AT + 1 + index_size
    index = marker if index_size == 0 else int.from_bytes(frame[_PIECE_INDEX_AT + 1 : index_end], "big")
    if len(frame) <= index_end:
        return None
    length_size = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(frame[index_end], 0)
    data_at = index_end + 1 + length_size
    length = int.from_bytes(frame[index_end + 1 : data_at], "big")
    head = _piece_head(manifest_id, index, length)
    if not length_size or head is None or len(frame) < data_at or frame[:data_at] != head:
        return None
    return manifest_id, index, data_at, length


def decode_piece(frame: bytes) -> Piece | None:
    """The piece ``frame`` encodes canonically, or None if it is anything else (see above)."""
    parsed = _parse_piece_head(frame)
    if parsed is None or len(frame) != parsed[2] + parsed[3]:
        return None
    manifest_id, index, data_at, _ = parsed
    return Piece(manifest_id, index, frame[data_at:])


def piece_frame(manifest_id: bytes, index: int, data: bytes, digest: bytes | None) -> DigestedFrame:
    """Piece ``index`` as a digested frame: head ‖ data is ``encode(Piece(...))``; ``digest`` is the
    piece's hash from the manifest (or None: the channel hashes it)."""
    head = _piece_head(manifest_id, index, len(data))
    if head is None:
        encode(Piece(manifest_id, index, data))  # raises LocalProtocolError, naming the broken bound
        raise AssertionError("unreachable: a piece that fails _piece_head fails its own encoding")
    return DigestedFrame(head, data, digest)


def decode_digested_piece(frame: DigestedFrame) -> Piece | None:
    """The piece a digested frame carries, if its head is exactly the canonical head for its bulk's
    length; None otherwise (the caller decodes ``frame.joined()`` the general way)."""
    parsed = _parse_piece_head(frame.head)
    if parsed is None or parsed[2] != len(frame.head) or parsed[3] != len(frame.bulk):
        return None
    return Piece(parsed[0], parsed[1], bytes(frame.bulk))


# --- have / request / cancel without the general codec ------------------------------------------------------
#
# After the pieces, the commonest frames are the three (manifest_id, index) messages: every verified piece
# sends a ``have`` to each neighbour that lacks it. Their canonical form is fixed too,
# [1, type, [manifest_id, index]], and the same rule holds: ``decode_indexed`` accepts a frame only if it is
# byte for byte ``encode`` of what it returns.

IndexedMessage = Have | Request | Cancel
_INDEXED_FIELDS = b"\x92\xc4" + bytes([DIGEST_SIZE])  # [manifest_id (bin 8, 32 bytes), ...
_INDEXED: dict[bytes, type[Have] | type[Request] | type[Cancel]] = {
    b"\x93\x01" + bytes([0xA0 | len(kind.TYPE)]) + kind.TYPE.encode() + _INDEXED_FIELDS: kind
    for kind in (Have, Request, Cancel)
}
_INDEXED_PREFIX = {kind: prefix for prefix, kind in _INDEXED.items()}


def encode_indexed(message: IndexedMessage) -> bytes:
    """``encode(message)`` for a have, request or cancel, without the general codec."""
    if len(message.manifest_id) != DIGEST_SIZE or not 0 <= message.index < MAX_PIECES:
        return encode(message)  # raises LocalProtocolError
    return _INDEXED_PREFIX[type(message)] + message.manifest_id + _uint(message.index)


def decode_indexed(frame: bytes) -> IndexedMessage | None:
    """The have, request or cancel ``frame`` encodes canonically, or None if it is anything else."""
    if len(frame) < 3 or not 0xA0 <= frame[2] < 0xC0:
        return None
    index_at = 6 + (frame[2] & 0x1F) + DIGEST_SIZE
    kind = _INDEXED.get(frame[: index_at - DIGEST_SIZE])
    if kind is None or not index_at < len(frame) <= index_at + 5:
        return None
    marker = frame[index_at]
    index = marker if marker < 0x80 else int.from_bytes(frame[index_at + 1 :], "big")
    if index >= MAX_PIECES or frame[index_at:] != _uint(index):
        return None
    return kind(frame[index_at - DIGEST_SIZE : index_at], index)
