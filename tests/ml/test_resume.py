"""Where a session starts again and which steps its rollout log replays (``ml/resume.py``), without a model:
the session tests (test_session.py, test_kill_resume.py) run the same rules end to end."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from prime_node.errors import NodeError
from prime_node.ml.checkpoint import Checkpoint, step_dir
from prime_node.ml.resume import Resume, resume_point
from prime_node.ml.sharded_checkpoint import ShardedCheckpoint


def _state(step: int) -> ShardedCheckpoint:
    return ShardedCheckpoint(step, Path(f"state_{step}"), 1, {}, [])


def _checkpoints(*steps: int) -> list[Checkpoint]:
    return [Checkpoint(step, Path(f"step_{step}")) for step in steps]


def test_a_fresh_run_starts_from_the_base_model() -> None:
    assert resume_point([], [], []) == (0, None, 0)
    assert resume_point([], [], None) == (0, None, 0)


def test_the_log_replays_the_steps_after_the_state_up_to_its_first_gap(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = _state(3)
    assert resume_point(_checkpoints(3, 4, 5), [_state(1), state], [2, 3, 4, 6]) == (3, state, 5)
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        assert resume_point(_checkpoints(3, 7), [state], [3, 4, 6]) == (3, state, 5)
    assert "policies 6..7 are trained again" in caplog.text


def test_ranks_other_than_0_follow_from_the_state() -> None:
    state = _state(2)
    assert resume_point(_checkpoints(2, 5), [state], None) == (2, state, 2)


def test_policies_the_log_cannot_reach_without_a_state_are_refused() -> None:
    with pytest.raises(NodeError) as refused:
        resume_point(_checkpoints(1, 2), [], [0])
    assert refused.value.reason == "bad_checkpoint"
    assert resume_point(_checkpoints(1, 2), [], [0, 1]) == (0, None, 2)
    assert resume_point(_checkpoints(1, 6), [], list(range(9))) == (0, None, 9)


def _checkpoint_on_disk(root: Path, step: int, dtype: torch.dtype) -> Path:
    directory = step_dir(root, step)
    directory.mkdir(parents=True)
    save_file({"w": torch.zeros(2, dtype=dtype)}, str(directory / "model.safetensors"))
    (directory / "trainer_state.json").write_text(json.dumps({"step": step}))
    return directory / "model.safetensors"


def test_a_replayed_step_keeps_its_checkpoints_weights_file(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    kept = _checkpoint_on_disk(root, 1, torch.bfloat16)
    _checkpoint_on_disk(root, 2, torch.float32)
    _checkpoint_on_disk(root, 3, torch.bfloat16)  # left by a run that got further before the kill
    resume = Resume(
        tmp_path,
        checkpoint_root=root,
        state_root=tmp_path / "state",
        keeps_log=False,
        published_dtype="bfloat16",
    )
    resume.replay_until = 2  # as if the log replayed steps 0 and 1
    staging = tmp_path / "policy_staging"
    assert resume.holds_kept(1, staging / "step_1")
    assert (staging / "step_1").samefile(kept)
    assert not resume.holds_kept(2, staging / "step_2")  # its checkpoint is in another dtype
    assert not resume.holds_kept(3, staging / "step_3")  # past the replay: a new step, newly staged
    assert sorted(p.name for p in staging.iterdir()) == ["step_1"]
