"""The inferer as a node service: newest policy in, proven and signed rollout batches out (DESIGN §1).

It waits for the first complete checkpoint in the weight swarm, loads it into an engine
(``ml.engines.load_engine``; with the torch threads the node gives its role: ``--threads``) on the device the
role runner chose (``hardware.select_device``), then loops:
before each batch it switches to the newest complete policy the swarm holds, generates the scheduled
batch for (its address, policy step, batch counter) with TOPLOC proofs in a worker thread, and gossips
it signed. Counters start at the wall clock in ms and only grow, so a restarted inferer never repeats a
draw.

To avoid wasted work it produces what the trainer will take (issue 38): given the trainer's signed demand
(``roles/demand.py``, a ``DemandView`` the node shares), it starts a batch only if its policy will still
be at or above the trainer's floor when the batch arrives (the floor projected over the batch's measured
generation time and verdict round trip) and the trainer still wants batches of that policy step beyond
those on their way that the demand cannot count: the trainer counts every batch it has heard announced
(and names, per worker, the newest batch counter it heard), so the inferer counts only its own batches
above its mark, until a demand's mark covers them, their verdict rejects them or they time out, and a
newer demand that predates them does not make it forget them; otherwise it waits for a newer policy or
a newer demand. With no demand
heard it produces at most ``batches_per_policy`` batches per policy step and then waits (briefly) for a
newer one: batches of an old policy go stale at the trainer. Verdicts about its own
batches are counted for the status section "rollouts" (and any rejection charges the worker, via
``ReputationService``, like on every node).

A batch frame small enough for gossip rides it whole; a bigger one (up to the run's
``max_rollout_batch_bytes``) is held by the service's ``BatchTransfer`` and announced, and validators and
the trainer fetch it over the data plane (prime_node/verification/batch_publish.py).

The model work (loading on the chosen device with a VRAM plan, switching weights, making a batch's frames
through a ``RolloutProducer``) is ``InfererModel``'s (inferer_model.py), run in worker threads that a
stopping service abandons, and stops at the next token (verification/model_threads.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import trio

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.cpu_compute import default_threads
from prime_node.errors import NodeError
from prime_node.ml.oom_retry import cuda_free_bytes
from prime_node.node.stage_times import StageTimes
from prime_node.roles.inferer_model import HonestProducer, InfererModel, RolloutProducer
from prime_node.verification.batch_publish import VERDICTS_TOPIC, publish_frame
from prime_node.verification.batch_transfer import BatchTransfer
from prime_node.verification.model_threads import run_model_work
from prime_node.verification.reputation import ReputationService
from prime_node.verification.transfer_settings import TransferSettings
from protocol.errors import ProtocolError

if TYPE_CHECKING:
    from prime_node.ml.vram_plan import VramPlan
    from prime_node.node.context import NodeContext
    from prime_node.node.gossip import Delivered
    from prime_node.roles.demand import DemandView
    from prime_node.verification.batch_transfer import BatchTransfer

log = logging.getLogger(__name__)
MAX_TRACKED_BATCHES = 4096
ETA_WEIGHT = 0.3
"""Weight of the newest measurement in the generation and verdict round-trip means."""


class PolicySource(Protocol):
    """The part of the weight swarm an inferer uses."""

    def newest(self) -> tuple[int, Path] | None: ...

    async def wait_newer(self, than: int | None) -> tuple[int, Path]: ...


class InfererService:
    """See the module doc."""

    def __init__(
        self,
        *,
        key: WalletKey,
        run_config: RunConfig,
        swarm: PolicySource,
        producer: RolloutProducer | None = None,
        batches_per_policy: int = 1,
        policy_wait_s: float = 2.0,
        max_in_flight: int = 2,
        verdict_timeout_s: float = 20.0,
        device: str = "cpu",
        free_vram: Callable[[str], int] | None = None,
        threads: int = 0,
        demand: DemandView | None = None,
    ) -> None:
        self.key = key
        self.device = device
        """Where the engine computes (``hardware.select_device``)."""
        self.config = run_config
        self.swarm = swarm
        self.batches_per_policy = batches_per_policy
        self.policy_wait_s = policy_wait_s
        self.max_in_flight = max_in_flight
        self.verdict_timeout_s = verdict_timeout_s
        self.waited_for_verdicts_s = 0.0
        self.skipped_waits = 0
        self._in_flight: dict[bytes, float] = {}
        self._verdict_arrived = trio.Event()
        self.produced = 0
        self.published = 0
        self.accepted = 0
        self.rejected: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.policy_step: int | None = None
        self.generate_s = 0.0
        self.stages = StageTimes()
        self.producer: RolloutProducer = (
            HonestProducer(key=key, run_config=run_config, stages=self.stages)
            if producer is None
            else producer
        )
        self.model = InfererModel(
            run_config,
            producer=self.producer,
            device=device,
            threads=threads or default_threads(),  # the cores the node gives its role (``join --threads``)
            free_vram=free_vram or cuda_free_bytes,
        )
        """The engine and its work, in worker threads (inferer_model.py)."""
        self.mine: dict[bytes, int] = {}
        self._reputation: Any = None
        self.transfer: BatchTransfer | None = None
        """Serves this inferer's large batches over the data plane (built when the service runs)."""
        self.demand = demand
        """The trainer's demand as this node believes it (None: produce as without demand)."""
        self.held_back: Counter[str] = Counter()
        """Batches not started, by the demand's reason (``would_be_stale``, ``wants_met``)."""
        self.generate_mean_s = 0.0
        self.round_trip_mean_s = 0.0
        self._sent_policy: dict[bytes, int] = {}
        self._sent_counter: dict[bytes, int] = {}
        """Batch counter of our batches awaiting a verdict (their place against the demand's mark)."""
        self._counter = -1
        self._accepted_own: dict[bytes, tuple[int, int, float]] = {}
        """Our accepted batches (policy step, counter, sent at) no demand has counted yet."""

    def status(self) -> dict[str, Any]:
        return {
            "produced": self.produced,
            "published": self.published,
            "accepted": self.accepted,
            "rejected": dict(self.rejected),
            "policy_step": self.policy_step,
            "generate_s": round(self.generate_s, 2),
            "waited_for_verdicts_s": round(self.waited_for_verdicts_s, 2),
            "in_flight": len(self._in_flight),
            "policy_waits": self.skipped_waits,
            "held_back": dict(self.held_back),
            "eta_s": round(self.eta_s(), 3),
            "errors": dict(self.errors),
            "adversary": self.producer.adversary,
            "stages": self.stages.summary(),
            "transfer": self.transfer.status() if self.transfer is not None else {},
            "device": self.device,
            "vram_plan": self.vram_plan.describe() if self.vram_plan is not None else None,
            "chunk": getattr(self.model.engine, "max_batch", None),
        }

    @property
    def vram_plan(self) -> VramPlan | None:
        return self.model.vram_plan

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:

        context.add_status_section("rollouts", self.status)
        if self.config.trusted_validators:
            self._reputation = ReputationService(run_config=self.config)
            self._reputation.attach(context)  # charges offenders; this service reads the verdicts itself
            await context.gossip.subscribe(VERDICTS_TOPIC, self.on_verdict)
        # Hold enough of our own batches for every one still awaiting its verdicts and the trainer.
        hold = max(4, 2 * self.max_in_flight) * self.config.max_rollout_batch_bytes
        self.transfer = BatchTransfer.for_node(context, self.key, settings=TransferSettings(hold_bytes=hold))
        async with trio.open_nursery() as nursery:
            await nursery.start(self.transfer.run)
            task_status.started()
            await self._produce(context)

    async def _produce(self, context: NodeContext) -> None:
        """Switch to the newest policy, generate, publish; forever (module doc)."""
        step, path = await self.swarm.wait_newer(None)
        await run_model_work(self.model.stop, self._load, step, path)
        counter = context.clock.wall_ms()
        made_for_policy = 0
        while True:
            switched = False
            newest = self.swarm.newest()
            if newest is not None and newest[0] > self.policy_step_or(-1):
                try:
                    await run_model_work(self.model.stop, self._switch, *newest)
                except NodeError as exc:  # e.g. retention removed it meanwhile: the next one will do
                    self.errors[exc.reason] += 1
                    log.warning("could not switch to policy %d: %s", newest[0], exc)
                    await trio.sleep(0.2)
                    continue
                made_for_policy = 0
                switched = True
            if self.demand is not None and self.demand.current() is not None:
                if not await self._wanted(self.policy_step_or(0)):
                    continue
            elif not switched and (
                made_for_policy >= self.batches_per_policy
                or self._announced() - self.policy_step_or(0) >= self.config.async_level
            ):
                # Enough work for this policy, or a policy so far behind the newest announced one that
                # its batch would arrive stale: wait (briefly) for the newer policy to be complete here.
                self.skipped_waits += 1
                with trio.move_on_after(self.policy_wait_s):
                    await self.swarm.wait_newer(self.policy_step)
                    continue
            await self._backpressure()
            started = trio.current_time()
            try:
                frames = await run_model_work(
                    self.model.stop, self._make_frames, counter, context.clock.wall_ms()
                )
            except (NodeError, ProtocolError, ValueError, RuntimeError) as exc:
                self.errors[type(exc).__name__] += 1
                log.warning("batch %d not produced: %s", counter, exc)
                await trio.sleep(1.0)
                counter += 1
                continue
            took = trio.current_time() - started
            self.generate_s += took
            self.generate_mean_s = _mean(self.generate_mean_s, took)
            self._counter = counter  # the batch counter of the frames published next
            counter += 1
            made_for_policy += 1
            self.produced += 1
            published = trio.current_time()
            await self._publish(context, frames)
            self.stages.add("publish", trio.current_time() - published)

    async def _wanted(self, policy_step: int) -> bool:
        """Whether the trainer's demand wants a batch of ``policy_step`` started now; if not, wait (at most
        ``policy_wait_s``) for a newer policy or a newer demand, and say no."""
        assert self.demand is not None
        decision = self.demand.should_start(
            policy_step,
            eta_s=self.eta_s(),
            in_flight=self.in_flight_of(policy_step),
            in_flight_total=self.in_flight_of(None),
        )
        if decision.go:
            return True
        self.held_back[decision.reason] += 1
        demand = self.demand
        with trio.move_on_after(self.policy_wait_s):
            async with trio.open_nursery() as nursery:

                async def newer_policy() -> None:
                    await self.swarm.wait_newer(policy_step)
                    nursery.cancel_scope.cancel()

                async def newer_demand() -> None:
                    await demand.wait_changed()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(newer_policy)
                nursery.start_soon(newer_demand)
        return False

    def eta_s(self) -> float:
        """Seconds from starting a batch to the trainer holding its verdict (measured means)."""
        return self.generate_mean_s + self.round_trip_mean_s

    def in_flight_of(self, policy_step: int | None) -> int:
        """Our batches of ``policy_step`` (None: of any step) on their way that the current demand cannot
        count: awaiting a verdict or accepted, above the demand's mark for us (the newest batch counter
        the trainer had heard of ours; a batch without a counter, or with no mark, counts), at or above
        its floor (below, the trainer will never take it), and not past ``verdict_timeout_s``."""
        demand = self.demand.current() if self.demand is not None else None
        mark = demand.heard_of(self.key.address) if demand is not None else None
        floor = demand.floor if demand is not None else 0
        now = trio.current_time()
        for batch_id, (_, counter, sent) in list(self._accepted_own.items()):
            if now - sent > self.verdict_timeout_s or (mark is not None and counter <= mark):
                del self._accepted_own[batch_id]  # counted by the trainer now (or lost)
        mine = [
            (self._sent_policy.get(batch_id, -1), self._sent_counter.get(batch_id), sent)
            for batch_id, sent in self._in_flight.items()
        ] + list(self._accepted_own.values())
        return sum(
            1
            for policy, counter, sent in mine
            if (policy_step is None or policy == policy_step)
            and now - sent <= self.verdict_timeout_s
            and (mark is None or counter is None or counter > mark)
            and (policy_step is not None or policy >= floor)
        )

    async def _backpressure(self) -> None:
        """Wait while ``max_in_flight`` of our batches await a verdict: more would only queue up at the
        validators and go stale there (a batch with no verdict after ``verdict_timeout_s`` counts as lost).
        Without trusted validators to hear from, there is nothing to wait for."""
        if self._reputation is None or self.max_in_flight <= 0:
            return
        started = trio.current_time()
        while True:
            now = trio.current_time()
            for batch_id, sent in list(self._in_flight.items()):
                if now - sent > self.verdict_timeout_s:
                    del self._in_flight[batch_id]
                    self.errors["no_verdict"] += 1
            if len(self._in_flight) < self.max_in_flight:
                break
            self._verdict_arrived = trio.Event()
            with trio.move_on_after(1.0):
                await self._verdict_arrived.wait()
        self.waited_for_verdicts_s += trio.current_time() - started

    def _announced(self) -> int:
        """The newest step the swarm knows of, complete or still fetching (SwarmService.versions)."""
        versions = getattr(self.swarm, "versions", None)
        steps = [v.step for v in versions.values()] if isinstance(versions, dict) else []
        return max(steps, default=self.policy_step_or(0))

    def policy_step_or(self, default: int) -> int:
        return default if self.policy_step is None else self.policy_step

    # -- publishing and verdicts ---------------------------------------------------------------------

    async def _publish(self, context: NodeContext, frames: list[bytes]) -> None:

        for frame in frames:
            try:
                batch_id = await publish_frame(
                    context, frame, transfer=self.transfer, max_size=self.config.max_rollout_batch_bytes
                )
            except NodeError as exc:
                self.errors[exc.reason] += 1
                log.warning("rollout batch not published: %s", exc)
                continue
            self.published += 1
            self.mine[batch_id] = self.policy_step_or(0)
            self._in_flight[batch_id] = trio.current_time()
            self._sent_policy[batch_id] = self.policy_step_or(0)
            self._sent_counter[batch_id] = self._counter
            for tracked in (self.mine, self._sent_policy, self._sent_counter):
                while len(tracked) > MAX_TRACKED_BATCHES:
                    tracked.pop(next(iter(tracked)))

    async def on_verdict(self, message: Delivered) -> None:
        """A gossiped verdict: charge rejected workers, count the ones about our own batches."""
        if self._reputation is None:
            return
        opened = self._reputation.open(message.payload)
        if opened is None:
            return
        verdict, _ = opened
        self._reputation.observe(verdict)
        sent = self._in_flight.pop(verdict.batch_id, None)
        if sent is not None:
            took = trio.current_time() - sent
            self.stages.add("verdict_round_trip", took)
            self.round_trip_mean_s = _mean(self.round_trip_mean_s, took)
            self._verdict_arrived.set()
        policy = self._sent_policy.pop(verdict.batch_id, None)
        counter = self._sent_counter.pop(verdict.batch_id, None)
        if verdict.accepted and sent is not None and policy is not None and counter is not None:
            if len(self._accepted_own) < MAX_TRACKED_BATCHES:  # on its way until a demand counts it
                self._accepted_own[verdict.batch_id] = (policy, counter, sent)
        elif not verdict.accepted:
            self._accepted_own.pop(verdict.batch_id, None)  # another validator's rejection: not coming
        if verdict.worker != self.key.address or self.mine.pop(verdict.batch_id, None) is None:
            return
        if verdict.accepted:
            self.accepted += 1
        else:
            for reason in verdict.reasons:
                self.rejected[reason] += 1

    # -- model work (worker threads: inferer_model.py) -------------------------------------------------

    def _load(self, step: int, path: Path) -> None:
        self.model.load(step, path)
        self.policy_step = step
        log.info("inferer loaded policy %d from %s on %s", step, path, self.device)

    def _switch(self, step: int, path: Path) -> None:
        self.model.switch(step, path)
        self.policy_step = step

    def _make_frames(self, counter: int, now_ms: int) -> list[bytes]:
        assert self.policy_step is not None
        return self.model.frames(self.policy_step, counter, now_ms)


def _mean(mean: float, value: float) -> float:
    """An exponential mean that starts at its first value."""
    return value if mean <= 0 else (1 - ETA_WEIGHT) * mean + ETA_WEIGHT * value
