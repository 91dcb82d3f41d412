"""What a service gets of its node: a read-only view, and two ways to report back.

Services compose like rust-libp2p behaviours (DESIGN §10): a service reads the node's key, run, clock,
metrics, peer policy and membership, talks on gossip and streams, and *reports* what it holds (status
sections, parts of the node's peer record) instead of writing fields of the node. The node merges the
reports when it builds each heartbeat, so no service needs to know when heartbeats are sent.

``NodeContext.scoped()`` gives a service whose life is shorter than the node's (a role the role runner
may switch away from) a context whose gossip subscriptions end with it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from crypto.keys import WalletKey
from prime_node.node.clock import NodeClock
from prime_node.node.gossip import Gossip, GossipScope
from prime_node.node.metrics import NodeMetrics
from prime_node.node.peers import PeerPolicy
from prime_node.p2p.interface import P2PHost
from protocol.membership import Member, PeerState
from protocol.peer_record import HardwareSummary, PeerRecord

log = logging.getLogger(__name__)
StatusSection = Callable[[], Any]


@dataclass(frozen=True)
class NodeIdentity:
    address: str
    peer_id: str


class MembershipView(Protocol):
    """The read side of ``protocol.membership.Membership``: who is known, and in which state."""

    def members(self) -> list[Member[PeerRecord]]: ...

    def in_state(self, state: PeerState) -> list[str]: ...


@dataclass(frozen=True)
class RecordPart:
    """What one service holds, for the node's peer record; ``None`` says nothing about that field."""

    role: str | None = None
    hardware: HardwareSummary | None = None
    versions_held: tuple[int, ...] | None = None
    dataplane_port: int | None = None
    load_percent: int | None = None

    def over(self, base: RecordPart) -> RecordPart:
        """``base`` with the fields this part sets replaced."""
        changes = {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}
        return dataclasses.replace(base, **changes)


RecordSource = Callable[[], RecordPart]


class NodeReports:
    """What the node's services reported; the node owns it and reads it (status API, heartbeats)."""

    def __init__(self) -> None:
        self.status_sections: dict[str, StatusSection] = {}
        self.record_sources: list[RecordSource] = []

    def record(self, base: RecordPart) -> RecordPart:
        """``base`` (the node's own view) overlaid with every source, later sources winning; a source
        that fails is logged and left out (a heartbeat must not stop over one service's bug)."""
        merged = base
        for source in self.record_sources:
            try:
                merged = source().over(merged)
            except Exception:
                log.exception("a peer-record source failed; the record goes out without its part")
        return merged


@dataclass(frozen=True)
class NodeContext:
    """A running node as its services see it (module doc). Built by ``Node.run``; read-only (frozen).
    ``host``: streams and the connected-peer list (a service opens streams; only the node dials and
    bans); ``running``: whether the node still runs (``is_running``)."""

    key: WalletKey
    identity: NodeIdentity
    run_id: str
    clock: NodeClock
    metrics: NodeMetrics
    policy: PeerPolicy
    membership: MembershipView
    gossip: Gossip
    host: P2PHost
    reports: NodeReports
    running: Callable[[], bool]

    @property
    def is_running(self) -> bool:
        return self.running()

    def peers_in(self, state: PeerState) -> list[str]:
        return self.membership.in_state(state)

    # -- reporting -------------------------------------------------------------------------------------

    def add_status_section(self, name: str, section: StatusSection) -> None:
        """Show ``section()`` (JSON-ready) under ``name`` in ``prime-node status``."""
        self.reports.status_sections[name] = section

    def add_record_source(self, source: RecordSource) -> None:
        """Read ``source()`` into every peer record this node sends (later sources win a field)."""
        self.reports.record_sources.append(source)

    @contextmanager
    def scoped(self) -> Iterator[NodeContext]:
        """A context whose gossip subscriptions are removed when the ``with`` block ends."""
        scope = GossipScope(self.gossip)
        try:
            yield dataclasses.replace(self, gossip=scope)
        finally:
            scope.close()
