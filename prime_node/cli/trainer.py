"""``prime-node run-trainer``: the GRPO trainer (``--local``: with its own inference, no network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("run-trainer")(run_trainer)


def run_trainer(
    config: Annotated[Path, typer.Option("--config", help="Run config (TOML).", dir_okay=False)],
    model: Annotated[
        Path | None, typer.Option("--model", help="Model directory (overrides model_dir).")
    ] = None,
    nproc: Annotated[
        int, typer.Option("--nproc", min=1, help="Trainer processes via torchrun (gloo/NCCL).")
    ] = 1,
    local: Annotated[
        bool, typer.Option("--local", help="Generate rollouts in-process (no network).")
    ] = False,
    output: Annotated[
        Path | None, typer.Option("--output", help="Output directory (overrides output_dir).")
    ] = None,
    max_steps: Annotated[int | None, typer.Option("--max-steps", min=0, help="Override max_steps.")] = None,
) -> None:
    """Train with GRPO; resumes from the newest checkpoint in the output directory."""
    from prime_node.config import load_run_config
    from prime_node.errors import NodeError

    overrides: dict[str, object] = {}
    if model is not None:
        overrides["model_dir"] = str(model)
    if output is not None:
        overrides["output_dir"] = str(output)
    if max_steps is not None:
        overrides["max_steps"] = max_steps
    run = load_run_config(config, overrides=overrides)  # fail fast, before spawning anything
    if not local:
        raise NodeError(
            "the networked trainer needs the swarm layer; run with --local for in-process rollouts",
            reason="not_available",
        )
    args = ["--config", str(config)] + [
        arg for key, value in overrides.items() for arg in (f"--{key.replace('_', '-')}", str(value))
    ]
    if nproc > 1:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "prime_node.ml.dist_entry",
            *args,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        code = subprocess.call(command, env=env)
        if code != 0:
            raise NodeError(f"torchrun exited with status {code}", reason="trainer_failed")
        return
    from prime_node.ml.local_run import run_local

    result = run_local(
        run,
        on_step=lambda m: typer.echo(
            json.dumps(
                {
                    "step": m.step,
                    "reward": round(m.reward_mean, 4),
                    "groups_kept": m.groups_kept,
                    "loss": round(m.loss, 5),
                    "grad_norm": round(m.grad_norm, 4),
                }
            )
        ),
    )
    for point in result.evals:
        typer.echo(json.dumps({"eval_step": point.step, "heldout_greedy_accuracy": point.accuracy}))
