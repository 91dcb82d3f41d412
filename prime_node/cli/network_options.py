"""The networking flags of every command that runs a node (``join``, ``share``, ``fetch``), spelled and
documented once, and the NodeConfig they make."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from crypto.keys import WalletKey
    from prime_node.node_config import NodeConfig

BootstrapOption = Annotated[
    list[str] | None,
    typer.Option(
        "--bootstrap", help="Full /p2p/ multiaddr of a node in the swarm (repeatable). None: first node."
    ),
]
ListenOption = Annotated[str, typer.Option("--listen", help="libp2p listen multiaddr (TCP).")]
AnnounceOption = Annotated[
    list[str] | None,
    typer.Option("--announce", help="Multiaddr to advertise instead (e.g. public IP behind NAT)."),
]
DataDirOption = Annotated[
    Path | None,
    typer.Option(
        "--data-dir",
        help="Node data directory (node.json, keystore). Default: $PRIME_NODE_DATA_DIR.",
        file_okay=False,
    ),
]
ApiPortOption = Annotated[
    int, typer.Option("--api-port", help="Status API port on 127.0.0.1 (0 = any free port).")
]
RunOption = Annotated[
    str, typer.Option("--run", help="Run id to join (scopes gossip topics and the DHT key).")
]
HeartbeatOption = Annotated[float, typer.Option("--heartbeat-interval", help="Seconds between heartbeats.")]
BootstrapTimeoutOption = Annotated[
    float,
    typer.Option("--bootstrap-timeout", help="Exit if no bootstrap answers within this many s (0 = never)."),
]
DataplanePortOption = Annotated[
    int, typer.Option("--dataplane-port", help="TCP port of the weight-swarm data plane (0 = any free port).")
]
NewWalletOption = Annotated[
    bool, typer.Option("--new-wallet", help="Create the keystore first if it does not exist yet.")
]
LightKdfOption = Annotated[
    bool, typer.Option("--light-kdf", help="With --new-wallet: fast, weak scrypt (tests).")
]


def network_config(
    *,
    listen: str,
    announce: list[str] | None,
    bootstrap: list[str] | None,
    data_dir: Path,
    api_port: int,
    run: str,
    heartbeat_interval: float,
    bootstrap_timeout: float,
    role: str = "auto",
    dead_after: float = 0.0,
) -> NodeConfig:
    """A checked NodeConfig from the flags above; NodeError (one line) on a bad value."""
    from prime_node.errors import NodeError
    from prime_node.node_config import NodeConfig
    from prime_node.p2p.libp2p_host import parse_multiaddr

    try:
        config = NodeConfig(
            listen=listen,
            announce=tuple(announce or ()),
            bootstrap=tuple(bootstrap or ()),
            data_dir=data_dir,
            api_port=api_port,
            role=role,  # type: ignore[arg-type]
            run_id=run,
            heartbeat_interval=heartbeat_interval,
            bootstrap_timeout=bootstrap_timeout,
            dead_after=dead_after,
        )
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in getattr(exc, "errors", list)()
        )
        raise NodeError(f"bad node settings: {problems or exc}", reason="bad_config") from None
    parse_multiaddr(config.listen, need_peer_id=False)
    for address in config.bootstrap:
        parse_multiaddr(address, need_peer_id=True)
    return config


def node_key(
    data_dir: Path,
    keystore: Path | None,
    password_file: Path | None,
    password_env: str | None,
    no_password: bool,
    *,
    new_wallet: bool,
    light_kdf: bool,
) -> WalletKey:
    """The node's wallet key: --keystore, else $PRIME_NODE_KEYSTORE, else DATA_DIR/keystore.json; with
    --new-wallet a missing keystore is created first."""
    import os

    from crypto.keys import WalletKey
    from prime_node.errors import NodeError
    from prime_node.paths import KEYSTORE_ENV
    from prime_node.wallet_store import LIGHT_SCRYPT, PasswordSource, create_keystore, unlock_keystore

    path = keystore or (
        Path(os.environ[KEYSTORE_ENV]) if os.environ.get(KEYSTORE_ENV) else data_dir / "keystore.json"
    )
    source = PasswordSource(password_file, password_env, no_password)
    if path.exists():
        return unlock_keystore(path, source.resolve())
    if not new_wallet:
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


def dataplane_host_for(listen: str) -> str:
    """The data plane listens where libp2p does: loopback stays loopback, anything else on all addresses."""
    return "127.0.0.1" if listen.startswith("/ip4/127.") else "0.0.0.0"
