"""A download's first bytes checked against the offer (issue 35 item 2): bytes that cannot begin the announced
frame are refused at the first chunk, not after the announced size."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto.keys import WalletKey
from protocol.codec import encode
from protocol.envelope import Domain, seal
from protocol.errors import RemoteProtocolError
from protocol.rollout_transfer import (
    BAD_BYTES,
    CHUNK_BYTES,
    FRAME_START_BYTES,
    SENDING,
    WRONG_START,
    BatchDownload,
    BatchReply,
    announcement_for,
    check_frame_start,
    chunks,
)
from protocol.rollouts import RolloutBatch, RolloutSample, pack_logprobs, pack_tokens

KEY = WalletKey(b"\x05" * 32)
KIND = "rollouts"


def _frame(*, counter: int = 9, samples: int = 4, tokens: int = 8, run: str = "run") -> bytes:
    sample = RolloutSample(
        task_id=1,
        seed=2,
        prompt=pack_tokens([1, 2, 3]),
        completion=pack_tokens(list(range(tokens))),
        logprobs=pack_logprobs([-0.5] * tokens),
        finished=True,
        proof=b"",
    )
    batch = RolloutBatch(1, run, KEY.address, 3, counter, 0.7, 1, (sample,) * samples)
    return encode(seal(KEY, Domain(KIND, run), encode(batch), now_ms=1_700_000_000_000))


def _offer(frame: bytes, **changes: object) -> object:
    offer = announcement_for(frame, run_id="run", worker=KEY.address, policy_step=3, batch_counter=9, port=9)
    return dataclasses.replace(offer, **changes)


@pytest.mark.parametrize("samples", [1, 40, 4000])
def test_the_start_of_the_announced_frame_passes(samples: int) -> None:
    frame = _frame(samples=samples)
    check_frame_start(_offer(frame), frame[:FRAME_START_BYTES], kind=KIND)  # type: ignore[arg-type]


def test_bytes_that_cannot_begin_the_announced_frame_are_refused() -> None:
    frame = _frame(samples=400)
    offer = _offer(frame)
    wrong = {
        "zeros": bytes(len(frame)),
        "another batch": _frame(counter=10, samples=400),
        "another run": _frame(samples=400, run="other"),
        "padded": frame[:-1],  # the right start, but the envelope cannot be the announced size
    }
    for label, data in wrong.items():
        sized = dataclasses.replace(offer, size=len(frame) + 1) if label == "padded" else offer
        with pytest.raises(RemoteProtocolError) as caught:
            check_frame_start(sized, data[:FRAME_START_BYTES], kind=KIND)
        assert caught.value.reason == WRONG_START, label
    with pytest.raises(RemoteProtocolError, match="domain"):
        check_frame_start(offer, frame[:FRAME_START_BYTES], kind="verdicts")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=FRAME_START_BYTES))
def test_random_bytes_are_refused_with_wrong_start_and_nothing_else(data: bytes) -> None:
    frame = _frame()
    try:
        check_frame_start(_offer(frame), data, kind=KIND)  # type: ignore[arg-type]
    except RemoteProtocolError as exc:
        assert exc.reason == WRONG_START


def test_a_download_refuses_wrong_bytes_at_the_first_chunk_not_after_the_announced_size() -> None:
    frame = _frame(samples=4000, tokens=400)  # ~13 MiB: four chunks
    assert len(frame) > 3 * CHUNK_BYTES
    offer = _offer(frame)
    download = BatchDownload(
        offer.batch_id,  # type: ignore[attr-defined]
        len(frame),
        check_start=functools.partial(check_frame_start, offer, kind=KIND),
    )
    assert download.reply(encode(BatchReply(offer.batch_id, SENDING, len(frame)))) == SENDING  # type: ignore[attr-defined]
    with pytest.raises(RemoteProtocolError) as caught:
        download.chunk(bytes(CHUNK_BYTES))
    assert caught.value.reason == WRONG_START and caught.value.reason in BAD_BYTES
    assert download.received == CHUNK_BYTES  # one chunk taken, three never asked for


def test_the_start_is_checked_however_small_the_chunks_and_the_right_frame_still_arrives() -> None:
    frame = _frame(samples=40)
    offer = _offer(frame)
    seen: list[bytes] = []

    def check(start: bytes) -> None:
        seen.append(start)
        check_frame_start(offer, start, kind=KIND)  # type: ignore[arg-type]

    download = BatchDownload(offer.batch_id, len(frame), chunk_bytes=100, check_start=check)  # type: ignore[attr-defined]
    download.reply(encode(BatchReply(offer.batch_id, SENDING, len(frame))))  # type: ignore[attr-defined]
    got = None
    for piece in chunks(frame, 100):
        got = download.chunk(bytes(piece))
    assert got == frame and seen == [frame[:FRAME_START_BYTES]]
    liar = BatchDownload(offer.batch_id, len(frame), chunk_bytes=100, check_start=check)  # type: ignore[attr-defined]
    liar.reply(encode(BatchReply(offer.batch_id, SENDING, len(frame))))  # type: ignore[attr-defined]
    with pytest.raises(RemoteProtocolError, match="envelope"):
        for _ in range(FRAME_START_BYTES // 100 + 1):
            liar.chunk(b"\x00" * 100)
    assert liar.received == (FRAME_START_BYTES // 100 + 1) * 100  # refused once the start was in
