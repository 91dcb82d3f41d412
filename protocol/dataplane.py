"""The data plane's frames, sans-IO: MAC'd, counted, with a deadline once begun.

Bulk bytes (checkpoint pieces) are public and each piece is checked against the signed manifest, so the
channel owes its users two things only: that the peer is who it claims (its wallet address: the handshake,
protocol/dataplane_handshake.py) and that every frame arrives unmodified, once, in order (here). It does
not encrypt. That is what lets it run at close to raw TCP speed, where py-libp2p's Noise+yamux stream
moves ~55 MB/s (DESIGN §4, §11). protocol/piece_frames.py frames the swarm's commonest messages.

Frame: ``u32`` big-endian body length ‖ body ‖ 32-byte tag, tag = keyed BLAKE3 (the direction's key)
over direction ‖ ``u64`` frame counter ‖ ``u32`` length ‖ body. The counter is implicit, so a replayed,
dropped or reordered frame fails its tag. A frame, once begun, must keep moving (``FrameDeadlines``).

A *digested* frame (``DigestedFrame``, the top bit of the length word set) carries a small head and a
bulk part, and its tag covers the head and the bulk's BLAKE3 digest instead of the bulk itself. A piece
goes as one: its bulk is the piece, whose BLAKE3 digest the manifest names, so the sender takes the
digest from the manifest instead of hashing the piece, and the receiver hashes it once, for the MAC and
the manifest check together (three BLAKE3 passes per piece delivered became one). docs/dataplane.md has
the byte-level layout.
"""

from __future__ import annotations

import enum
import hmac
import struct
from dataclasses import dataclass

from crypto.digests import blake3, blake3_hasher, keyed_blake3
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.swarm.messages import Piece

TAG_SIZE = 32
FRAME_HEADER = struct.Struct(">I")
DIGESTED = 1 << 31
"""Set in a frame's length word: a digested frame (``DigestedFrame``); the rest of the word is the length."""
HEAD_LENGTH = struct.Struct(">H")
MAX_DIGESTED_HEAD = 1024
"""A digested frame's head is at most this long (a piece's is ~45 bytes)."""
DEFAULT_MAX_FRAME = Piece.MAX_BYTES
"""The largest swarm message (a 16 MiB piece plus its envelope): nothing bigger needs to cross."""
_COUNTER_LIMIT = 1 << 64


DEFAULT_FRAME_IDLE = 10.0
DEFAULT_FRAME_GRACE = 10.0
DEFAULT_FRAME_MIN_RATE = 64 << 10


@dataclass(frozen=True)
class FrameDeadlines:
    """How long a frame may take once it has begun, in either direction. A peer may stay silent between
    frames, but inside one it must keep bytes moving (no gap over ``idle`` seconds) and finish within
    ``grace + length / min_rate`` seconds: a frame that stalls or trickles would otherwise hold a
    connection and its buffer for as long as the peer likes."""

    idle: float = DEFAULT_FRAME_IDLE
    grace: float = DEFAULT_FRAME_GRACE
    min_rate: float = DEFAULT_FRAME_MIN_RATE
    """Bytes per second."""

    def __post_init__(self) -> None:
        if not (self.idle > 0 and self.grace > 0 and self.min_rate > 0):
            raise LocalProtocolError("frame deadlines must be positive", reason="bad_deadlines")

    def allowance(self, length: int) -> float:
        """Seconds a frame with a body of ``length`` bytes may take from its first byte to its last."""
        return self.grace + length / self.min_rate


class Direction(enum.IntEnum):
    """Which way a frame travels; part of every tag so a frame cannot be reflected back to its sender."""

    DIALER_TO_LISTENER = 0
    LISTENER_TO_DIALER = 1


def frame_tag(key: bytes, direction: Direction, counter: int, body: bytes | bytearray | memoryview) -> bytes:
    """Keyed BLAKE3 over direction ‖ u64 counter ‖ u32 length ‖ body."""
    hasher = keyed_blake3(key)
    hasher.update(_tag_prefix(direction, counter, len(body)))
    hasher.update(body)
    return hasher.digest()


def _tag_prefix(direction: Direction, counter: int, length: int) -> bytes:
    return bytes([direction]) + counter.to_bytes(8, "big") + length.to_bytes(4, "big")


@dataclass(frozen=True, slots=True)
class DigestedFrame:
    """A frame sent as ``head`` ‖ ``bulk`` whose tag covers the head and ``digest``, the BLAKE3-256 of the
    bulk, in place of the bulk. Its bytes mean what ``head + bulk`` as one frame would (a piece's head is
    the start of its canonical encoding), so a receiver that wants plain bytes joins them.

    Sending: ``digest`` may be given (a piece's, from the manifest: then the sender does not hash) or left
    None (the channel hashes the bulk). Receiving: ``digest`` is what this node computed over the bulk it
    received, never a number from the wire, so it stands in for hashing the bulk again."""

    head: bytes
    bulk: bytes | bytearray | memoryview
    digest: bytes | None = None

    def __len__(self) -> int:
        """Bytes of the frame's body on the wire (head length field, head, bulk)."""
        return HEAD_LENGTH.size + len(self.head) + len(self.bulk)

    def joined(self) -> bytes:
        return self.head + bytes(self.bulk)


