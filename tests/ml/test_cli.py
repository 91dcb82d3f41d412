"""The commands as a user runs them: init-model, run-trainer and filter-tasks, including their errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from prime_node.ml.model import load_model
from tests import warm_cli
from tests.cli_in_process import run_cli

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return warm_cli.run(
        [sys.executable, "-m", "prime_node", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_init_model_writes_a_loadable_directory_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tiny"
    done = run_cli(capsys, "init-model", "--tiny", str(out), "--no-warmup", "--seed", "4", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["parameters"] > 100_000 and "warmup_steps" not in summary
    assert load_model(out) is not None
    again = _cli("init-model", "--tiny", str(out), "--no-warmup")
    assert again.returncode == 1 and again.stderr.startswith("error:") and "not empty" in again.stderr
    no_tiny = _cli("init-model", str(tmp_path / "other"))
    assert no_tiny.returncode == 1 and "--tiny" in no_tiny.stderr


def test_run_trainer_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("eps_high = -1\n")
    done = _cli("run-trainer", "--config", str(bad), "--local")
    assert done.returncode == 1 and done.stderr.strip().count("\n") == 0 and "field eps_high" in done.stderr
    # The next two load torch before they fail (a fresh process each would spend most of its time on it).
    good = tmp_path / "good.toml"
    good.write_text(f'model_dir = "{tmp_path / "missing"}"\n')
    done = run_cli(capsys, "run-trainer", "--config", str(good))
    assert done.returncode == 1 and "--local" in done.stderr
    done = run_cli(capsys, "run-trainer", "--config", str(good), "--local", "--output", str(tmp_path / "out"))
    assert done.returncode == 1 and "does not exist" in done.stderr and done.stderr.strip().count("\n") == 0


def test_run_trainer_local_and_filter_tasks(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """run-trainer --local in this process (as a real process it runs in tests/ml/test_local_run.py's
    SIGKILL test), filter-tasks as a real process."""
    config = tmp_path / "run.toml"
    config.write_text(
        "group_size = 4\nprompts_per_step = 2\nmax_new_tokens = 4\neval_tasks = 10\nthreads = 1\n"
        "[length_reward]\ncoef = 1.0\ntarget_tokens = 2\n"
    )
    out = tmp_path / "out"
    done = run_cli(
        capsys,
        "run-trainer",
        "--config",
        str(config),
        "--model",
        str(tiny_model_dir),
        "--local",
        "--output",
        str(out),
        "--max-steps",
        "2",
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["step"] for line in lines if "step" in line] == [1, 2]
    assert [line["eval_step"] for line in lines if "eval_step" in line] == [0, 2]
    assert (out / "checkpoints" / "step_00000002" / "model.safetensors").is_file()
    kept = tmp_path / "kept.jsonl"
    done = _cli(
        "filter-tasks",
        "--config",
        str(config),
        "--model",
        str(tiny_model_dir),
        "--limit",
        "6",
        "--samples",
        "2",
        "--lo",
        "0",
        "--hi",
        "1",
        "--out",
        str(kept),
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in kept.read_text().splitlines()]
    assert len(rows) == 6 and all(0 <= row["pass_rate"] <= 1 for row in rows)


def test_run_trainer_refuses_an_unknown_dtype_in_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    """An unknown --dtype name is one line before anything starts. That --dtype bf16 goes through torchrun
    to each rank's run config (dist_entry would refuse an argument it does not know) is
    tests/ml/test_local_run.py's test_run_trainer_with_two_gloo_processes_trains; what bf16 compute does
    to the gradient is tests/ml/test_fsdp.py's."""
    config = tmp_path / "run.toml"
    config.write_text(
        "group_size = 4\nprompts_per_step = 2\nmax_new_tokens = 4\neval_tasks = 0\nthreads = 1\n"
        "[length_reward]\ncoef = 1.0\ntarget_tokens = 2\n"
    )
    common = ["run-trainer", "--config", str(config), "--model", str(tiny_model_dir), "--local"]
    wrong = _cli(*common, "--output", str(tmp_path / "wrong"), "--dtype", "fp16")
    assert wrong.returncode == 1 and "--dtype 'fp16'" in wrong.stderr
    assert wrong.stderr.strip().count("\n") == 0 and not (tmp_path / "wrong").exists()


def test_run_trainer_local_prints_each_evaluation_as_it_happens(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Issue 36: ``run-trainer --local`` printed its held-out evaluations all together after the last step.
    As a real process, each evaluation's line comes between the steps around it (order of lines, not
    time): the start, after step 1 (eval_every = 1), and the final one after the last step."""
    config = tmp_path / "run.toml"
    config.write_text(
        "group_size = 4\nprompts_per_step = 2\nmax_new_tokens = 4\neval_tasks = 4\neval_every = 1\n"
        'threads = 1\nlocal_inference = "thread"\n[length_reward]\ncoef = 1.0\ntarget_tokens = 2\n'
    )
    done = _cli(
        "run-trainer",
        "--config",
        str(config),
        "--model",
        str(tiny_model_dir),
        "--local",
        "--output",
        str(tmp_path / "out"),
        "--max-steps",
        "2",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    order = [("eval", line["eval_step"]) if "eval_step" in line else ("step", line["step"]) for line in lines]
    assert order == [("eval", 0), ("step", 1), ("eval", 1), ("step", 2), ("eval", 2)]


@pytest.mark.slow
def test_run_trainer_nproc_prints_each_line_as_it_happens(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Issue 36: ``run-trainer --local --nproc 2`` printed its step lines only after the last step (rank 0
    printed the run's result at the end). As a real process (torchrun, two gloo ranks), read line by line:
    the start's evaluation and step 1 arrive while the run is still going, so it can be stopped there,
    well before its last step (order of events, no time bound)."""
    config = tmp_path / "run.toml"
    config.write_text(
        "group_size = 4\nprompts_per_step = 2\nmax_new_tokens = 4\neval_tasks = 4\nthreads = 1\n"
        'local_inference = "thread"\n[length_reward]\ncoef = 1.0\ntarget_tokens = 2\n'
    )
    out, steps = tmp_path / "out", 100
    command = [sys.executable, "-m", "prime_node", "run-trainer", "--config", str(config), "--local"]
    command += ["--model", str(tiny_model_dir), "--output", str(out), "--max-steps", str(steps)]
    command += ["--nproc", "2"]
    with (tmp_path / "stderr.txt").open("w") as errors:
        process = subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=errors, text=True, start_new_session=True
        )
        guard = threading.Timer(600, lambda: os.killpg(process.pid, signal.SIGKILL))  # hang guard only
        guard.daemon = True
        guard.start()
        try:
            assert process.stdout is not None
            first = [json.loads(process.stdout.readline())]
            metrics = out / "metrics.jsonl"
            written = metrics.read_text().splitlines() if metrics.exists() else []
            assert len(written) < steps  # the first line came while the run was still training
            first.append(json.loads(process.stdout.readline()))
            assert first[0].get("eval_step") == 0 and first[1].get("step") == 1, first
            process.send_signal(signal.SIGTERM)  # stopping it there (the launcher stops every rank)
            rest = [json.loads(line) for line in process.stdout if line.startswith("{")]
            assert process.wait() == 130
        finally:
            guard.cancel()
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    printed = [line["step"] for line in first + rest if "step" in line]
    assert printed == list(range(1, len(printed) + 1)) and len(printed) < steps
