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

Its intake is the shared ``RolloutInbox`` (inbox.py), with the validator's screening, fetch bounds,
defences and charging rule: a gossiped frame is screened on arrival (signature, signer = sender, run,
freshness; a claimed step too far ahead too, given ``newest_step``) and its sender charged if it fails.
A batch too big for gossip arrives as a ``RolloutAnnouncement``: the offer is kept (refused as on the
validator; bounded per worker and in all) and its bytes are fetched over the data plane only once an
accepting quorum is in, usually from the validators that judged it (they re-announce what they hold),
so the trainer downloads nothing a validator rejected; at most ``fetch_ahead`` of them are fetched or
ready but not yet taken by ``next_accepted``, newest policy step first, within each worker's share of
pending fetches. The fetched frame is checked against the id, decoded and settled like a gossiped one;
the trainer then re-serves it from its ``BatchTransfer``. A frame that passes screening but does not
decode is charged to its (proven) author.

It counts the batches it has heard of and not yet settled (``pending_by_policy``, ``heard_marks``;
inbox/pending.py, bounded per worker by its fetch share): the trainer's demand counts them as had, so
its count of batches on their way is exact (issue 38).

It also does the reputation work on the trainer node (rejections charge the worker's peer), so the
trainer needs no separate ``ReputationService``.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from crypto.keys import Address
from prime_node.errors import NodeError
from prime_node.verification.admission import VerdictBook
from prime_node.verification.batch_publish import VERDICTS_TOPIC
from prime_node.verification.batch_transfer import BatchTransfer
from prime_node.verification.inbox import (
    INTAKE_COUNTS,
    Arrival,
    InboxSettings,
    IntakeHooks,
    RolloutInbox,
    StepBound,
)
from prime_node.verification.inbox.pending import PendingBatches
from prime_node.verification.reasons import BELOW_FLOOR
from prime_node.verification.reputation import ReputationService
from protocol.codec import decode
from protocol.envelope import Envelope
from protocol.errors import ProtocolError
from protocol.rollout_screen import MALFORMED_BATCH
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
        newest_step: Callable[[], int] | None = None,
        hooks: IntakeHooks | None = None,
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
        self.inbox = RolloutInbox(
            run_config=run_config,
            intake=self,
            settings=InboxSettings(
                fetch_on_arrival=False,
                reannounce=False,
                max_offers=capacity,
                delivery_stage="rollout_delivery",
            ),
            reputation=self.reputation,
            transfer=transfer,
            # The trainer's own step is authoritative: a claim past it is no honest worker's.
            steps=StepBound(newest_step) if newest_step is not None else None,
            hooks=hooks,
        )
        self.book = VerdictBook(quorum=run_config.verdict_quorum, capacity=16 * capacity)
        self.counts: Counter[str] = self.inbox.counts
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
        self.stages = self.inbox.stages
        self._context: NodeContext | None = None
        self.pending = PendingBatches(
            per_worker=self.inbox.settings.per_worker_fetches, max_batches=capacity, max_workers=capacity
        )
        """Batches heard of and not yet settled, per worker at most its fetch share (the demand's count)."""
        self.on_change: Callable[[], None] | None = None
        """Called when ``pending_by_policy`` or ``heard_marks`` may have changed (the trainer's demand)."""

    @property
    def transfer(self) -> BatchTransfer | None:
        """Fetches announced batches once accepted (the inbox's; built when it runs if not given)."""
        return self.inbox.transfer

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._context = context
        self.reputation.attach(context)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.inbox.run, context)
            await context.gossip.subscribe(VERDICTS_TOPIC, self._on_verdict)
            task_status.started()

    async def next_accepted(self) -> AcceptedBatch:
        """The next batch an accepting quorum of trusted validators vouched for (waits for one)."""
        while not self._ready:
            self._wakeup = trio.Event()
            await self._wakeup.wait()
        accepted = self._ready.popleft()
        self._not_pending(accepted.batch_id)  # the trainer counts it as being admitted from here on
        self.inbox.pump()
        return accepted

    def pending_by_policy(self) -> dict[int, int]:
        """Batches heard of, not yet taken by ``next_accepted`` nor refused, per policy step (bounded)."""
        return dict(self.pending.by_policy(trio.current_time()))

    def heard_marks(self, most: int) -> tuple[tuple[Address, int], ...]:
        """(worker, newest batch counter heard), the ``most`` most recently heard workers first."""
        return self.pending.marks(most)

    def _heard(self, batch_id: bytes, worker: Address, policy_step: int, counter: int) -> None:
        self.pending.heard(batch_id, worker, policy_step, counter, trio.current_time())
        if self.on_change is not None:
            self.on_change()

    def _not_pending(self, batch_id: bytes) -> None:
        if self.pending.settled(batch_id) and self.on_change is not None:
            self.on_change()

    def stats(self) -> dict[str, Any]:
        inbox = self.inbox
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
            "heard_pending": len(self.pending),
            "heard_not_counted": self.pending.not_counted,
            "heard_not_vouched": self.pending.not_vouched,
            **{key: self.counts[key] for key in INTAKE_COUNTS},
            "refused_reasons": dict(inbox.refused),
            "offers": inbox.offers_kept,
            "fetching": inbox.fetches_pending,
            "waiting_to_fetch": len(inbox.wanted),
            "transfer": self.transfer.status() if self.transfer is not None else {},
        }

    # -- the inbox's intake (inbox.Intake) --------------------------------------------------------------

    def arrived(self, arrival: Arrival) -> bool:
        """A screened frame (or one an accepting quorum named): decode it, then settle."""
        batch_id = arrival.batch_id
        try:
            batch = decode(decode(arrival.frame, Envelope).payload, RolloutBatch)
        except ProtocolError as exc:  # screened: the envelope is its sender's own
            self.counts["malformed_frames"] += 1
            log.info("unreadable rollout frame from %s: %s", arrival.origin, exc)
            self.inbox.charge(arrival.origin_peer_id, MALFORMED_BATCH)
            return False
        self._frames[batch_id] = batch
        self._arrived_at.setdefault(batch_id, trio.current_time())
        self._heard(batch_id, batch.worker, batch.policy_step, batch.batch_counter)
        while len(self._frames) > self.capacity:
            forgotten, _ = self._frames.popitem(last=False)
            self._verified.pop(forgotten, None)
            self._arrived_at.pop(forgotten, None)
            self._not_pending(forgotten)
            self.counts["dropped_frames"] += 1
        self._settle(batch_id)
        return False  # bounded by ``capacity`` (gossiped frames) and ``fetch_ahead`` (fetched ones)

    def refused(self, batch_id: bytes, reason: str) -> None:
        self._not_pending(batch_id)
        if reason == BELOW_FLOOR:  # the trainer no longer wants it: never handed out
            self.rejected_by_reason[reason] += 1
            self._frames.pop(batch_id, None)
            self._mark(batch_id, handed_out=False)

    def known(self, batch_id: bytes) -> bool:
        return batch_id in self._settled or batch_id in self._frames

    def room(self, fetching: int) -> bool:
        return fetching + len(self._ready) < self.fetch_ahead

    def offered(self, batch_id: bytes) -> None:
        self._arrived_at.setdefault(batch_id, trio.current_time())
        offer = self.inbox.offer_of(batch_id)
        if offer is not None:
            self._heard(batch_id, offer.worker, offer.policy_step, offer.batch_counter)
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
            self.inbox.forget(batch_id)
            self._verified.pop(batch_id, None)
            self._arrived_at.pop(batch_id, None)
            self._not_pending(batch_id)
            self.counts["rejected"] += 1
            verdict = self.book.verdict_of(batch_id)
            for reason in verdict.reasons if verdict is not None else ("rejected",):
                self.rejected_by_reason[reason] += 1
            return
        batch = self._frames.get(batch_id)
        if batch is None and self.book.admitted(batch_id):
            self.inbox.want(batch_id)  # an offer kept: fetch it now (or once there is room)
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
            self._not_pending(batch_id)
            log.warning("batch %s accepted with no verified group: nothing to train", batch_id.hex()[:16])
            return
        # Verified work: its announcements count in the demand from now, and its mark covers this batch.
        self.pending.vouched(batch.worker, batch.batch_counter)
        if self.on_change is not None:
            self.on_change()
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
            self._not_pending(self._ready.popleft().batch_id)
            self.counts["dropped_ready"] += 1
        self._wakeup.set()

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
