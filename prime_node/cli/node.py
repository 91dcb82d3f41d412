"""``prime-node join`` (run a node) and ``prime-node status`` (look at a running one)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Annotated

import typer

from prime_node.cli.network_options import (
    DEFAULT_FLAGS,
    DataDirOption,
    JoinRunOption,
    NodeFlags,
    TrainerOption,
    dataplane_host_for,
    join_target,
    with_node_flags,
)
from prime_node.cli.options import JsonOption, KeepBatchesOption
from prime_node.errors import NodeError


def register(app: typer.Typer) -> None:
    app.command("join")(join)
    app.command("status")(status)


def _progress_sink(as_json: bool) -> Callable[[str], None]:
    """Where the runner's lines go: text to stderr beside the log, JSON lines to stdout beside the
    identity line (what a script reads)."""
    if as_json:
        return lambda line: typer.echo(
            line if line.startswith("{") else json.dumps({"event": "notice", "text": line})
        )
    return lambda line: typer.echo(line, err=True)


@with_node_flags()
def join(
    node: NodeFlags = DEFAULT_FLAGS,
    role: Annotated[str, typer.Option("--role", help="auto, inferer, validator or seeder.")] = "auto",
    run: JoinRunOption = "demo",
    dead_after: Annotated[
        float,
        typer.Option("--dead-after", help="Seconds of silence before a peer is dead (0 = 6 heartbeats)."),
    ] = 0.0,
    gpu: Annotated[
        str, typer.Option("--gpu", help="GPUs this node may use: auto, none, or indices such as 0,1.")
    ] = "auto",
    threads: Annotated[
        int,
        typer.Option(
            "--threads",
            min=0,
            max=1024,
            help="Torch threads (and the cores offered) for this node's role; 0: every core this process "
            "may use, or OMP_NUM_THREADS when set.",
        ),
    ] = 0,
    trainer: TrainerOption = None,
    keep_batches: KeepBatchesOption = 0,
    adversary: Annotated[
        str | None, typer.Option("--adversary", hidden=True, help="Demo/tests: cheat as this attack kind.")
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json", help="Progress lines and the summary on exit as JSON objects on stdout (else text)."
        ),
    ] = False,
) -> None:
    """Start a node: join the swarm via a bootstrap peer, learn the run from its pinned trainer's signed
    announcement (--run RUN@0xTRAINER,BOOTSTRAP or --trainer), take a role (inferer, validator or seeder:
    from hardware and demand, or pinned with --role), fetch and re-serve checkpoints, and serve the status
    API. Without a pinned trainer it takes no role and lists the trainers that announce the run."""

    target = join_target(run, trainer)
    if target.bootstrap:
        node = dataclasses.replace(node, bootstrap=[*(node.bootstrap or ()), *target.bootstrap])
    directory = node.directory()
    config = node.config(target.run_id, role=role, dead_after=dead_after).keeping_batches(keep_batches)
    from prime_node.hardware import parse_gpu_selection

    gpus = parse_gpu_selection(gpu)
    pinned = target.trainer
    if adversary is not None:
        from prime_node.verification.cheating import ATTACKS

        if adversary not in ATTACKS:
            raise NodeError(f"--adversary must be one of {', '.join(ATTACKS)}", reason="bad_config")
    key = node.key()
    from prime_node.node.runner import run_node_until_signal
    from prime_node.roles.role_runner import RoleRunner, RoleSettings
    from prime_node.swarm.service import SwarmService, SwarmSettings

    swarm = SwarmService(
        key=key,
        run_id=config.run_id,
        trainer=pinned,
        store_dir=directory / "swarm",
        settings=SwarmSettings(
            dataplane_host=dataplane_host_for(config.listen), dataplane_port=node.dataplane_port, keep=3
        ),
    )

    runner = RoleRunner(
        key=key,
        run_id=config.run_id,
        swarm=swarm,
        data_dir=directory,
        gpus=gpus,
        settings=RoleSettings(
            pinned=role,
            trainer=pinned,
            adversary=adversary,
            threads=threads,
            progress_json=as_json,
            keep_batches=config.keep_batches,
            keep_batches_max_bytes=config.keep_batches_max_bytes,
        ),
        notify=_progress_sink(as_json),
    )
    run_node_until_signal(config, key, echo=typer.echo, services=[swarm, runner])


def status(
    api: Annotated[
        str | None, typer.Option("--api", help="Status API URL, e.g. http://127.0.0.1:8000.")
    ] = None,
    data_dir: DataDirOption = None,
    once: Annotated[bool, typer.Option("--once", help="Print one snapshot and exit.")] = False,
    as_json: JsonOption = False,
    interval: Annotated[
        float, typer.Option("--interval", help="Seconds between refreshes of the live view.")
    ] = 1.0,
) -> None:
    """Show a running node: live TUI, or one snapshot with --once (--json for scripts)."""
    from prime_node.status.client import fetch_snapshot, resolve_api_url

    url = resolve_api_url(api, data_dir)
    if once:
        data = fetch_snapshot(url)
        if as_json:
            typer.echo(json.dumps(data, indent=2))
        else:
            from prime_node.status.tui import print_once

            print_once(data)
        return
    from prime_node.status.tui import live

    live(url, interval)
