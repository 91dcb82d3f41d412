"""The rollout batch wire format: round trips, invariants and hostile frames."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crypto.keys import Address
from protocol.codec import decode, encode
from protocol.errors import InvariantError, RemoteProtocolError
from protocol.rollouts import (
    MAX_BATCH_BYTES,
    RolloutBatch,
    RolloutSample,
    pack_logprobs,
    pack_tokens,
    proof_size,
)

tokens = st.lists(st.integers(0, 150_000), min_size=1, max_size=70)


def _sample(task_id: int, prompt: list[int], completion: list[int], with_proof: bool) -> RolloutSample:
    return RolloutSample(
        task_id=task_id,
        seed=task_id * 7,
        prompt=pack_tokens(prompt),
        completion=pack_tokens(completion),
        logprobs=pack_logprobs([-0.25 * (i % 5) for i in range(len(completion))]),
        finished=True,
        proof=b"\x07" * proof_size(len(completion)) if with_proof else b"",
    )


@given(tokens, tokens, st.integers(1, 4), st.booleans())
def test_batches_round_trip(
    prompt: list[int], completion: list[int], group_size: int, with_proof: bool
) -> None:
    samples = tuple(_sample(g, prompt, completion, with_proof) for g in range(2) for _ in range(group_size))
    batch = RolloutBatch(1, "demo", Address(b"\x02" * 20), 3, 1, 0.7, group_size, samples)
    again = decode(encode(batch), RolloutBatch)
    assert again == batch
    assert list(again.samples[0].completion_tokens()) == completion
    assert list(again.samples[0].prompt_tokens()) == prompt
    assert again.groups == 2 and again.group(1)[0].task_id == 1


def test_proof_size_is_258_bytes_per_started_chunk_of_32() -> None:
    assert [proof_size(n) for n in (1, 32, 33, 64, 65)] == [258, 258, 516, 516, 774]


@pytest.mark.parametrize(
    "change",
    [
        {"completion": b"\x01\x00\x00"},
        {"logprobs": pack_logprobs([-0.1])},
        {"logprobs": pack_logprobs([0.5, -0.1])},
        {"logprobs": pack_logprobs([math.nan, -0.1])},
        {"proof": b"\x00" * 10},
        {"prompt": b""},
        {"completion": pack_tokens([1 << 31, 2])},
    ],
)
def test_sample_invariants(change: dict[str, bytes]) -> None:
    good = _sample(1, [1, 2], [3, 4], False)
    with pytest.raises(InvariantError):
        dataclasses.replace(good, **change)


def test_batch_invariants_and_hostile_frames() -> None:
    a, b = _sample(1, [1], [2], False), _sample(2, [1], [2], False)
    worker = Address(b"\x03" * 20)
    with pytest.raises(InvariantError, match="task id"):
        RolloutBatch(1, "demo", worker, 0, 0, 1.0, 2, (a, b))
    with pytest.raises(InvariantError, match="groups"):
        RolloutBatch(1, "demo", worker, 0, 0, 1.0, 2, (a,))
    with pytest.raises(InvariantError):
        RolloutBatch(1, "demo", worker, 0, 0, -1.0, 1, (a,))
    frame = encode(RolloutBatch(1, "demo", worker, 0, 0, 1.0, 1, (a, b)))
    for bad in (
        frame[:-1],
        frame + b"\x00",
        frame.replace(b"demo", b"dem\xff"),
        b"\x00" * (MAX_BATCH_BYTES + 1),
    ):
        with pytest.raises(RemoteProtocolError):
            decode(bad, RolloutBatch)


def test_a_realistic_batch_fits_the_envelope_cap() -> None:
    completion = list(range(1000, 3000))  # 2000 tokens with a full proof
    samples = tuple(_sample(g, list(range(500)), completion, True) for g in range(16) for _ in range(8))
    frame = encode(RolloutBatch(1, "demo", Address(b"\x04" * 20), 0, 0, 1.0, 8, samples))
    assert len(frame) <= MAX_BATCH_BYTES
