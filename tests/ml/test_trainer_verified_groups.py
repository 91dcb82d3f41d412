"""Issue 13: the networked trainer never executes nor trains on a group no validator replayed.

A worker's code-task batch hides an informative hostile group (one program passes the tests, one fails,
both write a marker file) outside the secret sample of a validator that recomputes one group in four.
The validator accepts the batch; its signed verdict travels over gossip (real nodes on the in-memory
network) to the trainer node's admission, and the real ``TrainerService`` intake admits what it is
handed with its real ``TrainingSession``. The hostile programs must never run there, and nothing of
their group may be queued for a GRPO step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from crypto.keys import WalletKey
from prime_node.roles.trainer_service import TrainerOptions, TrainerService
from prime_node.testing.adversary import validator_for
from prime_node.verification.batch_publish import publish_frame
from prime_node.verification.judge import Judge
from prime_node.verification.validator import CheckPolicy
from protocol.codec import decode
from protocol.envelope import Envelope
from protocol.rollouts import RolloutBatch
from tests.p2p.helpers import wait_until
from tests.verification.code_attack import code_run, marker_dir, unsampled_hostile_frame
from tests.verification.network_helpers import policy_dir
from tests.verification.verdict_net import publish_verdict, start_verdict_net


@pytest.fixture
def markers() -> Iterator[Path]:
    with marker_dir() as path:
        yield path


async def test_the_trainer_neither_executes_nor_trains_on_a_group_no_validator_replayed(
    tmp_path: Path, markers: Path
) -> None:
    validator_key, trainer_key = WalletKey.generate(), WalletKey.generate()
    run = code_run(
        tmp_path,
        markers,
        trusted_validators=(str(validator_key.address),),
        output_dir=str(tmp_path / "out"),
        max_steps=4,
    )
    scenario = run.scenario
    scenario.current_step = 0  # the trainer starts at step 0 and admits no batch from its future
    scenario.now_ms = time.time_ns() // 1_000_000
    validator = validator_for(scenario)
    validator.policy = CheckPolicy(recompute_groups=1)
    frame, hostile = unsampled_hostile_frame(run, validator)
    result, verdict = Judge(validator, validator_key).judge(frame, now_ms=scenario.now_ms, current_step=0)
    assert result.accepted and verdict is not None, result.detail
    run.task.scored.clear()  # from here on, only the trainer scores
    for leftover in markers.iterdir():  # whatever the validator did is another test's business
        leftover.unlink()

    trainer = TrainerService(
        key=trainer_key,
        run_config=scenario.config,
        swarm=None,  # type: ignore[arg-type]  # the intake alone runs here: nothing is shared
        admission=None,  # type: ignore[arg-type]  # set below, once the network is up
        options=TrainerOptions(model_dir=policy_dir(scenario, tmp_path), evaluate=False),
    )
    trainer.session = await trio.to_thread.run_sync(trainer._open)
    trainer.session.task = run.task
    async with trio.open_nursery() as nursery:
        net = await start_verdict_net(nursery, tmp_path, trainer.config, [validator_key], scenario.key)
        trainer.admission = net.admission
        nursery.start_soon(trainer._intake)
        await publish_frame(net.worker, frame)
        await publish_verdict(net.validators[0], verdict)
        await wait_until(lambda: trainer.batches_accepted + sum(trainer.rejected.values()) >= 1, 120)
        nursery.cancel_scope.cancel()

    assert not run.executed_hostile(), "the trainer executed a completion no validator replayed"
    assert list(markers.iterdir()) == []
    hostile_tokens = [list(s.completion_tokens()) for s in _signed_batch(frame).group(hostile)]
    queued = trainer.gatherer.take(trainer.step)
    sequences = [seq for c in (queued.batches if queued else []) for seq in c.item.prepared.sequences]
    assert not any(seq[-len(t) :] == t for seq in sequences for t in hostile_tokens)
    group_size = scenario.config.group_size
    assert len(run.task.scored) == group_size, trainer.rejected  # the replayed group was scored
    assert trainer.batches_accepted == 1
    assert net.admission.stats()["groups_unverified"] == scenario.config.prompts_per_step - 1
    assert trainer.status()["groups_unverified"] == scenario.config.prompts_per_step - 1


def _signed_batch(frame: bytes) -> RolloutBatch:
    return decode(decode(frame, Envelope).payload, RolloutBatch)
