"""What the role runner hears and shows beside its role decisions: the backlog taps and the progress view.

Demand (advisory; it only steers roles, never admission): the backlog is the number of rollout batches
gossiped in the last minute that no verdict has named yet (``BacklogMeter``; a validator uses its own
queue length instead). ``BacklogTaps`` hears the ``rollouts`` topic (unless the role is pinned: only the
policy needs the backlog, and receiving every batch costs CPU) and the ``verdicts`` topic, beside the
role's services (gossip fans out to every subscriber). ``role_progress`` is the contributor's view for
the progress lines (``roles.progress``), read from the running role's status and the weight swarm.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import trio

from prime_node.config import RunConfig
from prime_node.roles.progress import Progress
from prime_node.verification.batch_publish import ROLLOUTS_TOPIC, VERDICTS_TOPIC
from prime_node.verification.inbox import new_batch_id
from protocol.codec import decode
from protocol.envelope import Envelope
from protocol.errors import ProtocolError
from protocol.verdict import Verdict

if TYPE_CHECKING:
    from prime_node.node.context import NodeContext
    from prime_node.node.gossip import Delivered
    from prime_node.swarm.service import SwarmService

BACKLOG_WINDOW_S = 60.0
MAX_TRACKED = 4096


class BacklogMeter:
    """Rollout batches seen recently that no verdict has named yet (bounded)."""

    def __init__(self, window_s: float = BACKLOG_WINDOW_S) -> None:
        self.window_s = window_s
        self._pending: OrderedDict[bytes, float] = OrderedDict()
        self._judged: OrderedDict[bytes, None] = OrderedDict()

    def rollout(self, batch_id: bytes, now: float) -> None:
        if batch_id in self._judged or batch_id in self._pending:
            return
        self._pending[batch_id] = now
        while len(self._pending) > MAX_TRACKED:
            self._pending.popitem(last=False)

    def verdict(self, batch_id: bytes) -> None:
        self._pending.pop(batch_id, None)
        self._judged[batch_id] = None
        while len(self._judged) > MAX_TRACKED:
            self._judged.popitem(last=False)

    def backlog(self, now: float) -> int:
        while self._pending and next(iter(self._pending.values())) < now - self.window_s:
            self._pending.popitem(last=False)
        return len(self._pending)


class BacklogTaps:
    """The runner's own subscriptions (module doc): rollouts and verdicts into one ``BacklogMeter``."""

    def __init__(self) -> None:
        self.meter = BacklogMeter()

    async def subscribe(self, context: NodeContext, *, rollouts: bool) -> None:
        """Hear verdicts, and rollouts too when ``rollouts`` (the policy chooses the role)."""
        await context.gossip.subscribe(VERDICTS_TOPIC, self._on_verdict)
        if rollouts:
            await context.gossip.subscribe(ROLLOUTS_TOPIC, self._on_rollout)

    def backlog(self, now: float) -> int:
        return self.meter.backlog(now)

    async def _on_rollout(self, message: Delivered) -> None:
        """Count a new rollout batch: a gossiped batch, or a worker's own offer of one that moves over the
        data plane (peers that re-announce a batch they fetched do not make it a new one): the inbox's
        rule (verification/inbox), so the backlog and the intake count the same batches."""
        batch_id = new_batch_id(message.payload, message.origin)
        if batch_id is not None:
            self.meter.rollout(batch_id, trio.current_time())

    async def _on_verdict(self, message: Delivered) -> None:

        try:
            verdict = decode(decode(message.payload, Envelope).payload, Verdict)
        except ProtocolError:
            return
        self.meter.verdict(verdict.batch_id)


def role_progress(role: str, config: RunConfig | None, swarm: SwarmService, service: Any) -> Progress | None:
    """The contributor's view for the progress lines: ``role``'s running ``service`` (its status section's
    counts) and the weight swarm's holdings (None until the run is known)."""
    if config is None:
        return None
    newest = swarm.newest()
    work = service.status() if service is not None else {}
    return Progress(
        role=role,
        policy_held=newest[0] if newest is not None else None,
        max_steps=config.max_steps,
        published=int(work.get("published", 0)) if role == "inferer" else 0,
        accepted=int(work.get("accepted", 0)) if role == "inferer" else 0,
        rejected=dict(work.get("rejected", {})) if role == "inferer" else {},
        validated=int(work.get("validated", 0)) if role == "validator" else 0,
        bytes_served=int(swarm.dataplane.bytes_out),
    )
