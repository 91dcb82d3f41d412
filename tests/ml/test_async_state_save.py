"""The training state saved off the step's path (``AsyncShardedSaver``, ``state_save_due``): the saved
state is the one of the moment of ``submit`` even though the next optimizer step follows at once, and
the "auto" policy keeps saving within its share of the training time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from prime_node.config import RunConfig
from prime_node.errors import NodeError
from prime_node.ml.checkpoint import optimizer_snapshot
from prime_node.ml.prepared import Prepared
from prime_node.ml.session import TrainingSession
from prime_node.ml.sharded_checkpoint import AsyncShardedSaver, list_sharded, state_save_due
from prime_node.ml.sharded_load import load_sharded


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().clone()


def _state(session: TrainingSession) -> dict[str, torch.Tensor]:
    weights = {f"w.{n}": _local(p) for n, p in session.trainer.model.named_parameters()}
    moments, _ = optimizer_snapshot(session.trainer.optimizer)
    return weights | {f"m.{k}": _local(v) for k, v in moments.items()}


def test_an_optimizer_step_right_after_submit_does_not_reach_the_saved_state(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = RunConfig.model_validate(
        {"model_dir": str(tiny_model_dir), "output_dir": str(tmp_path / "run"), "checkpoint_every": 100}
    )
    session = TrainingSession(config, base=tiny_model_dir)
    try:
        vocab = len(session.tokenizer)
        generator = torch.Generator().manual_seed(3)
        sequences = torch.randint(3, vocab, (8, 12), generator=generator).tolist()
        advantages = torch.randn(8, generator=generator).tolist()
        behaviour = (-1.0 - torch.rand(8, 6, generator=generator)).tolist()
        batch = Prepared(0, sequences, [6] * 8, advantages, 0.5, 2, 0, behaviour)
        session.trainer.train_step(batch)  # AdamW has moments to save
        before = _state(session)
        saver = AsyncShardedSaver(tmp_path / "state", meta={})
        saver.submit(7, session.trainer.model, session.trainer.optimizer)
        session.trainer.before_update = saver.wait  # as the session wires it
        session.trainer.train_step(batch)  # changes the weights and moments in place
        saver.close()
        after = _state(session)
        assert any(not torch.equal(after[k], before[k]) for k in before)  # the step did change them
        (saved,) = list_sharded(tmp_path / "state")
        assert saved.step == 7
        load_sharded(saved, session.trainer.model, session.trainer.optimizer)
        loaded = _state(session)
        assert all(torch.equal(loaded[k], before[k]) for k in before)
        (tmp_path / "a file").write_text("not a directory")
        failing = AsyncShardedSaver(tmp_path / "a file", meta={})
        failing.submit(8, session.trainer.model, session.trainer.optimizer)
        with pytest.raises(NodeError) as failed:  # a background failure reaches the training thread
            failing.wait()
        assert failed.value.reason in {"checkpoint_failed", "disk_full", "io_error", "permission_denied"}
    finally:
        session.close()


@given(
    every=st.integers(1, 50),
    step=st.integers(1, 10_000),
    seconds=st.floats(0, 1e6),
    last=st.none() | st.floats(0, 1e4),
)
def test_an_explicit_interval_saves_every_that_many_steps(
    every: int, step: int, seconds: float, last: float | None
) -> None:
    due = state_save_due(every=every, step=step, final=False, seconds_since_save=seconds, last_save_s=last)
    assert due == (step % every == 0)
    assert state_save_due(every=every, step=step, final=True, seconds_since_save=0, last_save_s=last)


@given(
    save_s=st.floats(0.001, 100),
    steps=st.lists(st.floats(0.001, 100), min_size=1, max_size=200),
)
def test_auto_keeps_saving_within_a_tenth_of_the_training_time(save_s: float, steps: list[float]) -> None:
    """A run whose saves each take ``save_s`` (the first is the step-0 one): the saves after the first
    add up to at most 10 % of the training time, and a save is never skipped once that share is met."""
    saved, since, last = 0.0, 0.0, save_s
    for k, duration in enumerate(steps, start=1):
        since += duration
        if state_save_due(every=None, step=k, final=False, seconds_since_save=since, last_save_s=last):
            assert save_s <= 0.1 * since * (1 + 1e-9)
            saved += save_s
            since = 0.0
        else:
            assert save_s > 0.1 * since
    assert saved <= 0.1 * sum(steps) * (1 + 1e-9)
    assert state_save_due(every=None, step=5, final=False, seconds_since_save=0.0, last_save_s=None)


@pytest.mark.parametrize("value", [0, -3, "often", 2.5])
def test_checkpoint_every_is_a_positive_count_or_auto(value: object) -> None:
    with pytest.raises(ValidationError):
        RunConfig.model_validate({"checkpoint_every": value})
    assert RunConfig.model_validate({"checkpoint_every": 3}).checkpoint_every == 3
    assert RunConfig().checkpoint_every == "auto"
