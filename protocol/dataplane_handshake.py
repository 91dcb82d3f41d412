"""The data plane's handshake, sans-IO: who the peer is (its wallet address) and the two frame keys.

Three codec messages, each in a ``u32`` length-prefixed frame:

1. dialer → listener: ``dataplane.hello`` (ephemeral secp256k1 key, 32-byte nonce)
2. listener → dialer: ``dataplane.hello``, then ``dataplane.auth`` (its address, signature over the
   transcript and its own address)
3. dialer → listener: ``dataplane.auth`` (its address, signature over the transcript and both addresses)

Session keys come from the ECDH of the two ephemeral keys, hashed with BLAKE3 in derive-key mode
together with the transcript and both addresses, so both ends hold the same keys only if they agree on
everything, identities included (a relay that swaps a signature gets keys nobody else has). The frames
those keys seal are protocol/dataplane.py's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated

from crypto.digests import blake3, blake3_derive_key
from crypto.errors import CryptoError
from crypto.exchange import EPHEMERAL_KEY_SIZE, EphemeralKey, check_public_key
from crypto.keys import Address, WalletKey
from crypto.signatures import recover_address
from protocol.codec import ExactLen, Message, decode, encode, message
from protocol.dataplane import FRAME_HEADER, Direction
from protocol.errors import LocalProtocolError, RemoteProtocolError

PROTOCOL_TAG = b"prime-node/dataplane/v2"
"""v2: digested frames. A v1 peer's handshake fails against it (the transcript names the version)."""
KEY_CONTEXT = "prime-node 2026 dataplane v2 session keys"
NONCE_SIZE = 32
SECRET_SIZE = 32
SIGNATURE_SIZE = 65
HANDSHAKE_MAX_FRAME = 256
MAX_CONTEXT_BYTES = 255


class Role(enum.Enum):
    DIALER = 0
    LISTENER = 1


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
