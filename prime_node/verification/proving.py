"""The inferer's side: generate one scheduled batch with TOPLOC proofs attached, and sign it.

This is what an honest worker runs: draw the tasks and seeds of (worker, policy step, batch counter)
from the schedule, sample each task ``group_size`` times with the engine (keeping the final hidden
states), commit to them per 32 tokens, and seal the packed batch with the worker's wallet key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from crypto.keys import Address, WalletKey
from prime_node.verification.proofs import build_proofs
from prime_node.verification.validator import ROLLOUT_KIND
from protocol import schedule
from protocol.codec import encode
from protocol.envelope import Domain, Envelope, seal
from protocol.rollouts import FORMAT_VERSION, RolloutBatch, RolloutSample, pack_logprobs, pack_tokens

if TYPE_CHECKING:
    from prime_node.config import RunConfig
    from prime_node.ml.engine import InferenceEngine
    from prime_node.tasks.base import TaskSource


def rollout_domain(run_id: str) -> Domain:
    return Domain(ROLLOUT_KIND, run_id)


def proven_batch(
    engine: InferenceEngine,
    task: TaskSource,
    tokenizer: Any,
    config: RunConfig,
    *,
    worker: Address,
    policy_step: int,
    batch_counter: int,
) -> RolloutBatch:
    """The scheduled batch for (worker, policy_step, batch_counter), every sample with its proof."""
    from prime_node.ml.engine import SamplingParams
    from prime_node.ml.evaluation import encode_prompt

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
    task_ids = [pool[i] for i in drawn.task_indices for _ in range(config.group_size)]
    prompts = [encode_prompt(tokenizer, task.prompt(t)) for t in task_ids]
    seeds = [seed for group in drawn.seeds for seed in group]
    params = SamplingParams(config.max_new_tokens, config.temperature, return_hidden=True)
    completions = engine.generate(prompts, seeds, params)
    proofs = build_proofs([c.hidden for c in completions if c.hidden is not None])
    samples = tuple(
        RolloutSample(
            task_id=task_ids[i],
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


def seal_batch(key: WalletKey, batch: RolloutBatch, *, now_ms: int) -> Envelope:
    """Sign ``batch`` as the worker ``key`` for the run's rollout domain."""
    return seal(key, rollout_domain(batch.run_id), encode(batch), now_ms=now_ms)
