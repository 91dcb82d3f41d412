"""The trainer's intake: rollout batches in, only those a trusted quorum accepted out.

``AdmissionService`` subscribes to ``rollouts`` and ``verdicts``. It keeps recent batch frames by id
(bounded, oldest forgotten first) and counts verdicts only from the run's ``trusted_validators``
(``VerdictBook``: ``verdict_quorum`` distinct acceptances and no rejection). A batch is handed out by
``next_accepted`` once, as soon as it has both its frame and an accepting quorum, whichever came
first; a batch any trusted validator rejected is never handed out. The frame is not re-verified here:
its id is BLAKE3 of the exact bytes the validators checked (signature included).

An acceptance vouches only for the groups its validator replayed (``Verdict.verified_groups``; a
validator that recomputes a secret sample of groups names that sample). What is handed out is the
batch cut down to the union of the verified groups of the accepting verdicts heard so far: validators
with different secret keys cover different groups, and a group no trusted validator replayed is never
scored (a code task would execute it) nor trained on. An accepting quorum that verified no group hands
out nothing (``counts["nothing_verified"]``).

A batch too big for gossip arrives as a ``RolloutAnnouncement`` (protocol/rollout_transfer.py): the
offer is kept (bounded like the frames; refused if it is not its worker's, not of this run, or over the
run's ``max_rollout_batch_bytes``) and its bytes are fetched over the data plane only once an accepting
quorum is in, usually from the validators that judged it (they re-announce what they hold), so the
trainer downloads nothing a validator rejected, and at most ``fetch_ahead`` of them are fetched or
ready but not yet taken by ``next_accepted``. The fetched frame is checked against the id, decoded and
settled like a gossiped one; the trainer then re-serves it from its ``BatchTransfer``.

It also does the reputation work on the trainer node (rejections charge the worker's peer), so the
trainer needs no separate ``ReputationService``.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from crypto.digests import blake3
from crypto.keys import Address
from prime_node.errors import NodeError
from prime_node.node.stage_times import StageTimes
from prime_node.verification.admission import VerdictBook
from prime_node.verification.batch_transfer import BatchTransfer, ban_peer
from prime_node.verification.reputation import ReputationService
from prime_node.verification.topics import ROLLOUTS_TOPIC, VERDICTS_TOPIC
from prime_node.verification.validator import ROLLOUT_KIND
from protocol.codec import decode
from protocol.envelope import Envelope
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.rollout_transfer import (
    Holder,
    RolloutAnnouncement,
    check_frame_start,
    read_announcement,
    screen_announcement,
)
from protocol.rollouts import RolloutBatch
from protocol.verdict import Verdict

if TYPE_CHECKING:
    from prime_node.config import RunConfig
    from prime_node.node.context import NodeContext
    from prime_node.node.gossip import Delivered

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AcceptedBatch:
    """A batch the quorum accepted, cut down to its verified groups: what the trainer trains on."""

    batch: RolloutBatch
    """The verified groups only, in ascending order (``verified_groups``)."""
    worker: Address
    batch_id: bytes
    """BLAKE3 of the frame the validators checked (the whole batch)."""
    validator_rewards: tuple[float, ...]
    """Per sample of ``batch``: the rewards of the first accepting validator that verified its group (the
    trainer recomputes its own anyway)."""
    accepted_at: float = 0.0
    """trio time at which the quorum was reached (the trainer times its queue from here)."""
    verified_groups: tuple[int, ...] = ()
    """Indices, in the batch as signed, of the groups ``batch`` holds."""
    drawn_groups: int = 0
    """Groups the batch as signed holds (verified or not)."""


class AdmissionService:
    """Rollouts and verdicts in; ``next_accepted()`` out (module doc)."""

    def __init__(
        self,
        *,
        run_config: RunConfig,
        capacity: int = 256,
        penalise: bool = True,
        transfer: BatchTransfer | None = None,
        fetch_ahead: int = 4,
    ) -> None:
        if not run_config.trusted_validators:
            raise NodeError(
                "the run config lists no trusted_validators: a networked trainer only trains on batches "
                "accepted by validators it names (add their addresses to the run config)",
                reason="no_trusted_validators",
            )
        if capacity < 1 or fetch_ahead < 1:
            raise ValueError("capacity and fetch_ahead must be positive")
        self.fetch_ahead = fetch_ahead
        """Accepted, announced batches fetched or being fetched but not yet taken by ``next_accepted``:
        beyond it the next waits, so a slow trainer does not pull in more bytes than it can use."""
        self.run_config = run_config
        self.capacity = capacity
        self.penalise = penalise
        self.reputation = ReputationService(run_config=run_config)  # attached, fed from _on_verdict
        self.book = VerdictBook(quorum=run_config.verdict_quorum, capacity=16 * capacity)
        self.counts: Counter[str] = Counter()
        self.rejected_by_reason: Counter[str] = Counter()
        self.accepted_by_worker: Counter[str] = Counter()
        self._frames: OrderedDict[bytes, RolloutBatch] = OrderedDict()
        # Per batch, each verified group's rewards from the first accepting verdict that verified it
        # (bounded like the verdict book: trusted validators only, the oldest batches forgotten first).
        self._verified: OrderedDict[bytes, dict[int, tuple[float, ...]]] = OrderedDict()
        self._settled: OrderedDict[bytes, bool] = OrderedDict()  # handed out (True) or rejected (False)
        self._ready: deque[AcceptedBatch] = deque()
        self._wakeup = trio.Event()
        self._arrived_at: dict[bytes, float] = {}
        self.stages = StageTimes()
        self.transfer = transfer
        """Fetches announced batches once accepted (None: one of its own, built when it runs)."""
        self._offers: OrderedDict[bytes, tuple[RolloutAnnouncement, Delivered]] = OrderedDict()
        self._fetching: set[bytes] = set()
        self._to_fetch: OrderedDict[bytes, None] = OrderedDict()  # admitted offers waiting for room
        self._context: NodeContext | None = None
        self._nursery: trio.Nursery | None = None

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._context = context
        self.reputation.attach(context)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.transfer is None:
                self.transfer = BatchTransfer.for_node(context, context.key, on_bad_bytes=self._bad_bytes)
            if not self.transfer.running:
                await nursery.start(self.transfer.run)
            await context.gossip.subscribe(ROLLOUTS_TOPIC, self._on_rollout)
            await context.gossip.subscribe(VERDICTS_TOPIC, self._on_verdict)
            task_status.started()

    async def next_accepted(self) -> AcceptedBatch:
        """The next batch an accepting quorum of trusted validators vouched for (waits for one)."""
        while not self._ready:
            self._wakeup = trio.Event()
            await self._wakeup.wait()
        accepted = self._ready.popleft()
        self._pump()
        return accepted

    def stats(self) -> dict[str, Any]:
        return {
            "accepted": self.counts["accepted"],
            "rejected": dict(self.rejected_by_reason),
            "accepted_by_worker": dict(self.accepted_by_worker),
            "pending": len(self._frames),
            "ready": len(self._ready),
            "dropped": self.counts["dropped_frames"] + self.counts["dropped_ready"],
            "groups_unverified": self.counts["groups_unverified"],
            "nothing_verified": self.counts["nothing_verified"],
            "untrusted_verdicts": self.reputation.counts["verdicts_ignored_untrusted_validator"],
            "stages": self.stages.summary(),
            "offers": len(self._offers),
            "fetching": len(self._fetching),
            "waiting_to_fetch": len(self._to_fetch),
            "transfer": self.transfer.status() if self.transfer is not None else {},
        }

    # -- handlers ---------------------------------------------------------------------------------------

    async def _on_rollout(self, message: Delivered) -> None:
        if self.reputation.worker_banned(message.origin):
            self.counts["dropped_banned"] += 1
            return
        announcement = read_announcement(message.payload)
        if announcement is not None:
            self._on_batch_announcement(message, announcement)
            return
        self._take_frame(message.payload, message)

    def _on_batch_announcement(self, message: Delivered, announcement: RolloutAnnouncement) -> None:
        """Keep a valid offer (and every holder heard) until a quorum makes the batch worth fetching."""
        assert self.transfer is not None
        batch_id = announcement.batch_id
        if not self.transfer.heard(announcement, message.origin, message.origin_peer_id):
            return  # a re-server (now a known holder), or an offer heard before
        if batch_id in self._settled or batch_id in self._frames:
            return
        try:
            screen_announcement(
                announcement,
                origin=message.origin,
                run_id=self.run_config.run_id,
                max_size=self.run_config.max_rollout_batch_bytes,
            )
        except RemoteProtocolError as exc:
            self.counts["refused_announcements"] += 1
            log.info("refused a rollout announcement from %s: %s", message.origin, exc)
            return
        self.reputation.learn(message.origin, message.origin_peer_id)
        self._offers[batch_id] = (announcement, message)
        self._arrived_at[batch_id] = trio.current_time()
        while len(self._offers) > self.capacity:
            forgotten, _ = self._offers.popitem(last=False)
            self._arrived_at.pop(forgotten, None)
            self._to_fetch.pop(forgotten, None)
            self.transfer.book.forget(forgotten)
            self.counts["dropped_frames"] += 1
        self._settle(batch_id)

    async def _fetch(self, announcement: RolloutAnnouncement, message: Delivered) -> None:
        assert self.transfer is not None
        batch_id = announcement.batch_id
        frame: bytes | None = None
        try:
            fetching = trio.current_time()
            check = functools.partial(check_frame_start, announcement, kind=ROLLOUT_KIND)
            frame = await self.transfer.fetch(batch_id, announcement.size, check_start=check)
            self.stages.add("fetch", trio.current_time() - fetching)
        finally:
            self._fetching.discard(batch_id)
            self._offers.pop(batch_id, None)
            if frame is None:
                self.counts["fetch_failed"] += 1
                self._arrived_at.pop(batch_id, None)
            else:
                self._take_frame(frame, message, announced=announcement)
            self._pump()

    def _bad_bytes(self, holder: Holder, reason: str) -> None:
        """A peer sent bytes that are not the batch it was asked for: banned (from the transfer's data plane
        already; here on the node's peer scores, protocol/scoring.py)."""
        self.counts["bad_bytes"] += 1
        if self._context is not None:
            ban_peer(self._context.policy, holder.peer_id, f"rollout batch bytes: {reason}")

    def _take_frame(
        self, frame: bytes, message: Delivered, *, announced: RolloutAnnouncement | None = None
    ) -> None:
        """A whole frame, gossiped or fetched (already checked against its id): decode it, then settle."""
        batch_id = blake3(frame) if announced is None else announced.batch_id
        if batch_id in self._settled or batch_id in self._frames:
            return
        try:
            envelope = decode(frame, Envelope)
            batch = decode(envelope.payload, RolloutBatch)
        except ProtocolError as exc:
            self.counts["malformed_frames"] += 1
            log.info("unreadable rollout frame from %s: %s", message.origin, exc)
            return
        if envelope.signer != batch.worker or batch.run_id != self.run_config.run_id:
            self.counts["malformed_frames"] += 1
            return
        if announced is not None and (batch.worker, batch.policy_step) != (
            announced.worker,
            announced.policy_step,
        ):
            self.counts["malformed_frames"] += 1
            return
        self.reputation.learn(message.origin, message.origin_peer_id)
        self._delivered("rollout_delivery", message)
        self._frames[batch_id] = batch
        self._arrived_at.setdefault(batch_id, trio.current_time())
        while len(self._frames) > self.capacity:
            forgotten, _ = self._frames.popitem(last=False)
            self._verified.pop(forgotten, None)
            self._arrived_at.pop(forgotten, None)
            self.counts["dropped_frames"] += 1
        self._settle(batch_id)

    async def _on_verdict(self, message: Delivered) -> None:
        opened = self.reputation.open(message.payload)
        if opened is None:
            return
        verdict, validator = opened
        self._delivered("verdict_delivery", message)
        if self.penalise:
            self.reputation.observe(verdict)
        self.book.record(verdict, validator)
        if verdict.accepted:
            self._record_verified(verdict)
        self._settle(verdict.batch_id)

    # -- bookkeeping ------------------------------------------------------------------------------------

    def _settle(self, batch_id: bytes) -> None:
        if batch_id in self._settled:
            return
        if self.book.rejected(batch_id):
            self._mark(batch_id, handed_out=False)
            self._frames.pop(batch_id, None)
            self._to_fetch.pop(batch_id, None)
            if self._offers.pop(batch_id, None) is not None and self.transfer is not None:
                self.transfer.book.forget(batch_id)
            self._verified.pop(batch_id, None)
            self._arrived_at.pop(batch_id, None)
            self.counts["rejected"] += 1
            verdict = self.book.verdict_of(batch_id)
            for reason in verdict.reasons if verdict is not None else ("rejected",):
                self.rejected_by_reason[reason] += 1
            return
        batch = self._frames.get(batch_id)
        if batch is None and batch_id in self._offers and self.book.admitted(batch_id):
            self._start_fetch(batch_id)
        if batch is None or not self.book.admitted(batch_id):
            return
        del self._frames[batch_id]
        verified = {g: r for g, r in self._verified.pop(batch_id, {}).items() if g < batch.groups}
        self._mark(batch_id, handed_out=True)
        self.counts["accepted"] += 1
        self.accepted_by_worker[str(batch.worker)] += 1
        now = trio.current_time()
        self.stages.add("await_verdict", now - self._arrived_at.pop(batch_id, now))
        self.counts["groups_unverified"] += batch.groups - len(verified)
        if not verified:
            self.counts["nothing_verified"] += 1
            log.warning("batch %s accepted with no verified group: nothing to train", batch_id.hex()[:16])
            return
        groups = sorted(verified)
        lined_up = all(len(verified[g]) == batch.group_size for g in groups)
        self._ready.append(
            AcceptedBatch(
                batch.only_groups(groups),
                batch.worker,
                batch_id,
                tuple(r for g in groups for r in verified[g]) if lined_up else (),
                accepted_at=now,
                verified_groups=tuple(groups),
                drawn_groups=batch.groups,
            )
        )
        while len(self._ready) > self.capacity:
            self._ready.popleft()
            self.counts["dropped_ready"] += 1
        self._wakeup.set()

    def _start_fetch(self, batch_id: bytes) -> None:
        if batch_id in self._fetching or self._nursery is None:
            return
        if len(self._fetching) + len(self._ready) >= self.fetch_ahead:
            self._to_fetch[batch_id] = None  # ``_pump`` starts it once the trainer has taken some
            return
        self._to_fetch.pop(batch_id, None)
        self._fetching.add(batch_id)
        announcement, message = self._offers[batch_id]
        self._nursery.start_soon(self._fetch, announcement, message)

    def _pump(self) -> None:
        """Start waiting fetches while there is room (``fetch_ahead``)."""
        while self._to_fetch and len(self._fetching) + len(self._ready) < self.fetch_ahead:
            batch_id, _ = self._to_fetch.popitem(last=False)
            if batch_id in self._offers and batch_id not in self._settled:
                self._start_fetch(batch_id)

    def _record_verified(self, verdict: Verdict) -> None:
        """Add an accepting verdict's verified groups (with its rewards, when they line up) to its batch's."""
        groups = verdict.verified_groups
        entry = self._verified.get(verdict.batch_id)
        if entry is None:
            entry = self._verified[verdict.batch_id] = {}
            while len(self._verified) > 16 * self.capacity:
                self._verified.popitem(last=False)
        size = (
            len(verdict.rewards) // len(groups) if groups and len(verdict.rewards) % len(groups) == 0 else 0
        )
        for i, group in enumerate(groups):
            entry.setdefault(group, verdict.rewards[i * size : (i + 1) * size])

    def _delivered(self, stage: str, message: Delivered) -> None:
        """Gossip latency of one message: our wall clock minus the origin's signed timestamp."""
        if self._context is not None:
            self.stages.add(stage, (self._context.clock.wall_ms() - message.timestamp_ms) / 1000)

    def _mark(self, batch_id: bytes, *, handed_out: bool) -> None:
        self._settled[batch_id] = handed_out
        while len(self._settled) > 16 * self.capacity:
            self._settled.popitem(last=False)
