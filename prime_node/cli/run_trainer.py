"""``prime-node run-trainer``: the GRPO trainer (``--local``: with its own inference, no network)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from prime_node.cli.network_options import DEFAULT_FLAGS, NodeFlags, dataplane_host_for, with_node_flags
from prime_node.cli.options import KeepBatchesOption
from prime_node.errors import NodeError
from prime_node.node.data_dir_lock import check_data_dir_free
from prime_node.roles.rendezvous import Rendezvous, parse_rendezvous
from prime_node.roles.rendezvous import gloo_interface as find_interface
from prime_node.roles.trainer_launcher import LaunchSpec, launch_networked, run_torchrun

if TYPE_CHECKING:
    from prime_node.hardware import GpuSelection


def register(app: typer.Typer) -> None:
    app.command("run-trainer")(run_trainer)


@with_node_flags()
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
    dtype: Annotated[
        str | None,
        typer.Option("--dtype", help="Training compute dtype: bf16, fp32 or auto (overrides train_dtype)."),
    ] = None,
    gpu: Annotated[
        str,
        typer.Option(
            "--gpu", help="GPUs to train on: auto, none (CPU), or indices such as 0,1 (one per --nproc rank)."
        ),
    ] = "auto",
    nnodes: Annotated[
        int, typer.Option("--nnodes", help="Machines in a multi-node run (each runs --nproc ranks).")
    ] = 1,
    node_rank: Annotated[
        int, typer.Option("--node-rank", help="This machine's place among --nnodes (node 0 holds the key).")
    ] = 0,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option("--rdzv-endpoint", help="Multi-node: node 0's HOST:PORT, where every node meets."),
    ] = None,
    gloo_interface: Annotated[
        str | None,
        typer.Option(
            "--gloo-interface",
            help="Network interface for gloo (default: lo on one node, else the one towards the endpoint).",
        ),
    ] = None,
    node: NodeFlags = DEFAULT_FLAGS,
    keep_batches: KeepBatchesOption = 0,
    exit_when_done: Annotated[
        bool,
        typer.Option("--exit-when-done", help="Networked: exit after max_steps (default: keep seeding)."),
    ] = False,
) -> None:
    """Train with GRPO; resumes from the newest checkpoint in the output directory.

    Without --local this is the networked trainer node: it must hold the run's trainer key, shares each
    policy through the weight swarm, gossips the signed run config, and trains only on batches its
    trusted validators accepted. Networking flags are those of `join`. With --nproc N either way runs
    under torchrun; networked, rank 0 is the node and the other ranks only train. Across machines, run
    it on each with --nnodes, its --node-rank and node 0's --rdzv-endpoint; only node 0 needs the key,
    and the output directory must be storage every machine shares (docs/quickstart.md)."""
    from prime_node.config import load_run_config
    from prime_node.hardware import parse_gpu_selection

    rendezvous = parse_rendezvous(nnodes, node_rank, rdzv_endpoint, gloo_interface)
    rendezvous = dataclasses.replace(rendezvous, interface=find_interface(rendezvous))
    gpus = parse_gpu_selection(gpu)
    overrides: dict[str, object] = {}
    if model is not None:
        overrides["model_dir"] = str(model)
    if output is not None:
        overrides["output_dir"] = str(output)
    if max_steps is not None:
        overrides["max_steps"] = max_steps
    if dtype is not None:
        overrides["train_dtype"] = _train_dtype(dtype)
    run = load_run_config(config, overrides=overrides)  # fail fast, before spawning anything
    if not local:
        _networked(
            run,
            node,
            exit_when_done=exit_when_done,
            nproc=nproc,
            gpus=gpus,
            rendezvous=rendezvous,
            keep_batches=keep_batches,
        )
        return
    args = ["--config", str(config)] + [
        arg for key, value in overrides.items() for arg in (f"--{key.replace('_', '-')}", str(value))
    ]
    if nproc > 1 or rendezvous.multi_node:
        run_torchrun("prime_node.ml.dist_entry", [*args, "--gpu", str(gpus)], nproc, rendezvous=rendezvous)
        return
    from prime_node.ml.distributed import init_from_env
    from prime_node.ml.local_run import eval_line, run_local, step_line

    run_local(  # each step's and each evaluation's line as it happens (issue 36: evaluations came last)
        run,
        dist=init_from_env(gpus),
        on_step=lambda m: typer.echo(step_line(m)),
        on_eval=lambda point: typer.echo(eval_line(point)),
    )


_DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}


def _train_dtype(name: str) -> str:
    """``--dtype``'s spelling as the run config's ``train_dtype`` (short or long names)."""
    if name == "auto":
        return name
    if name not in _DTYPE_NAMES:
        raise NodeError(f"--dtype {name!r}: use bf16, fp32 or auto", reason="bad_flag")
    return _DTYPE_NAMES[name]


def _networked(
    run: Any,
    flags: NodeFlags,
    *,
    exit_when_done: bool,
    nproc: int,
    gpus: GpuSelection,
    rendezvous: Rendezvous,
    keep_batches: int = 0,
) -> None:
    """The networked trainer node (prime_node/roles/trainer_node.py); with ``nproc`` > 1 or several
    nodes its rank 0, under torchrun (prime_node/roles/trainer_ranks.py). Everything that can fail is
    checked first. Nodes other than node 0 hold no rank 0: they need neither the key nor the network."""
    from prime_node.roles.trainer_node import build_trainer_node, run_trainer_node, step_line

    node_config = flags.config(run.run_id).keeping_batches(keep_batches)
    dataplane_host = dataplane_host_for(node_config.listen)
    under_torchrun = nproc > 1 or rendezvous.multi_node
    if rendezvous.node_rank > 0:
        if run.model_dir is None or not run.model_dir.is_dir():
            raise NodeError(f"model directory {run.model_dir} does not exist", reason="bad_model_dir")
        spec = LaunchSpec(run, node_config, dataplane_host, flags.dataplane_port, exit_when_done)
        launch_networked(spec, None, nproc, str(gpus), rendezvous)
        return
    check_data_dir_free(flags.directory())  # before building anything: a running trainer's files are its own
    try:
        key = flags.key()
    except NodeError as exc:
        if exc.reason != "no_keystore":
            raise
        raise NodeError(
            f"{exc}; the networked trainer needs the run's trainer key (for an in-process run without "
            "network or key, pass --local)",
            reason=exc.reason,
        ) from None
    dist = None  # under torchrun each rank sets up its own; the launcher needs no torch (3 s to import)
    if not under_torchrun:
        from prime_node.ml.distributed import init_from_env

        dist = init_from_env(gpus)
    parts = build_trainer_node(  # every check of the one-process node, before anything starts
        node_config,
        run,
        key,
        dataplane_host=dataplane_host,
        dataplane_port=flags.dataplane_port,
        on_step=lambda metrics: typer.echo(step_line(metrics)),
        dist=dist,  # one process: just its device
    )
    if under_torchrun:
        checked = parts.trainer.config  # trainer_address filled in
        if not checked.model_dir.is_dir():
            raise NodeError(f"model directory {checked.model_dir} does not exist", reason="bad_model_dir")
        spec = LaunchSpec(checked, node_config, dataplane_host, flags.dataplane_port, exit_when_done)
        launch_networked(spec, key, nproc, str(gpus), rendezvous)
        return
    run_trainer_node(node_config, parts, key, echo=typer.echo, exit_when_done=exit_when_done)
