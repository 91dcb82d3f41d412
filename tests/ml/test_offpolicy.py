"""The trainer's off-policy objectives on a real tiny model: behaviour log-probs reach the loss aligned
with the completion tokens, each objective trains on stale batches, and staleness is reported."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from prime_node.config import RunConfig
from prime_node.errors import NodeError
from prime_node.ml.distributed import DistInfo
from prime_node.ml.engine import TorchEngine
from prime_node.ml.grpo import OBJECTIVES, Objective
from prime_node.ml.model import load_model
from prime_node.ml.prepared import prepare
from prime_node.ml.rollout_batch import LOCAL_WORKER, make_batch
from prime_node.ml.tokenizer import load_tokenizer
from prime_node.ml.trainer import GRPOTrainer, _behaviour_micro_batch, _micro_batch
from prime_node.tasks.arithmetic import ArithmeticTask
from protocol.rollouts import RolloutBatch, pack_logprobs, pack_tokens

CONFIG = RunConfig.model_validate(
    {"group_size": 4, "prompts_per_step": 3, "max_new_tokens": 5, "temperature": 0.7, "async_level": 2}
)
TASK = ArithmeticTask()


@pytest.fixture(scope="module")
def parts(tiny_model_dir: Path) -> tuple[Any, TorchEngine]:
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = TorchEngine(
        load_model(tiny_model_dir), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return tokenizer, engine


def _sampler_logprobs(engine: TorchEngine, prompt: list[int], completion: list[int]) -> list[float]:
    """What the sampler reports for ``completion``: log_softmax(logits / T)[token] (docs/rl.md)."""
    logits = engine.prefill([prompt], [completion])[0].logits.float() / CONFIG.temperature
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)
    return [float(v) for v in logp]


def _batch_with_answers(parts: tuple[Any, TorchEngine], counter: int) -> RolloutBatch:
    """A policy-0 batch in which the first sample of each group is the right answer, with the honest
    behaviour log-probs of policy 0 for it (a random model never finds it alone)."""
    tokenizer, engine = parts
    batch = make_batch(
        engine, TASK, tokenizer, CONFIG, worker=LOCAL_WORKER, policy_step=0, batch_counter=counter
    )
    samples = list(batch.samples)
    for g in range(batch.groups):
        i = g * batch.group_size
        answer = [
            *tokenizer.encode(TASK.answer(samples[i].task_id), add_special_tokens=False),
            tokenizer.eos_token_id,
        ]
        logprobs = _sampler_logprobs(engine, list(samples[i].prompt_tokens()), answer)
        samples[i] = dataclasses.replace(
            samples[i], completion=pack_tokens(answer), logprobs=pack_logprobs(logprobs)
        )
    return dataclasses.replace(batch, samples=tuple(samples))


def test_behaviour_log_probs_line_up_with_the_trainers_completion_tokens(
    parts: tuple[Any, TorchEngine], tiny_model_dir: Path
) -> None:
    tokenizer, engine = parts
    batch = make_batch(engine, TASK, tokenizer, CONFIG, worker=LOCAL_WORKER, policy_step=0, batch_counter=3)
    sequences = [list(s.prompt_tokens()) + list(s.completion_tokens()) for s in batch.samples]
    prompt_lengths = [len(s.prompt_tokens()) for s in batch.samples]
    ids, targets, mask = _micro_batch(sequences, prompt_lengths, tokenizer.pad_token_id)
    behaviour = _behaviour_micro_batch(
        [list(s.completion_logprobs()) for s in batch.samples], prompt_lengths, targets.shape[1]
    )
    with torch.no_grad():
        logits = load_model(tiny_model_dir)(input_ids=ids).logits.float() / CONFIG.temperature
    trainer_logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # same policy: the sampler's log-probs are the trainer's, up to KV-cache vs prefill rounding
    assert torch.allclose(trainer_logp[mask], behaviour[mask], atol=1e-4)
    assert int(mask.sum()) == sum(len(s.completion_tokens()) for s in batch.samples)
    assert torch.count_nonzero(behaviour[~mask]) == 0


def test_prepare_carries_each_kept_samples_behaviour_log_probs(parts: tuple[Any, TorchEngine]) -> None:
    batch = _batch_with_answers(parts, counter=0)
    prepared = prepare(batch, current_step=0, task=TASK, tokenizer=parts[0], config=CONFIG)
    assert prepared.groups_kept == 3
    kept = list(batch.samples)  # every group is informative here, so every sample is kept, in order
    assert prepared.behaviour_logprobs == [list(s.completion_logprobs()) for s in kept]
    assert [len(v) for v in prepared.behaviour_logprobs] == [
        len(s) - p for s, p in zip(prepared.sequences, prepared.prompt_lengths, strict=True)
    ]


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_each_objective_trains_on_stale_batches(
    parts: tuple[Any, TorchEngine], tiny_model_dir: Path, tmp_path: Path, objective: Objective
) -> None:
    tokenizer, _ = parts
    config = CONFIG.model_copy(update={"objective": objective, "learning_rate": 3e-3})
    model = load_model(tiny_model_dir)
    trainer = GRPOTrainer(config, model, tokenizer, checkpoint_root=tmp_path, dist=DistInfo())
    assert (trainer._old_model is None) == (objective != "recompute")  # no model copy unless recomputing
    batches = [_batch_with_answers(parts, counter=c) for c in range(3)]
    probe = prepare(batches[0], current_step=0, task=TASK, tokenizer=tokenizer, config=config)
    answers = [i for i, a in enumerate(probe.advantages) if a > 0]

    def answer_logp() -> float:
        ids, targets, mask = _micro_batch(
            [probe.sequences[i] for i in answers],
            [probe.prompt_lengths[i] for i in answers],
            tokenizer.pad_token_id,
        )
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float() / config.temperature
        logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return float(logp[mask].sum())

    before = answer_logp()
    for step, batch in enumerate(batches):  # all generated by policy 0: staleness 0, 1, 2
        prepared = prepare(batch, current_step=trainer.step, task=TASK, tokenizer=tokenizer, config=config)
        metrics = trainer.train_step(prepared)
        assert metrics.staleness == step and metrics.policy_step == 0
        assert metrics.grad_norm > 0 and torch.isfinite(torch.tensor(metrics.loss))
        assert 0.0 <= metrics.is_fraction <= 1.0
    assert answer_logp() > before + 1.0  # the rewarded completions became much more likely


@pytest.mark.parametrize("objective", ["behaviour", "decoupled", "masked_is"])
def test_a_batch_without_behaviour_log_probs_is_refused_by_the_off_policy_objectives(
    parts: tuple[Any, TorchEngine], tiny_model_dir: Path, tmp_path: Path, objective: Objective
) -> None:
    tokenizer, _ = parts
    config = CONFIG.model_copy(update={"objective": objective})
    trainer = GRPOTrainer(
        config, load_model(tiny_model_dir), tokenizer, checkpoint_root=tmp_path, dist=DistInfo()
    )
    prepared = prepare(
        _batch_with_answers(parts, 0), current_step=0, task=TASK, tokenizer=tokenizer, config=config
    )
    with pytest.raises(NodeError) as info:
        trainer.train_step(dataclasses.replace(prepared, behaviour_logprobs=[]))
    assert info.value.reason == "missing_behaviour_logprobs"
