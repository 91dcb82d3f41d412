"""Signed envelopes: every message that carries authority travels inside one.

An envelope binds a payload to a *domain* (which kind of message, for which run), to its signer's
address, to a timestamp and to a random nonce. Receivers check, in this order: the domain is the one
they expect, the timestamp lies inside their acceptance window, the signature recovers the claimed
signer, and (signer, nonce) has not been seen before. Everything here is pure: the caller passes the
time, and the replay cache is an explicit object the caller owns.

The signature is an EIP-191 personal_sign over a 32-byte digest, so any Ethereum tool can check it:

    digest = keccak256("prime-node/envelope/v1" ‖ u16 len(domain) ‖ domain ‖ signer(20) ‖
                       u64 timestamp_ms ‖ u8 len(nonce) ‖ nonce ‖ blake3(payload))
"""

from __future__ import annotations

import heapq
import re
import struct
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated

from crypto.digests import blake3, keccak256
from crypto.errors import CryptoError
from crypto.keys import Address, WalletKey
from crypto.randomness import random_bytes
from crypto.signatures import SIGNATURE_SIZE, eip191_digest, recover_address
from protocol.codec import ExactLen, IntRange, MaxLen, Message, decode, encode, message
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.names import NAME_RULE, is_valid_name

PROTOCOL_NAME = "prime-node"
NONCE_SIZE = 16
MAX_DOMAIN_CHARS = 160
# Large enough for a rollout batch of real size (16 prompts x 16 samples x 4,096 tokens with proofs is
# ~20-40 MiB); every transport bounds what it accepts far below this (gossip: 256 KiB, the data plane: the
# run's max_rollout_batch_bytes), so this cap only says what a signature may cover.
MAX_PAYLOAD_BYTES = 64 << 20
_SIGNING_TAG = b"prime-node/envelope/v1"
_DOMAIN = re.compile(r"^prime-node/(?P<version>[0-9]+)/(?P<kind>[a-z0-9._-]+)/(?P<run>[a-z0-9._-]+)$")


class Reject(StrEnum):
    """Why an envelope was refused (the ``reason`` of the RemoteProtocolError)."""

    WRONG_DOMAIN = "wrong_domain"
    EXPIRED = "expired"
    FROM_THE_FUTURE = "from_the_future"
    BAD_SIGNATURE = "bad_signature"
    SIGNER_MISMATCH = "signer_mismatch"
    REPLAY = "replay"
    BEHIND_REPLAY_WINDOW = "behind_replay_window"


@dataclass(frozen=True)
class Domain:
    """What an envelope is for: a message kind inside one run, e.g. ``prime-node/1/heartbeat/demo``."""

    kind: str
    run: str
    version: int = 1

    def __post_init__(self) -> None:
        for label, value in (("kind", self.kind), ("run", self.run)):
            if not is_valid_name(value):
                raise LocalProtocolError(f"domain {label} {value!r} {NAME_RULE}", reason="bad_domain")

    @classmethod
    def parse(cls, text: str) -> Domain:
        found = _DOMAIN.match(text)
        if found is None:
            raise RemoteProtocolError(f"not a domain tag: {text[:60]!r}", reason=Reject.WRONG_DOMAIN)
        try:
            return cls(found["kind"], found["run"], int(found["version"]))
        except LocalProtocolError as exc:
            raise RemoteProtocolError(str(exc), reason=Reject.WRONG_DOMAIN) from exc

    def __str__(self) -> str:
        return f"{PROTOCOL_NAME}/{self.version}/{self.kind}/{self.run}"


@message("envelope", max_bytes=MAX_PAYLOAD_BYTES + 1024)
@dataclass(frozen=True)
class Envelope(Message):
    """A payload signed by ``signer`` for ``domain`` at ``timestamp_ms`` (see the module doc)."""

    domain: Annotated[str, MaxLen(MAX_DOMAIN_CHARS)]
    payload: Annotated[bytes, MaxLen(MAX_PAYLOAD_BYTES)]
    signer: Address
    timestamp_ms: Annotated[int, IntRange(0, (1 << 63) - 1)]
    nonce: Annotated[bytes, ExactLen(NONCE_SIZE)]
    signature: Annotated[bytes, ExactLen(SIGNATURE_SIZE)]

    def signing_digest(self) -> bytes:
        """The 32 bytes whose EIP-191 form is signed."""
        return signing_digest(self.domain, self.signer, self.timestamp_ms, self.nonce, self.payload)

    def id(self) -> bytes:
        """Content id: BLAKE3 of the canonical frame."""
        return blake3(encode(self))


def signing_digest(domain: str, signer: Address, timestamp_ms: int, nonce: bytes, payload: bytes) -> bytes:
    domain_bytes = domain.encode("utf-8")
    return keccak256(
        _SIGNING_TAG
        + struct.pack(">H", len(domain_bytes))
        + domain_bytes
        + signer.raw
        + struct.pack(">Q", timestamp_ms)
        + struct.pack(">B", len(nonce))
        + nonce
        + blake3(payload)
    )


