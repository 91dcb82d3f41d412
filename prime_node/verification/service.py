"""Verification on the network: the validator node service, and the entry points of the other roles.

``ValidatorService`` judges rollout batches. Its intake is the shared ``RolloutInbox`` (inbox.py: the
same steps, defences and charging rule as the trainer's admission): every gossiped frame and every
announced batch (fetched at once, within each worker's share of pending fetches) is screened on arrival
(protocol/rollout_screen.py: envelope, signer = the peer that gossiped it, this run, a policy step the
trainer has published or is about to); a frame that fails is refused there and its sender charged. A
frame whose policy checkpoint is held joins the judge queue, served newest policy step first and
round-robin across workers within a step (fair_slots.py), so one worker's flood delays only its own
batches. A frame whose checkpoint has not arrived yet waits beside the queue (protocol/waiting_room.py)
for up to ``policy_wait_s`` and joins it when the checkpoint arrives; at its deadline it is judged anyway
(the pipeline answers ``unknown_policy``) unless the trainer never published that step, in which case it
is refused and its sender charged. The check loop itself never waits for anything but work: it judges
one batch at a time with ``Judge`` in a worker thread (a stopping service leaves it: model_threads.py)
and gossips each signed verdict on ``verdicts``. A frame the pipeline rejects without a verdict to name
its worker (a replay, a body that does not decode) is charged to its sender too. The inbox re-announces
what the validator fetched, so peers may fetch it from here instead of from the worker.

Also importable from here: ``publish_batch`` (inferer), ``AdmissionService`` (trainer),
``ReputationService`` (any role), the topic names.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from crypto.digests import blake3
from crypto.keys import Address, WalletKey
from prime_node.errors import NodeError
from prime_node.verification.admission_service import AcceptedBatch, AdmissionService
from prime_node.verification.batch_publish import ROLLOUTS_TOPIC, VERDICTS_TOPIC, publish_batch, publish_frame
from prime_node.verification.batch_transfer import BatchTransfer
from prime_node.verification.fair_slots import NewestFirstQueue
from prime_node.verification.inbox import (
    INTAKE_COUNTS,
    Arrival,
    InboxSettings,
    IntakeHooks,
    RolloutInbox,
    StepBound,
)
from prime_node.verification.judging import ThreadJudge
from prime_node.verification.model_threads import run_model_work
from prime_node.verification.reasons import BELOW_FLOOR
from prime_node.verification.reputation import ReputationService
from prime_node.verification.transfer_settings import TransferSettings
from prime_node.verification.validator import CheckPolicy
from protocol.codec import decode, encode
from protocol.errors import ProtocolError
from protocol.rollout_screen import FUTURE_POLICY
from protocol.swarm.messages import Announce
from protocol.topics import CHECKPOINTS_TOPIC
from protocol.waiting_room import Waiting, WaitingRoom

if TYPE_CHECKING:
    from prime_node.config import RunConfig
    from prime_node.node.context import NodeContext
    from prime_node.node.gossip import Delivered

__all__ = [
    "ROLLOUTS_TOPIC",
    "VERDICTS_TOPIC",
    "AcceptedBatch",
    "AdmissionService",
    "ReputationService",
    "ValidatorService",
    "ValidatorSettings",
    "publish_batch",
    "publish_frame",
]

log = logging.getLogger(__name__)
RECENT_RESULTS = 256


@dataclass(frozen=True)
class Judged:
    """One finished check (or refusal on arrival), kept (bounded) for status and tests."""

    batch_id: bytes
    worker: Address | None
    accepted: bool
    reasons: tuple[str, ...]
    published: bool


@dataclass(frozen=True)
class ValidatorSettings:
    """How a validator queues and waits; the defaults suit a networked run."""

    queue_size: int = 64
    """Batches waiting for a check, all workers together; beyond it the longest queue loses its oldest."""
    per_worker_queue: int = 16
    """Batches of one worker waiting for a check; beyond it that worker's oldest is dropped (and counted)."""
    policy_wait_s: float = 30.0
    """How long a batch may wait for its policy checkpoint (beside the queues) before it is judged without."""
    waiting_size: int = 64
    """Batches waiting for their checkpoint, all workers together (the longest wait list loses its newest)."""
    per_worker_waiting: int = 4
    """Batches of one worker waiting for their checkpoint; beyond it that worker's new ones are dropped."""
    future_steps: int = 1
    """How far past the newest step the trainer has published a batch may claim (a manifest the validator
    has not heard yet); a claim beyond it is refused on arrival."""
    poll_s: float = 0.5
    """Fallback poll for arrived checkpoints (the weight swarm normally wakes the waiting batches)."""
    keep_policies: int = 3
    """Policy engines kept loaded (the run's async level + 1 covers every step a batch may claim)."""
    max_held_bytes: int = 1 << 30
    """Frames queued, waiting, being judged or being fetched, in bytes, all together: a batch announced
    while they would pass it is not fetched (counted in ``dropped_backlog``) unless it evicts a fetch of a
    worker with more pending (module doc). Gossiped frames (≤ 256 KiB each) are bounded by the queue
    sizes."""
    per_worker_fetches: int = 4
    """Announced batches of one worker being fetched at once; beyond it its announcements are refused on
    arrival (``refused_worker_fetches``)."""
    per_worker_fetch_bytes: int = 256 << 20
    """Bytes reserved for one worker's pending fetches; an announcement that would pass it is refused on
    arrival (``refused_worker_bytes``)."""
    transfer: TransferSettings | None = None
    """Bounds of the service's own ``BatchTransfer`` (None: its defaults)."""
    check_policy: CheckPolicy = field(default_factory=CheckPolicy)
    device: str = "cpu"
    """Where the policy engines compute (``prime_node.hardware.select_device``)."""

    def __post_init__(self) -> None:
        sizes = (self.queue_size, self.per_worker_queue, self.waiting_size, self.per_worker_waiting)
        if min(sizes) < 1 or self.policy_wait_s < 0 or self.poll_s <= 0 or self.future_steps < 0:
            raise ValueError("queue sizes must be positive, waits and future_steps non-negative")

    def inbox_settings(self) -> InboxSettings:
        """The intake's bounds (the judge queue's ``queue_size`` also bounds the fetches pending)."""
        return InboxSettings(  # raises ValueError on its own bounds
            fetch_on_arrival=True,
            reannounce=True,
            max_fetches=self.queue_size,
            max_held_bytes=self.max_held_bytes,
            per_worker_fetches=self.per_worker_fetches,
            per_worker_fetch_bytes=self.per_worker_fetch_bytes,
            transfer=self.transfer,
        )