Frame = bytes | DigestedFrame
"""What a channel carries: plain frames, and digested ones."""


def is_digested(header: bytes | bytearray | memoryview) -> bool:
    """Whether the frame whose 4-byte header this is was sent digested."""
    return bool(int.from_bytes(header[: FRAME_HEADER.size], "big") & DIGESTED)


def digested_tag(
    key: bytes, direction: Direction, counter: int, head: bytes, bulk_length: int, digest: bytes
) -> bytes:
    """Keyed BLAKE3 over direction ‖ u64 counter ‖ u32 (DIGESTED | body length) ‖ u16 head length ‖ head ‖
    digest. The flag bit in the length word keeps it apart from every plain frame's tag."""
    length = HEAD_LENGTH.size + len(head) + bulk_length
    hasher = keyed_blake3(key)
    hasher.update(_tag_prefix(direction, counter, DIGESTED | length))
    hasher.update(HEAD_LENGTH.pack(len(head)) + head)
    hasher.update(digest)
    return hasher.digest()


class DigestedCheck:
    """The running digest of one incoming digested frame's bulk (see ``FrameOpener.begin_digested``)."""

    def __init__(self, key: bytes, direction: Direction, counter: int, head: bytes, bulk_length: int) -> None:
        self.counter = counter
        self.length = bulk_length
        """Bytes of bulk to feed with ``update`` (the head came whole, before the check began)."""
        self.received = 0
        self.head = head
        self._key = key
        self._direction = direction
        self._hasher = blake3_hasher()
        self.bulk_digest = b""
        """BLAKE3-256 of the bulk, set by ``digest``."""

    def update(self, chunk: bytes | bytearray | memoryview) -> None:
        self.received += len(chunk)
        self._hasher.update(chunk)

    def digest(self) -> bytes:
        """The tag this frame must carry (and ``bulk_digest`` from here on)."""
        self.bulk_digest = self._hasher.digest()
        key, direction = self._key, self._direction
        return digested_tag(key, direction, self.counter, self.head, self.length, self.bulk_digest)


class FrameCheck:
    """The running tag of one incoming frame (see ``FrameOpener.begin``)."""

    def __init__(self, key: bytes, direction: Direction, counter: int, length: int) -> None:
        self.counter = counter
        self.length = length
        self.received = 0
        self._hasher = keyed_blake3(key)
        self._hasher.update(_tag_prefix(direction, counter, length))

    def update(self, chunk: bytes | bytearray | memoryview) -> None:
        self.received += len(chunk)
        self._hasher.update(chunk)

    def digest(self) -> bytes:
        return self._hasher.digest()


