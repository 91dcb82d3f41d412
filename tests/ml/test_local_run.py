"""The --local trainer end to end: checkpoints, the rollout log, resume (in-process and after SIGKILL),
and torchrun with 2 gloo processes against 1 process.

A random tiny model solves no addition, so these runs add a length reward: completions of different
lengths earn different rewards, which gives GRPO real gradients without a warm-up.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from prime_node.config import RunConfig
from prime_node.ml.checkpoint import list_checkpoints, read_weights
from prime_node.ml.local_run import run_local
from prime_node.ml.rollout_log import RolloutLog
from prime_node.ml.sharded_checkpoint import list_sharded, newest_sharded
from tests import warm_cli
from tests.ml import gloo_step_worker

REPO = Path(__file__).resolve().parents[2]


def _fields(message: Any, leave_out: str) -> dict[str, Any]:
    return {f.name: getattr(message, f.name) for f in dataclasses.fields(message) if f.name != leave_out}


def _floats(raw: bytes) -> torch.Tensor:
    """A sample's log-probabilities (little-endian float32 on the wire)."""
    return torch.frombuffer(bytearray(raw), dtype=torch.float32)


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
            # The inference stage in a thread of this process: no child that loads torch again (several
            # CPU-seconds each). The child process is checked against the thread in
            # test_inference_in_a_child_process_gives_the_same_run, and runs in the CLI runs of the SIGKILL
            # test and of the 2-rank run-trainer test.
            "local_inference": "thread",
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
    split = tmp_path / "split"
    first = run_local(_config(split, tiny_model_dir, 3, checkpoint_every=4))
    # As if killed after batch 2 was logged but before step 3's training state and checkpoint were
    # written: the only training state left is step 0's... which the newer one replaced, so the restart
    # starts from the base model and replays batches 0, 1 and 2.
    assert [s.step for s in list_sharded(split / "train_state")] == [3]
    shutil.rmtree(split / "train_state" / "sharded_00000003")
    shutil.rmtree(split / "checkpoints" / "step_00000003")
    logged = RolloutLog(split / "rollouts.log").batches_from(0)
    resumed = run_local(_config(split, tiny_model_dir, 5, checkpoint_every=4))
    assert len(first.steps) == 3 and resumed.start_step == 0
    assert [m.step for m in resumed.steps] == [1, 2, 3, 4, 5]
    log = RolloutLog(split / "rollouts.log")
    assert sorted(log.batches_from(0)) == [0, 1, 2, 3, 4]  # nothing compacted: the resume started at 0
    assert all(log.batches_from(0)[k] == logged[k] for k in logged)  # replayed, not drawn again
    assert [s.step for s in list_sharded(split / "train_state")] == [5]
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
    # Killed once checkpoint 8 exists (3 kept: the log has been compacted), so 20 leaves the rerun 12 steps.
    steps = 20
    reference = tmp_path / "reference"
    run_local(_config(reference, tiny_model_dir, steps), evaluate=False)
    out = tmp_path / "killed"
    toml = tmp_path / "run.toml"
    # As a user runs it: the inference stage in its child process (the reference used a thread; the two
    # give the same run).
    # Training state every 4 steps: the rerun replays the logged steps after the newest one.
    _write_toml(toml, _config(out, tiny_model_dir, steps, local_inference="process", checkpoint_every=4))
    command = [sys.executable, "-m", "prime_node", "run-trainer", "--config", str(toml), "--local"]
    process = warm_cli.popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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
    state = newest_sharded(out / "train_state")
    assert state is not None and state.step % 4 == 0
    oldest = min(list_checkpoints(out / "checkpoints")[0].step, state.step)
    accepted = RolloutLog(out / "rollouts.log").batches_from(0)
    assert sorted(accepted) == list(range(len(accepted)))  # every accepted batch, in order, none torn
    untrained = {k for k in accepted if k >= last}  # accepted but in no checkpoint yet: must survive
    finished = warm_cli.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert finished.returncode == 0, finished.stderr
    after = RolloutLog(out / "rollouts.log").batches_from(0)
    # The restart compacted batches no resume can need (inside every kept checkpoint and the training
    # state); none of the rest is missing.
    assert sorted(after) == list(range(oldest, steps))
    assert untrained <= set(after)
    assert all(after[k] == accepted[k] for k in accepted if k >= oldest)  # replayed, not redrawn
    # The uninterrupted run's weights, to float rounding (other processes need not sum in the same
    # order; one step more or less moves weights by ~lr = 3e-3, far outside this tolerance).
    expected, got = _final_weights(reference), _final_weights(out)
    assert expected.keys() == got.keys()
    assert all(torch.allclose(expected[k], got[k], rtol=1e-4, atol=1e-6) for k in expected)


