"""``prime-node demo``: a whole swarm on this machine (trainer, validators, inferers, an adversary)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from prime_node.cli.options import JsonOption
from prime_node.errors import NodeError


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


def demo(
    inferers: Annotated[int, typer.Option("--inferers", min=0, max=16, help="Honest inferer processes.")] = 2,
    validators: Annotated[
        int, typer.Option("--validators", min=1, max=8, help="Validator processes (all trusted).")
    ] = 1,
    adversary: Annotated[
        str,
        typer.Option(
            "--adversary",
            help="Add a cheating inferer: an attack name (see prime_node/verification/cheating.py), "
            "'random', or 'none'.",
        ),
    ] = "forged_proof",
    steps: Annotated[int, typer.Option("--steps", min=1, help="Trainer steps before the demo ends.")] = 300,
    no_tui: Annotated[bool, typer.Option("--no-tui", help="Progress lines, no live view.")] = False,
    as_json: JsonOption = False,
    workdir: Annotated[
        Path | None,
        typer.Option(
            "--workdir",
            file_okay=False,
            help="Empty dir for model, wallets, logs (kept). Default: a temp dir.",
        ),
    ] = None,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the temporary workdir afterwards.")] = False,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model", file_okay=False, help="Start from this model directory instead of the packaged one."
        ),
    ] = None,
    timeout: Annotated[
        float, typer.Option("--timeout", min=10, help="Give up (and stop everything) after this many s.")
    ] = 1200.0,
    seed: Annotated[
        int, typer.Option("--seed", min=0, help="Run seed (task schedule, sampling), attack pick.")
    ] = 0,
) -> None:
    """Start a whole swarm on this machine and train a tiny model until its held-out reward rises."""
    from prime_node.demo.orchestrator import DemoOptions, DemoStopped, run_demo
    from prime_node.verification.cheating import ATTACKS

    kind: str | None = None if adversary == "none" else adversary
    if kind is not None and kind != "random" and kind not in ATTACKS:
        raise NodeError(
            f"unknown --adversary {adversary!r}: one of {', '.join(ATTACKS)}, random, none", reason="bad_flag"
        )
    from rich.console import Console

    console = Console(stderr=as_json or no_tui)

    def say(line: str) -> None:
        print(line, file=sys.stderr if as_json else sys.stdout, flush=True)

    options = DemoOptions(
        inferers=inferers,
        validators=validators,
        adversary=kind,
        steps=steps,
        tui=not no_tui,
        workdir=workdir,
        keep=keep,
        model_dir=model,
        timeout_s=timeout,
        seed=seed,
    )
    try:
        result = run_demo(options, say=say, console=console)
    except DemoStopped as stopped:
        say(f"received {signal.Signals(stopped.signum).name}: every demo process stopped")
        raise typer.Exit(128 + stopped.signum) from None
    except KeyboardInterrupt:
        say("interrupted: every demo process stopped")
        raise typer.Exit(130) from None
    summary = result.summary
    summary["workdir_kept"] = result.kept
    if as_json:
        typer.echo(json.dumps(summary))
        return
    _print_summary(summary)


def _print_summary(summary: dict[str, object]) -> None:
    lines = [
        "",
        "demo finished",
        f"  held-out accuracy   {summary['reward_start']} -> {summary['reward_end']}",
        f"  trainer steps       {summary['steps']}",
        f"  checkpoints shared  {summary['checkpoints_shared']}",
        f"  batches accepted    {summary['batches_accepted']}",
        f"  batches refused     {summary['batches_rejected'] or 0}",
        f"  validator refusals  {summary['validation_rejected'] or 0}",
    ]
    if summary.get("adversary"):
        lines.append(f"  adversary           {summary['adversary']}")
        lines.append(f"  adversary accepted  {summary['adversary_accepted']}")
    lines.append(f"  wall time           {summary.get('wall_s')} s")
    if summary.get("workdir_kept"):
        lines.append(f"  files               {summary['workdir']}")
    typer.echo("\n".join(lines))
