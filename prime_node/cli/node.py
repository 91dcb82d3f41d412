"""``prime-node join`` (run a node) and ``prime-node status`` (look at a running one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from prime_node.cli.options import (
    JsonOption,
    KeystoreOption,
    NoPasswordOption,
    PasswordEnvOption,
    PasswordFileOption,
)

DataDirOption = Annotated[
    Path | None,
    typer.Option(
        "--data-dir",
        help="Node data directory (node.json, keystore). Default: $PRIME_NODE_DATA_DIR.",
        file_okay=False,
    ),
]


def register(app: typer.Typer) -> None:
    app.command("join")(join)
    app.command("status")(status)


def join(
    bootstrap: Annotated[
        list[str] | None,
        typer.Option(
            "--bootstrap", help="Full /p2p/ multiaddr of a node in the swarm (repeatable). None: first node."
        ),
    ] = None,
    listen: Annotated[
        str, typer.Option("--listen", help="libp2p listen multiaddr (TCP).")
    ] = "/ip4/0.0.0.0/tcp/4001",
    announce: Annotated[
        list[str] | None,
        typer.Option("--announce", help="Multiaddr to advertise instead (e.g. public IP behind NAT)."),
    ] = None,
    data_dir: DataDirOption = None,
    api_port: Annotated[
        int, typer.Option("--api-port", help="Status API port on 127.0.0.1 (0 = any free port).")
    ] = 0,
    role: Annotated[str, typer.Option("--role", help="auto, inferer, validator or seeder.")] = "auto",
    run: Annotated[
        str, typer.Option("--run", help="Run id to join (scopes gossip topics and the DHT key).")
    ] = "demo",
    heartbeat_interval: Annotated[
        float, typer.Option("--heartbeat-interval", help="Seconds between heartbeats.")
    ] = 2.0,
    dead_after: Annotated[
        float,
        typer.Option("--dead-after", help="Seconds of silence before a peer is dead (0 = 6 heartbeats)."),
    ] = 0.0,
    bootstrap_timeout: Annotated[
        float,
        typer.Option(
            "--bootstrap-timeout", help="Exit if no bootstrap answers within this many s (0 = never)."
        ),
    ] = 30.0,
    keystore: KeystoreOption = None,
    password_file: PasswordFileOption = None,
    password_env: PasswordEnvOption = None,
    no_password: NoPasswordOption = False,
    new_wallet: Annotated[
        bool, typer.Option("--new-wallet", help="Create the keystore first if it does not exist yet.")
    ] = False,
    light_kdf: Annotated[
        bool, typer.Option("--light-kdf", help="With --new-wallet: fast, weak scrypt (tests).")
    ] = False,
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
    dataplane_port: Annotated[
        int, typer.Option("--dataplane-port", help="TCP port of the weight-swarm data plane (0 = any).")
    ] = 0,
    adversary: Annotated[
        str | None, typer.Option("--adversary", hidden=True, help="Demo/tests: cheat as this attack kind.")
    ] = None,
) -> None:
    """Start a node: join the swarm via a bootstrap peer, learn the run from its signed announcement, take
    a role (inferer, validator or seeder: from hardware and demand, or pinned with --role), fetch and
    re-serve checkpoints, and serve the status API."""
    from prime_node.errors import NodeError
    from prime_node.node_config import NodeConfig
    from prime_node.paths import KEYSTORE_ENV, default_data_dir
    from prime_node.wallet_store import PasswordSource

    directory = data_dir if data_dir is not None else default_data_dir()
    import os

    keystore_path = keystore or (
        Path(os.environ[KEYSTORE_ENV]) if os.environ.get(KEYSTORE_ENV) else directory / "keystore.json"
    )
    try:
        config = NodeConfig(
            listen=listen,
            announce=tuple(announce or ()),
            bootstrap=tuple(bootstrap or ()),
            data_dir=directory,
            api_port=api_port,
            role=role,  # type: ignore[arg-type]
            run_id=run,
            heartbeat_interval=heartbeat_interval,
            dead_after=dead_after,
            bootstrap_timeout=bootstrap_timeout,
        )
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in getattr(exc, "errors", list)()
        )
        raise NodeError(f"bad node settings: {problems or exc}", reason="bad_config") from None
    from prime_node.p2p.libp2p_host import parse_multiaddr

    parse_multiaddr(config.listen, need_peer_id=False)
    for address in config.bootstrap:
        parse_multiaddr(address, need_peer_id=True)
    from prime_node.hardware import parse_gpu_selection

    gpus = parse_gpu_selection(gpu)
    pinned = _parse_trainer(trainer)
    if adversary is not None:
        from prime_node.testing.adversary import ATTACKS

        if adversary not in ATTACKS:
            raise NodeError(f"--adversary must be one of {', '.join(ATTACKS)}", reason="bad_config")
    password_source = PasswordSource(password_file, password_env, no_password)
    key = _load_or_create_key(keystore_path, password_source, create=new_wallet, light_kdf=light_kdf)
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


def dataplane_host_for(listen: str) -> str:
    """The data plane listens where libp2p does: loopback stays loopback, anything else on all addresses."""
    return "127.0.0.1" if listen.startswith("/ip4/127.") else "0.0.0.0"


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


def _load_or_create_key(path: Path, source: Any, *, create: bool, light_kdf: bool) -> Any:
    from crypto.keys import WalletKey
    from prime_node.errors import NodeError
    from prime_node.wallet_store import LIGHT_SCRYPT, create_keystore, unlock_keystore

    if not path.exists():
        if not create:
            raise NodeError(
                f"no keystore at {path}; create one with `prime-node wallet new --keystore {path}` "
                "or pass --new-wallet",
                reason="no_keystore",
            )
        key = WalletKey.generate()
        password = source.resolve(confirm=True)
        if light_kdf:
            create_keystore(path, key, password, scrypt=LIGHT_SCRYPT)
        else:
            create_keystore(path, key, password)
        typer.echo(f"created keystore {path} for {key.address}", err=True)
        return key
    return unlock_keystore(path, source.resolve())


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
