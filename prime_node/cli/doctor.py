"""``prime-node doctor``: the first command a home user runs. Checks this machine and its path to the swarm
(prime_node/doctor/), prints one line per check with a one-line fix under each problem, and exits 1 if
any check failed (warnings do not fail)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from prime_node.cli.network_options import BootstrapOption, DataDirOption, join_target
from prime_node.cli.options import JsonOption
from prime_node.errors import NodeError
from prime_node.paths import default_data_dir
from protocol.probe import MAX_PROBE_BYTES


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)


def doctor(
    bootstrap: BootstrapOption = None,
    run: Annotated[
        str | None,
        typer.Option(
            "--run",
            help="A run address RUN@0xTRAINER,BOOTSTRAP... (as join --run): adds its bootstraps, and sizes "
            "the role from the run's signed config and newest checkpoint, as join would.",
        ),
    ] = None,
    as_json: JsonOption = False,
    data_dir: DataDirOption = None,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            help="The run's model directory, to size disk and role (default: an estimate).",
            file_okay=False,
        ),
    ] = None,
    run_config: Annotated[
        Path | None,
        typer.Option(
            "--run-config", help="The run's TOML config (its model_dir and async_level).", dir_okay=False
        ),
    ] = None,
    gpu: Annotated[
        str, typer.Option("--gpu", help="GPUs to check: auto, none, or indices such as 0,1.")
    ] = "auto",
    role: Annotated[
        str | None,
        typer.Option("--role", help="Check a pinned role (as join --role) instead of the policy's."),
    ] = None,
    threads: Annotated[
        int, typer.Option("--threads", help="As join --threads: the cores the role computes with (0: all).")
    ] = 0,
    listen: Annotated[
        str, typer.Option("--listen", help="Where the doctor's throwaway libp2p host listens.")
    ] = "/ip4/0.0.0.0/tcp/0",
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds each network step may take.")] = 5.0,
    probe_bytes: Annotated[
        int,
        typer.Option(
            "--probe-bytes", help=f"Bytes each way for the bandwidth probe (at most {MAX_PROBE_BYTES})."
        ),
    ] = 1 << 20,
) -> None:
    """Check Python, torch and CUDA, GPU/VRAM, RAM, disk for the run's checkpoints and the role this machine
    would take (with --run: the role join would take in that run, for its model); with --bootstrap also
    the bootstrap peers (latency), reachability (NAT), clock skew and bandwidth. One line per check, a fix
    under each problem; exit 1 if any check failed."""
    from prime_node.doctor.checkup import DoctorOptions, run_doctor

    if not 1 <= probe_bytes <= MAX_PROBE_BYTES:
        raise NodeError(f"--probe-bytes must be between 1 and {MAX_PROBE_BYTES}", reason="bad_config")
    if not 0 < timeout <= 120:
        raise NodeError("--timeout must be in (0, 120] seconds", reason="bad_config")
    peers = list(bootstrap or ())
    target = join_target(run, None) if run is not None else None
    if target is not None:
        peers += target.bootstrap
    options = DoctorOptions(
        bootstrap=tuple(peers),
        listen=listen,
        data_dir=data_dir if data_dir is not None else default_data_dir(),
        model_dir=model,
        run_config=run_config,
        gpus=gpu,
        role=None if role in (None, "auto") else role,
        timeout=timeout,
        probe_bytes=probe_bytes,
        run_id=target.run_id if target is not None and target.trainer is not None else None,
        trainer=target.trainer if target is not None else None,
        threads=threads,
    )
    report = run_doctor(options)
    if as_json:
        typer.echo(report.to_json_text())
    else:
        for line in report.lines():
            typer.echo(line)
    raise typer.Exit(report.exit_code)
