"""The networking flags of every command that runs a node (``join``, ``share``, ``fetch``), spelled and
documented once, and the NodeConfig they make."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

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
) -> NodeConfig:
    """A checked NodeConfig from the flags above; NodeError (one line) on a bad value."""
    from prime_node.errors import NodeError
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
