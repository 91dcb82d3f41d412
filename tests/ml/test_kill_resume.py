"""A SIGKILLed rank of `run-trainer --local --nproc 2` (torchrun, gloo, FSDP2): the rerun of the same
command resumes from the newest complete sharded checkpoint, replays the logged batches and finishes
``max_steps`` with no admitted batch lost (issue 14, DESIGN §6).

Everything is real: the CLI, torchrun, two gloo ranks, the files in the output directory. The rank is
found among torchrun's children with psutil by the RANK in its environment.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from prime_node.ml.rollout_log import RolloutLog
from prime_node.ml.sharded_checkpoint import newest_sharded
from prime_node.warm_start.process import WarmProcess
from tests import warm_cli

REPO = Path(__file__).resolve().parents[2]
STEPS = 10
KILLS = ((1, 1, 4), (0, 3, 7))
"""(rank killed, checkpoint_every, step): the first launch saves the training state after every step and
loses rank 1 once step 4 is in metrics.jsonl; the second, its rerun, saves it every 3 steps and loses
rank 0 once step 7 is there; the third runs to STEPS. Each kill waits for the state its checkpoint_every
promises before it (steps 3 and 6), so the resume point does not depend on how far a save running beside
the next step had got (the claims hold for any kill points: these keep the runs short)."""
LOSS_RTOL = 1e-4
"""A step retrained after the resume starts from the same weights and AdamW state on the same batch as
before the kill, in another pair of processes. Measured here (native kernels and
ATEN_CPU_CAPABILITY=default, 1 thread per rank): the retrained step's loss equalled the first attempt's
exactly. 1e-4 relative leaves room for other machines' summation order while still far below the
difference a different batch or a different starting policy makes."""


def _write_config(path: Path, model_dir: Path, out: Path, checkpoint_every: int) -> None:
    path.write_text(
        "\n".join(
            [
                f"model_dir = {json.dumps(str(model_dir))}",
                f"output_dir = {json.dumps(str(out))}",
                f"max_steps = {STEPS}",
                "group_size = 4",
                "prompts_per_step = 4",
                "max_new_tokens = 6",
                "temperature = 1.0",
                "async_level = 2",
                "threads = 1",
                "learning_rate = 3e-3",
                "eval_tasks = 0",
                f"checkpoint_every = {checkpoint_every}",
                # Rank 0 generates in a thread, not in a child that loads torch again in every launch (the
                # child under torchrun is tests/ml/test_local_run.py's 2-rank run-trainer test; a killed
                # trainer with its child, that file's SIGKILL test).
                'local_inference = "thread"',
                "[length_reward]",
                "coef = 1.0",
                "target_tokens = 3",
            ]
        )
        + "\n"
    )


def _metrics(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _rank_process(launcher: subprocess.Popen[Any] | WarmProcess, rank: int) -> psutil.Process | None:
    """torchrun's worker process of ``rank`` (a descendant of the CLI process)."""
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if "prime_node.ml.dist_entry" in " ".join(child.cmdline()) and child.environ().get("RANK") == str(
                rank
            ):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def _stop_tree(launcher: subprocess.Popen[Any] | WarmProcess) -> None:
    """Leave no process behind if the test fails midway (the launcher runs in a session of its own)."""
    if launcher.poll() is None:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            child.kill()
        launcher.kill()
    launcher.wait(timeout=30)