def _gloo_step_batch(model_dir: Path, out: Path) -> Path:
    """A fixed prepared batch for ``gloo_step_worker.py``: 6 groups of 4 samples (arithmetic prompts,
    random completions of 1 to 6 tokens, so ranks hold different token counts), random advantages,
    behaviour log-probs = the model's own plus noise (importance weights vary, some hit is_cap), and a
    config whose gradient clip never bites (the raw summed gradient is compared, scale included)."""
    from prime_node.ml.evaluation import encode_prompt
    from prime_node.ml.grpo import group_advantages
    from prime_node.ml.model import load_model
    from prime_node.ml.tokenizer import load_tokenizer
    from prime_node.tasks.arithmetic import ArithmeticTask

    model, tokenizer, task = load_model(model_dir), load_tokenizer(model_dir), ArithmeticTask(2)
    generator = torch.Generator().manual_seed(11)
    groups, group_size = 6, 4
    sequences, prompt_lengths, behaviour = [], [], []
    for g in range(groups):
        prompt = encode_prompt(tokenizer, task.prompt(task.train_ids()[97 * g]))
        for _ in range(group_size):
            length = int(torch.randint(1, 7, (1,), generator=generator))
            completion = torch.randint(3, len(tokenizer), (length,), generator=generator).tolist()
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
            own = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
            noise = 0.5 * torch.randn(length, generator=generator)
            sequences.append(prompt + completion)
            prompt_lengths.append(len(prompt))
            behaviour.append((own + noise).tolist())
    rewards = torch.randn(groups, group_size, generator=generator, dtype=torch.float64)
    document = {
        "config": {
            "output_dir": str(out / "unused"),
            "group_size": group_size,
            "prompts_per_step": groups,
            "max_new_tokens": 6,
            "temperature": 1.0,
            "threads": 1,
            "micro_batch_samples": 5,
            "grad_clip": 1e9,
        },
        "prepared": {
            "policy_step": 0,
            "sequences": sequences,
            "prompt_lengths": prompt_lengths,
            "advantages": group_advantages(rewards).flatten().tolist(),
            "reward_mean": float(rewards.mean()),
            "groups_kept": groups,
            "groups_dropped": 0,
            "behaviour_logprobs": behaviour,
        },
    }
    path = out / "batch.json"
    path.write_text(json.dumps(document))
    return path


