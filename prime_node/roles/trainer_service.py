"""The networked GRPO trainer as a node service (DESIGN §1, §6; docs/rl.md *Networked run*).

It shares the starting policy through the weight swarm, then loops: accepted batches (an accepted,
signed verdict from the run's validators; ``AdmissionService``, which hands out only the groups those
validators replayed, so nothing here scores or trains on an unverified completion) are admitted again
by ``prepare`` (run, shape, prompts, rewards recomputed; stale ones refused) and queued in a
``StepGatherer``; a step takes the informative groups of one policy step (see
``prime_node.roles.gather``) and trains one GRPO step through the ``TrainingSession`` the --local run
drives too (``prime_node.ml.session``:
resume, replaying the logged steps after the newest training state, the fsynced rollout log before the
step, checkpoints, evaluation), then shares the new policy's Hugging Face directory (written by the
session, a hard link to the same file as its checkpoint). No stage waits for another (issue 38): the
intake admits the next step's batches while a step trains (admission needs the task and tokenizer, not
the model), a step starts as soon as its batches are queued, and each new policy goes to the one
publisher (``roles/trainer_publisher.py``), which writes and shares it while the next step trains.
Held-out greedy accuracy is measured on the session's separate engine every ``eval_every`` steps
without stopping the loop (``roles/trainer_eval.py``). Model work runs in worker threads (one step at a
time, with the run's ``threads`` or every core this process may use: ``trainer_threads``; the
evaluation beside it on one) so the node keeps serving pieces and gossip; under torchrun
(``TrainerOptions.dist``) this is rank 0, and the step's collectives with the other ranks happen in the
same worker thread as the step.

Only the holder of the run's trainer key runs this (checked before anything starts).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import trio

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.cpu_compute import default_threads
from prime_node.errors import NodeError
from prime_node.node.context import RecordPart
from prime_node.node.stage_times import StageTimes
from prime_node.roles.demand import DemandPublisher
from prime_node.roles.demand_plan import TrainerWants, heard_source
from prime_node.roles.gather import STALE_IN_QUEUE, Candidate, StepGatherer
from prime_node.roles.trainer_eval import HeldOutEvaluator
from prime_node.roles.trainer_key import check_trainer_key
from prime_node.roles.trainer_publisher import PolicyPublisher, Sharer, Timing
from protocol.codec import encode

if TYPE_CHECKING:
    from prime_node.ml.distributed import DistInfo
    from prime_node.ml.prepared import Prepared
    from prime_node.ml.session import TrainingSession
    from prime_node.ml.trainer import StepMetrics
    from prime_node.node.context import NodeContext
    from protocol.rollouts import RolloutBatch

log = logging.getLogger(__name__)
MAX_CURVE_POINTS = 512


class AcceptedSource(Protocol):
    """The part of admission the trainer uses: the next batch with an accepted verdict."""

    async def next_accepted(self) -> Any: ...


@dataclass
class _Queued:
    prepared: Prepared
    frame: bytes
    worker: str
    accepted_at: float
    arrived_step: int = 0


@dataclass(frozen=True)
class TrainerOptions:
    """How the networked trainer runs (the ``run-trainer`` flags beyond the run config)."""

    model_dir: Path | None = None
    """Start from this model directory instead of the run config's ``model_dir``."""
    stop_when_done: bool = False
    """Leave ``run`` after ``max_steps`` (default: keep seeding the checkpoints)."""
    evaluate: bool = True
    """Held-out evaluation every ``eval_every`` steps."""
    fill_wait_s: float = 0.5
    """How long a step waits for more admitted batches once it has some (a step takes one batch's worth
    of prompts)."""
    demand: bool = True
    """Gossip the trainer's demand (``roles/demand.py``, issue 38): inferers produce what it will take."""
    dist: DistInfo | None = None
    """Rank 0 of a torchrun group (``roles/trainer_ranks.py``): each step's batch reaches the other
    ranks inside ``session.train``, and ``close`` stops them. None: one process."""


def trainer_threads(config: RunConfig) -> int:
    """Torch threads of the training worker: the run config's ``threads``, else the cores this process may
    use (``OMP_NUM_THREADS`` where torchrun or the demo set it: one per rank/process)."""
    return config.threads or default_threads()


