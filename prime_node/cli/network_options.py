"""The networking and wallet flags of every command that runs a node (``join``, ``share``, ``fetch``,
``run-trainer``), declared once as one group (``NodeFlags``), and the NodeConfig and key they make."""

from __future__ import annotations

import functools
import inspect
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from prime_node.cli.options import KeystoreOption, NoPasswordOption, PasswordEnvOption, PasswordFileOption
from prime_node.errors import NodeError
from prime_node.paths import KEYSTORE_ENV, default_data_dir

if TYPE_CHECKING:
    from crypto.keys import Address, WalletKey
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
JoinRunOption = Annotated[
    str,
    typer.Option(
        "--run",
        help="The run to work for, as its run address RUN@0xTRAINER[,BOOTSTRAP...] (what the trainer "
        "prints and its operator publishes): pins the trainer and adds the bootstrap peers. A bare run id "
        "needs --trainer, or the node takes no role.",
    ),
]
TrainerOption = Annotated[
    str | None,
    typer.Option(
        "--trainer",
        help="Pin the run's trainer address: believe only run announcements it signed (the same pin as "
        "--run RUN@ADDRESS). Without a pin the node believes no trainer and takes no role.",
    ),
]
HeartbeatOption = Annotated[float, typer.Option("--heartbeat-interval", help="Seconds between heartbeats.")]
BootstrapTimeoutOption = Annotated[
    float,
    typer.Option("--bootstrap-timeout", help="Exit if no bootstrap answers within this many s (0 = never)."),
]
DataplanePortOption = Annotated[
    int, typer.Option("--dataplane-port", help="TCP port of the weight-swarm data plane (0 = any free port).")
]
RelayServiceOption = Annotated[
    bool,
    typer.Option(
        "--relay-service/--no-relay-service",
        help="Relay control traffic for peers behind NAT (bounded; circuit relay v2).",
    ),
]
HolePunchingOption = Annotated[
    bool,
    typer.Option(
        "--hole-punching/--no-hole-punching",
        help="Behind NAT: reserve a relay slot and upgrade relayed connections by hole punching (DCUtR).",
    ),
]
NeighboursOption = Annotated[
    int,
    typer.Option(
        "--neighbours",
        help="Peers this node exchanges heartbeats with directly (it accepts up to twice as many); "
        "everyone else is known from the signed records they pass on.",
    ),
]
MaxInboundPerIpOption = Annotated[
    int,
    typer.Option(
        "--max-inbound-per-ip",
        help="Inbound peers admitted from one IP (or /24): raise it only for many nodes behind one "
        "address, e.g. a local testnet.",
    ),
]
NewWalletOption = Annotated[
    bool, typer.Option("--new-wallet", help="Create the keystore first if it does not exist yet.")
]
LightKdfOption = Annotated[
    bool, typer.Option("--light-kdf", help="With --new-wallet: fast, weak scrypt (tests).")
]


DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/4001"
Command = TypeVar("Command", bound=Callable[..., None])


@dataclass(frozen=True)
class NodeFlags:
    """The flags every node-running command takes; a command asks for them with one ``NodeFlags``
    parameter and ``@with_node_flags`` (the annotations below are the options' declarations)."""

    bootstrap: BootstrapOption = None
    listen: ListenOption = DEFAULT_LISTEN
    announce: AnnounceOption = None
    data_dir: DataDirOption = None
    api_port: ApiPortOption = 0
    heartbeat_interval: HeartbeatOption = 2.0
    bootstrap_timeout: BootstrapTimeoutOption = 30.0
    dataplane_port: DataplanePortOption = 0
    keystore: KeystoreOption = None
    password_file: PasswordFileOption = None
    password_env: PasswordEnvOption = None
    no_password: NoPasswordOption = False
    new_wallet: NewWalletOption = False
    light_kdf: LightKdfOption = False
    relay_service: RelayServiceOption = True
    hole_punching: HolePunchingOption = True
    neighbours: NeighboursOption = 8
    max_inbound_per_ip: MaxInboundPerIpOption = 16

    def directory(self) -> Path:
        """--data-dir, else $PRIME_NODE_DATA_DIR (or the user data dir)."""
        return self.data_dir if self.data_dir is not None else default_data_dir()

    def config(self, run: str, *, role: str = "auto", dead_after: float = 0.0) -> NodeConfig:
        """The checked NodeConfig for ``run``; NodeError (one line) on a bad value."""
        return network_config(
            listen=self.listen,
            announce=self.announce,
            bootstrap=self.bootstrap,
            data_dir=self.directory(),
            api_port=self.api_port,
            run=run,
            heartbeat_interval=self.heartbeat_interval,
            bootstrap_timeout=self.bootstrap_timeout,
            role=role,
            dead_after=dead_after,
            relay_service=self.relay_service,
            hole_punching=self.hole_punching,
            neighbours=self.neighbours,
            max_inbound_per_ip=self.max_inbound_per_ip,
        )

    def key(self) -> WalletKey:
        """The node's wallet key (see ``node_key``)."""
        return node_key(
            self.directory(),
            self.keystore,
            self.password_file,
            self.password_env,
            self.no_password,
            new_wallet=self.new_wallet,
            light_kdf=self.light_kdf,
        )


