"""Typed configuration of one node (``prime-node join``). The *run's* config lives in prime_node/config/.

Every field has a default that works for a first node on one machine; the CLI fills the rest from flags.
Importing this module pulls in pydantic only (no libp2p, no trio).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Role = Literal["auto", "inferer", "validator", "seeder"]
_RUN_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


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
    role: Role = Field(default="auto", description="auto lets the node choose; the others pin the role.")
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
        default=5.0, gt=0, description="Longest pause between DHT provider lookups."
    )

    @model_validator(mode="after")
    def _check(self) -> NodeConfig:
        if not _RUN_ID.match(self.run_id):
            raise ValueError("run id must be 1-64 of [a-z0-9._-], starting alphanumeric")
        if self.dead_window <= self.unhealthy_window:
            raise ValueError("dead_after must be longer than unhealthy_after")
        return self

    @property
    def unhealthy_window(self) -> float:
        return self.unhealthy_after or 3 * self.heartbeat_interval

    @property
    def dead_window(self) -> float:
        return self.dead_after or 6 * self.heartbeat_interval
