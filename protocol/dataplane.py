"""The data plane's channel protocol, sans-IO: a wallet-authenticated handshake and MAC'd frames.

Bulk bytes (checkpoint pieces) are public and each piece is checked against the signed manifest, so the
channel owes its users two things only: that the peer is who it claims (its wallet address) and that
every frame arrives unmodified, once, in order. It does not encrypt. That is what lets it run at close
to raw TCP speed, where py-libp2p's Noise+yamux stream moves ~55 MB/s (DESIGN §4, §11).

Handshake (three codec messages, each in a ``u32`` length-prefixed frame):

1. dialer → listener: ``dataplane.hello`` (ephemeral secp256k1 key, 32-byte nonce)
2. listener → dialer: ``dataplane.hello``, then ``dataplane.auth`` (its address, signature over the
   transcript and its own address)
3. dialer → listener: ``dataplane.auth`` (its address, signature over the transcript and both addresses)

Session keys come from the ECDH of the two ephemeral keys, hashed with BLAKE3 in derive-key mode
together with the transcript and both addresses, so both ends hold the same keys only if they agree on
everything, identities included (a relay that swaps a signature gets keys nobody else has).

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
from typing import Annotated

from crypto.digests import DIGEST_SIZE, blake3, blake3_derive_key, blake3_hasher, keyed_blake3
from crypto.errors import CryptoError
from crypto.exchange import EPHEMERAL_KEY_SIZE, EphemeralKey, check_public_key
from crypto.keys import Address, WalletKey
from crypto.signatures import recover_address
from protocol.codec import ExactLen, Message, decode, encode, message
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.manifest import MAX_PIECE_SIZE, MAX_PIECES
from protocol.swarm.messages import Cancel, Have, Piece, Request

PROTOCOL_TAG = b"prime-node/dataplane/v2"
"""v2: digested frames. A v1 peer's handshake fails against it (the transcript names the version)."""
KEY_CONTEXT = "prime-node 2026 dataplane v2 session keys"
NONCE_SIZE = 32
SECRET_SIZE = 32
SIGNATURE_SIZE = 65
TAG_SIZE = 32
FRAME_HEADER = struct.Struct(">I")
DIGESTED = 1 << 31
"""Set in a frame's length word: a digested frame (``DigestedFrame``); the rest of the word is the length."""
HEAD_LENGTH = struct.Struct(">H")
MAX_DIGESTED_HEAD = 1024
"""A digested frame's head is at most this long (a piece's is ~45 bytes)."""
HANDSHAKE_MAX_FRAME = 256
DEFAULT_MAX_FRAME = Piece.MAX_BYTES
"""The largest swarm message (a 16 MiB piece plus its envelope): nothing bigger needs to cross."""
MAX_CONTEXT_BYTES = 255
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


class Role(enum.Enum):
    DIALER = 0
    LISTENER = 1


class Direction(enum.IntEnum):
    """Which way a frame travels; part of every tag so a frame cannot be reflected back to its sender."""

    DIALER_TO_LISTENER = 0
    LISTENER_TO_DIALER = 1


@message("dataplane.hello", max_bytes=128)
@dataclass(frozen=True)
class Hello(Message):
    """A fresh ephemeral public key (compressed secp256k1) and nonce for this connection only."""

    ephemeral_key: Annotated[bytes, ExactLen(EPHEMERAL_KEY_SIZE)]
    nonce: Annotated[bytes, ExactLen(NONCE_SIZE)]


@message("dataplane.auth", max_bytes=160)
@dataclass(frozen=True)
class Auth(Message):
    """The sender's wallet address and its recoverable signature over the handshake transcript."""

    signer: Address
    signature: Annotated[bytes, ExactLen(SIGNATURE_SIZE)]


@dataclass(frozen=True)
class SessionKeys:
    """What a finished handshake yields: who the peer is and the two directional frame keys."""

    remote: Address
    send_key: bytes
    receive_key: bytes
    send_direction: Direction
    receive_direction: Direction


def transcript_hash(context: str, dialer: Hello, listener: Hello) -> bytes:
    """BLAKE3 of tag ‖ u8 len(context) ‖ context ‖ dialer key ‖ nonce ‖ listener key ‖ nonce."""
    raw_context = _context_bytes(context)
    return blake3(
        PROTOCOL_TAG
        + bytes([len(raw_context)])
        + raw_context
        + dialer.ephemeral_key
        + dialer.nonce
        + listener.ephemeral_key
        + listener.nonce
    )


def listener_auth_digest(transcript: bytes, listener: Address) -> bytes:
    return blake3(PROTOCOL_TAG + b"/listener-auth" + transcript + listener.raw)


def dialer_auth_digest(transcript: bytes, listener: Address, dialer: Address) -> bytes:
    return blake3(PROTOCOL_TAG + b"/dialer-auth" + transcript + listener.raw + dialer.raw)


def derive_session_keys(shared_secret: bytes, transcript: bytes, dialer: Address, listener: Address) -> bytes:
    """64 bytes: the dialer→listener key, then the listener→dialer key."""
    material = shared_secret + transcript + dialer.raw + listener.raw
    return blake3_derive_key(KEY_CONTEXT, material, length=2 * SECRET_SIZE)


def _context_bytes(context: str) -> bytes:
    raw = context.encode("utf-8")
    if len(raw) > MAX_CONTEXT_BYTES:
        raise LocalProtocolError("handshake context longer than 255 bytes", reason="bad_context")
    return raw


