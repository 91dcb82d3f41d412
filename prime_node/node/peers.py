"""Applies peer scores: counts messages, admits gossip within budgets, charges offences, and cuts off
banned peers.

The scoring rules are pure (protocol/scoring.py); this class carries out their ``Disconnect`` actions on
the host and records them (and dropped gossip, by reason) for the status API.
"""

from __future__ import annotations

import logging

import trio

from prime_node.node.clock import NodeClock
from prime_node.node.metrics import NodeMetrics
from prime_node.p2p.interface import P2PHost
from protocol.scoring import Admission, Disconnect, Offence, PeerScores, ScoringConfig

log = logging.getLogger(__name__)


class PeerPolicy:
    def __init__(
        self,
        host: P2PHost,
        clock: NodeClock,
        metrics: NodeMetrics,
        nursery: trio.Nursery,
        config: ScoringConfig,
    ) -> None:
        self.host = host
        self.clock = clock
        self.metrics = metrics
        self.nursery = nursery
        self.scores = PeerScores(config)

    def is_banned(self, peer_id: str) -> bool:
        return self.scores.is_banned(peer_id, self.clock.now())

    def score(self, peer_id: str) -> float:
        return self.scores.score(peer_id, self.clock.now())

    def admit_message(self, peer_id: str) -> bool:
        """Count a message from ``peer_id``; False if it must be dropped (banned, or banned just now)."""
        if self.is_banned(peer_id):
            return False
        self._apply(self.scores.message(peer_id, self.clock.now()), "flood")
        return not self.is_banned(peer_id)

    def admit_gossip(self, peer_id: str) -> Admission:
        """Count one gossip frame (normal or repair) from ``peer_id``: only ``ACCEPT`` may be processed.
        Over the flood limit it is charged; a new key over its probation budget is only dropped."""
        admission, actions = self.scores.admit(peer_id, self.clock.now())
        self._apply(actions, "flood")
        if admission is not Admission.ACCEPT:
            self.metrics.count(f"gossip_dropped_{admission.value}")
        return admission

    def credit(self, peer_id: str) -> None:
        """A gossip frame of ``peer_id`` was verified and delivered: it counts toward leaving probation."""
        self.scores.credit(peer_id, self.clock.now())

    def vouch(self, peer_id: str) -> None:
        """Never put ``peer_id`` on probation: a key the run names (trainer, trusted validator)."""
        self.scores.vouch(peer_id, self.clock.now())

    def on_probation(self, peer_id: str) -> bool:
        return self.scores.on_probation(peer_id, self.clock.now())

    def offence(self, peer_id: str, offence: Offence, reason: str) -> None:
        self.metrics.count(f"offence_{offence.value}")
        self._apply(self.scores.offence(peer_id, offence, self.clock.now()), reason)

    def expire(self) -> None:
        for peer_id in self.scores.expire(self.clock.now()):
            self.metrics.event(self.clock.uptime(), "unban", f"ban on {peer_id} ended")

    def _apply(self, actions: list[Disconnect], reason: str) -> None:
        for action in actions:
            self.metrics.count("bans")
            self.metrics.event(self.clock.uptime(), "ban", f"banned {action.peer_id} ({reason})")
            log.warning(
                "banning peer %s for %.0f s (%s)", action.peer_id, action.until - self.clock.now(), reason
            )
            self.nursery.start_soon(self.host.disconnect, action.peer_id)