class TrainerService:
    """See the module doc."""

    def __init__(
        self,
        *,
        key: WalletKey,
        run_config: RunConfig,
        swarm: Sharer,
        admission: AcceptedSource,
        options: TrainerOptions | None = None,
        on_step: Any = None,
    ) -> None:
        options = options or TrainerOptions()
        model_dir, stop_when_done, evaluate = options.model_dir, options.stop_when_done, options.evaluate
        self.key = key
        self.fill_wait_s = options.fill_wait_s
        self.dist = options.dist
        self.config = check_trainer_key(run_config, key)
        self.base = model_dir or self.config.model_dir
        if self.base is None:
            raise NodeError("no model: pass --model or set model_dir in the run config", reason="bad_config")
        self.admission = admission
        self.stop_when_done = stop_when_done
        self.on_step = on_step
        self.evaluate = evaluate
        self.gatherer: StepGatherer[_Queued] = StepGatherer(
            prompts_per_step=self.config.prompts_per_step, async_level=self.config.async_level
        )
        self.step = self.start_step = 0
        self.reward_curve: list[list[float]] = []
        self.held_out: list[list[float]] = []
        self.batches_accepted = 0
        self.batches_trained = 0
        self.rejected: Counter[str] = Counter()
        self.by_worker: Counter[str] = Counter()
        self.timing = Timing()
        self.stages = StageTimes()
        self.publisher = PolicyPublisher(
            config=self.config,
            swarm=swarm,
            write=self._write_policy,
            timing=self.timing,
            stages=self.stages,
            on_published=lambda _: self._demand_changed(),
        )
        self.started_at = 0.0
        self.first_step_at: float | None = None
        self._first_train_at: float | None = None
        self.done = trio.Event()
        self._arrived = trio.Event()
        self._model_lock = trio.CapacityLimiter(1)
        self.evaluator = HeldOutEvaluator(
            eval_tasks=self.config.eval_tasks, timing=self.timing, held_out=self.held_out
        )
        self.session: TrainingSession | None = None
        self.stopped_ranks = False
        """``close`` ended the session cleanly on every rank (the ranks may meet in a last barrier)."""
        heard = heard_source(admission, self._demand_changed)  # batches on their way: an exact count
        self.wants = TrainerWants(self.config.async_level, heard=heard, shared=lambda: self.publisher.newest)
        self.train_after_first_s = 0.0
        self.demand = (
            DemandPublisher(
                key=key, run_id=run_config.run_id, current=self.demand_now, heard=self.wants.heard
            )
            if options.demand
            else None
        )

    @property
    def swarm(self) -> Sharer:
        """Where policies are shared (the publisher's)."""
        return self.publisher.swarm

    @swarm.setter
    def swarm(self, swarm: Sharer) -> None:
        self.publisher.swarm = swarm

    @property
    def checkpoints_shared(self) -> int:
        return self.publisher.shared

    # -- status --------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        rate = 0.0
        done = self.step - self.start_step - 1  # steps after the first (start-up not counted)
        if self.first_step_at is not None and done > 0 and now > self.first_step_at:
            rate = done / (now - self.first_step_at)
        rejected = Counter(self.rejected)
        admission: dict[str, Any] = {}
        stats = getattr(self.admission, "stats", None)
        if callable(stats):  # the validators' reasons, as counted by admission
            admission = stats()
            rejected.update(admission.get("rejected", {}))
        return {
            "step": self.step,
            "max_steps": self.config.max_steps,
            "ranks": 1 if self.dist is None else self.dist.world_size,
            "device": "cpu" if self.dist is None else self.dist.device,
            "reward_curve": self.reward_curve,
            "held_out": self.held_out,
            "batches_accepted": self.batches_accepted,
            "batches_trained": self.batches_trained,
            "batches_rejected": dict(rejected),
            "accepted_by_worker": dict(self.by_worker),
            "checkpoints_shared": self.checkpoints_shared,
            "publishing": self.publisher.status(),
            "queued": len(self.gatherer),
            "steps_per_s": round(rate, 3),
            "time_s": {k: round(v, 2) for k, v in asdict(self.timing).items()},
            "stages": self.stages.summary(),
            "admission_stages": admission.get("stages", {}),
            "groups_unverified": admission.get("groups_unverified", 0),
            "busy_share": self.busy_share(now),
            "demand": {**self.demand.status(), "depth": self.wants.depth()}
            if self.demand is not None
            else None,
            "ages": self.wants.ages_status(),
        }

    def busy_share(self, now: float) -> float | None:
        """Time in ``train`` / wall time since the first step began (start-up excluded), None before."""
        if self._first_train_at is None or now <= self._first_train_at:
            return None
        return round(min(1.0, self.train_after_first_s / (now - self._first_train_at)), 3)

    # -- demand (issue 38) ---------------------------------------------------------------------------

    def demand_now(self) -> tuple[int, int, tuple[int, ...], int, int]:
        """(step, floor, wanted, step_ms, fresh) for the demand publisher (``roles/demand.py``): the step
        trained last, even while its policy is being shared (it is wanted the moment it is out)."""
        return self.wants.current(
            step=self.step, queued=self.gatherer.by_policy(), queued_steps=self.gatherer.queued_steps()
        )

    def _demand_changed(self) -> None:
        if self.demand is not None:
            self.demand.changed()

    # -- lifecycle -----------------------------------------------------------------------------------

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:

        trainer = RecordPart(role="trainer")
        context.add_record_source(lambda: trainer)  # peers see this node as the run's trainer
        self.started_at = trio.current_time()
        self.session = await trio.to_thread.run_sync(self._open)
        self.start_step = self.session.step
        await trio.to_thread.run_sync(self._replay, limiter=self._model_lock)
        self.step = self.session.step
        await self.publisher.publish(self.step)  # ready once the starting policy is shared
        context.add_status_section("training", self.status)
        async with trio.open_nursery() as nursery:
            if self.demand is not None:
                await nursery.start(self.demand.run, context)
            task_status.started()
            nursery.start_soon(self.publisher.run)
            nursery.start_soon(self._intake)
            if self.evaluate:
                self.evaluator.start(nursery, self.session, self.step)
            await self._train_loop(nursery)
            await self.publisher.flush()  # the last policy is out before the run is done
            if self.evaluate:
                await self.evaluator.final(self.session, self.step)
            self.done.set()
            log.info("trainer reached max_steps %d", self.config.max_steps)
            if self.stop_when_done:
                nursery.cancel_scope.cancel()
                return
        await trio.sleep_forever()

    def _open(self) -> TrainingSession:
        import torch

        from prime_node.ml.session import TrainingSession

        torch.set_num_threads(trainer_threads(self.config))  # per OS thread: each worker thread sets it
        assert self.base is not None
        return TrainingSession(self.config, base=self.base, dist=self.dist)

    # -- intake: accepted batches -> admitted, queued ------------------------------------------------

    async def _intake(self) -> None:
        while True:
            accepted = await self.admission.next_accepted()
            batch: RolloutBatch = accepted.batch
            worker = str(getattr(accepted, "worker", batch.worker))
            if self.step >= self.config.max_steps:
                continue
            admitting = trio.current_time()
            self.wants.admitting[batch.policy_step] += 1  # had, for the demand, while it is admitted
            self._demand_changed()
            try:  # beside a step in training: admission needs no model
                prepared, frame = await trio.to_thread.run_sync(self._prepare, batch)
                self.stages.add("admit", trio.current_time() - admitting)
            except NodeError as exc:
                self.rejected[exc.reason] += 1
                log.info("trainer refused an accepted batch from %s: %s", worker, exc)
                if exc.reason == "stale":  # its round trip counts toward the demand's depth too
                    self.wants.arrived(self.step, batch.policy_step, trio.current_time())
                continue
            finally:
                self.wants.admit_ended(batch.policy_step)
                self._demand_changed()
            self.wants.arrived(self.step, prepared.policy_step, trio.current_time())
            self.batches_accepted += 1
            if not self.gatherer.add(
                Candidate(
                    prepared.policy_step,
                    prepared.groups_kept,
                    _Queued(prepared, frame, worker, trio.current_time(), self.step),
                    drawn_groups=prepared.groups_kept + prepared.groups_dropped,
                )
            ):
                self.rejected["uninformative" if prepared.groups_kept == 0 else "queue_full"] += 1
                continue
            self._arrived.set()

    def _prepare(self, batch: RolloutBatch) -> tuple[Prepared, bytes]:

        assert self.session is not None
        return self.session.admit(batch, current_step=self.step), encode(batch)

    # -- the loop ------------------------------------------------------------------------------------

    async def _train_loop(self, nursery: trio.Nursery) -> None:
        config = self.config
        while self.step < config.max_steps:
            await self._fill()
            gathered = self.gatherer.take(self.step)
            if gathered is not None:
                self.rejected[STALE_IN_QUEUE] += len(gathered.dropped_stale)
                self.wants.dropped([(c.item.arrived_step, c.policy_step) for c in gathered.dropped_stale])
            if gathered is None or not gathered.batches:
                waited = trio.current_time()
                self._arrived = trio.Event()
                await self._arrived.wait()
                self.timing.waiting_s += trio.current_time() - waited
                continue
            queued = [c.item for c in gathered.batches]
            t0 = trio.current_time()
            for item in queued:
                self.stages.add("queue", t0 - item.accepted_at)
            if self._first_train_at is None:
                self._first_train_at = t0
            self.wants.train(self.step, [q.prepared.policy_step for q in queued], len(self.gatherer), t0)
            self._demand_changed()  # the queue shrank: its room is wanted while this step trains
            metrics = await trio.to_thread.run_sync(self._train, queued, limiter=self._model_lock)
            t1 = trio.current_time()
            self.train_after_first_s += t1 - t0
            self.step = metrics.step
            self.publisher.offer(metrics.step, t1)  # written and shared while the next step trains
            for item in queued:
                self.by_worker[item.worker] += 1
            self.batches_trained += len(queued)
            self._note(metrics)
            self.timing.train_s += t1 - t0
            self.stages.add("train", t1 - t0)
            self.wants.stepped(self.step, t1)
            self._demand_changed()
            if self.first_step_at is None:
                self.first_step_at = t1
            if self.on_step is not None:
                self.on_step(metrics)
            if self.evaluate and config.eval_every and self.step % config.eval_every == 0:
                assert self.session is not None
                self.evaluator.start(nursery, self.session, self.step)

    async def _fill(self) -> None:
        """Give a started step up to ``fill_wait_s`` to reach ``prompts_per_step`` groups."""
        ready = self.gatherer.ready_groups(self.step)
        if ready == 0 or ready >= self.config.prompts_per_step or self.fill_wait_s <= 0:
            return
        waited = trio.current_time()
        with trio.move_on_after(self.fill_wait_s):
            while self.gatherer.ready_groups(self.step) < self.config.prompts_per_step:
                self._arrived = trio.Event()
                await self._arrived.wait()
        self.timing.waiting_s += trio.current_time() - waited

    def _train(self, queued: list[_Queued]) -> StepMetrics:
        import torch

        torch.set_num_threads(trainer_threads(self.config))
        assert self.session is not None
        return self.session.train([item.prepared for item in queued], [item.frame for item in queued])

    def _note(self, metrics: StepMetrics) -> None:
        self.reward_curve.append([metrics.step, round(metrics.reward_mean, 4)])
        if len(self.reward_curve) > MAX_CURVE_POINTS:
            self.reward_curve = self.reward_curve[::2]

    # -- policies: write, share, prune ---------------------------------------------------------------

    def _write_policy(self, step: int) -> Path:
        """policies/step_N, written by the session's one writer (``TrainingSession.publish_policy``): the
        HF files peers need and a hard link to the policy's one weights file, the same bytes as its
        checkpoint."""
        assert self.session is not None
        return self.session.publish_policy(step)

    def _replay(self) -> int:
        """Train again the logged steps after the resumed training state (rank 0; the session hands them
        to the other ranks), so no accepted batch trained before a kill is lost; how many."""
        import torch

        torch.set_num_threads(trainer_threads(self.config))
        assert self.session is not None
        done = self.session.replay(self._note)
        if done:
            log.info(
                "replayed %d logged steps from the rollout log: policies %d..%d trained again",
                len(done),
                done[0].step,
                done[-1].step,
            )
        return len(done)

    async def _share(self, directory: Path, step: int) -> None:
        """Share policy ``step`` now (``PolicyPublisher.share``; the loop offers policies instead)."""
        await self.publisher.share(directory, step)

    def close(self) -> None:
        """Stop the other ranks, if any, and flush the checkpoint writer (the CLI calls this on shutdown)."""
        if self.session is None:
            return
        try:
            self.session.close()
        except NodeError as exc:
            log.warning("closing the training session: %s", exc)
            self.stopped_ranks = True
        except RuntimeError as exc:  # a collective with a rank that is gone (torchrun reports it)
            log.warning("stopping the other trainer ranks failed: %s", exc)
        else:
            self.stopped_ranks = True
