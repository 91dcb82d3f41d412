"""Generating one scheduled rollout batch, the step every producer of batches shares (DESIGN §1, §6).

The --local inference stage (thread or child process), the networked inferer and the cheating producers
of ``prime_node.verification.cheating`` (through ``verification.proving``) all draw the scheduled tasks
and seeds and pack them here, so a batch depends only on (worker, policy step, counter, run seed) and
the policy's weights, and a validator can recompute the draw. It lives apart from the training loop so
that a process that only generates imports no trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from crypto.keys import Address
from prime_node.config import RunConfig
from prime_node.errors import NodeError
from prime_node.ml.engine import InferenceEngine, SamplingParams
from prime_node.ml.evaluation import encode_prompt
from prime_node.tasks.base import TaskSource
from protocol import schedule
from protocol.rollouts import FORMAT_VERSION, RolloutBatch, RolloutSample, pack_logprobs, pack_tokens

if TYPE_CHECKING:
    import torch

LOCAL_WORKER = Address(b"\x00" * 20)
"""The worker address of batches a --local run generates for itself."""


def with_tied_head(model: Any, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Saved weights (which leave out a tied output projection) ready for ``engine.load_weights``."""
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" not in weights:
        return {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
    return weights


def scheduled_requests(
    task: TaskSource,
    tokenizer: Any,
    config: RunConfig,
    *,
    worker: Address,
    policy_step: int,
    batch_counter: int,
) -> tuple[list[int], list[list[int]], list[int]]:
    """The scheduled batch's task ids (one per group) and, per sample, its prompt tokens and seed: what
    ``make_batch`` asks the engine for (a GPU inferer can generate many batches' requests at once)."""
    pool = task.train_ids()
    drawn = schedule.draw(
        worker,
        policy_step,
        batch_counter,
        config.seed,
        pool_size=len(pool),
        groups=config.prompts_per_step,
        group_size=config.group_size,
    )
    task_ids = [pool[i] for i in drawn.task_indices]
    prompts = [encode_prompt(tokenizer, task.prompt(t)) for t in task_ids for _ in range(config.group_size)]
    seeds = [s for group in drawn.seeds for s in group]
    return task_ids, prompts, seeds


def make_batch(
    engine: InferenceEngine,
    task: TaskSource,
    tokenizer: Any,
    config: RunConfig,
    *,
    worker: Address,
    policy_step: int,
    batch_counter: int,
    prove: Callable[[list[torch.Tensor]], list[bytes]] | None = None,
) -> RolloutBatch:
    """Draw the scheduled tasks, sample each ``group_size`` times with its scheduled seeds, pack the batch.

    With ``prove`` (e.g. ``prime_node.verification.proofs.build_proofs``) the engine also returns the final
    hidden states and each sample carries its TOPLOC proof; without it the proof slot stays empty.
    """
    task_ids, prompts, seeds = scheduled_requests(
        task, tokenizer, config, worker=worker, policy_step=policy_step, batch_counter=batch_counter
    )
    params = SamplingParams(
        max_new_tokens=config.max_new_tokens, temperature=config.temperature, return_hidden=prove is not None
    )
    completions = engine.generate(prompts, seeds, params)
    proofs = [b""] * len(completions)
    if prove is not None:
        hiddens = [c.hidden for c in completions]
        if any(h is None for h in hiddens):
            raise NodeError("the engine returned no hidden states to prove", reason="engine_without_hidden")
        proofs = prove([h for h in hiddens if h is not None])
    samples = tuple(
        RolloutSample(
            task_id=task_ids[i // config.group_size],
            seed=seeds[i],
            prompt=pack_tokens(prompts[i]),
            completion=pack_tokens(c.tokens),
            logprobs=pack_logprobs([min(v, 0.0) for v in c.logprobs]),
            finished=c.finished,
            proof=proofs[i],
        )
        for i, c in enumerate(completions)
    )
    return RolloutBatch(
        FORMAT_VERSION,
        config.run_id,
        worker,
        policy_step,
        batch_counter,
        config.temperature,
        config.group_size,
        samples,
    )
