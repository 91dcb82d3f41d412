"""Verdicts into peer scores: every node that hears a trusted rejection charges the worker's peer.

DESIGN §7: verdicts feed peer scores. A rejection signed by one of the run's trusted validators costs
the rejected worker ``Offence.BAD_DATA`` on this node's ``PeerPolicy``; a few in a row ban the worker's
peer, and the gossip layer then drops everything it publishes (its rollouts never reach validation
again) until the ban ends. Verdicts by anyone else are ignored: an untrusted signer could otherwise
frame an honest worker.

The worker is named by its wallet address; scores are kept per libp2p peer ID. The two are the same key
(DESIGN §3), and this node learns the pairing from authenticated sources only: a rollout gossiped by its
own worker (the gossip layer checks the signer against the peer) and verified peer records.

Run it as a service (``ReputationService(run_config=...)``, which subscribes to ``verdicts``) on any
role. Admission, which reads every verdict itself, only ``attach``es one and feeds it.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Any

import trio

from crypto.keys import Address
from prime_node.errors import NodeError
from prime_node.verification.batch_publish import VERDICTS_TOPIC
from protocol.codec import decode
from protocol.envelope import Envelope, EnvelopeVerifier
from protocol.errors import ProtocolError
from protocol.scoring import Offence
from protocol.verdict import Verdict, open_verdict, verdict_domain

if TYPE_CHECKING:
    from prime_node.config import RunConfig
    from prime_node.node.context import NodeContext
    from prime_node.node.gossip import Delivered

log = logging.getLogger(__name__)
MAX_KNOWN_WORKERS = 4096
# Rejections an honest worker gets through lag alone, its own or the validator's: a policy that aged out
# while the batch waited (stale), or a checkpoint / manifest the validator has not received yet (unknown,
# future). They keep the batch out of training but cost the worker nothing; otherwise a busy swarm would
# ban its own honest inferers (E2 saw it in the demo). None of them lets a cheater gain anything.
NOT_CHARGED = frozenset({"stale_policy", "unknown_policy", "future_policy"})


def trusted_validators(run_config: RunConfig) -> frozenset[Address]:
    return frozenset(Address.parse(a) for a in run_config.trusted_validators)


class ReputationService:
    """Opens verdict envelopes from trusted validators and charges rejected workers' peers."""

    def __init__(self, *, run_config: RunConfig) -> None:
        self.run_config = run_config
        self.trusted = trusted_validators(run_config)
        self.verifier = EnvelopeVerifier(verdict_domain(run_config.run_id))
        self.counts: Counter[str] = Counter()
        self._peers: OrderedDict[Address, str] = OrderedDict()
        self._context: NodeContext | None = None

    @property
    def context(self) -> NodeContext:
        if self._context is None:
            raise NodeError("the reputation service is not running", reason="not_running")
        return self._context

    def attach(self, context: NodeContext) -> None:
        """Charge through ``context`` without hearing verdicts (for a service that reads them itself)."""
        self._context = context

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.attach(context)
        await context.gossip.subscribe(VERDICTS_TOPIC, self.on_delivered)
        task_status.started()

    async def on_delivered(self, message: Delivered) -> None:
        opened = self.open(message.payload)
        if opened is not None:
            self.observe(opened[0])

    def open(self, payload: bytes) -> tuple[Verdict, Address] | None:
        """The verdict in a gossiped envelope and its signer, if a trusted validator signed it."""
        try:
            envelope = decode(payload, Envelope)
            verdict = open_verdict(
                envelope, self.verifier, trusted=self.trusted, now_ms=self.context.clock.wall_ms()
            )
        except ProtocolError as exc:
            reason = getattr(exc, "reason", "malformed")
            self.counts[f"verdicts_ignored_{reason}"] += 1
            log.info("ignored verdict: %s", exc)
            return None
        self.counts["verdicts_trusted"] += 1
        return verdict, envelope.signer

    def observe(self, verdict: Verdict) -> None:
        """Charge the worker of a rejected batch (accepted work, or lag (``NOT_CHARGED``), costs nothing)."""
        if verdict.accepted or set(verdict.reasons) <= NOT_CHARGED:
            return
        peer_id = self.peer_of(verdict.worker)
        if peer_id is None:
            self.counts["penalties_unmapped"] += 1
            log.info("cannot charge worker %s: no peer known for it", verdict.worker)
            return
        self.counts["penalties"] += 1
        self.context.policy.offence(peer_id, Offence.BAD_DATA, f"rejected batch: {','.join(verdict.reasons)}")

    def learn(self, address: Address, peer_id: str) -> None:
        """Remember that ``address`` publishes as ``peer_id`` (from an authenticated source only)."""
        self._peers[address] = peer_id
        self._peers.move_to_end(address)
        while len(self._peers) > MAX_KNOWN_WORKERS:
            self._peers.popitem(last=False)

    def peer_of(self, address: Address) -> str | None:
        if address in self._peers:
            return self._peers[address]
        for member in self.context.membership.members():
            if member.record.address == address:
                self.learn(address, member.peer_id)
                return member.peer_id
        return None

    def worker_banned(self, address: Address) -> bool:
        peer_id = self.peer_of(address)
        return peer_id is not None and self.context.policy.is_banned(peer_id)
