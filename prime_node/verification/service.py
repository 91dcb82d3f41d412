"""Verification on the network: the validator node service, and the entry points of the other roles.

``ValidatorService`` subscribes to the run's ``rollouts`` topic, keeps the received batch frames in a
bounded queue (the oldest is dropped, and counted, when validation falls behind), checks one batch at a
time with ``Judge`` in a worker thread (model forward passes must not stall the trio loop: heartbeats
and gossip keep flowing) and gossips each signed verdict on ``verdicts``. A batch whose policy
checkpoint has not arrived yet waits up to ``policy_wait_s`` (the weight swarm is usually a few seconds
behind the manifest); then the pipeline answers ``stale_policy`` or ``unknown_policy`` itself.

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

from crypto.keys import Address, WalletKey
from prime_node.errors import NodeError
from prime_node.node.stage_times import StageTimes
from prime_node.verification.admission_service import AcceptedBatch, AdmissionService
from prime_node.verification.reputation import ReputationService
from prime_node.verification.topics import (
    ROLLOUTS_TOPIC,
    VERDICTS_TOPIC,
    publish_batch,
    publish_frame,
)
from prime_node.verification.validator import CheckPolicy, ValidationResult
from protocol.codec import decode, encode
from protocol.envelope import Envelope
from protocol.errors import ProtocolError
from protocol.rollouts import RolloutBatch

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
    """One finished check, kept (bounded) for status and tests."""

    batch_id: bytes
    worker: Address | None
    accepted: bool
    reasons: tuple[str, ...]
    published: bool


@dataclass(frozen=True)
class ValidatorSettings:
    """How a validator queues and waits; the defaults suit a networked run."""

    queue_size: int = 64
    """Batches waiting for a check; the oldest is dropped (and counted) beyond it."""
    policy_wait_s: float = 30.0
    """How long a batch may wait for its policy checkpoint before the pipeline judges it without."""
    poll_s: float = 0.5
    """Fallback poll while waiting for a policy (the weight swarm normally wakes the wait)."""
    keep_policies: int = 3
    """Policy engines kept loaded (the run's async level + 1 covers every step a batch may claim)."""
    check_policy: CheckPolicy = field(default_factory=CheckPolicy)

    def __post_init__(self) -> None:
        if self.queue_size < 1 or self.policy_wait_s < 0 or self.poll_s <= 0:
            raise ValueError("queue_size must be positive, waits non-negative")


@dataclass(frozen=True)
class _Queued:
    frame: bytes
    origin: Address
    origin_peer_id: str
    queued_at: float


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
    ) -> None:
        settings = settings or ValidatorSettings()
        self.key = key
        self.run_config = run_config
        self.locate = locate
        self.current_step = current_step
        self.reputation = reputation
        self.tokenizer = tokenizer
        self.queue_size = settings.queue_size
        self.policy_wait_s = settings.policy_wait_s
        self.poll_s = settings.poll_s
        self.keep_policies = settings.keep_policies
        self.check_policy = settings.check_policy
        self.policies_changed = policies_changed
        self.stages = StageTimes()
        self.counts: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.recent: deque[Judged] = deque(maxlen=RECENT_RESULTS)
        self._queue: deque[_Queued] = deque()
        self._busy = False
        self._validate_s = 0.0
        self._arrived = trio.Event()
        self._judge: Judge | None = None
        self._engines: PolicyEngines | None = None
        self._context: NodeContext | None = None

    # -- service ----------------------------------------------------------------------------------------

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._context = context
        await trio.to_thread.run_sync(self._build_judge)
        await context.gossip.subscribe(ROLLOUTS_TOPIC, self._on_rollout)
        context.add_status_section("validation", self.status)
        task_status.started()
        while True:
            while not self._queue:
                self._arrived = trio.Event()
                await self._arrived.wait()
            item = self._queue.popleft()
            self._busy = True
            try:
                await self._validate(context, item)
            finally:
                self._busy = False

    def status(self) -> dict[str, Any]:
        validated = self.counts["validated"]
        return {
            "validated": validated,
            "accepted": self.counts["accepted"],
            "rejected": dict(self.rejected),
            "backlog": len(self._queue) + int(self._busy),
            "mean_validate_s": round(self._validate_s / validated, 4) if validated else 0.0,
            "dropped_backlog": self.counts["dropped_backlog"],
            "dropped_banned": self.counts["dropped_banned"],
            "stages": self.stages.summary(),
        }

    async def _on_rollout(self, message: Delivered) -> None:
        if self.reputation is not None:
            if self.reputation.worker_banned(message.origin):
                self.counts["dropped_banned"] += 1
                return
            self.reputation.learn(message.origin, message.origin_peer_id)
        if self._context is not None:
            self.stages.add("delivery", (self._context.clock.wall_ms() - message.timestamp_ms) / 1000)
        if len(self._queue) >= self.queue_size:
            self._queue.popleft()
            self.counts["dropped_backlog"] += 1
        self._queue.append(
            _Queued(message.payload, message.origin, message.origin_peer_id, trio.current_time())
        )
        self._arrived.set()

    # -- one batch --------------------------------------------------------------------------------------

    async def _validate(self, context: NodeContext, item: _Queued) -> None:
        dequeued = trio.current_time()
        self.stages.add("queue", dequeued - item.queued_at)
        step = _claimed_step(item.frame)
        if step is not None:
            await self._await_policy(step)
        started = trio.current_time()
        self.stages.add("policy_wait", started - dequeued)
        judge = functools.partial(self._judge_sync, item.frame, context.clock.wall_ms(), self.current_step())
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
        worker = result.batch.worker if result.batch is not None else None
        reasons = tuple(str(r) for r in result.reasons)
        self.recent.append(Judged(result.batch_id, worker, result.accepted, reasons, published))

    async def _await_policy(self, step: int) -> None:
        """Wait (bounded) until the claimed policy is current enough and its checkpoint is on disk."""
        deadline = trio.current_time() + self.policy_wait_s
        while trio.current_time() < deadline:
            current = self.current_step()
            if step < current - self.run_config.async_level or step > current + 1:
                return  # stale, or further ahead than one missed manifest: the pipeline rejects it now
            if step <= current and self._has_policy(step):
                return
            # Woken as soon as the weight swarm completes a version; the poll is only a fallback.
            with trio.move_on_after(min(self.poll_s, max(0.0, deadline - trio.current_time()))):
                if self.policies_changed is not None:
                    await self.policies_changed()
                else:
                    await trio.sleep_forever()
        self.counts["policy_wait_timeouts"] += 1

    def _has_policy(self, step: int) -> bool:
        directory = self.locate(step)
        return directory is not None and directory.is_dir()

    # -- in the worker thread ---------------------------------------------------------------------------

    def _build_judge(self) -> None:
        from prime_node.tasks.factory import build_task
        from prime_node.verification.proving import rollout_domain
        from prime_node.verification.role import Judge, PolicyEngines
        from prime_node.verification.validator import BatchValidator
        from protocol.envelope import EnvelopeVerifier

        self._engines = PolicyEngines(self.locate, self.tokenizer, keep=self.keep_policies)
        validator = BatchValidator(
            self.run_config,
            build_task(self.run_config.task),
            self.tokenizer,
            self._engine,
            rollout_verifier=EnvelopeVerifier(rollout_domain(self.run_config.run_id)),
            policy=self.check_policy,
        )
        self._judge = Judge(validator, self.key)

    def _engine(self, step: int) -> TorchEngine | None:
        """``PolicyEngines`` plus the tokenizer, read from the first checkpoint seen when none was given."""
        assert self._engines is not None and self._judge is not None
        if self.tokenizer is None:
            directory = self.locate(step)
            if directory is None or not directory.is_dir():
                return None
            from prime_node.ml.tokenizer import load_tokenizer

            try:
                self.tokenizer = load_tokenizer(directory)
            except (OSError, ValueError) as exc:
                raise NodeError(
                    f"cannot load the tokenizer in {directory}: {exc}", reason="bad_checkpoint"
                ) from exc
            self._engines.tokenizer = self.tokenizer
            self._judge.validator.tokenizer = self.tokenizer
        return self._engines(step)

    def _judge_sync(
        self, frame: bytes, now_ms: int, current_step: int
    ) -> tuple[ValidationResult, Envelope | None]:
        assert self._judge is not None
        return self._judge.judge(frame, now_ms=now_ms, current_step=current_step)


def _claimed_step(frame: bytes) -> int | None:
    """The policy step a frame claims, read without any checks (only to decide how long to wait)."""
    try:
        return decode(decode(frame, Envelope).payload, RolloutBatch).policy_step
    except ProtocolError:
        return None
