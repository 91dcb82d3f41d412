"""Verification on the network: the validator node service, and the entry points of the other roles.

``ValidatorService`` subscribes to the run's ``rollouts`` topic and screens each frame on arrival
(protocol/rollout_screen.py: envelope, signer = the peer that gossiped it, this run, a policy step the
trainer has published or is about to): a frame that fails is refused there and its sender charged on the
node's peer scores. A frame whose policy checkpoint is held joins its worker's queue; the queues are
served round-robin (protocol/fair_queue.py), so one worker's flood delays only its own batches. A frame
whose checkpoint has not arrived yet waits beside the queues (protocol/waiting_room.py) for up to
``policy_wait_s`` and joins its queue when the checkpoint arrives; at its deadline it is judged anyway
(the pipeline answers ``unknown_policy``) unless the trainer never published that step, in which case
it is refused and its sender charged. The check loop itself never waits for anything but work: it judges
one batch at a time with ``Judge`` in a worker thread (model forward passes must not stall the trio
loop) and gossips each signed verdict on ``verdicts``. A frame the pipeline rejects without a verdict to
name its worker (a replay, a body that does not decode) is charged to its sender here too.

A batch too big for gossip arrives as a ``RolloutAnnouncement`` (protocol/rollout_transfer.py): it is
refused before any byte moves if it is not its worker's, not of this run, over the run's
``max_rollout_batch_bytes``, for a policy too far ahead, or over its worker's share of pending fetches
(``per_worker_fetches`` and ``per_worker_fetch_bytes``: counted in ``refused_worker_fetches`` and
``refused_worker_bytes``); past the bounds of all workers together (``queue_size`` fetches pending,
``max_held_bytes``) a worker with fewer pending fetches evicts the newest of the worker with the most, so
many keys announcing batches they never deliver delay only each other. Otherwise the service's
``BatchTransfer`` fetches it over the data plane (download slots round-robin across workers, a reply
deadline that does not grow with the announced size, a byte-rate floor per chunk: batch_transfer.py),
checks its first bytes against the announcement and the whole against the id, and the frame then takes
exactly the path of a gossiped one (screening, queues, judging, replay check). A worker that does not
deliver its own announced batch is charged (``Offence.UNSOLICITED``); a peer that sends other bytes is
banned. The validator re-announces what it fetched, so peers may fetch it from here instead of from the
worker.

Also importable from here: ``publish_batch`` (inferer), ``AdmissionService`` (trainer),
``ReputationService`` (any role), the topic names.
"""

from __future__ import annotations

import dataclasses
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
from prime_node.node.stage_times import StageTimes
from prime_node.verification.admission_service import AcceptedBatch, AdmissionService
from prime_node.verification.batch_transfer import BatchTransfer, TransferSettings, ban_peer
from prime_node.verification.proving import rollout_domain
from prime_node.verification.reasons import Reason
from prime_node.verification.reputation import ReputationService
from prime_node.verification.topics import (
    ROLLOUTS_TOPIC,
    VERDICTS_TOPIC,
    publish_batch,
    publish_frame,
)
from prime_node.verification.validator import CheckPolicy, ValidationResult
from protocol.codec import decode, encode
from protocol.envelope import Envelope, FreshnessWindow
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.fair_queue import FairQueue
from protocol.rollout_screen import FUTURE_POLICY, MALFORMED_BATCH, offence_for, screen_rollout
from protocol.rollout_transfer import (
    Holder,
    RolloutAnnouncement,
    check_frame_start,
    read_announcement,
    screen_announcement,
)
from protocol.scoring import Offence
from protocol.swarm.messages import Announce
from protocol.topics import CHECKPOINTS_TOPIC
from protocol.waiting_room import Waiting, WaitingRoom

if TYPE_CHECKING:
    from prime_node.config import RunConfig
    from prime_node.ml.engine import TorchEngine
    from prime_node.node.context import NodeContext
    from prime_node.node.gossip import Delivered
    from prime_node.verification.role import Judge, PolicyEngines

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
        sizes = (
            self.queue_size,
            self.per_worker_queue,
            self.waiting_size,
            self.per_worker_waiting,
            self.max_held_bytes,
            self.per_worker_fetches,
            self.per_worker_fetch_bytes,
        )
        if min(sizes) < 1 or self.policy_wait_s < 0 or self.poll_s <= 0 or self.future_steps < 0:
            raise ValueError("queue sizes must be positive, waits and future_steps non-negative")


