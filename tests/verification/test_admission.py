"""Verdicts decide what the trainer admits and lower rejected workers' peer scores (pure, no torch)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crypto.keys import Address, WalletKey
from prime_node.verification.admission import VerdictBook, apply_verdict
from protocol.codec import decode, encode
from protocol.envelope import EnvelopeVerifier
from protocol.errors import InvariantError, RemoteProtocolError
from protocol.scoring import PeerScores
from protocol.verdict import Verdict, open_verdict, seal_verdict, verdict_domain

WORKER = Address(b"\x11" * 20)
V1, V2 = Address(b"\x01" * 20), Address(b"\x02" * 20)


def verdict(batch: int, accepted: bool) -> Verdict:
    return Verdict(
        run_id="demo",
        batch_id=batch.to_bytes(32, "big"),
        worker=WORKER,
        policy_step=3,
        batch_counter=batch,
        accepted=accepted,
        reasons=() if accepted else ("sampling_mismatch",),
        rejected_samples=() if accepted else (0,),
        rewards=(1.0, 0.0) if accepted else (),
    )


def test_admission_needs_a_quorum_and_no_rejection() -> None:
    book = VerdictBook(quorum=2)
    book.record(verdict(1, True), V1)
    assert not book.admitted(verdict(1, True).batch_id)
    book.record(verdict(1, True), V2)
    assert book.admitted(verdict(1, True).batch_id)
    book.record(verdict(1, False), V2)  # V2 changes its mind
    assert not book.admitted(verdict(1, True).batch_id) and book.rejected(verdict(1, True).batch_id)
    assert not book.admitted(b"\x00" * 32)


def test_the_book_forgets_oldest_batches_first() -> None:
    book = VerdictBook(capacity=3)
    for batch in range(5):
        book.record(verdict(batch, True), V1)
    assert [book.admitted(verdict(b, True).batch_id) for b in range(5)] == [False, False, True, True, True]


def test_rejected_work_gets_a_worker_banned() -> None:
    scores = PeerScores()
    assert apply_verdict(scores, verdict(1, True), "worker-peer", now=0.0) == []
    assert apply_verdict(scores, verdict(2, False), "worker-peer", now=1.0) == []
    assert scores.score("worker-peer", 1.0) == -50.0  # protocol.scoring's BAD_DATA penalty
    assert apply_verdict(scores, verdict(3, False), "worker-peer", now=2.0) == []  # -99: recovered 1 point
    [disconnect] = apply_verdict(scores, verdict(4, False), "worker-peer", now=3.0)
    assert disconnect.peer_id == "worker-peer" and scores.is_banned("worker-peer", 4.0)


def test_verdict_envelopes_round_trip_and_refuse_untrusted_or_replayed() -> None:
    key = WalletKey.generate()
    envelope = seal_verdict(key, verdict(7, False), now_ms=1_000_000)
    verifier = EnvelopeVerifier(verdict_domain("demo"))
    trusted = frozenset({key.address})
    assert open_verdict(envelope, verifier, trusted=trusted, now_ms=1_000_000) == verdict(7, False)
    with pytest.raises(RemoteProtocolError) as caught:
        open_verdict(envelope, verifier, trusted=trusted, now_ms=1_000_000)
    assert caught.value.reason == "replay"


@given(st.binary(max_size=400))
def test_random_bytes_never_decode_into_anything_but_a_valid_verdict(data: bytes) -> None:
    try:
        decoded = decode(data, Verdict)
    except RemoteProtocolError:
        return
    assert decoded.accepted == (decoded.reasons == ())
    assert decode(encode(decoded), Verdict) == decoded


def test_inconsistent_verdicts_cannot_be_built() -> None:
    with pytest.raises(InvariantError):
        Verdict("demo", b"\x00" * 32, WORKER, 0, 0, True, ("replay",), (), ())
    with pytest.raises(InvariantError):
        Verdict("demo", b"\x00" * 32, WORKER, 0, 0, False, ("replay", "replay"), (), ())
