"""The --local trainer end to end: checkpoints, the rollout log, resume (in-process and after SIGKILL),
and torchrun with 2 gloo processes against 1 process.

A random tiny model solves no addition, so these runs add a length reward: completions of different
lengths earn different rewards, which gives GRPO real gradients without a warm-up.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from prime_node.config import RunConfig
from prime_node.ml.checkpoint import list_checkpoints, read_weights
from prime_node.ml.local_run import run_local
from prime_node.ml.rollout_log import RolloutLog

REPO = Path(__file__).resolve().parents[2]


def _config(out: Path, model: Path, steps: int, **extra: object) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model_dir": str(model),
            "output_dir": str(out),
            "max_steps": steps,
            "group_size": 4,
            "prompts_per_step": 4,
            "max_new_tokens": 6,
            "temperature": 1.0,
            "async_level": 2,
            "threads": 1,
            "learning_rate": 3e-3,
            "eval_tasks": 20,
            "length_reward": {"coef": 1.0, "target_tokens": 3},
            **extra,
        }
    )


def _write_toml(path: Path, config: RunConfig) -> None:
    lines = [
        f"{k} = {json.dumps(str(v) if isinstance(v, Path) else v)}"
        for k, v in config.model_dump(exclude={"task", "length_reward", "trainer_address"}).items()
        if not isinstance(v, tuple)
    ]
    lines += [
        "[length_reward]",
        f"coef = {config.length_reward.coef}",
        f"target_tokens = {config.length_reward.target_tokens}",
    ]
    path.write_text("\n".join(lines) + "\n")


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    return read_weights(list_checkpoints(out / "checkpoints")[-1].path)


def test_local_run_learns_checkpoints_and_resumes_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    straight = run_local(_config(tmp_path / "straight", tiny_model_dir, 5))
    assert [m.step for m in straight.steps] == [1, 2, 3, 4, 5]
    assert sum(m.groups_kept for m in straight.steps) > 0 and all(m.grad_norm >= 0 for m in straight.steps)
    assert [e.step for e in straight.evals] == [0, 5]
    assert [c.step for c in list_checkpoints(tmp_path / "straight" / "checkpoints")] == [3, 4, 5]
    assert len(RolloutLog(tmp_path / "straight" / "rollouts.log")) == 5
    assert len((tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()) == 5
    first = run_local(_config(tmp_path / "split", tiny_model_dir, 3))
    # As if killed after batch 2 was logged but before checkpoint 3 was written: batch 2 must be replayed.
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "step_00000003")
    logged_batch_2 = RolloutLog(tmp_path / "split" / "rollouts.log").batches_from(2)[2]
    resumed = run_local(_config(tmp_path / "split", tiny_model_dir, 5))
    assert len(first.steps) == 3 and resumed.start_step == 2 and [m.step for m in resumed.steps] == [3, 4, 5]
    log = RolloutLog(tmp_path / "split" / "rollouts.log")
    assert sorted(log.batches_from(0)) == [1, 2, 3, 4]  # 0 compacted: it lives on in every kept checkpoint
    assert log.batches_from(2)[2] == logged_batch_2  # replayed, not drawn again
    expected, got = _final_weights(tmp_path / "straight"), _final_weights(tmp_path / "split")
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_synchronous_and_async_runs_use_their_own_policy_windows(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    sync = run_local(_config(tmp_path / "sync", tiny_model_dir, 3, async_level=0), evaluate=False)
    assert [m.policy_step for m in sync.steps] == [0, 1, 2]
    lagged = run_local(_config(tmp_path / "async", tiny_model_dir, 4), evaluate=False)
    assert [m.policy_step for m in lagged.steps] == [0, 0, 0, 1]


@pytest.mark.slow
def test_sigkilled_trainer_resumes_and_loses_no_accepted_rollout(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    steps = 40
    reference = tmp_path / "reference"
    run_local(_config(reference, tiny_model_dir, steps), evaluate=False)
    out = tmp_path / "killed"
    toml = tmp_path / "run.toml"
    _write_toml(toml, _config(out, tiny_model_dir, steps))
    command = [sys.executable, "-m", "prime_node", "run-trainer", "--config", str(toml), "--local"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list_checkpoints(out / "checkpoints")) < 3:
        time.sleep(0.05)
    while time.monotonic() < deadline and list_checkpoints(out / "checkpoints")[-1].step < 8:
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    logged = len(RolloutLog(out / "rollouts.log"))
    last = list_checkpoints(out / "checkpoints")[-1].step
    assert 8 <= last < steps and logged >= last
    oldest = list_checkpoints(out / "checkpoints")[0].step
    accepted = RolloutLog(out / "rollouts.log").batches_from(0)
    assert sorted(accepted) == list(range(len(accepted)))  # every accepted batch, in order, none torn
    untrained = {k for k in accepted if k >= last}  # accepted but in no checkpoint yet: must survive
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert finished.returncode == 0, finished.stderr
    after = RolloutLog(out / "rollouts.log").batches_from(0)
    # The restart compacted batches already inside every kept checkpoint; none of the rest is missing.
    assert sorted(after) == list(range(oldest, steps))
    assert untrained <= set(after)
    assert all(after[k] == accepted[k] for k in accepted if k >= oldest)  # replayed, not redrawn
    expected, got = _final_weights(reference), _final_weights(out)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    results = {}
    for nproc in (1, 2):
        out = tmp_path / f"n{nproc}"
        toml = tmp_path / f"n{nproc}.toml"
        _write_toml(toml, _config(out, tiny_model_dir, 4, prompts_per_step=6))
        command = [
            sys.executable,
            "-m",
            "prime_node",
            "run-trainer",
            "--config",
            str(toml),
            "--local",
            "--nproc",
            str(nproc),
        ]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        results[nproc] = _final_weights(out)
    moved = read_weights(list_checkpoints(tmp_path / "n1" / "checkpoints")[0].path)
    assert any(not torch.equal(moved[k], results[1][k]) for k in moved)  # training really changed weights
    for key, tensor in results[1].items():
        assert torch.allclose(tensor, results[2][key], rtol=1e-4, atol=1e-6), key


def test_a_code_task_trains_through_the_real_sandbox(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The tiny model writes no working code: every completion runs in the sandbox and scores 0, the
    length reward alone gives the step a gradient, and nothing crashes."""
    config = _config(
        tmp_path / "code",
        tiny_model_dir,
        1,
        group_size=2,
        prompts_per_step=2,
        task={
            "kind": "code",
            "path": str(REPO / "examples" / "data" / "code_sample.jsonl"),
            "code_timeout_s": 2.0,
        },
    )
    result = run_local(config, evaluate=False)
    assert len(result.steps) == 1 and result.steps[0].groups_kept + result.steps[0].groups_dropped == 2


def test_inference_in_a_child_process_gives_the_same_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    """local_inference = "process" moves generation out of the trainer's GIL; batches depend only on
    their policy and seeds, so the run is bit-identical to the threaded one."""
    threaded = run_local(_config(tmp_path / "thread", tiny_model_dir, 5), evaluate=False)
    child = run_local(
        _config(tmp_path / "process", tiny_model_dir, 5, local_inference="process"), evaluate=False
    )
    assert [m.policy_step for m in child.steps] == [m.policy_step for m in threaded.steps] == [0, 0, 0, 1, 2]
    expected, got = _final_weights(tmp_path / "thread"), _final_weights(tmp_path / "process")
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert RolloutLog(tmp_path / "process" / "rollouts.log").batches_from(0) == RolloutLog(
        tmp_path / "thread" / "rollouts.log"
    ).batches_from(0)
