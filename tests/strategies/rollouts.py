"""Hypothesis strategies for the rollout wire types, whose invariants random bytes rarely meet."""

from __future__ import annotations

from hypothesis import strategies as st

from crypto.keys import Address
from protocol.rollouts import RolloutBatch, RolloutSample, pack_logprobs, pack_tokens, proof_size
from tests.strategies.messages import register_strategy

_tokens = st.lists(st.integers(0, (1 << 31) - 1), min_size=1, max_size=40)


@st.composite
def rollout_samples(draw: st.DrawFn, task_id: int | None = None) -> RolloutSample:
    completion = draw(_tokens)
    logprobs = draw(
        st.lists(st.floats(-50.0, 0.0, width=32), min_size=len(completion), max_size=len(completion))
    )
    proof = draw(st.sampled_from([b"", b"\x01" * proof_size(len(completion))]))
    return RolloutSample(
        task_id=draw(st.integers(0, (1 << 63) - 1)) if task_id is None else task_id,
        seed=draw(st.integers(0, (1 << 63) - 1)),
        prompt=pack_tokens(draw(_tokens)),
        completion=pack_tokens(completion),
        logprobs=pack_logprobs(logprobs),
        finished=draw(st.booleans()),
        proof=proof,
    )


@st.composite
def rollout_batches(draw: st.DrawFn) -> RolloutBatch:
    group_size = draw(st.integers(1, 4))
    groups = draw(st.integers(1, 3))
    samples = []
    for _ in range(groups):
        task_id = draw(st.integers(0, 1 << 40))
        samples += [draw(rollout_samples(task_id)) for _ in range(group_size)]
    return RolloutBatch(
        format_version=1,
        run_id=draw(st.text(max_size=20)),
        worker=Address(draw(st.binary(min_size=20, max_size=20))),
        policy_step=draw(st.integers(0, (1 << 63) - 1)),
        batch_counter=draw(st.integers(0, (1 << 63) - 1)),
        temperature=draw(st.floats(0.0, 100.0)),
        group_size=group_size,
        samples=tuple(samples),
    )


register_strategy(RolloutSample, rollout_samples())
register_strategy(RolloutBatch, rollout_batches())