class FrameSealer:
    """The sending half: numbers frames and tags them. Not thread-safe: one writer per connection."""

    def __init__(self, key: bytes, direction: Direction, *, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._key = key
        self._direction = direction
        self.max_frame = max_frame
        self.counter = 0

    def seal(self, body: bytes | bytearray | memoryview) -> tuple[bytes, bytes]:
        """(header, tag) to send around ``body``; the caller sends header ‖ body ‖ tag, in that order."""
        if len(body) > self.max_frame:
            raise LocalProtocolError(
                f"frame of {len(body)} bytes exceeds the cap of {self.max_frame}", reason="frame_too_large"
            )
        if self.counter >= _COUNTER_LIMIT:
            raise LocalProtocolError("frame counter exhausted", reason="counter_exhausted")
        tag = frame_tag(self._key, self._direction, self.counter, body)
        self.counter += 1
        return FRAME_HEADER.pack(len(body)), tag

    def seal_wire(self, body: bytes) -> bytes:
        header, tag = self.seal(body)
        return header + body + tag

    def seal_digested(self, frame: DigestedFrame) -> tuple[bytes, bytes]:
        """(start, tag) to send around ``frame.bulk``: the caller sends start ‖ bulk ‖ tag, where start is
        the length word, the head's length and the head. Hashes the bulk only if ``frame.digest`` is None."""
        length = len(frame)
        if length > self.max_frame or len(frame.head) > MAX_DIGESTED_HEAD:
            raise LocalProtocolError(
                f"digested frame of {length} bytes (head {len(frame.head)}) exceeds the caps",
                reason="frame_too_large",
            )
        if self.counter >= _COUNTER_LIMIT:
            raise LocalProtocolError("frame counter exhausted", reason="counter_exhausted")
        digest = frame.digest if frame.digest is not None else blake3(frame.bulk)
        tag = digested_tag(self._key, self._direction, self.counter, frame.head, len(frame.bulk), digest)
        self.counter += 1
        start = FRAME_HEADER.pack(DIGESTED | length) + HEAD_LENGTH.pack(len(frame.head)) + frame.head
        return start, tag


class FrameOpener:
    """The receiving half: checks lengths before anything is allocated, and each frame's tag in order.

    After one bad frame the opener refuses everything: a connection that lost integrity is closed.
    """

    def __init__(self, key: bytes, direction: Direction, *, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._key = key
        self._direction = direction
        self.max_frame = max_frame
        self.counter = 0
        self.broken = False

    def body_length(self, header: bytes | bytearray | memoryview) -> int:
        """The announced body length; RemoteProtocolError if it is over the cap (nothing is read or kept)."""
        self._check_usable()
        if len(header) != FRAME_HEADER.size:
            raise RemoteProtocolError("frame header is 4 bytes", reason="truncated_frame")
        (word,) = FRAME_HEADER.unpack(header)
        length = word & ~DIGESTED
        if length > self.max_frame:
            self.broken = True
            raise RemoteProtocolError(
                f"frame of {length} bytes exceeds the cap of {self.max_frame}", reason="frame_too_large"
            )
        return int(length)

    def head_length(self, length: int, field: bytes | bytearray | memoryview) -> int:
        """A digested frame's head length from its 2-byte field; RemoteProtocolError (bad_frame_head) if
        it is over ``MAX_DIGESTED_HEAD`` or does not fit in the frame's ``length``."""
        self._check_usable()
        (head_length,) = HEAD_LENGTH.unpack(field)
        if head_length > MAX_DIGESTED_HEAD or HEAD_LENGTH.size + head_length > length:
            self.broken = True
            raise RemoteProtocolError(
                f"digested frame head of {head_length} bytes in a frame of {length}", reason="bad_frame_head"
            )
        return int(head_length)

    def begin_digested(self, length: int, head: bytes) -> DigestedCheck:
        """Start checking the next frame, a digested one of ``length`` body bytes whose head (already
        received whole, its length checked by ``head_length``) is ``head``; feed its bulk, then ``finish``."""
        self._check_usable()
        bulk_length = length - HEAD_LENGTH.size - len(head)
        return DigestedCheck(self._key, self._direction, self.counter, head, bulk_length)

    def begin(self, length: int) -> FrameCheck:
        """Start checking the next frame of ``length`` bytes; feed its body as it arrives (hashing each
        chunk while it is still in cache), then ``finish``."""
        self._check_usable()
        return FrameCheck(self._key, self._direction, self.counter, length)

    def finish(self, check: FrameCheck | DigestedCheck, tag: bytes | bytearray | memoryview) -> None:
        """Accept the frame ``check`` saw or raise RemoteProtocolError (bad_mac, truncated_frame)."""
        self._check_usable()
        if check.counter != self.counter or check.received != check.length or len(tag) != TAG_SIZE:
            self.broken = True
            raise RemoteProtocolError("frame shorter than announced", reason="truncated_frame")
        if not hmac.compare_digest(check.digest(), bytes(tag)):
            self.broken = True
            raise RemoteProtocolError(
                f"frame {self.counter} fails its MAC (altered, replayed or reordered)", reason="bad_mac"
            )
        self.counter += 1

    def open(self, length: int, body: bytes | bytearray | memoryview, tag: bytes | bytearray) -> None:
        """Accept ``body`` as the next frame or raise RemoteProtocolError (bad_mac, truncated_frame)."""
        check = self.begin(length)
        check.update(body)
        self.finish(check, tag)

    def open_digested(
        self, length: int, head: bytes, bulk: bytes | bytearray | memoryview, tag: bytes | bytearray
    ) -> bytes:
        """Accept a whole digested frame as the next or raise RemoteProtocolError; the bulk's digest."""
        check = self.begin_digested(length, head)
        check.update(bulk)
        self.finish(check, tag)
        return check.bulk_digest

    def open_wire(self, data: bytes) -> bytes:
        """One whole plain frame as received (header ‖ body ‖ tag), checked; the body. A header with the
        digested flag fails like a bad tag: a plain frame's tag covers the length without the flag, so the
        flag would otherwise be the one header bit nothing authenticates."""
        length = self.body_length(data[: FRAME_HEADER.size])
        if FRAME_HEADER.unpack(data[: FRAME_HEADER.size])[0] & DIGESTED:
            self.broken = True
            raise RemoteProtocolError(
                f"frame {self.counter} carries the digested flag on a plain frame", reason="bad_mac"
            )
        end = FRAME_HEADER.size + length
        if len(data) != end + TAG_SIZE:
            self.broken = True
            raise RemoteProtocolError(
                f"frame is {len(data)} bytes, header announces {end + TAG_SIZE}", reason="truncated_frame"
            )
        body = data[FRAME_HEADER.size : end]
        self.open(length, body, data[end:])
        return body

    def _check_usable(self) -> None:
        if self.broken:
            raise LocalProtocolError("channel already failed its integrity check", reason="channel_broken")
