"""Typed configuration of one node (``prime-node join``). The *run's* config lives in prime_node/config/.

Every field has a default that works for a first node on one machine; the CLI fills the rest from flags.
Importing this module pulls in pydantic only (no libp2p, no trio).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protocol.names import NAME_RULE, is_valid_name
from protocol.roles import TRAINER, RoleSetting


class NodeConfig(BaseModel):
    """How one node joins the swarm."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    listen: str = Field(
        default="/ip4/0.0.0.0/tcp/4001",
        description="libp2p listen multiaddr (TCP). Port 0 picks a free port. Peers dial this port.",
    )
    announce: tuple[str, ...] = Field(
        default=(),
        description="Multiaddrs to advertise instead of the listen address (e.g. the public IP behind NAT).",
    )
    bootstrap: tuple[str, ...] = Field(
        default=(),
        description="Full /p2p/ multiaddrs of nodes already in the swarm. The first node needs none.",
    )
    data_dir: Path = Field(default=Path("."), description="Where node.json (and later checkpoints) live.")
    api_port: int = Field(
        default=0, ge=0, le=65535, description="Status API port on 127.0.0.1; 0 = any free port."
    )
    role: RoleSetting = Field(
        default="auto",
        description="auto lets the node choose; inferer, validator or seeder pin the role (the trainer "
        "runs with `prime-node run-trainer`).",
    )
    run_id: str = Field(default="demo", description="The run to join: scopes gossip topics and the DHT key.")
    heartbeat_interval: float = Field(
        default=2.0, gt=0, le=300, description="Seconds between signed heartbeats."
    )
    unhealthy_after: float = Field(
        default=0.0, ge=0, description="Silence before a peer is unhealthy; 0 = 3 beats."
    )
    dead_after: float = Field(default=0.0, ge=0, description="Silence before a peer is dead; 0 = 6 beats.")
    bootstrap_timeout: float = Field(
        default=30.0,
        ge=0,
        description="Give up (exit 1) if no bootstrap peer answers this long after start; 0 = never.",
    )
    max_peers: int = Field(
        default=64, ge=1, le=4096, description="Stop dialling discovered peers beyond this many."
    )
    discovery_interval: float = Field(
        default=60.0,
        gt=0,
        description="Longest pause between DHT provider lookups (they back off from 1 s while they find "
        "no one new; each asks up to 40 peers).",
    )
    neighbours: int = Field(
        default=8,
        ge=1,
        le=64,
        description="Direct links (heartbeats, peer records) a node opens; everyone else is known from "
        "the signed records its neighbours pass on (DESIGN §4).",
    )
    max_neighbours: int = Field(
        default=16, ge=1, le=128, description="Links a node accepts at most; it refuses more."
    )
    max_inbound_per_ip: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="Inbound peers admitted from one IP group (a /24, or one address on loopback and "
        "private networks): the Sybil bound. Raise it only for many nodes behind one address (a local "
        "testnet, a lab behind one NAT).",
    )
    relay_service: bool = Field(
        default=True,
        description="Relay for peers behind NAT (circuit relay v2): a few reservations and circuits, each "
        "capped in bytes and time, so only control traffic; worth it on a publicly reachable node.",
    )
    hole_punching: bool = Field(
        default=True,
        description="Upgrade relayed connections to direct ones by hole punching (DCUtR), and reserve a "
        "relay slot when this node finds it is not reachable.",
    )

    keep_batches: int = Field(
        default=0,
        ge=0,
        le=1_000_000,
        description="Keep the newest N signed rollout batches this node decodes, exactly as received, in "
        "DATA_DIR/batches/ (with a sidecar naming the worker, the claimed policy and where it lives), for "
        "`prime-node validate`; 0 = off.",
    )
    keep_batches_max_bytes: int = Field(
        default=1 << 30,
        ge=1,
        description="Bytes the kept batches and their sidecars may take together; the oldest go first.",
    )

    @field_validator("role")
    @classmethod
    def _role_is_a_pin(cls, role: RoleSetting) -> RoleSetting:
        """The trainer is whoever holds the run's key and runs ``prime-node run-trainer``; a node built
        from flags or a file cannot pin it (that command's own copy is made with ``model_copy``)."""
        if role == TRAINER:
            raise ValueError(
                "the trainer runs with `prime-node run-trainer`; pin auto, inferer, validator or seeder"
            )
        return role

    @model_validator(mode="after")
    def _check(self) -> NodeConfig:
        if not is_valid_name(self.run_id):
            raise ValueError(f"run id {NAME_RULE}")
        if self.max_neighbours < self.neighbours:
            raise ValueError("max_neighbours must be at least neighbours")
        if self.dead_window <= self.unhealthy_window:
            raise ValueError("dead_after must be longer than unhealthy_after")
        return self

    def keeping_batches(self, count: int) -> NodeConfig:
        """This config with ``keep_batches`` set (checked like every field: ValueError if out of range)."""
        return NodeConfig.model_validate({**self.model_dump(), "keep_batches": count})

    @property
    def unhealthy_window(self) -> float:
        return self.unhealthy_after or 3 * self.heartbeat_interval

    @property
    def dead_window(self) -> float:
        return self.dead_after or 6 * self.heartbeat_interval