DEFAULT_FLAGS = NodeFlags()
"""The placeholder default of a command's NodeFlags parameter (``with_node_flags`` always passes one)."""


def with_node_flags(*, listen: str = DEFAULT_LISTEN) -> Callable[[Command], Command]:
    """Give a command every ``NodeFlags`` option in place of its one ``NodeFlags`` parameter.

    Typer reads a command's signature, so the wrapper shows the flags as parameters of their own and packs
    them into a NodeFlags for the command. ``listen``: this command's default for --listen.
    """

    def decorate(command: Command) -> Command:
        signature = inspect.signature(command, eval_str=True)
        (group,) = (name for name, p in signature.parameters.items() if p.annotation is NodeFlags)
        defaults = {**{f.name: f.default for f in fields(NodeFlags)}, "listen": listen}
        keyword = inspect.Parameter.KEYWORD_ONLY  # typer passes every value by name
        parameters: list[inspect.Parameter] = []
        for name, parameter in signature.parameters.items():
            if name != group:
                parameters.append(parameter.replace(kind=keyword))
                continue
            for flag, annotation in _flag_types().items():
                parameters.append(
                    inspect.Parameter(flag, keyword, default=defaults[flag], annotation=annotation)
                )

        @functools.wraps(command)
        def with_flags(**values: Any) -> None:
            flags = NodeFlags(**{name: values.pop(name) for name in defaults})
            command(**values, **{group: flags})

        with_flags.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        with_flags.__annotations__ = {p.name: p.annotation for p in parameters}
        return with_flags  # type: ignore[return-value]

    return decorate


@functools.cache
def _flag_types() -> dict[str, Any]:
    """NodeFlags' fields with their Annotated option types, resolved (annotations here are strings)."""
    return typing.get_type_hints(NodeFlags, include_extras=True)


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
    relay_service: bool = True,
    hole_punching: bool = True,
    neighbours: int = 8,
    max_inbound_per_ip: int = 16,
) -> NodeConfig:
    """A checked NodeConfig from the flags above; NodeError (one line) on a bad value."""
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
            relay_service=relay_service,
            hole_punching=hole_punching,
            neighbours=neighbours,
            max_neighbours=2 * neighbours,
            max_inbound_per_ip=max_inbound_per_ip,
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


@dataclass(frozen=True)
class JoinTarget:
    """What ``join --run`` and ``--trainer`` name: the run id, the pinned trainer (None: no pin) and
    bootstrap peers from the run address."""

    run_id: str
    trainer: Address | None
    bootstrap: tuple[str, ...] = ()


def join_target(run: str, trainer: str | None) -> JoinTarget:
    """Read ``--run`` (a run id or a run address) and ``--trainer``; NodeError (one line) if they are
    malformed or name two different trainers."""
    from crypto.errors import CryptoError
    from crypto.keys import Address
    from protocol.errors import ProtocolError
    from protocol.names import NAME_RULE, is_valid_name
    from protocol.run_announcement import RUN_ADDRESS_FORM, RunAddress

    pinned = None
    if trainer is not None:
        try:
            pinned = Address.parse(trainer)
        except CryptoError as exc:
            raise NodeError(
                f"--trainer {trainer[:48]!r} is not an Ethereum address: {exc}", reason="bad_config"
            ) from None
    if "@" not in run:
        if is_valid_name(run):
            return JoinTarget(run, pinned)
        if not {",", "/"} & set(run):
            raise NodeError(
                f"--run {run[:80]!r} is neither a run id (it {NAME_RULE}) nor a run address "
                f"({RUN_ADDRESS_FORM})",
                reason="bad_config",
            )
    try:
        address = RunAddress.parse(run)  # a run address without "@0xTRAINER" is named as such
    except ProtocolError as exc:
        raise NodeError(f"--run: {exc}", reason="bad_config") from None
    if pinned is not None and pinned != address.trainer:
        raise NodeError(
            f"--run names trainer {address.trainer} but --trainer is {pinned}: pass one of them",
            reason="bad_config",
        )
    return JoinTarget(address.run_id, address.trainer, address.bootstrap)


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
    from crypto.keys import WalletKey
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
