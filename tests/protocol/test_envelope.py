"""Signed envelopes: every tamper, replay, foreign key, foreign domain and stale timestamp is refused."""

from __future__ import annotations

import pytest
from eth_account import Account
from eth_account.messages import encode_defunct
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from crypto.keys import SECP256K1_ORDER, WalletKey
from protocol.codec import decode, encode
from protocol.envelope import (
    NONCE_SIZE,
    Domain,
    Envelope,
    EnvelopeVerifier,
    FreshnessWindow,
    Reject,
    ReplayCache,
    check_signature,
    seal,
)
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError

DOMAIN = Domain("heartbeat", "run-1")
NOW = 1_700_000_000_000
keys = st.integers(1, SECP256K1_ORDER - 1).map(lambda n: WalletKey(n.to_bytes(32, "big")))
payloads = st.binary(max_size=2048)


def _reason(envelope_or_frame: Envelope | bytes, verifier: EnvelopeVerifier, now_ms: int = NOW) -> str:
    with pytest.raises(RemoteProtocolError) as caught:
        if isinstance(envelope_or_frame, bytes):
            verifier.open(envelope_or_frame, now_ms=now_ms)
        else:
            verifier.verify(envelope_or_frame, now_ms=now_ms)
    return caught.value.reason


@given(key=keys, payload=payloads)
def test_sealed_envelope_passes_once_then_is_a_replay(key: WalletKey, payload: bytes) -> None:
    verifier = EnvelopeVerifier(DOMAIN)
    frame = encode(seal(key, DOMAIN, payload, now_ms=NOW))
    opened = verifier.open(frame, now_ms=NOW + 10)
    assert (opened.payload, opened.signer) == (payload, key.address)
    assert _reason(frame, verifier, NOW + 20) == Reject.REPLAY
    fresh = seal(key, DOMAIN, payload, now_ms=NOW + 30)
    assert verifier.verify(fresh, now_ms=NOW + 40).payload == payload