class _State(enum.Enum):
    AWAIT_HELLO = enum.auto()
    AWAIT_AUTH = enum.auto()
    DONE = enum.auto()
    FAILED = enum.auto()


class Handshake:
    """One side of the handshake. Feed it each handshake frame received; send the frames it returns.

    The ephemeral secret and nonce are passed in (the caller draws them from the OS), so the machine is
    deterministic under test. The dialer must name ``expected_peer``; a listener may (then any other
    dialer is refused), otherwise it learns the dialer's address from ``result.remote``.
    """

    def __init__(
        self,
        role: Role,
        wallet: WalletKey,
        *,
        ephemeral_secret: bytes,
        nonce: bytes,
        context: str,
        expected_peer: Address | None = None,
    ) -> None:
        if role is Role.DIALER and expected_peer is None:
            raise LocalProtocolError("a dialer must know whom it dials", reason="no_expected_peer")
        if len(nonce) != NONCE_SIZE:
            raise LocalProtocolError("a handshake nonce is 32 bytes", reason="bad_nonce")
        _context_bytes(context)
        self.role = role
        self._wallet = wallet
        self._ephemeral = EphemeralKey(ephemeral_secret)
        self._own_hello = Hello(self._ephemeral.public_key, nonce)
        self._context = context
        self._expected = expected_peer
        self._state = _State.AWAIT_HELLO
        self._peer_hello: Hello | None = None
        self._transcript = b""
        self.result: SessionKeys | None = None

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    def initial_frames(self) -> list[bytes]:
        """The dialer speaks first; the listener waits."""
        return [encode(self._own_hello)] if self.role is Role.DIALER else []

    def receive(self, frame: bytes) -> list[bytes]:
        """Process one handshake frame; RemoteProtocolError (and a dead handshake) if it is wrong."""
        if self._state in (_State.DONE, _State.FAILED):
            raise LocalProtocolError(f"handshake is {self._state.name.lower()}", reason="handshake_over")
        try:
            if self._state is _State.AWAIT_HELLO:
                return self._on_hello(decode(frame, Hello))
            return self._on_auth(decode(frame, Auth))
        except RemoteProtocolError:
            self._state = _State.FAILED
            raise

    def _on_hello(self, hello: Hello) -> list[bytes]:
        try:
            check_public_key(hello.ephemeral_key)
        except CryptoError as exc:
            raise RemoteProtocolError("peer's ephemeral key is not a curve point", reason="bad_key") from exc
        if hello.ephemeral_key == self._own_hello.ephemeral_key:
            raise RemoteProtocolError("peer echoed our own ephemeral key", reason="reflected_hello")
        self._peer_hello = hello
        self._state = _State.AWAIT_AUTH
        if self.role is Role.DIALER:
            self._transcript = transcript_hash(self._context, self._own_hello, hello)
            return []
        self._transcript = transcript_hash(self._context, hello, self._own_hello)
        me = self._wallet.address
        auth = Auth(me, self._wallet.sign_digest(listener_auth_digest(self._transcript, me)))
        return [encode(self._own_hello), encode(auth)]

    def _on_auth(self, auth: Auth) -> list[bytes]:
        if self._expected is not None and auth.signer != self._expected:
            raise RemoteProtocolError(
                f"peer is {auth.signer}, expected {self._expected}", reason="wrong_peer"
            )
        me = self._wallet.address
        if self.role is Role.DIALER:
            listener, dialer = auth.signer, me
            digest = listener_auth_digest(self._transcript, listener)
        else:
            listener, dialer = me, auth.signer
            digest = dialer_auth_digest(self._transcript, listener, dialer)
        try:
            recovered = recover_address(digest, auth.signature)
        except CryptoError as exc:
            raise RemoteProtocolError(f"handshake signature invalid: {exc}", reason="bad_signature") from exc
        if recovered != auth.signer:
            raise RemoteProtocolError(f"handshake signature is not {auth.signer}'s", reason="bad_signature")
        out: list[bytes] = []
        if self.role is Role.DIALER:
            own = Auth(me, self._wallet.sign_digest(dialer_auth_digest(self._transcript, listener, me)))
            out.append(encode(own))
        assert self._peer_hello is not None
        shared = self._ephemeral.shared_secret(self._peer_hello.ephemeral_key)
        keys = derive_session_keys(shared, self._transcript, dialer, listener)
        to_listener, to_dialer = keys[:SECRET_SIZE], keys[SECRET_SIZE:]
        if self.role is Role.DIALER:
            self.result = SessionKeys(
                auth.signer,
                to_listener,
                to_dialer,
                Direction.DIALER_TO_LISTENER,
                Direction.LISTENER_TO_DIALER,
            )
        else:
            self.result = SessionKeys(
                auth.signer,
                to_dialer,
                to_listener,
                Direction.LISTENER_TO_DIALER,
                Direction.DIALER_TO_LISTENER,
            )
        self._state = _State.DONE
        return out


def handshake_frame(message_bytes: bytes) -> bytes:
    """A handshake message on the wire: u32 length ‖ codec bytes."""
    return FRAME_HEADER.pack(len(message_bytes)) + message_bytes


def handshake_length(header: bytes | bytearray) -> int:
    """The length of the handshake frame whose header this is; refuses anything over 256 bytes."""
    (length,) = FRAME_HEADER.unpack(header)
    if length > HANDSHAKE_MAX_FRAME:
        raise RemoteProtocolError(
            f"handshake frame of {length} bytes exceeds {HANDSHAKE_MAX_FRAME}", reason="frame_too_large"
        )
    return int(length)


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


# --- The piece frame without the general codec ------------------------------------------------------------
#
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
