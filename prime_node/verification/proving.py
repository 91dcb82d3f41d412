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
from protocol.codec import encode
from protocol.envelope import Domain, Envelope, seal
from protocol.rollouts import RolloutBatch

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
    from prime_node.ml.rollout_batch import make_batch

    return make_batch(
        engine,
        task,
        tokenizer,
        config,
        worker=worker,
        policy_step=policy_step,
        batch_counter=batch_counter,
        prove=build_proofs,
    )


def seal_batch(key: WalletKey, batch: RolloutBatch, *, now_ms: int) -> Envelope:
    """Sign ``batch`` as the worker ``key`` for the run's rollout domain."""
    return seal(key, rollout_domain(batch.run_id), encode(batch), now_ms=now_ms)