@pytest.mark.slow  # three launches of torchrun with two ranks
def test_sigkilled_ranks_resume_from_sharded_checkpoints_losing_no_batch(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Killing rank 1 leaves torchrun to stop rank 0, which is blocked in the step's collectives; killing
    rank 0 takes the rollout log and the checkpoint writer down mid-run. Each rerun of the same command
    resumes from the newest sharded training state (at or before the last trained step), retrains the
    logged steps after it on the same batches to the same losses, and loses no batch: with the state
    every step (the first kill) or every 3 steps (the second, replaying the logged steps since it).

    One chain of launches on one output directory: the rerun after the first kill is the run the second
    kill stops (a launch of torchrun and two ranks fewer than two separate kill-and-rerun cases)."""
    out = tmp_path / "run"
    config = tmp_path / "run.toml"
    command = [sys.executable, "-m", "prime_node", "run-trainer", "--config", str(config), "--local"]
    command += ["--nproc", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed: _Killed | None = None  # the previous launch's kill, checked against this launch's lines
    for launch, (rank, checkpoint_every, at_step) in enumerate(KILLS):
        _write_config(config, tiny_model_dir, out, checkpoint_every)
        start = len(_metrics(out))
        state_due = (at_step - 1) // checkpoint_every * checkpoint_every

        def ready(start: int = start, at_step: int = at_step, state_due: int = state_due) -> bool:
            lines, state = _metrics(out)[start:], newest_sharded(out / "train_state")
            return (
                bool(lines) and lines[-1]["step"] >= at_step and state is not None and state.step >= state_due
            )

        _run_until_killed(command, env, tmp_path / f"launch{launch}.log", rank, ready)
        lines = _metrics(out)[start:]
        killed_at = lines[-1]["step"]
        if killed is not None:
            _check_rerun(killed, lines, _logged(out))
        first = killed.resumed_from(lines) + 1 if killed is not None else 1
        assert [m["step"] for m in lines] == list(range(first, killed_at + 1)) and killed_at < STEPS
        logged = _logged(out)
        low = 0 if killed is None else min(logged)  # a rerun compacts what no resume can need
        assert set(range(low, killed_at)) <= set(logged)  # every trained batch was logged first
        resume_point = newest_sharded(out / "train_state")
        assert resume_point is not None and state_due <= resume_point.step <= killed_at + 1
        assert resume_point.step % checkpoint_every == 0
        every_line = _metrics(out)
        killed = _Killed(killed_at, {m["step"]: m for m in every_line}, logged, len(every_line))

    assert killed is not None
    rerun = warm_cli.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=480, check=False)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    after = _metrics(out)[killed.lines :]
    _check_rerun(killed, after, _logged(out))
    assert after[-1]["step"] == STEPS
    logged_after = _logged(out)
    assert sorted(logged_after) == list(range(min(logged_after), STEPS))  # one batch per step, none lost
    final = newest_sharded(out / "train_state")
    assert final is not None and (final.step, final.world_size) == (STEPS, 2)


@dataclass
class _Killed:
    """What a killed launch left: its last trained step, each step's latest metrics line, the rollout
    log, and how many lines metrics.jsonl had."""

    killed_at: int
    trained: dict[int, dict[str, Any]]
    logged: dict[int, Any]
    lines: int

    def resumed_from(self, lines: list[dict[str, Any]]) -> int:
        return int(lines[0]["step"]) - 1


def _check_rerun(killed: _Killed, lines: list[dict[str, Any]], logged_after: dict[int, Any]) -> None:
    """The launch after a kill resumed from a sharded checkpoint (not from scratch) at or before the last
    trained step and took every later step once, in order; steps trained before the kill and again after
    it were retrained on the same logged batch from the same state (same rewards, kept groups, loss); the
    log kept every batch a resume can need and replayed, not redrew, them."""
    resumed_from = killed.resumed_from(lines)
    assert 1 <= resumed_from <= killed.killed_at
    assert [m["step"] for m in lines] == list(range(resumed_from + 1, lines[-1]["step"] + 1))
    for again in (m for m in lines if m["step"] <= killed.killed_at):
        first = killed.trained[again["step"]]
        assert (first["reward_mean"], first["groups_kept"]) == (again["reward_mean"], again["groups_kept"])
        assert math.isclose(first["loss"], again["loss"], rel_tol=LOSS_RTOL, abs_tol=1e-7)
    oldest = min(logged_after)
    assert sorted(logged_after) == list(range(oldest, max(logged_after) + 1))  # no gap
    assert oldest <= resumed_from
    assert all(logged_after[k] == killed.logged[k] for k in killed.logged if k >= oldest)  # replayed


def _logged(out: Path) -> dict[int, Any]:
    """The rollout log's batches by step (cutting a torn tail, as a rerun would)."""
    return RolloutLog(out / "rollouts.log").batches_from(0)


def _run_until_killed(
    command: list[str], env: dict[str, str], log: Path, rank: int, ready: Callable[[], bool]
) -> None:
    """Start the command, SIGKILL torchrun's worker of ``rank`` once ``ready()``, and see torchrun fail."""
    with open(log, "wb") as handle:
        launcher = warm_cli.popen(
            command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not ready():
                assert launcher.poll() is None, log.read_text()[-3000:]
                time.sleep(0.05)
            victim = _rank_process(launcher, rank)
            assert victim is not None, "no torchrun worker with that RANK"
            victim.send_signal(signal.SIGKILL)
            assert launcher.wait(timeout=180) != 0  # torchrun saw the rank die and failed the run
        finally:
            _stop_tree(launcher)
