"""``prime-node join`` (run a node) and ``prime-node status`` (look at a running one)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from prime_node.cli.network_options import (
    AnnounceOption,
    ApiPortOption,
    BootstrapOption,
    BootstrapTimeoutOption,
    DataDirOption,
    DataplanePortOption,
    HeartbeatOption,
    LightKdfOption,
    ListenOption,
    NewWalletOption,
    RunOption,
)
from prime_node.cli.options import (
    JsonOption,
    KeystoreOption,
    NoPasswordOption,
    PasswordEnvOption,
    PasswordFileOption,
)


def register(app: typer.Typer) -> None:
    app.command("join")(join)
    app.command("status")(status)


def join(
    bootstrap: BootstrapOption = None,
    listen: ListenOption = "/ip4/0.0.0.0/tcp/4001",
    announce: AnnounceOption = None,
    data_dir: DataDirOption = None,
    api_port: ApiPortOption = 0,
    role: Annotated[str, typer.Option("--role", help="auto, inferer, validator or seeder.")] = "auto",
    run: RunOption = "demo",
    heartbeat_interval: HeartbeatOption = 2.0,
    dead_after: Annotated[
        float,
        typer.Option("--dead-after", help="Seconds of silence before a peer is dead (0 = 6 heartbeats)."),
    ] = 0.0,
    bootstrap_timeout: BootstrapTimeoutOption = 30.0,
    keystore: KeystoreOption = None,
    password_file: PasswordFileOption = None,
    password_env: PasswordEnvOption = None,
    no_password: NoPasswordOption = False,
    new_wallet: NewWalletOption = False,
    light_kdf: LightKdfOption = False,
    gpu: Annotated[
        str, typer.Option("--gpu", help="GPUs this node may use: auto, none, or indices such as 0,1.")
    ] = "auto",
    trainer: Annotated[
        str | None,
        typer.Option(
            "--trainer",
            help="Pin the run's trainer address: believe only run announcements it signed. Without it "
            "the first valid announcement is trusted (printed on stderr).",
        ),
    ] = None,
    dataplane_port: DataplanePortOption = 0,
    adversary: Annotated[
        str | None, typer.Option("--adversary", hidden=True, help="Demo/tests: cheat as this attack kind.")
    ] = None,
) -> None:
    """Start a node: join the swarm via a bootstrap peer, learn the run from its signed announcement, take
    a role (inferer, validator or seeder: from hardware and demand, or pinned with --role), fetch and
    re-serve checkpoints, and serve the status API."""
    from prime_node.cli.network_options import dataplane_host_for, network_config, node_key
    from prime_node.errors import NodeError
    from prime_node.paths import default_data_dir

    directory = data_dir if data_dir is not None else default_data_dir()
    config = network_config(
        listen=listen,
        announce=announce,
        bootstrap=bootstrap,
        data_dir=directory,
        api_port=api_port,
        run=run,
        heartbeat_interval=heartbeat_interval,
        bootstrap_timeout=bootstrap_timeout,
        role=role,
        dead_after=dead_after,
    )
    from prime_node.hardware import parse_gpu_selection

    gpus = parse_gpu_selection(gpu)
    pinned = _parse_trainer(trainer)
    if adversary is not None:
        from prime_node.testing.adversary import ATTACKS

        if adversary not in ATTACKS:
            raise NodeError(f"--adversary must be one of {', '.join(ATTACKS)}", reason="bad_config")
    key = node_key(
        directory,
        keystore,
        password_file,
        password_env,
        no_password,
        new_wallet=new_wallet,
        light_kdf=light_kdf,
    )
    from prime_node.node.runner import run_node_until_signal
    from prime_node.roles.runner import RoleRunner
    from prime_node.swarm.service import SwarmService

    swarm = SwarmService(
        key=key,
        run_id=config.run_id,
        trainer=pinned,
        store_dir=directory / "swarm",
        dataplane_host=dataplane_host_for(config.listen),
        dataplane_port=dataplane_port,
        keep=3,
    )

    def trusted(announcement: Any, on_first_use: bool) -> None:
        how = (
            f"trusted on first use; pin it with --trainer {announcement.trainer}"
            if on_first_use
            else "pinned"
        )
        typer.echo(f"run {announcement.run_id}: trainer {announcement.trainer} ({how})", err=True)

    runner = RoleRunner(
        key=key,
        run_id=config.run_id,
        swarm=swarm,
        data_dir=directory,
        gpus=gpus,
        pinned=role,
        trainer=pinned,
        adversary=adversary,
        on_trusted=trusted,
    )
    run_node_until_signal(config, key, echo=typer.echo, services=[swarm, runner])


def _parse_trainer(text: str | None) -> Any:
    from crypto.errors import CryptoError
    from crypto.keys import Address
    from prime_node.errors import NodeError

    if text is None:
        return None
    try:
        return Address.parse(text)
    except (CryptoError, ValueError) as exc:
        raise NodeError(
            f"--trainer {text[:48]!r} is not an Ethereum address: {exc}", reason="bad_config"
        ) from None


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
