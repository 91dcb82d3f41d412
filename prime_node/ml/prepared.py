"""Prepared batches: a rollout batch admitted for the loss, and its exact encoding for the other ranks.

Admission (``prepare``) trusts nothing in a batch but its tokens: the policy step must be within
``async_level`` of the trainer's, every task id must exist, every prompt must be exactly the task's
prompt, and the reward of every completion is recomputed with the task's checker. Groups whose rewards
are all equal carry no advantage and are dropped before any forward pass. Scoring may execute a
completion (code tasks), so a networked trainer hands ``prepare`` only the groups its validators
replayed (``AcceptedBatch.batch``, prime_node/verification/admission_service.py).

Rank 0 admits each batch and broadcasts the ``Prepared`` result (``encode_prepared``/``decode_prepared``:
pickle-free, bit-exact), so every rank trains on the same numbers; the step itself is
``trainer.GRPOTrainer``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from prime_node.config import RunConfig
from prime_node.errors import NodeError
from prime_node.ml.evaluation import completion_text, encode_prompt
from prime_node.ml.grpo import group_advantages
from prime_node.tasks.base import TaskSource, length_bonus
from protocol.rollouts import RolloutBatch


class RejectedBatchError(NodeError):
    """A rollout batch the trainer refuses (``reason`` says why)."""


@dataclass
class Prepared:
    """An admitted batch: the samples of its informative groups, ready for the loss."""

    policy_step: int
    sequences: list[list[int]]
    prompt_lengths: list[int]
    advantages: list[float]
    reward_mean: float
    groups_kept: int
    groups_dropped: int
    behaviour_logprobs: list[list[float]] = field(default_factory=list)
    """Per sample, the sampler's log-prob of each completion token (log_softmax(logits / T)), as in the
    rollout; the off-policy objectives weigh tokens with them. Merged batches must carry them along."""

    @property
    def completion_tokens(self) -> int:
        return sum(len(s) - p for s, p in zip(self.sequences, self.prompt_lengths, strict=True))


_PREPARED_MAGIC = 0x50524550_00000001  # "PREP", version 1


def encode_prepared(prepared: Prepared) -> bytes:
    """A compact, pickle-free encoding of ``prepared`` for rank 0 to broadcast to the other ranks:
    int64 header and lengths, int64 tokens, float64 advantages and log-probs (Python floats survive
    exactly, so every rank trains on the same numbers)."""
    import numpy as np

    n = len(prepared.sequences)
    behaviour = prepared.behaviour_logprobs
    header = [
        _PREPARED_MAGIC,
        prepared.policy_step,
        n,
        len(behaviour),
        prepared.groups_kept,
        prepared.groups_dropped,
    ]
    parts = [
        np.asarray(header, dtype="<i8"),
        np.asarray([prepared.reward_mean], dtype="<f8"),
        np.asarray([len(s) for s in prepared.sequences], dtype="<i8"),
        np.asarray(prepared.prompt_lengths, dtype="<i8"),
        np.asarray([len(b) for b in behaviour], dtype="<i8"),
        np.asarray([t for s in prepared.sequences for t in s], dtype="<i8"),
        np.asarray(prepared.advantages, dtype="<f8"),
        np.asarray([v for b in behaviour for v in b], dtype="<f8"),
    ]
    return b"".join(part.tobytes() for part in parts)


def decode_prepared(data: bytes) -> Prepared:
    """``encode_prepared``'s inverse; NodeError ``bad_step_message`` for anything malformed."""
    import numpy as np

    def bad(why: str) -> NodeError:
        return NodeError(f"malformed step message from rank 0: {why}", reason="bad_step_message")

    offset = 0

    def take(count: int, dtype: str) -> Any:
        nonlocal offset
        end = offset + 8 * count
        if count < 0 or end > len(data):
            raise bad("truncated")
        array = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
        offset = end
        return array

    magic, policy_step, n, n_behaviour, kept, dropped = (int(v) for v in take(6, "<i8"))
    if magic != _PREPARED_MAGIC or n_behaviour not in (0, n):
        raise bad("wrong header")
    reward_mean = float(take(1, "<f8")[0])
    seq_lengths, prompt_lengths, lp_lengths = take(n, "<i8"), take(n, "<i8"), take(n_behaviour, "<i8")
    if (seq_lengths < 0).any() or (lp_lengths < 0).any():
        raise bad("negative length")
    tokens = take(int(seq_lengths.sum()), "<i8").tolist()
    advantages = take(n, "<f8").tolist()
    logprobs = take(int(lp_lengths.sum()), "<f8").tolist()
    if offset != len(data):
        raise bad("trailing bytes")
    sequences, behaviour, at, lp_at = [], [], 0, 0
    for length in seq_lengths.tolist():
        sequences.append(tokens[at : at + length])
        at += length
    for length in lp_lengths.tolist():
        behaviour.append(logprobs[lp_at : lp_at + length])
        lp_at += length
    return Prepared(
        policy_step, sequences, prompt_lengths.tolist(), advantages, reward_mean, kept, dropped, behaviour
    )