def _gloo_step(
    model_dir: Path,
    batch: Path,
    out: Path,
    nproc: int,
    *,
    env: dict[str, str] | None = None,
    sabotage: str = "",
    steps: int = 1,
) -> list[dict[str, torch.Tensor]]:
    """Run ``gloo_step_worker.py`` under torchrun with ``nproc`` gloo ranks (one rank: in this process,
    the code torchrun's single rank runs, see the worker's doc); the full gradient of the first step as
    every rank gathered it."""
    from safetensors.torch import load_file

    arguments = ["--model", str(model_dir), "--batch", str(batch), "--out", str(out), "--steps", str(steps)]
    if nproc == 1 and not sabotage and env is None:
        gloo_step_worker.train(arguments)
        return [load_file(str(out / "grads_rank0.safetensors"))]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(REPO / "tests" / "ml" / "gloo_step_worker.py"),
        *arguments,
        *(("--sabotage", sabotage) if sabotage else ()),
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(
        command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [load_file(str(out / f"grads_rank{rank}.safetensors")) for rank in range(nproc)]


def _gradient_gap(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """Worst over parameters of max|expected - got| / max|expected|: the error relative to each
    tensor's own gradient scale (elementwise relative error is meaningless for entries near 0)."""
    assert expected.keys() == got.keys()
    worst = 0.0
    for key, tensor in expected.items():
        scale = float(tensor.abs().max())
        gap = float((tensor - got[key]).abs().max())
        worst = max(worst, gap / scale if scale > 0 else (math.inf if gap > 0 else 0.0))
    return worst


GLOO_GRADIENT_TOLERANCE = 1e-4
GLOO_LOSS_TOLERANCE = 1e-5
GLOO_CURVE_STEPS = 6


@pytest.fixture(scope="module")
def gloo_runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, GlooRun]:
    """``GLOO_CURVE_STEPS`` FSDP2 steps on one fixed batch with 1 rank (in this process) and with 2 gloo
    ranks (torchrun): the full gradient of the first step on every rank, and rank 0's loss and grad-norm
    curve."""
    root = tmp_path_factory.mktemp("gloo")
    batch = _gloo_step_batch(tiny_model_dir, root)
    runs = {}
    for nproc in (1, 2):
        out = root / f"n{nproc}"
        grads = _gloo_step(tiny_model_dir, batch, out, nproc, steps=GLOO_CURVE_STEPS)
        runs[nproc] = GlooRun(grads, json.loads((out / "metrics.json").read_text()))
    return runs


@dataclasses.dataclass
class GlooRun:
    grads: list[dict[str, torch.Tensor]]
    metrics: dict[str, Any]


@pytest.mark.slow
def test_two_gloo_processes_sum_the_gradient_of_one_process(gloo_runs: dict[int, GlooRun]) -> None:
    """One GRPO step's gradient on FSDP2, reduce-scattered over 2 gloo ranks under torchrun and gathered
    back, equals the 1-rank gradient of the same batch up to float reassociation, on both ranks.

    Why one step's gradient and not weights after several steps: training is chaotic (and AdamW's first
    step is nearly lr * sign(gradient)), so a 1e-7 reassociation difference grows into a different
    trajectory; the old 4-step weight comparison (rtol 1e-4) failed on an AVX2 machine. The summed
    gradient is what data parallelism promises to preserve.

    Measured on this batch under FSDP2 (gap = max over parameters of max|g_a - g_b| / max|g_a|; the
    gradient clip is disabled so scale errors show): 2 ranks vs 1 rank 3.7e-7 with AVX2 kernels and
    3.3e-7 with ATEN_CPU_CAPABILITY=default (scalar), the same for 1 and 2 threads; the worst pair across
    all of those settings (AVX2 vs scalar kernels, 1 vs 2 ranks, 1 vs 2 threads) 1.1e-6. The tolerance,
    1e-4, is ~90x that worst and ~270x the same-machine gap. Broken data parallelism lands four orders
    of magnitude outside it (``gloo_step_worker.py --sabotage``): rank 1's samples dropped 1.69,
    FSDP2's default mean over ranks instead of the sum 0.50, each rank normalising by its own shard's
    tokens 1.53.
    """
    one, (first, second) = gloo_runs[1].grads[0], gloo_runs[2].grads
    assert max(float(t.abs().max()) for t in one.values()) > 0  # the batch really has a gradient
    assert _gradient_gap(one, first) < GLOO_GRADIENT_TOLERANCE
    assert _gradient_gap(one, second) < GLOO_GRADIENT_TOLERANCE


@pytest.mark.slow
def test_two_gloo_processes_follow_the_loss_curve_of_one_process(gloo_runs: dict[int, GlooRun]) -> None:
    """Six FSDP2 steps on one batch: the 2-rank loss and grad-norm curves follow the 1-rank ones.

    Measured (rank 0's curves, max over the 6 steps of |a - b|; losses run from -0.004 to -0.22, grad
    norms from 1.57 to 0.70): 2 ranks vs 1 rank 3.7e-8 (loss) and 1.2e-7 (grad norm) with AVX2 kernels,
    3.8e-8 and 1.2e-7 with ATEN_CPU_CAPABILITY=default; the worst pair across AVX2/scalar kernels, 1/2
    ranks and 1/2 threads 5.2e-8 and 2.4e-7. The tolerances (1e-5 on the loss, 1e-4 relative on the
    norm) are ~200x those worsts. Sabotaged runs (see the test above): rank 1's samples dropped misses
    by 0.15 on the loss, the per-shard normaliser by 0.12. FSDP2's mean instead of the sum halves every
    gradient, which AdamW's scale invariance hides from the loss curve (5.2e-7): the grad-norm curve
    catches it (off by 0.79), as does the gradient test.
    """
    one, two = gloo_runs[1].metrics, gloo_runs[2].metrics
    assert two["world_size"] == 2 and len(one["losses"]) == len(two["losses"]) == GLOO_CURVE_STEPS
    assert one["losses"][-1] < one["losses"][0] - 0.1  # the curve really moves: the steps train
    assert two["losses"] == pytest.approx(one["losses"], rel=0, abs=GLOO_LOSS_TOLERANCE)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=GLOO_GRADIENT_TOLERANCE)