@settings(max_examples=100)
@given(key=keys, payload=st.binary(max_size=64), data=st.data())
def test_any_single_bit_flip_fails(key: WalletKey, payload: bytes, data: st.DataObject) -> None:
    frame = encode(seal(key, DOMAIN, payload, now_ms=NOW))
    bit = data.draw(st.integers(0, len(frame) * 8 - 1))
    tampered = bytearray(frame)
    tampered[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(RemoteProtocolError):
        EnvelopeVerifier(DOMAIN).open(bytes(tampered), now_ms=NOW)


@given(key=keys, other=keys, payload=payloads)
def test_another_signer_claimed_is_refused(key: WalletKey, other: WalletKey, payload: bytes) -> None:
    envelope = seal(key, DOMAIN, payload, now_ms=NOW)
    if other.address != key.address:
        forged = Envelope(
            envelope.domain, envelope.payload, other.address, NOW, envelope.nonce, envelope.signature
        )
        assert _reason(forged, EnvelopeVerifier(DOMAIN)) == Reject.SIGNER_MISMATCH


@given(key=keys, payload=payloads)
def test_another_domain_is_refused(key: WalletKey, payload: bytes) -> None:
    for other in (
        Domain("heartbeat", "run-2"),
        Domain("verdict", "run-1"),
        Domain("heartbeat", "run-1", version=2),
    ):
        envelope = seal(key, other, payload, now_ms=NOW)
        assert _reason(envelope, EnvelopeVerifier(DOMAIN)) == Reject.WRONG_DOMAIN
        # Relabelling the domain breaks the signature instead.
        relabelled = Envelope(str(DOMAIN), payload, key.address, NOW, envelope.nonce, envelope.signature)
        assert _reason(relabelled, EnvelopeVerifier(DOMAIN)) == Reject.SIGNER_MISMATCH


def test_time_window() -> None:
    key = WalletKey.generate()
    window = FreshnessWindow(max_age_ms=60_000, max_skew_ms=5_000)
    assert (
        _reason(seal(key, DOMAIN, b"", now_ms=NOW - 60_001), EnvelopeVerifier(DOMAIN, window))
        == Reject.EXPIRED
    )
    assert (
        _reason(seal(key, DOMAIN, b"", now_ms=NOW + 5_001), EnvelopeVerifier(DOMAIN, window))
        == Reject.FROM_THE_FUTURE
    )
    EnvelopeVerifier(DOMAIN, window).verify(seal(key, DOMAIN, b"", now_ms=NOW - 60_000), now_ms=NOW)
    EnvelopeVerifier(DOMAIN, window).verify(seal(key, DOMAIN, b"", now_ms=NOW + 5_000), now_ms=NOW)


def test_signature_is_plain_eip191_over_the_signing_digest() -> None:
    """Ordinary Ethereum tooling can check an envelope given its signing digest."""
    key = WalletKey.generate()
    envelope = seal(key, DOMAIN, b"payload", now_ms=NOW)
    recovered = Account.recover_message(
        encode_defunct(primitive=envelope.signing_digest()), signature=envelope.signature
    )
    assert recovered == str(key.address)


def test_bad_nonce_and_domain_labels() -> None:
    key = WalletKey.generate()
    with pytest.raises(LocalProtocolError):
        seal(key, DOMAIN, b"", now_ms=NOW, nonce=b"short")
    for kind, run in (("", "r"), ("Heartbeat", "r"), ("k", "r/x"), ("k", "x" * 65)):
        with pytest.raises(LocalProtocolError):
            Domain(kind, run)
    envelope = seal(key, DOMAIN, b"", now_ms=NOW)
    short_nonce = Envelope(envelope.domain, b"", key.address, NOW, b"\0" * 4, envelope.signature)
    with pytest.raises(RemoteProtocolError):
        check_signature(short_nonce)
    with pytest.raises(LocalProtocolError):
        encode(short_nonce)
    assert Domain.parse(str(DOMAIN)) == DOMAIN
    with pytest.raises(RemoteProtocolError):
        Domain.parse("prime-node/1/UPPER/run")


def test_envelope_round_trips_through_the_codec_at_its_size_limit() -> None:
    from protocol.envelope import MAX_PAYLOAD_BYTES

    key = WalletKey.generate()
    envelope = seal(key, DOMAIN, b"\xab" * MAX_PAYLOAD_BYTES, now_ms=NOW)
    assert decode(encode(envelope), Envelope) == envelope
    with pytest.raises(LocalProtocolError):
        seal(key, DOMAIN, b"\0" * (MAX_PAYLOAD_BYTES + 1), now_ms=NOW)


class ReplayCacheMachine(RuleBasedStateMachine):
    """Model: with a tiny capacity and a moving clock, no accepted (signer, nonce) is ever accepted twice,
    memory never exceeds the capacity, and a fresh envelope newer than the floor is always accepted."""

    @initialize(capacity=st.integers(1, 4))
    def setup(self, capacity: int) -> None:
        self.keys = [WalletKey((i + 1).to_bytes(32, "big")) for i in range(2)]
        self.window = FreshnessWindow(max_age_ms=1_000, max_skew_ms=100)
        self.verifier = EnvelopeVerifier(DOMAIN, self.window, ReplayCache(capacity))
        self.now = NOW
        self.accepted: list[Envelope] = []
        self.counter = 0

    @rule(advance=st.integers(0, 400))
    def tick(self, advance: int) -> None:
        self.now += advance

    @rule(signer=st.integers(0, 1), age=st.integers(0, 1_100))
    def send_fresh(self, signer: int, age: int) -> None:
        self.counter += 1
        nonce = self.counter.to_bytes(NONCE_SIZE, "big")
        envelope = seal(self.keys[signer], DOMAIN, b"", now_ms=self.now - age, nonce=nonce)
        try:
            self.verifier.verify(envelope, now_ms=self.now)
        except ProtocolError as exc:
            assert exc.reason in (Reject.EXPIRED, Reject.BEHIND_REPLAY_WINDOW)
            if exc.reason == Reject.BEHIND_REPLAY_WINDOW:
                assert envelope.timestamp_ms <= self.verifier.replay_cache.floor_ms
            return
        self.accepted.append(envelope)

    @precondition(lambda self: bool(self.accepted))
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        envelope = data.draw(st.sampled_from(self.accepted))
        with pytest.raises(RemoteProtocolError):
            self.verifier.verify(envelope, now_ms=self.now)

    @invariant()
    def memory_is_bounded(self) -> None:
        assert len(self.verifier.replay_cache) <= self.verifier.replay_cache.capacity


TestReplayCache = ReplayCacheMachine.TestCase
TestReplayCache.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