def seal(
    key: WalletKey, domain: Domain, payload: bytes, *, now_ms: int, nonce: bytes | None = None
) -> Envelope:
    """Sign ``payload`` for ``domain`` as of ``now_ms``. A fresh random nonce unless one is given."""
    nonce = random_bytes(NONCE_SIZE) if nonce is None else nonce
    if len(nonce) != NONCE_SIZE:
        raise LocalProtocolError(f"nonce must be {NONCE_SIZE} bytes", reason="bad_nonce")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise LocalProtocolError(
            f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}", reason="too_large"
        )
    signer = key.address
    digest = signing_digest(str(domain), signer, now_ms, nonce, payload)
    signature = key.sign_digest(eip191_digest(digest))
    return Envelope(str(domain), payload, signer, now_ms, nonce, signature)


@dataclass(frozen=True)
class FreshnessWindow:
    """How old (and how far ahead, for clock skew) an envelope's timestamp may be when it arrives."""

    max_age_ms: int = 5 * 60_000
    max_skew_ms: int = 30_000


class ReplayCache:
    """Remembers (signer, nonce) of accepted envelopes for as long as they could still pass the time check.

    Memory is bounded by ``capacity``. When full, the oldest entry is evicted and the cache's *floor*
    rises to its timestamp: from then on anything not newer than the floor is refused, because the
    cache can no longer prove it is not a replay. Under overload this refuses some late honest messages
    but never accepts a replay.
    """

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise LocalProtocolError("replay cache capacity must be positive", reason="bad_capacity")
        self.capacity = capacity
        self.floor_ms = -1
        self._seen: set[tuple[bytes, bytes]] = set()
        self._by_time: list[tuple[int, bytes, bytes]] = []

    def __len__(self) -> int:
        return len(self._seen)

    def check_and_remember(
        self, signer: Address, nonce: bytes, timestamp_ms: int, *, oldest_valid_ms: int
    ) -> None:
        """Record an envelope, or raise RemoteProtocolError if it may be a replay."""
        self._forget_before(oldest_valid_ms)
        if timestamp_ms <= self.floor_ms:
            raise RemoteProtocolError(
                "envelope is older than the replay cache can vouch for", reason=Reject.BEHIND_REPLAY_WINDOW
            )
        entry = (signer.raw, nonce)
        if entry in self._seen:
            raise RemoteProtocolError(f"replayed envelope from {signer}", reason=Reject.REPLAY)
        self._seen.add(entry)
        heapq.heappush(self._by_time, (timestamp_ms, signer.raw, nonce))
        while len(self._seen) > self.capacity:
            evicted_ms, evicted_signer, evicted_nonce = heapq.heappop(self._by_time)
            self._seen.discard((evicted_signer, evicted_nonce))
            self.floor_ms = max(self.floor_ms, evicted_ms)

    def _forget_before(self, oldest_valid_ms: int) -> None:
        """Entries older than the freshness window can go: the time check refuses them anyway."""
        while self._by_time and self._by_time[0][0] < oldest_valid_ms:
            _, old_signer, old_nonce = heapq.heappop(self._by_time)
            self._seen.discard((old_signer, old_nonce))


@dataclass
class EnvelopeVerifier:
    """Everything a receiver needs to accept envelopes of one domain: the window and its replay cache."""

    domain: Domain
    window: FreshnessWindow = field(default_factory=FreshnessWindow)
    replay_cache: ReplayCache = field(default_factory=ReplayCache)

    def verify(self, envelope: Envelope, *, now_ms: int) -> Envelope:
        """Return ``envelope`` if it passes every check; RemoteProtocolError (with a Reject reason) if not."""
        if envelope.domain != str(self.domain):
            raise RemoteProtocolError(
                f"envelope for {envelope.domain[:80]!r}, expected {self.domain}", reason=Reject.WRONG_DOMAIN
            )
        oldest_valid_ms = now_ms - self.window.max_age_ms
        if envelope.timestamp_ms < oldest_valid_ms:
            raise RemoteProtocolError("envelope is too old", reason=Reject.EXPIRED)
        if envelope.timestamp_ms > now_ms + self.window.max_skew_ms:
            raise RemoteProtocolError("envelope is dated in the future", reason=Reject.FROM_THE_FUTURE)
        check_signature(envelope)
        self.replay_cache.check_and_remember(
            envelope.signer, envelope.nonce, envelope.timestamp_ms, oldest_valid_ms=oldest_valid_ms
        )
        return envelope

    def open(self, frame: bytes, *, now_ms: int) -> Envelope:
        """Decode and verify one envelope frame."""
        return self.verify(decode(frame, Envelope), now_ms=now_ms)


def check_signature(envelope: Envelope) -> None:
    """The signature must recover exactly ``envelope.signer`` (no time or replay checks: see the verifier)."""
    if len(envelope.nonce) != NONCE_SIZE:
        raise RemoteProtocolError(f"nonce must be {NONCE_SIZE} bytes", reason=Reject.BAD_SIGNATURE)
    try:
        recovered = recover_address(eip191_digest(envelope.signing_digest()), envelope.signature)
    except CryptoError as exc:
        raise RemoteProtocolError(f"unusable signature: {exc}", reason=Reject.BAD_SIGNATURE) from exc
    if recovered != envelope.signer:
        raise RemoteProtocolError(
            f"signature is by {recovered}, not the claimed signer {envelope.signer}",
            reason=Reject.SIGNER_MISMATCH,
        )