@dataclass(frozen=True)
class _Queued:
    frame: bytes
    origin: Address
    origin_peer_id: str
    step: int
    """The policy step the frame claims (read while screening it)."""
    queued_at: float
    waited_s: float = 0.0


class ValidatorService:
    """The validator role: rollouts in, signed verdicts out (module doc)."""

    def __init__(
        self,
        *,
        key: WalletKey,
        run_config: RunConfig,
        locate: Callable[[int], Path | None],
        current_step: Callable[[], int],
        reputation: ReputationService | None = None,
        tokenizer: Any = None,
        policies_changed: Callable[[], Awaitable[object]] | None = None,
        settings: ValidatorSettings | None = None,
        transfer: BatchTransfer | None = None,
        hooks: IntakeHooks | None = None,
    ) -> None:
        settings = settings or ValidatorSettings()
        self.key = key
        self.run_config = run_config
        self.locate = locate
        self.current_step = current_step
        self.reputation = reputation
        self.settings = settings
        self.policy_wait_s = settings.policy_wait_s
        self.poll_s = settings.poll_s
        self.policies_changed = policies_changed
        self.trainer = Address.parse(run_config.trainer_address) if run_config.trainer_address else None
        self.announced_step: int | None = None
        """The newest step the trainer announced on ``checkpoints`` (None until one is heard)."""
        self.inbox = RolloutInbox(
            run_config=run_config,
            intake=self,
            settings=settings.inbox_settings(),
            reputation=reputation,
            transfer=transfer,
            steps=StepBound(
                self.published_step, lambda: self.announced_step is not None, settings.future_steps
            ),
            hooks=hooks,
        )
        self.domain = self.inbox.domain
        self.window = self.inbox.window
        self.stages = self.inbox.stages
        self.counts: Counter[str] = self.inbox.counts
        self.rejected: Counter[str] = Counter()
        self.recent: deque[Judged] = deque(maxlen=RECENT_RESULTS)
        self._queue: NewestFirstQueue[Address, _Queued] = NewestFirstQueue(
            capacity=settings.queue_size, per_key=settings.per_worker_queue
        )
        self._waiting: WaitingRoom[Address, _Queued] = WaitingRoom(
            capacity=settings.waiting_size, per_key=settings.per_worker_waiting
        )
        self._busy = False
        self._validate_s = 0.0
        self._arrived = trio.Event()
        self._parked = trio.Event()
        self._judge = ThreadJudge(
            key,
            run_config,
            locate,
            tokenizer,
            keep=settings.keep_policies,
            check_policy=settings.check_policy,
            device=settings.device,
        )
        self._context: NodeContext | None = None

    @property
    def context(self) -> NodeContext:
        if self._context is None:
            raise NodeError("the validator service is not running", reason="not_running")
        return self._context

    @property
    def transfer(self) -> BatchTransfer | None:
        """Fetches announced batches and re-serves them (the inbox's; built when it runs if not given)."""
        return self.inbox.transfer

    # -- service ----------------------------------------------------------------------------------------

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._context = context
        await run_model_work(self._judge.stop, self._judge.build, self.domain, self.window)
        async with trio.open_nursery() as nursery:
            if self.trainer is not None:
                await context.gossip.subscribe(CHECKPOINTS_TOPIC, self._on_announce)
            await nursery.start(functools.partial(self.inbox.run, context, key=self.key))
            context.add_status_section("validation", self.status)
            nursery.start_soon(self._release_loop)
            task_status.started()
            await self._check_loop(context)

    async def _check_loop(self, context: NodeContext) -> None:
        """Judge queued batches one at a time (fair_slots.py's order); waits only for work."""
        while True:
            while not len(self._queue):
                self._arrived = trio.Event()
                await self._arrived.wait()
            _, item = self._queue.pop()
            try:
                if self.reputation is not None and self.reputation.worker_banned(item.origin):
                    self.counts["dropped_banned"] += 1
                    continue
                if self.inbox.below_floor(item.step):  # the trainer's floor rose while it waited
                    self.counts[BELOW_FLOOR] += 1
                    self.refused(blake3(item.frame), BELOW_FLOOR)
                    continue
                self._busy = True
                try:
                    await self._validate(context, item)
                finally:
                    self._busy = False
            finally:
                self.inbox.release(len(item.frame))

    def status(self) -> dict[str, Any]:
        validated = self.counts["validated"]
        counted = (*INTAKE_COUNTS, "dropped_waiting", "policy_wait_timeouts")
        return {
            "validated": validated,
            "accepted": self.counts["accepted"],
            "rejected": dict(self.rejected),
            "backlog": len(self._queue) + int(self._busy),
            "waiting_for_policy": len(self._waiting),
            "mean_validate_s": round(self._validate_s / validated, 4) if validated else 0.0,
            **{key: self.counts[key] for key in counted},
            "stages": self.stages.summary(),
            "fetches_pending": self.inbox.fetches_pending,
            "held_bytes": self.inbox.held_bytes,
            "transfer": self.transfer.status() if self.transfer is not None else {},
            "device": self.settings.device,
        }

    def published_step(self) -> int:
        """The newest step the trainer has published, as far as this node knows."""
        current = self.current_step()
        return current if self.announced_step is None else max(current, self.announced_step)

    async def _on_announce(self, message: Delivered) -> None:
        """Track the trainer's newest announced step (the swarm service fetches and checks the version)."""
        if message.origin != self.trainer:
            return
        try:
            announce = decode(message.payload, Announce)
        except ProtocolError:
            return  # the weight swarm logs and charges malformed announcements
        if announce.run == self.run_config.run_id:
            self.announced_step = max(announce.step, self.announced_step or 0)

    # -- the inbox's intake (inbox.Intake) --------------------------------------------------------------

    def arrived(self, arrival: Arrival) -> bool:
        """A screened frame: queue it, or park it until its policy arrives."""
        now = trio.current_time()
        step = arrival.header.policy_step
        item = _Queued(arrival.frame, arrival.origin, arrival.origin_peer_id, step, now)
        if self._ready(step):
            self._enqueue(item)
            return True
        for dropped in self._waiting.park(
            item.origin, step, item, now=now, deadline=now + self.policy_wait_s
        ):
            self.inbox.release(len(dropped.item.frame))
            self.counts["dropped_waiting"] += 1
            log.debug(
                "dropped a batch of %s waiting for policy %d (wait list full)", dropped.key, dropped.step
            )
        self._parked.set()
        return True

    def refused(self, batch_id: bytes, reason: str) -> None:
        self.rejected[reason] += 1
        self.recent.append(Judged(batch_id, None, False, (reason,), False))

    def known(self, batch_id: bytes) -> bool:
        return False  # a replay is the pipeline's to judge, in arrival order

    def room(self, fetching: int) -> bool:
        return True  # offers are fetched on arrival, within the inbox's bounds

    def offered(self, batch_id: bytes) -> None:
        """Never called: offers are fetched on arrival (``fetch_on_arrival``)."""

    def _ready(self, step: int) -> bool:
        """Whether a batch of ``step`` can be judged now: its checkpoint is held, or it is already too old
        (the pipeline rejects it as stale without one)."""
        current = self.current_step()
        if step < current - self.run_config.async_level:
            return True
        if step > current:
            return False
        directory = self.locate(step)
        return directory is not None and directory.is_dir()

    def _enqueue(self, item: _Queued) -> None:
        for dropped in self._queue.push(item.origin, item.step, item):
            self.inbox.release(len(dropped.frame))
            self.counts["dropped_backlog"] += 1
            log.debug("dropped a queued batch of %s (its queue is full)", dropped.origin)
        self._arrived.set()

    # -- waiting for checkpoints (beside the check loop) ------------------------------------------------

    async def _release_loop(self) -> None:
        """Move waiting batches to their queues as their checkpoints arrive; settle those that expire."""
        while True:
            self._release()
            self._parked = trio.Event()
            deadline = self._waiting.next_deadline()
            if deadline is None:
                await self._parked.wait()
                continue
            timeout = min(self.poll_s, max(0.0, deadline - trio.current_time()))
            with trio.move_on_after(timeout):
                if self.policies_changed is not None:
                    await self.policies_changed()
                else:
                    await trio.sleep_forever()

    def _release(self) -> None:
        now = trio.current_time()
        released, expired = self._waiting.sweep(now, self._ready)
        for waiting in released:
            self._enqueue(_waited(waiting, now))
        published = self.published_step()
        for waiting in expired:
            self.counts["policy_wait_timeouts"] += 1
            if waiting.step > published:  # the trainer never published it: no honest worker could hold it
                item = waiting.item
                self.inbox.release(len(item.frame))
                detail = f"policy {waiting.step} never published within {self.policy_wait_s:.0f} s"
                self.inbox.refuse(blake3(item.frame), item.origin_peer_id, FUTURE_POLICY, detail)
            else:  # published, but this node does not hold it: the pipeline answers unknown_policy
                self._enqueue(_waited(waiting, now))

    # -- one batch --------------------------------------------------------------------------------------

    async def _validate(self, context: NodeContext, item: _Queued) -> None:
        dequeued = trio.current_time()
        self.stages.add("queue", dequeued - item.queued_at)
        self.stages.add("policy_wait", item.waited_s)
        started = trio.current_time()
        judge = functools.partial(
            self._judge.judge, item.frame, item.step, context.clock.wall_ms(), self.current_step()
        )
        try:
            result, envelope = await run_model_work(self._judge.stop, judge)
        except (NodeError, ProtocolError, OSError, ValueError, RuntimeError) as exc:  # e.g. a bad checkpoint
            log.warning("could not validate batch from %s: %s", item.origin, exc)
            self.counts["errors"] += 1
            return
        self._validate_s += trio.current_time() - started
        self.stages.add("validate", trio.current_time() - started)
        self.counts["validated"] += 1
        if result.accepted:
            self.counts["accepted"] += 1
        for reason in result.reasons:
            self.rejected[str(reason)] += 1
        published = False
        if envelope is not None:
            try:
                publishing = trio.current_time()
                await context.gossip.publish(VERDICTS_TOPIC, encode(envelope))
                self.stages.add("publish_verdict", trio.current_time() - publishing)
                published = True
            except NodeError as exc:
                log.warning("verdict on %s not gossiped: %s", result.batch_id.hex()[:16], exc)
            verdict = result.verdict()
            if self.reputation is not None and verdict is not None:
                self.reputation.observe(verdict)  # our own verdicts do not come back to us over gossip
        elif result.reasons:
            # No verdict names a worker (a replay, a body that does not decode): screening proved the
            # frame is its sender's own, so the sender pays here.
            self.inbox.charge(item.origin_peer_id, str(result.reasons[0]))
        worker = result.batch.worker if result.batch is not None else None
        reasons = tuple(str(r) for r in result.reasons)
        self.recent.append(Judged(result.batch_id, worker, result.accepted, reasons, published))

    async def preload(self, step: int) -> bool:
        """Load the policy of ``step`` now (in a thread), so the first batch of that step does not wait
        for it; False if the checkpoint is not here (yet)."""
        return await run_model_work(self._judge.stop, self._judge.engine, step) is not None


def _waited(waiting: Waiting[Address, _Queued], now: float) -> _Queued:
    """The item of a batch that waited for its checkpoint, as it joins its queue."""
    item = waiting.item
    return _Queued(item.frame, item.origin, item.origin_peer_id, item.step, now, now - waiting.since)
