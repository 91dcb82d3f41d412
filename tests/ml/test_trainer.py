"""Admission of rollout batches (nothing trusted but tokens) and single GRPO steps."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from prime_node.config import RunConfig
from prime_node.ml.distributed import DistInfo
from prime_node.ml.engine import TorchEngine
from prime_node.ml.model import load_model
from prime_node.ml.prepared import RejectedBatchError, prepare
from prime_node.ml.rollout_batch import LOCAL_WORKER, make_batch
from prime_node.ml.tokenizer import load_tokenizer
from prime_node.ml.trainer import GRPOTrainer
from prime_node.tasks.arithmetic import ArithmeticTask
from protocol import schedule
from protocol.rollouts import RolloutBatch, pack_tokens

CONFIG = RunConfig(group_size=4, prompts_per_step=3, max_new_tokens=5, temperature=1.0, async_level=2)
TASK = ArithmeticTask()


@pytest.fixture(scope="module")
def parts(tiny_model_dir: Path) -> tuple[Any, TorchEngine]:
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = TorchEngine(
        load_model(tiny_model_dir), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return tokenizer, engine


def _batch(parts: tuple[Any, TorchEngine], policy_step: int = 0, counter: int = 0) -> RolloutBatch:
    tokenizer, engine = parts
    return make_batch(
        engine, TASK, tokenizer, CONFIG, worker=LOCAL_WORKER, policy_step=policy_step, batch_counter=counter
    )


def _with_answer(batch: RolloutBatch, tokenizer: Any, sample_index: int) -> RolloutBatch:
    """The batch with one completion replaced by the right answer (a real model would have to find it)."""
    sample = batch.samples[sample_index]
    answer = [
        *tokenizer.encode(TASK.answer(sample.task_id), add_special_tokens=False),
        tokenizer.eos_token_id,
    ]
    right = dataclasses.replace(
        sample, completion=pack_tokens(answer), logprobs=b"\x00\x00\x80\xbf" * len(answer)
    )
    samples = list(batch.samples)
    samples[sample_index] = right
    return dataclasses.replace(batch, samples=tuple(samples))


def test_batch_follows_the_schedule(parts: tuple[Any, TorchEngine]) -> None:
    batch = _batch(parts, policy_step=0, counter=5)
    pool = TASK.train_ids()
    drawn = schedule.draw(LOCAL_WORKER, 0, 5, CONFIG.seed, pool_size=len(pool), groups=3, group_size=4)
    assert [batch.group(g)[0].task_id for g in range(3)] == [pool[i] for i in drawn.task_indices]
    assert tuple(tuple(s.seed for s in batch.group(g)) for g in range(3)) == drawn.seeds


def test_rewards_are_recomputed_and_flat_groups_dropped(parts: tuple[Any, TorchEngine]) -> None:
    tokenizer, _ = parts
    batch = _with_answer(_batch(parts), tokenizer, sample_index=5)  # group 1 gets one right answer
    prepared = prepare(batch, current_step=0, task=TASK, tokenizer=tokenizer, config=CONFIG)
    assert prepared.groups_kept == 1 and prepared.groups_dropped == 2  # a random model solves nothing else
    assert len(prepared.sequences) == 4
    assert prepared.advantages[1] > 0 and all(a < 0 for i, a in enumerate(prepared.advantages) if i != 1)
    assert prepared.reward_mean == pytest.approx(1 / 12)


@pytest.mark.parametrize(("policy_step", "current", "reason"), [(0, 3, "stale"), (2, 1, "future_step")])
def test_policy_step_outside_the_window_is_refused(
    parts: tuple[Any, TorchEngine], policy_step: int, current: int, reason: str
) -> None:
    batch = dataclasses.replace(_batch(parts), policy_step=policy_step)
    with pytest.raises(RejectedBatchError) as info:
        prepare(batch, current_step=current, task=TASK, tokenizer=parts[0], config=CONFIG)
    assert info.value.reason == reason
    prepare(
        dataclasses.replace(batch, policy_step=current - 2 if current >= 2 else 0),
        current_step=current,
        task=TASK,
        tokenizer=parts[0],
        config=CONFIG,
    )


def test_forged_batches_are_refused(parts: tuple[Any, TorchEngine]) -> None:
    tokenizer, _ = parts
    batch = _batch(parts)
    first = batch.samples[0]
    cases = {
        "wrong_run": dataclasses.replace(batch, run_id="other"),
        "wrong_prompt": dataclasses.replace(
            batch, samples=(dataclasses.replace(first, prompt=pack_tokens([22, 34])), *batch.samples[1:])
        ),
        "unknown_task": dataclasses.replace(
            batch,
            samples=tuple(
                dataclasses.replace(s, task_id=10**9) if i < 4 else s for i, s in enumerate(batch.samples)
            ),
        ),
        "bad_completion": dataclasses.replace(
            batch,
            samples=(
                dataclasses.replace(first, completion=pack_tokens([5000]), logprobs=b"\x00" * 4),
                *batch.samples[1:],
            ),
        ),
        "wrong_temperature": dataclasses.replace(batch, temperature=0.5),
    }
    for reason, forged in cases.items():
        with pytest.raises(RejectedBatchError) as info:
            prepare(forged, current_step=0, task=TASK, tokenizer=tokenizer, config=CONFIG)
        assert info.value.reason == reason


def test_a_step_moves_the_weights_only_when_there_is_signal(
    parts: tuple[Any, TorchEngine], tiny_model_dir: Path, tmp_path: Path
) -> None:
    tokenizer, _ = parts
    model = load_model(tiny_model_dir)
    trainer = GRPOTrainer(CONFIG, model, tokenizer, checkpoint_root=tmp_path, dist=DistInfo())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flat = prepare(_batch(parts), current_step=0, task=TASK, tokenizer=tokenizer, config=CONFIG)
    assert flat.groups_kept == 0
    metrics = trainer.train_step(flat)
    assert metrics.step == 1 and trainer.step == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    useful = prepare(
        _with_answer(_batch(parts, policy_step=0, counter=1), tokenizer, 0),
        current_step=1,
        task=TASK,
        tokenizer=tokenizer,
        config=CONFIG,
    )
    metrics = trainer.train_step(useful)  # policy 0 < current 1: old log-probs from the stored policy 0
    assert metrics.grad_norm > 0 and torch.isfinite(torch.tensor(metrics.loss))
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