@dataclass
class _Pending:
    """A fetch in the background: what it reserved, and how to call it off."""

    worker: Address
    size: int
    scope: trio.CancelScope
    ended: bool = False


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
    ) -> None:
        settings = settings or ValidatorSettings()
        self.key = key
        self.transfer = transfer
        """Fetches announced batches and re-serves them (None: one of its own, built when it runs)."""
        self._pending: dict[Address, list[_Pending]] = {}
        """Fetches in the background, per worker (``per_worker_fetches``)."""
        self._fetches_pending = 0
        self._held_bytes = 0
        """Bytes of the frames this service holds or is fetching (``ValidatorSettings.max_held_bytes``)."""
        self.run_config = run_config
        self.locate = locate
        self.current_step = current_step
        self.reputation = reputation
        self.tokenizer = tokenizer
        self.settings = settings
        self.policy_wait_s = settings.policy_wait_s
        self.poll_s = settings.poll_s
        self.keep_policies = settings.keep_policies
        self.check_policy = settings.check_policy
        self.policies_changed = policies_changed
        self.trainer = Address.parse(run_config.trainer_address) if run_config.trainer_address else None
        self.announced_step: int | None = None
        """The newest step the trainer announced on ``checkpoints`` (None until one is heard)."""
        self.domain = rollout_domain(run_config.run_id)
        self.window = FreshnessWindow()
        self.stages = StageTimes()
        self.counts: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.recent: deque[Judged] = deque(maxlen=RECENT_RESULTS)
        self._queue: FairQueue[Address, _Queued] = FairQueue(
            capacity=settings.queue_size, per_key=settings.per_worker_queue
        )
        self._waiting: WaitingRoom[Address, _Queued] = WaitingRoom(
            capacity=settings.waiting_size, per_key=settings.per_worker_waiting
        )
        self._busy = False
        self._validate_s = 0.0
        self._arrived = trio.Event()
        self._parked = trio.Event()
        self._judge: Judge | None = None
        self._engines: PolicyEngines | None = None
        self._context: NodeContext | None = None
        self._nursery: trio.Nursery | None = None

    @property
    def context(self) -> NodeContext:
        if self._context is None:
            raise NodeError("the validator service is not running", reason="not_running")
        return self._context

    # -- service ----------------------------------------------------------------------------------------

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._context = context
        await trio.to_thread.run_sync(self._build_judge)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.transfer is None:
                self.transfer = BatchTransfer.for_node(
                    context,
                    self.key,
                    on_bad_bytes=self._bad_bytes,
                    on_undelivered=self._undelivered,
                    settings=self.settings.transfer,
                )
            if not self.transfer.running:
                await nursery.start(self.transfer.run)
            if self.trainer is not None:
                await context.gossip.subscribe(CHECKPOINTS_TOPIC, self._on_announce)
            await context.gossip.subscribe(ROLLOUTS_TOPIC, self._on_rollout)
            context.add_status_section("validation", self.status)
            nursery.start_soon(self._release_loop)
            task_status.started()
            await self._check_loop(context)

    async def _check_loop(self, context: NodeContext) -> None:
        """Judge queued batches one at a time, round-robin over workers; waits only for work."""
        while True:
            while not len(self._queue):
                self._arrived = trio.Event()
                await self._arrived.wait()
            _, item = self._queue.pop()
            try:
                if self.reputation is not None and self.reputation.worker_banned(item.origin):
                    self.counts["dropped_banned"] += 1
                    continue
                self._busy = True
                try:
                    await self._validate(context, item)
                finally:
                    self._busy = False
            finally:
                self._held_bytes -= len(item.frame)

    def status(self) -> dict[str, Any]:
        validated = self.counts["validated"]
        return {
            "validated": validated,
            "accepted": self.counts["accepted"],
            "rejected": dict(self.rejected),
            "backlog": len(self._queue) + int(self._busy),
            "waiting_for_policy": len(self._waiting),
            "mean_validate_s": round(self._validate_s / validated, 4) if validated else 0.0,
            "refused_on_arrival": self.counts["refused_on_arrival"],
            "charged": self.counts["charged"],
            "dropped_backlog": self.counts["dropped_backlog"],
            "refused_worker_fetches": self.counts["refused_worker_fetches"],
            "refused_worker_bytes": self.counts["refused_worker_bytes"],
            "evicted_fetches": self.counts["evicted_fetches"],
            "undelivered": self.counts["undelivered"],
            "banned_senders": self.counts["banned_senders"],
            "dropped_waiting": self.counts["dropped_waiting"],
            "dropped_banned": self.counts["dropped_banned"],
            "policy_wait_timeouts": self.counts["policy_wait_timeouts"],
            "stages": self.stages.summary(),
            "fetches_pending": self._fetches_pending,
            "held_bytes": self._held_bytes,
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

    # -- arrival ----------------------------------------------------------------------------------------

    async def _on_rollout(self, message: Delivered) -> None:
        if self.reputation is not None and self.reputation.worker_banned(message.origin):
            self.counts["dropped_banned"] += 1
            return
        announcement = read_announcement(message.payload)
        if announcement is not None:
            self._on_batch_announcement(message, announcement)
            return
        if self.reputation is not None:
            self.reputation.learn(message.origin, message.origin_peer_id)
        self._arrive(message.payload, message)

    def _on_batch_announcement(self, message: Delivered, announcement: RolloutAnnouncement) -> None:
        """A batch announced on gossip: refuse it or fetch it in the background (module doc)."""
        assert self.transfer is not None and self._nursery is not None
        if not self.transfer.heard(announcement, message.origin, message.origin_peer_id):
            return  # a re-server's announcement (now a known holder), or an offer heard before
        try:
            screen_announcement(
                announcement,
                origin=message.origin,
                run_id=self.run_config.run_id,
                max_size=self.run_config.max_rollout_batch_bytes,
                newest_step=self.published_step(),
                future_steps=self.settings.future_steps,
            )
        except RemoteProtocolError as exc:
            self.transfer.book.forget(announcement.batch_id)
            self._refuse_id(
                announcement.batch_id, message.origin, message.origin_peer_id, exc.reason, str(exc)
            )
            return
        if self.reputation is not None:
            self.reputation.learn(message.origin, message.origin_peer_id)
        worker, size = message.origin, announcement.size
        mine = self._pending.get(worker, [])
        if len(mine) >= self.settings.per_worker_fetches:
            self.counts["refused_worker_fetches"] += 1
            return
        if sum(p.size for p in mine) + size > self.settings.per_worker_fetch_bytes:
            self.counts["refused_worker_bytes"] += 1
            return
        if not self._make_room(worker, size):
            self.counts["dropped_backlog"] += 1
            return
        pending = _Pending(worker, size, trio.CancelScope())
        self._pending.setdefault(worker, []).append(pending)
        self._fetches_pending += 1
        self._held_bytes += size  # reserved now: the frame is this size or refused
        self._nursery.start_soon(self._fetch, message, announcement, pending)

    def _make_room(self, worker: Address, size: int) -> bool:
        """Whether a fetch of ``size`` bytes for ``worker`` fits all workers' bounds, after evicting (newest
        first) fetches of workers that have more pending than ``worker`` would."""
        settings = self.settings
        own = len(self._pending.get(worker, ())) + 1
        while (
            self._fetches_pending >= settings.queue_size or self._held_bytes + size > settings.max_held_bytes
        ):
            others = [w for w in self._pending if w != worker and len(self._pending[w]) > own]
            if not others:
                return False
            victim = max(others, key=lambda w: len(self._pending[w]))
            self._end_pending(self._pending[victim][-1], evicted=True)
        return True

    def _end_pending(self, pending: _Pending, *, evicted: bool = False) -> None:
        """Release what ``pending`` reserved (once); ``evicted``: also call its fetch off."""
        if pending.ended:
            return
        pending.ended = True
        queue = self._pending.get(pending.worker, [])
        if pending in queue:
            queue.remove(pending)
        if not queue:
            self._pending.pop(pending.worker, None)
        self._fetches_pending -= 1
        self._held_bytes -= pending.size  # _arrive counts the frame again if it keeps it
        if evicted:
            self.counts["evicted_fetches"] += 1
            pending.scope.cancel()

    async def _fetch(self, message: Delivered, announcement: RolloutAnnouncement, pending: _Pending) -> None:
        assert self.transfer is not None
        frame: bytes | None = None
        with pending.scope:
            try:
                fetching = trio.current_time()
                check = functools.partial(check_frame_start, announcement, kind=self.domain.kind)
                frame = await self.transfer.fetch(announcement.batch_id, announcement.size, check_start=check)
                self.stages.add("fetch", trio.current_time() - fetching)
            finally:
                self._end_pending(pending)
        if pending.scope.cancelled_caught:
            log.info("fetch of batch %s evicted", announcement.batch_id.hex()[:16])
            return
        if frame is None:
            self.counts["fetch_failed"] += 1
            return
        if self._arrive(frame, message, announced=announcement):
            await self._reannounce(announcement)

    async def _reannounce(self, announcement: RolloutAnnouncement) -> None:
        """Tell peers this node holds the batch now (they may fetch it here instead of from the worker)."""
        assert self.transfer is not None
        try:
            await self.context.gossip.publish(
                ROLLOUTS_TOPIC, encode(dataclasses.replace(announcement, port=self.transfer.port))
            )
        except NodeError as exc:
            log.info("batch %s not re-announced: %s", announcement.batch_id.hex()[:16], exc)

    def _bad_bytes(self, holder: Holder, reason: str) -> None:
        """A peer sent bytes that are not the batch it was asked for: banned (it is already banned from
        the transfer's data plane; here on the node's peer scores, protocol/scoring.py)."""
        self.counts["charged"] += 1
        self.counts["banned_senders"] += 1
        ban_peer(self.context.policy, holder.peer_id, f"rollout batch bytes: {reason}")

    def _undelivered(self, holder: Holder, reason: str) -> None:
        """A worker did not deliver a batch it announced itself (no reply, too slow, ``missing``, its port
        refused): an offer it does not honour costs it as unsolicited gossip does."""
        self.counts["charged"] += 1
        self.counts["undelivered"] += 1
        self.context.policy.offence(
            holder.peer_id, Offence.UNSOLICITED, f"announced batch undelivered: {reason}"
        )

    def _arrive(
        self, frame: bytes, message: Delivered, *, announced: RolloutAnnouncement | None = None
    ) -> bool:
        """A whole frame from ``message``'s origin (gossiped, or fetched for its announcement): screen it,
        then queue it or park it until its policy arrives. False if it was refused."""
        context = self.context
        self.stages.add("delivery", (context.clock.wall_ms() - message.timestamp_ms) / 1000)
        try:
            screened = screen_rollout(
                frame,
                domain=self.domain,
                window=self.window,
                sender=message.origin,
                run_id=self.run_config.run_id,
                newest_step=self.published_step(),
                future_steps=self.settings.future_steps,
                now_ms=context.clock.wall_ms(),
            )
            header = screened.header
            if announced is not None and (header.policy_step, header.batch_counter) != (
                announced.policy_step,
                announced.batch_counter,
            ):
                raise RemoteProtocolError(
                    "the batch is not the one its worker announced", reason=MALFORMED_BATCH
                )
        except RemoteProtocolError as exc:
            self._refuse(frame, message.origin, message.origin_peer_id, exc.reason, str(exc))
            return False
        now = trio.current_time()
        step = screened.header.policy_step
        item = _Queued(frame, message.origin, message.origin_peer_id, step, now)
        self._held_bytes += len(frame)
        if self._ready(step):
            self._enqueue(item)
            return True
        for dropped in self._waiting.park(
            item.origin, step, item, now=now, deadline=now + self.policy_wait_s
        ):
            self._held_bytes -= len(dropped.item.frame)
            self.counts["dropped_waiting"] += 1
            log.debug(
                "dropped a batch of %s waiting for policy %d (wait list full)", dropped.key, dropped.step
            )
        self._parked.set()
        return True

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
        for dropped in self._queue.push(item.origin, item):
            self._held_bytes -= len(dropped.frame)
            self.counts["dropped_backlog"] += 1
            log.debug("dropped a queued batch of %s (its queue is full)", dropped.origin)
        self._arrived.set()

    def _refuse(self, frame: bytes, origin: Address, peer_id: str, reason: str, detail: str) -> None:
        """Record a frame refused before judging, and charge the peer that sent it."""
        code = str(Reason(reason)) if reason in Reason._value2member_map_ else str(Reason.MALFORMED_ENVELOPE)
        self._refuse_id(blake3(frame), origin, peer_id, code, detail)

    def _refuse_id(self, batch_id: bytes, origin: Address, peer_id: str, code: str, detail: str) -> None:
        self.counts["refused_on_arrival"] += 1
        self.rejected[code] += 1
        self.recent.append(Judged(batch_id, None, False, (code,), False))
        log.info("refused a rollout batch from %s: %s", origin, detail)
        self._charge(peer_id, code)

    def _charge(self, peer_id: str, reason: str) -> None:
        offence = offence_for(reason, certain=self.announced_step is not None)
        if offence is not None:
            self.counts["charged"] += 1
            self.context.policy.offence(peer_id, offence, f"rollout frame refused: {reason}")

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
                self._held_bytes -= len(item.frame)
                detail = f"policy {waiting.step} never published within {self.policy_wait_s:.0f} s"
                self._refuse(item.frame, item.origin, item.origin_peer_id, FUTURE_POLICY, detail)
            else:  # published, but this node does not hold it: the pipeline answers unknown_policy
                self._enqueue(_waited(waiting, now))

    # -- one batch --------------------------------------------------------------------------------------

    async def _validate(self, context: NodeContext, item: _Queued) -> None:
        dequeued = trio.current_time()
        self.stages.add("queue", dequeued - item.queued_at)
        self.stages.add("policy_wait", item.waited_s)
        started = trio.current_time()
        judge = functools.partial(
            self._judge_sync, item.frame, item.step, context.clock.wall_ms(), self.current_step()
        )
        try:
            result, envelope = await trio.to_thread.run_sync(judge)
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
            self._charge(item.origin_peer_id, str(result.reasons[0]))
        worker = result.batch.worker if result.batch is not None else None
        reasons = tuple(str(r) for r in result.reasons)
        self.recent.append(Judged(result.batch_id, worker, result.accepted, reasons, published))

    # -- in the worker thread ---------------------------------------------------------------------------

    def _build_judge(self) -> None:
        from prime_node.tasks.factory import build_task
        from prime_node.verification.role import Judge, PolicyEngines
        from prime_node.verification.validator import BatchValidator
        from protocol.envelope import EnvelopeVerifier

        run = self.run_config
        self._engines = PolicyEngines(
            self.locate,
            self.tokenizer,
            keep=self.keep_policies,
            engine=run.engine,
            dtype=run.validator_dtype,
            device=self.settings.device,
        )
        validator = BatchValidator(
            self.run_config,
            build_task(self.run_config.task),
            self.tokenizer,
            self._engine,
            rollout_verifier=EnvelopeVerifier(self.domain, self.window),
            policy=self.check_policy,
            device=self.settings.device,
        )
        self._judge = Judge(validator, self.key)

    async def preload(self, step: int) -> bool:
        """Load the policy of ``step`` now (in a thread), so the first batch of that step does not wait
        for it; False if the checkpoint is not here (yet)."""
        return await trio.to_thread.run_sync(self._engine, step) is not None

    def _engine(self, step: int) -> TorchEngine | None:
        """``PolicyEngines``, once the tokenizer is known (read from the first checkpoint seen when none
        was given)."""
        assert self._engines is not None
        if self.tokenizer is None and not self._load_tokenizer(step):
            return None
        return self._engines(step)

    def _load_tokenizer(self, *steps: int) -> bool:
        """Read the tokenizer from the checkpoint of the first of ``steps`` held; False if none is."""
        assert self._engines is not None and self._judge is not None
        for step in steps:
            directory = self.locate(step)
            if directory is None or not directory.is_dir():
                continue
            from prime_node.ml.tokenizer import load_tokenizer

            try:
                self.tokenizer = load_tokenizer(directory)
            except (OSError, ValueError) as exc:
                raise NodeError(
                    f"cannot load the tokenizer in {directory}: {exc}", reason="bad_checkpoint"
                ) from exc
            self._engines.tokenizer = self.tokenizer
            self._judge.validator.tokenizer = self.tokenizer
            return True
        return False

    def _judge_sync(
        self, frame: bytes, step: int, now_ms: int, current_step: int
    ) -> tuple[ValidationResult, Envelope | None]:
        assert self._judge is not None
        if self.tokenizer is None:  # the pipeline's cheap stages may need it before any engine is built
            self._load_tokenizer(step, current_step)
        return self._judge.judge(frame, now_ms=now_ms, current_step=current_step)


def _waited(waiting: Waiting[Address, _Queued], now: float) -> _Queued:
    """The item of a batch that waited for its checkpoint, as it joins its queue."""
    item = waiting.item
    return _Queued(item.frame, item.origin, item.origin_peer_id, item.step, now, now - waiting.since)
