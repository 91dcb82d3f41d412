"""The sans-IO side of rollout batches over the data plane: announcements, the byte check, the holders."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto.digests import blake3
from crypto.keys import WalletKey
from protocol.codec import decode, encode
from protocol.errors import RemoteProtocolError
from protocol.rollout_transfer import (
    BAD_BYTES,
    BUSY,
    MISSING,
    SENDING,
    BatchDownload,
    BatchReply,
    Holder,
    HolderBook,
    RolloutAnnouncement,
    announcement_for,
    chunks,
    read_announcement,
    screen_announcement,
)

WORKER = WalletKey(b"\x01" * 32).address
OTHER = WalletKey(b"\x02" * 32).address
THIRD = WalletKey(b"\x03" * 32).address


def _announce(frame: bytes = b"frame", **changes: object) -> RolloutAnnouncement:
    fields = {"run_id": "run", "worker": WORKER, "policy_step": 3, "batch_counter": 9, "port": 4000}
    fields.update(changes)
    return announcement_for(frame, **fields)  # type: ignore[arg-type]


@given(
    frame=st.binary(min_size=1, max_size=64),
    step=st.integers(0, (1 << 63) - 1),
    counter=st.integers(0, (1 << 63) - 1),
    port=st.integers(1, 65535),
    run=st.text(max_size=64),
)
def test_announcement_round_trips_canonically(
    frame: bytes, step: int, counter: int, port: int, run: str
) -> None:
    announcement = _announce(frame, policy_step=step, batch_counter=counter, port=port, run_id=run)
    data = encode(announcement)
    assert len(data) <= RolloutAnnouncement.MAX_BYTES
    assert decode(data, RolloutAnnouncement) == announcement
    assert read_announcement(data) == announcement
    assert (announcement.batch_id, announcement.size) == (blake3(frame), len(frame))


@given(st.binary(max_size=1024))
def test_any_payload_is_an_announcement_or_none(payload: bytes) -> None:
    result = read_announcement(payload)
    assert result is None or encode(result) == payload


def test_a_batch_frame_is_not_an_announcement() -> None:
    assert read_announcement(b"\x93\x01\xa8envelope\x90" + b"\x00" * 600) is None


def test_screening_refuses_before_any_byte_moves() -> None:
    good = _announce(b"x" * 100)
    screen_announcement(good, origin=WORKER, run_id="run", max_size=100, newest_step=2, future_steps=1)
    cases = [
        (dict(origin=OTHER, run_id="run", max_size=100), "signer_not_worker"),
        (dict(origin=WORKER, run_id="other", max_size=100), "wrong_run"),
        (dict(origin=WORKER, run_id="run", max_size=99), "batch_too_large"),
        (dict(origin=WORKER, run_id="run", max_size=100, newest_step=1, future_steps=1), "future_policy"),
    ]
    for kwargs, reason in cases:
        with pytest.raises(RemoteProtocolError) as caught:
            screen_announcement(good, **kwargs)  # type: ignore[arg-type]
        assert caught.value.reason == reason


def _reply(batch_id: bytes, status: str, size: int) -> bytes:
    return encode(BatchReply(batch_id, status, size))


@settings(max_examples=200)
@given(frame=st.binary(min_size=1, max_size=4000), chunk=st.integers(1, 700))
def test_download_accepts_exactly_the_announced_bytes(frame: bytes, chunk: int) -> None:
    batch_id = blake3(frame)
    download = BatchDownload(batch_id, len(frame), chunk_bytes=chunk)
    assert download.reply(_reply(batch_id, SENDING, len(frame))) == SENDING
    pieces = chunks(frame, chunk)
    results = [download.chunk(bytes(p)) for p in pieces]
    assert results[:-1] == [None] * (len(pieces) - 1)
    assert results[-1] == frame


@settings(max_examples=200)
@given(
    frame=st.binary(min_size=2, max_size=2000),
    position=st.integers(0, 1999),
    flip=st.integers(1, 255),
    chunk=st.integers(1, 500),
)
def test_any_altered_byte_is_caught(frame: bytes, position: int, flip: int, chunk: int) -> None:
    position %= len(frame)
    altered = bytearray(frame)
    altered[position] ^= flip
    download = BatchDownload(blake3(frame), len(frame), chunk_bytes=chunk)
    download.reply(_reply(blake3(frame), SENDING, len(frame)))
    with pytest.raises(RemoteProtocolError) as caught:
        for piece in chunks(bytes(altered), chunk):
            download.chunk(bytes(piece))
    assert caught.value.reason == "wrong_bytes" and caught.value.reason in BAD_BYTES


@given(frame=st.binary(min_size=1, max_size=300), extra=st.binary(min_size=1, max_size=50))
def test_more_bytes_than_announced_are_refused(frame: bytes, extra: bytes) -> None:
    download = BatchDownload(blake3(frame), len(frame), chunk_bytes=1024)
    download.reply(_reply(blake3(frame), SENDING, len(frame)))
    with pytest.raises(RemoteProtocolError) as caught:
        download.chunk(frame + extra)
    assert caught.value.reason == "too_long"


def test_replies_about_other_bytes_are_bad_and_missing_or_busy_are_not() -> None:
    frame = b"abc" * 10
    batch_id = blake3(frame)
    for status in (MISSING, BUSY):
        assert BatchDownload(batch_id, len(frame)).reply(_reply(batch_id, status, 0)) == status
    for data in (
        _reply(blake3(b"other"), SENDING, len(frame)),
        _reply(batch_id, SENDING, len(frame) + 1),
        _reply(batch_id, "whatever", 0),
        b"\x00garbage",
    ):
        with pytest.raises(RemoteProtocolError) as caught:
            BatchDownload(batch_id, len(frame)).reply(data)
        assert caught.value.reason == "wrong_reply"
    download = BatchDownload(batch_id, len(frame), chunk_bytes=4)
    download.reply(_reply(batch_id, SENDING, len(frame)))
    with pytest.raises(RemoteProtocolError) as caught:
        download.chunk(frame[:5])
    assert caught.value.reason == "chunk_too_large"


def test_holder_book_offers_only_from_the_worker_and_routes_around_cheats() -> None:
    book = HolderBook(capacity=2)
    announcement = _announce(b"batch")
    batch_id = announcement.batch_id
    assert not book.heard(announcement, Holder(OTHER, "p-other", 5000))  # a re-server first: no offer
    assert book.heard(announcement, Holder(WORKER, "p-worker", 4000))
    assert not book.heard(announcement, Holder(WORKER, "p-worker", 4000))  # heard again: not new
    assert not book.heard(announcement, Holder(THIRD, "p-third", 6000))
    rng = random.Random(0)
    order = [h.address for h in book.candidates(batch_id, tried=set(), rng=rng)]
    assert order[-1] == WORKER and set(order) == {WORKER, OTHER, THIRD}
    book.caught(batch_id, OTHER)
    assert not book.heard(announcement, Holder(OTHER, "p-other", 5000))
    assert [h.address for h in book.candidates(batch_id, tried={THIRD}, rng=rng)] == [WORKER]
    assert book.offer(batch_id) == announcement
    for i in range(3):  # capacity 2: the oldest is forgotten
        book.heard(_announce(bytes([i]) * 4), Holder(WORKER, "p-worker", 4000))
    assert len(book) == 2 and book.offer(batch_id) is None


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 40)), max_size=200))
def test_holder_book_stays_bounded(events: list[tuple[int, int]]) -> None:
    book = HolderBook(capacity=8, max_holders=4)
    keys = [WalletKey(bytes([i + 1]) * 32).address for i in range(41)]
    for batch, holder in events:
        book.heard(_announce(bytes([batch])), Holder(keys[holder], f"p{holder}", 1))
    assert len(book) <= 8
    for batch, _ in events:
        assert len(book.holders(blake3(bytes([batch])))) <= 4


def test_claims_for_ids_nobody_offered_never_push_out_a_real_offer() -> None:
    book = HolderBook(capacity=4)
    offered = _announce(b"real batch")
    assert book.heard(offered, Holder(WORKER, "p-worker", 4000))
    for i in range(100):  # a peer gossips "I hold it" for made-up ids
        book.heard(_announce(i.to_bytes(4, "big")), Holder(OTHER, "p-other", 5000))
    assert len(book) == 4 and book.offer(offered.batch_id) == offered
