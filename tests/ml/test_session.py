"""The training session both trainers drive: open, train, checkpoint, close, resume, evaluate.

A real tiny model and real batches (``make_batch``); a length reward gives a random model's groups
different rewards, so the steps have gradients and the optimizer state is not empty.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from prime_node.config import RunConfig
from prime_node.ml.checkpoint import list_checkpoints, optimizer_snapshot, read_weights
from prime_node.ml.engine import TorchEngine
from prime_node.ml.model import load_model
from prime_node.ml.prepared import Prepared, RejectedBatchError
from prime_node.ml.rollout_batch import LOCAL_WORKER, make_batch
from prime_node.ml.rollout_log import RolloutLog
from prime_node.ml.session import TrainingSession, merge_prepared
from prime_node.ml.sharded_checkpoint import list_sharded
from protocol.codec import encode
from protocol.rollouts import RolloutBatch


def _config(out: Path, model: Path, checkpoint_every: int = 2) -> RunConfig:
    return RunConfig.model_validate(
        {
            "checkpoint_every": checkpoint_every,
            "model_dir": str(model),
            "output_dir": str(out),
            "max_steps": 10,
            "group_size": 4,
            "prompts_per_step": 3,
            "max_new_tokens": 6,
            "temperature": 1.0,
            "async_level": 2,
            "learning_rate": 3e-3,
            "eval_tasks": 8,
            "length_reward": {"coef": 1.0, "target_tokens": 3},
        }
    )


def _batches(session: TrainingSession, model: Path) -> list[RolloutBatch]:
    """Two batches of the base policy (step 0) with informative groups: the random model rarely ends a
    completion early, so the draws are chosen where it does (counters 3 and 5)."""
    engine = TorchEngine(
        load_model(model),
        eos_token_id=session.tokenizer.eos_token_id,
        pad_token_id=session.tokenizer.pad_token_id,
    )
    return [
        make_batch(
            engine,
            session.task,
            session.tokenizer,
            session.config,
            worker=LOCAL_WORKER,
            policy_step=0,
            batch_counter=counter,
        )
        for counter in (3, 5)
    ]


def test_a_session_trains_checkpoints_and_resumes_with_its_optimizer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    config = _config(out, tiny_model_dir)
    first = TrainingSession(config, base=tiny_model_dir)
    assert first.start_step == first.step == 0 and first.source == tiny_model_dir
    assert first.policy_file(0).is_file()  # staged before any step; its checkpoint finishes in the background
    batches = _batches(first, tiny_model_dir)
    for k, batch in enumerate(batches):
        metrics = first.train([first.admit(batch)], [encode(batch)])
        assert metrics.step == k + 1 == first.step and metrics.policy_step == 0 and metrics.groups_kept > 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    weights, (moments, _) = first.weights(2), optimizer_snapshot(first.trainer.optimizer)
    assert moments  # AdamW has state after real steps
    first.close()
    first.close()  # idempotent

    assert [c.step for c in list_checkpoints(out / "checkpoints")] == [0, 1, 2]
    saved = read_weights(list_checkpoints(out / "checkpoints")[-1].path)
    assert all(torch.equal(saved[k], weights[k]) for k in weights)
    log = RolloutLog(out / "rollouts.log")
    assert log.batches_from(0) == {0: batches[0], 1: batches[1]}  # logged under the step that used it

    again = TrainingSession(config, base=tiny_model_dir)
    try:
        assert again.start_step == again.step == again.replay_until == 2 and again.source == tiny_model_dir
        resumed_moments, _ = optimizer_snapshot(again.trainer.optimizer)
        assert resumed_moments.keys() == moments.keys()
        assert all(torch.equal(resumed_moments[k], moments[k]) for k in moments)
        assert all(torch.equal(again.weights(2)[k], weights[k]) for k in weights)
        assert again.logged_batches() == {}  # nothing logged after the newest checkpoint
        # A batch of policy 0 is still admissible at step 2 (async_level 2), not at step 3.
        assert again.admit(batches[0]).policy_step == 0
        with pytest.raises(RejectedBatchError) as refused:
            again.admit(batches[0], current_step=3)
        assert refused.value.reason == "stale"
    finally:
        again.close()


def test_logged_batches_after_the_newest_training_state_are_replayed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """checkpoint_every 3: policies 1 and 2 have checkpoints, the training state only step 0; a restart
    replays the logged steps 0 and 1 onto it (keeping the checkpoints peers may hold) and reaches the
    state the first session ended in."""
    out = tmp_path / "run"
    config = _config(out, tiny_model_dir, checkpoint_every=3)
    session = TrainingSession(config, base=tiny_model_dir)
    batches = _batches(session, tiny_model_dir)
    for batch in batches:
        session.train([session.admit(batch)], [encode(batch)])
    moments, _ = optimizer_snapshot(session.trainer.optimizer)
    session.close()
    assert [c.step for c in list_sharded(out / "train_state")] == [0]
    kept = (out / "checkpoints" / "step_00000002" / "model.safetensors").stat().st_ino
    resumed = TrainingSession(config, base=tiny_model_dir)
    try:
        assert (resumed.start_step, resumed.replay_until) == (0, 2)
        assert resumed.logged_batches() == {0: batches[0], 1: batches[1]}
        replayed = resumed.replay()
        assert [m.step for m in replayed] == [1, 2] and resumed.step == 2
        assert len(RolloutLog(out / "rollouts.log")) == 2  # replayed, not appended again
        again, _ = optimizer_snapshot(resumed.trainer.optimizer)
        for name, value in moments.items():  # same process, same batches: the replay lands where it was
            assert torch.allclose(_local(again[name]), _local(value), rtol=1e-5, atol=1e-7), name
        assert (out / "checkpoints" / "step_00000002" / "model.safetensors").stat().st_ino == kept
    finally:
        resumed.close()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-rank FSDP2 DTensor's whole local tensor (comparisons between DTensors need a mesh op)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def test_a_lost_training_state_is_rebuilt_from_the_log(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = _config(out, tiny_model_dir)
    session = TrainingSession(config, base=tiny_model_dir)
    batches = _batches(session, tiny_model_dir)
    for batch in batches:
        session.train([session.admit(batch)], [encode(batch)])
    session.close()
    shutil.rmtree(out / "train_state" / "sharded_00000002")  # as if killed before it was written
    resumed = TrainingSession(config, base=tiny_model_dir)
    try:
        assert (resumed.start_step, resumed.replay_until) == (0, 2)
        resumed.replay()
        assert resumed.step == 2 and resumed.policy_file(2).is_file()
    finally:
        resumed.close()


def test_evaluation_runs_on_its_own_engine_and_gives_an_accuracy(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    session = TrainingSession(_config(tmp_path / "run", tiny_model_dir), base=tiny_model_dir)
    try:
        assert len(session.eval_ids) == 8
        by_step = session.evaluate(0)
        assert 0.0 <= by_step <= 1.0
        assert session.evaluate(session.weights(0)) == by_step  # same weights, same process
        assert session._eval_engine is not None and session._eval_engine.model is not session.model
    finally:
        session.close()


def test_merging_keeps_every_sample_with_its_behaviour_logprobs() -> None:
    a = Prepared(3, [[1, 2]], [1], [0.5], 1.0, 1, 1, behaviour_logprobs=[[-0.1]])
    b = Prepared(3, [[4, 5]], [1], [-1.0], 0.0, 1, 0, behaviour_logprobs=[[-0.2]])
    merged = merge_prepared([a, b])
    assert merged.sequences == [[1, 2], [4, 5]] and merged.behaviour_logprobs == [[-0.1], [-0.2]]
    assert merge_prepared([a]) is a
    with pytest.raises(ValueError):
        merge_prepared([])
