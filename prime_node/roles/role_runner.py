"""``join``'s role runner: learn the run, pick a role from hardware and demand, run it, switch when needed.

Order of events: the pinned trainer's run announcement is believed (``RunFollower``), which gives the
run config and tells the weight swarm whose manifests to follow (without a pin nothing is believed and
the node takes no role: it only lists who announces the run, issue 13); the first
checkpoint arrives (its config.json and safetensors headers give the model's shape and parameter count:
``requirements_for``); from then on every ``interval``
seconds the pure policy ``protocol.roles.choose_role`` (with its hysteresis) looks at the hardware
profile, the run's requirements and the swarm's demand, and the runner starts the chosen role's
service in its own cancel scope, cancelling the previous one. A seeder runs nothing extra: the weight
swarm already re-serves every piece this node holds.

CPU roles: the role computes with the torch threads the node is given (``--threads``, by default every
core: ``cpu_compute.role_threads``), and the profile offers that many cores. Where the run lets inferers
use the CPU (its ``inferer_devices``) and the node has no GPU, the runner measures how fast those threads
decode in the run's dtype and batch (``cpu_compute.measure_cpu_decode``, well under a second) before the
first decision, and the policy makes it an inferer only when that rate generates a batch in time
(``needed_tokens_per_s``) and the weights fit in RAM.

Demand (advisory; it only steers roles, never admission): live inferers and validators from peer
records' ``role``; the backlog of batches no verdict has named yet from the runner's own gossip taps
(demand_taps.py, which also turns the role's status into the progress lines).

The trainer's demand (issue 38: which policy steps it still accepts, how many batches it still wants;
``roles/demand.py``) is heard by one ``DemandView`` per node, started once the run's trainer is known and
shared by the roles that use it: the inferer produces what the trainer will take, and the validator's
intake drops what falls below the trainer's floor.

The runner reports the chosen role, the hardware ``--gpu`` selected and the device the role computes on
(``hardware.select_device``: ``cpu`` or ``cuda:N``, handed to the role's engines) as a part of the node's
peer record (``NodeContext.add_record_source``) and in its status section. Each role's services run on
``context.scoped()``: their gossip subscriptions end with the role, beside the runner's own (gossip fans
out to every subscriber).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from crypto.keys import Address, WalletKey
from prime_node.config import RunConfig
from prime_node.cpu_compute import measure_cpu_decode, role_threads
from prime_node.errors import NodeError
from prime_node.hardware import probe, select_device, to_summary
from prime_node.ml.engines import admit_device
from prime_node.ml.vram_plan import model_shape
from prime_node.node.context import RecordPart
from prime_node.roles.announcement import RunFollower, worker_run_config
from prime_node.roles.choice import (
    decide_role,
    holds_trainer_key,
    requirements_for_shape,
)
from prime_node.roles.demand import DemandView
from prime_node.roles.demand_taps import BacklogTaps, role_progress
from prime_node.roles.inferer_service import InfererService
from prime_node.roles.progress import PROGRESS_INTERVAL_S, Progress, ProgressReporter, progress_role
from prime_node.verification.batch_archive import BatchArchive
from prime_node.verification.cheating import CheatingProducer
from prime_node.verification.inbox import IntakeHooks
from prime_node.verification.reputation import ReputationService
from prime_node.verification.service import ValidatorService, ValidatorSettings
from protocol.membership import PeerState
from protocol.roles import SwarmDemand

if TYPE_CHECKING:
    from prime_node.hardware import GpuSelection
    from prime_node.node.context import NodeContext
    from prime_node.swarm.service import SwarmService
    from protocol.peer_record import HardwareSummary
    from protocol.resources import HardwareProfile, RunRequirements
    from protocol.roles import RoleDecision, RoleState

log = logging.getLogger(__name__)


def preload(threads: int = 0) -> None:
    """Import torch, transformers and the role modules while the node is still joining (measured: 10-30 s
    of a CPU-starved joiner's start-up went to these imports after the first checkpoint had arrived).
    Role services start only after it returns: two threads importing from transformers at once can fail
    (its lazy module is not thread-safe). ``threads`` (when > 0) becomes torch's process-wide default,
    which every worker thread that has not set its own starts with (the validator's among them)."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM  # noqa: F401


async def _preload_in_thread(done: trio.Event | None = None, threads: int = 0) -> None:
    try:
        await trio.to_thread.run_sync(preload, threads, abandon_on_cancel=True)  # type: ignore[call-arg, unused-ignore]
    finally:
        if done is not None:
            done.set()


def requirements_for(config: RunConfig, checkpoint: Path) -> RunRequirements:
    """What the run's model needs (``choice.requirements_for_shape``): its parameter count and shape from
    the checkpoint's config.json and safetensors headers (whatever dtype the file holds: no weight is
    read). NodeError ``bad_model_dir`` for an unreadable config or header, or no weights."""

    shape = model_shape(checkpoint)
    if shape.params < 1:
        raise NodeError(f"{checkpoint} holds no weights (empty safetensors headers)", reason="bad_model_dir")
    return requirements_for_shape(config, shape)


def measured_profile(profile: HardwareProfile, config: RunConfig, threads: int) -> HardwareProfile:
    """``profile`` with the CPU decode rate of ``threads`` in the run's dtype and batch measured, where
    the role could infer on the CPU (the run allows it, the node has no GPU); otherwise as it is."""

    if profile.gpus or "cpu" not in config.inferer_devices:
        return profile
    seconds = measure_cpu_decode(config.inference_dtype, config.samples_per_step, threads)
    log.info("CPU decode on %d thread(s): %.3f s per GB of weights per step", threads, seconds)
    return dataclasses.replace(profile, cpu_decode_s_per_gb=seconds)


@dataclass(frozen=True)
class RoleSettings:
    """How a node picks and runs its role (the ``join`` flags)."""

    pinned: str | None = None
    """``--role``: a fixed role; None or "auto" lets the policy choose."""
    trainer: Address | None = None
    """``--trainer`` / ``--run RUN@0xTRAINER``: the only trainer whose run announcements are believed
    (None: none is, and the node takes no role)."""
    adversary: str | None = None
    """``--adversary``: publish this cheat (prime_node/verification/cheating.py) instead of honest work."""
    interval: float = 5.0
    """Seconds between role decisions."""
    min_dwell_s: float = 60.0
    """A role is kept at least this long before the policy may switch away."""
    threads: int = 0
    """``--threads``: torch threads of the role's model work, and the cores the node offers; 0: every core
    this process may use (``cpu_compute.default_threads``)."""
    progress_interval_s: float = PROGRESS_INTERVAL_S
    """At most this often a progress line to ``notify`` (``roles.progress``), and a summary on stop."""
    progress_json: bool = False
    """``join --json``: progress lines and the summary as JSON objects."""
    keep_batches: int = 0
    """``--keep-batches``: save this many of the signed batches the validator sees (DATA_DIR/batches)."""
    keep_batches_max_bytes: int = 1 << 30


class RoleRunner:
    """See the module doc."""

    def __init__(
        self,
        *,
        key: WalletKey,
        run_id: str,
        swarm: SwarmService,
        data_dir: Path,
        gpus: GpuSelection,
        settings: RoleSettings | None = None,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        settings = settings or RoleSettings()
        self.key = key
        self.swarm = swarm
        self.data_dir = data_dir
        self.gpus = gpus
        self.pinned = None if settings.pinned in (None, "auto") else settings.pinned
        self.adversary = settings.adversary
        self.interval = settings.interval
        self.min_dwell_s = settings.min_dwell_s
        self.threads = settings.threads
        self.reporter = (
            None
            if notify is None
            else ProgressReporter(
                self.progress,
                notify,
                interval_s=settings.progress_interval_s,
                as_json=settings.progress_json,
            )
        )
        self.follower = RunFollower(run_id, pinned=settings.trainer, notify=notify)
        self.taps = BacklogTaps()
        self.config: RunConfig | None = None
        self.profile: HardwareProfile | None = None
        self.state: RoleState | None = None
        self.reason = "waiting for the run announcement"
        self.service: Any = None
        self.device = ""
        """Where the role's engines compute (``hardware.select_device``); empty for a role without one."""
        self.switches = 0
        self._scope: trio.CancelScope | None = None
        self._stopped = trio.Event()
        self._advertised: RecordPart | None = None
        self._wall_ms: Callable[[], int] = lambda: 0  # the node's wall clock, once running
        self.demand: DemandView | None = None
        """The run trainer's demand, once the run is known (shared by the role's services)."""
        self.keep_batches = (settings.keep_batches, settings.keep_batches_max_bytes)
        self.archive: BatchArchive | None = None
        """Where the validator keeps the batches it saw (``--keep-batches``): one for every role switch."""

    @property
    def role(self) -> str:
        return self.state.role if self.state is not None else "seeder"

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        pinned = self.follower.trust.pinned
        return {
            "role": self.role if pinned is not None else "none",
            "reason": self.reason if pinned is not None else self.follower.refusal(),
            "since_s": round(now - self.state.since, 1) if self.state is not None else 0.0,
            "profile": self.profile.describe() if self.profile is not None else {},
            "threads": self.threads,
            "device": self.device,
            "trainer": str(pinned) if pinned is not None else None,
            "announcements": self.follower.status_rows(self._wall_ms()),
            "switches": self.switches,
            "policy_held": newest[0] if (newest := self.swarm.newest()) is not None else None,
            "max_steps": self.config.max_steps if self.config is not None else None,
        }

    def progress(self) -> Progress | None:
        """The contributor's view for the progress lines (None until the run is known)."""
        label = progress_role(self.state.role if self.state is not None else None, self.pinned)
        return role_progress(label, self.config, self.swarm, self.service)

    def record_part(self) -> RecordPart:
        """The role chosen and the hardware --gpu selected, once known (else the node's own view)."""
        return self._advertised or RecordPart()

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:

        self.threads = role_threads(self.threads)
        self._wall_ms = context.clock.wall_ms
        context.add_status_section("role", self.status)
        context.add_record_source(self.record_part)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.follower.run, context)
            if self.reporter is not None:
                nursery.start_soon(self.reporter.run)
            task_status.started()
            preloaded = trio.Event()  # transformers' lazy imports race across threads (E2: demo crashes)
            if self.follower.trust.pinned is not None:  # unpinned: no role ever, no torch needed
                nursery.start_soon(_preload_in_thread, preloaded, self.threads)
            probed = await trio.to_thread.run_sync(probe, self.gpus, self.data_dir)
            self.profile = dataclasses.replace(probed, cpu_cores=min(probed.cpu_cores, self.threads))
            self._advertised = RecordPart(hardware=to_summary(self.profile))
            announcement = await self.follower.wait()
            self.config = config = await trio.to_thread.run_sync(
                functools.partial(
                    worker_run_config,
                    announcement,
                    output_dir=self.data_dir / "run",
                    task_dir=self.data_dir / "tasks",  # a task file is checked against its digest here
                )
            )
            self.swarm.trainer = announcement.trainer
            self.swarm.keep = max(self.swarm.keep, config.async_level + 1)
            self.demand = DemandView(config.run_id, announcement.trainer)
            count, max_bytes = self.keep_batches
            if count > 0:
                self.archive = BatchArchive(
                    self.data_dir / "batches",
                    count,
                    max_bytes,
                    policy_roots=(self.data_dir / "swarm" / "checkpoints",),
                    run_config=config,
                )
            await nursery.start(self.demand.run, context)
            # Only the policy needs the backlog: a pinned role does not hear (and decode) every batch.
            await self.taps.subscribe(context, rollouts=self.pinned is None)
            self.reason = "waiting for the first checkpoint"
            _, path = await self.swarm.wait_newer(None)
            requirements = requirements_for(config, path)
            await preloaded.wait()  # before any role thread imports transformers itself
            if self.pinned is None:  # the rate only steers the policy: a pinned role needs none
                self.profile = await trio.to_thread.run_sync(
                    measured_profile, self.profile, config, self.threads
                )
            while True:
                decision = self._decide(context, requirements)
                self.reason = decision.reason
                if self.state is None or decision.role != self.state.role:
                    await self._switch(context, nursery, decision, config)
                self.state = decision.next_state(self.state, trio.current_time())
                if self.pinned is not None:
                    await trio.sleep_forever()
                await trio.sleep(self.interval)

    def _decide(self, context: NodeContext, requirements: RunRequirements) -> RoleDecision:
        """The swarm's demand as this node sees it, then ``choice.decide_role`` (what ``doctor`` runs)."""

        assert self.profile is not None and self.config is not None
        inferers = validators = 0
        healthy = set(context.peers_in(PeerState.HEALTHY))
        for member in context.membership.members():
            if member.peer_id in healthy:
                inferers += member.record.role == "inferer"
                validators += member.record.role == "validator"
        now = trio.current_time()
        backlog = self.taps.backlog(now)
        if self.role == "validator" and self.service is not None:
            backlog = int(self.service.status().get("backlog", backlog))
        return decide_role(
            self.profile,
            requirements,
            SwarmDemand(backlog=backlog, inferers=inferers, validators=validators),
            self.state,
            now,
            pinned=self.pinned,
            holds_trainer_key=holds_trainer_key(self.config, self.key.address),
            min_dwell_s=self.min_dwell_s,
        )

    async def _switch(
        self, context: NodeContext, nursery: trio.Nursery, decision: RoleDecision, config: RunConfig
    ) -> None:
        if self._scope is not None:
            self._scope.cancel()
            await self._stopped.wait()
            self._scope = None
        self.service = None
        role = decision.role
        self.device = self._device_for(role)
        if self.device:
            admit_device(config, role, self.device)  # NodeError with the fix: never an uncalibrated pair
        self._advertised = dataclasses.replace(self.record_part(), role=role, hardware=self._summary())
        log.info("role: %s (%s)%s", role, decision.reason, f" on {self.device}" if self.device else "")
        if self.state is not None:
            self.switches += 1
        services = self._build(role, config)
        if not services:
            return
        self.service = services[-1]
        self._stopped = trio.Event()
        await nursery.start(self._run_services, context, services)

    async def _run_services(
        self, context: NodeContext, services: list[Any], *, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The role's services, on a scoped context: cancelling the role also ends its subscriptions."""
        main = services[-1]
        with trio.CancelScope() as scope:
            self._scope = scope
            try:
                with context.scoped() as role_context:
                    async with trio.open_nursery() as nursery:
                        for service in services:
                            await nursery.start(service.run, role_context)
                        task_status.started()
            finally:
                self._stopped.set()
        if self.service is main and not scope.cancelled_caught:
            log.info("the %s service ended", self.role)

    def _device_for(self, role: str) -> str:
        """The device of a role that runs a model (NodeError if the selected GPU is gone), else empty."""

        if role not in ("inferer", "validator") or self.profile is None:
            return ""
        return select_device(self.profile, self.gpus)

    def _summary(self) -> HardwareSummary | None:

        return None if self.profile is None else to_summary(self.profile, self.device)

    def _build(self, role: str, config: RunConfig) -> list[Any]:
        """The role's services, the one whose status steers the policy last."""
        if role == "inferer":
            cheat = (
                None
                if self.adversary is None
                else CheatingProducer(self.adversary, key=self.key, run_config=config)
            )
            return [
                InfererService(
                    key=self.key,
                    run_config=config,
                    swarm=self.swarm,
                    producer=cheat,
                    device=self.device,
                    threads=self.threads,
                    demand=self.demand,
                )
            ]
        if role == "validator":
            reputation = ReputationService(run_config=config)  # hears verdicts, charges rejected workers
            validator = ValidatorService(
                key=self.key,
                run_config=config,
                locate=self.swarm.locate,
                current_step=self._current_step,
                reputation=reputation,
                settings=ValidatorSettings(keep_policies=config.async_level + 1, device=self.device),
                policies_changed=self.swarm.wait_changed,
                # Below the trainer's published floor a batch can no longer be trained: not judged, not
                # charged (verification/inbox); the kept batches go to ``--keep-batches``'s archive.
                hooks=IntakeHooks(
                    archive=self.archive, floor=self.demand.floor if self.demand is not None else None
                ),
            )
            return [reputation, validator]
        if role == "trainer":
            self.reason += " (this node holds the trainer key: run `prime-node run-trainer` to train)"
        return []  # seeder (or trainer key holder): the weight swarm re-serves pieces by itself

    def _current_step(self) -> int:
        newest = self.swarm.newest()
        return newest[0] if newest is not None else 0