@pytest.mark.slow
def test_run_trainer_with_two_gloo_processes_trains(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The launcher end to end (run-trainer --local --nproc 2: torchrun, dist_entry, rank 0 admitting and
    broadcasting each step, rank 1 following): it finishes, writes the sharded training state and moves
    the weights. Whether 2 ranks compute the 1-rank gradient and loss curve is the tests above.

    With --dtype bf16: the flag goes through torchrun to each rank's run config (dist_entry would refuse
    an argument it does not know) and the fp32 master weights train. The same launcher in fp32 (the
    default on CPU) runs in tests/ml/test_kill_resume.py and tests/ml/test_qwen3_example_run.py; what
    bf16 compute does to the gradient is tests/ml/test_fsdp.py's."""
    out = tmp_path / "n2"
    toml = tmp_path / "n2.toml"
    # Rank 0's inference stage in its child process, as a user's run has it.
    _write_toml(toml, _config(out, tiny_model_dir, 3, prompts_per_step=6, local_inference="process"))
    command = [sys.executable, "-m", "prime_node", "run-trainer", "--config", str(toml), "--local"]
    done = warm_cli.run(
        [*command, "--nproc", "2", "--dtype", "bf16"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # rank 0 prints each step's line and each evaluation's (eval_step) as they happen
    steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"step"')]
    assert [s["step"] for s in steps] == [1, 2, 3]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(math.isfinite(m["loss"]) for m in metrics)
    start, final = read_weights(list_checkpoints(out / "checkpoints")[0].path), _final_weights(out)
    assert all(start[k].dtype == final[k].dtype for k in start)  # fp32 master weights, compared as such
    assert all(torch.isfinite(t).all() for t in final.values())
    assert any(not torch.equal(start[k], final[k]) for k in start)  # training really changed weights
    states = list_sharded(out / "train_state")
    assert states and states[-1].step == 3 and states[-1].world_size == 2


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
    their policy and seeds, so the run is the threaded one: the same tokens, rewards and policy steps
    (both load the starting policy as published), log-probabilities and weights equal to float rounding
    (two processes need not sum in the same order)."""
    threaded = run_local(
        _config(tmp_path / "thread", tiny_model_dir, 5, local_inference="thread"), evaluate=False
    )
    child = run_local(
        _config(tmp_path / "process", tiny_model_dir, 5, local_inference="process"), evaluate=False
    )
    assert [m.policy_step for m in child.steps] == [m.policy_step for m in threaded.steps] == [0, 0, 0, 1, 2]
    expected, got = _final_weights(tmp_path / "thread"), _final_weights(tmp_path / "process")
    assert expected.keys() == got.keys()
    assert all(torch.allclose(expected[k], got[k], rtol=1e-4, atol=1e-6) for k in expected)
    logged = [RolloutLog(tmp_path / run / "rollouts.log").batches_from(0) for run in ("process", "thread")]
    assert logged[0].keys() == logged[1].keys() == {0, 1, 2, 3, 4}
    for step, batch in logged[0].items():
        other = logged[1][step]
        assert _fields(batch, "samples") == _fields(other, "samples")
        for mine, theirs in zip(batch.samples, other.samples, strict=True):
            assert _fields(mine, "logprobs") == _fields(theirs, "logprobs")  # every token and reward
            assert torch.allclose(_floats(mine.logprobs), _floats(theirs.logprobs), rtol=1e-5, atol=1e-6)