def batch_rewards(
    batch: RolloutBatch,
    task: TaskSource,
    tokenizer: Any,
    config: RunConfig,
    *,
    groups: Sequence[int] | None = None,
) -> list[float]:
    """Rewards recomputed from the completions alone (the checker plus the optional length bonus), for
    the samples of ``groups`` in order (default: every group). Scoring may execute a completion (a code
    task runs it): callers pass only groups whose tokens were verified against the model."""
    eos = tokenizer.eos_token_id
    chosen = range(batch.groups) if groups is None else groups
    rewards = []
    for sample in (s for g in chosen for s in batch.group(g)):
        tokens = sample.completion_tokens()
        text = completion_text(tokenizer, tokens, eos)
        score = task.score(sample.task_id, text)
        rewards.append(
            score
            + length_bonus(
                len(tokens), target=config.length_reward.target_tokens, coef=config.length_reward.coef
            )
        )
    return rewards


def prepare(
    batch: RolloutBatch, *, current_step: int, task: TaskSource, tokenizer: Any, config: RunConfig
) -> Prepared:
    """Admit ``batch`` for the trainer at ``current_step`` or raise RejectedBatchError."""
    if batch.run_id != config.run_id:
        raise RejectedBatchError(
            f"batch is for run {batch.run_id!r}, not {config.run_id!r}", reason="wrong_run"
        )
    if batch.policy_step > current_step:
        raise RejectedBatchError(
            f"policy step {batch.policy_step} is ahead of the trainer ({current_step})", reason="future_step"
        )
    if batch.policy_step < current_step - config.async_level:
        raise RejectedBatchError(
            f"policy step {batch.policy_step} is older than step {current_step} minus async_level",
            reason="stale",
        )
    if batch.group_size != config.group_size:
        raise RejectedBatchError(
            f"group size {batch.group_size}, run uses {config.group_size}", reason="wrong_group_size"
        )
    if batch.temperature != config.temperature:
        raise RejectedBatchError(
            f"temperature {batch.temperature}, run uses {config.temperature}", reason="wrong_temperature"
        )
    vocab = len(tokenizer)
    prompts: dict[int, list[int]] = {}  # one encoding per task, not per sample
    for sample in batch.samples:
        if sample.task_id not in prompts:
            try:
                prompts[sample.task_id] = encode_prompt(tokenizer, task.prompt(sample.task_id))
            except NodeError as exc:
                raise RejectedBatchError(str(exc), reason="unknown_task") from exc
        expected = prompts[sample.task_id]
        if list(sample.prompt_tokens()) != expected:
            raise RejectedBatchError(
                f"sample of task {sample.task_id} does not carry the task's prompt", reason="wrong_prompt"
            )
        completion = sample.completion_tokens()
        if len(completion) > config.max_new_tokens or max(completion) >= vocab:
            raise RejectedBatchError(
                "completion too long or with a token outside the vocabulary", reason="bad_completion"
            )
    rewards = torch.tensor(batch_rewards(batch, task, tokenizer, config), dtype=torch.float64)
    advantages = group_advantages(rewards.view(batch.groups, batch.group_size))
    prepared = Prepared(batch.policy_step, [], [], [], float(rewards.mean()), 0, 0)
    for g in range(batch.groups):
        if bool((advantages[g] == 0).all()):
            prepared.groups_dropped += 1
            continue
        prepared.groups_kept += 1
        for sample, advantage in zip(batch.group(g), advantages[g].tolist(), strict=True):
            prompt = list(sample.prompt_tokens())
            prepared.sequences.append(prompt + list(sample.completion_tokens()))
            prepared.prompt_lengths.append(len(prompt))
            prepared.advantages.append(advantage)
            prepared.behaviour_logprobs.append(list(sample.completion_logprobs()))
    return prepared
