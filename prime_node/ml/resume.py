"""Resume and replay: where a training session starts again after a kill, and the logged batches it
trains again to get back there. Kept apart from the step loop (``session.py``) because it is a
different job on different inputs: it runs when the session opens (and while it replays) and reads what
a killed run left on disk (checkpoints, training states, the rollout log), where the loop writes them.

The rules (DESIGN §6): resume from the newest sharded training state in ``OUT/train_state`` (FSDP2 fp32
weights and AdamW moments, saved every ``checkpoint_every`` steps), or from the base model, and replay
the rollout log's batches of the steps after it, up to the newest policy checkpoint or beyond
(``replay_until``), so no trained batch is lost. A replayed step whose checkpoint is on disk keeps that
checkpoint's weights file (peers may hold those bytes) instead of staging a new one. Only rank 0 keeps
the rollout log; the other ranks follow rank 0's steps and never replay on their own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from prime_node.errors import NodeError
from prime_node.ml.checkpoint import Checkpoint, list_checkpoints, step_dir, weights_dtype
from prime_node.ml.prepared import Prepared
from prime_node.ml.rollout_log import RolloutLog
from prime_node.ml.sharded_checkpoint import ShardedCheckpoint, list_sharded
from prime_node.ml.trainer import StepMetrics
from protocol.codec import decode
from protocol.errors import RemoteProtocolError
from protocol.rollouts import RolloutBatch

log = logging.getLogger(__name__)


def resume_point(
    checkpoints: Sequence[Checkpoint], sharded: Sequence[ShardedCheckpoint], logged: Sequence[int] | None
) -> tuple[int, ShardedCheckpoint | None, int]:
    """(start step, its training state or None for the base model, the newest step the log can bring
    the run back to). Training state is saved every ``checkpoint_every`` steps and policies every step,
    so the newest policy may be several steps past the newest state: the rollout log's batches for the
    steps in between are replayed. A policy the log cannot reach again (``logged``: the steps with a
    logged batch; None on ranks other than 0, which only follow) is refused: its batches are gone (a
    directory from before sharded checkpoints)."""
    state = sharded[-1] if sharded else None
    start = state.step if state is not None else 0
    if logged is None:
        return start, state, start
    reach = start
    present = set(logged)
    while reach in present:
        reach += 1
    newest = checkpoints[-1].step if checkpoints else 0
    if state is None and newest > reach:
        raise NodeError(
            f"checkpoints up to step {newest} but no training state, and the rollout log cannot replay "
            f"them (written before sharded checkpoints existed?): start a new output_dir",
            reason="bad_checkpoint",
        )
    if newest > reach:
        log.warning(
            "the rollout log replays steps %d..%d only: policies %d..%d are trained again on new batches",
            start,
            reach,
            reach + 1,
            newest,
        )
    return start, state, reach


def checkpoint_kept(checkpoint_root: Path, step: int) -> bool:
    """Whether policy ``step``'s checkpoint is finished on disk (a kill may leave it unwritten)."""
    return any(c.step == step for c in list_checkpoints(checkpoint_root))


class Replays(Protocol):
    """What a replay drives: the session's current step, admission and training."""

    @property
    def step(self) -> int: ...

    def admit(self, batch: RolloutBatch) -> Prepared: ...

    def train(self, prepared: Sequence[Prepared]) -> StepMetrics: ...


class Resume:
    """A session's way back after a kill, found when it opens: ``start_step`` and its training state
    (``state``: None for the base model), ``replay_until`` and, on rank 0 (``keeps_log``), the rollout
    log that replays the steps in between. The log is only read here; the step loop appends to it."""

    def __init__(
        self,
        output_dir: Path,
        *,
        checkpoint_root: Path,
        state_root: Path,
        keeps_log: bool,
        published_dtype: str,
    ) -> None:
        self.checkpoint_root, self.published_dtype = checkpoint_root, published_dtype
        self.rollout_log = RolloutLog(output_dir / "rollouts.log") if keeps_log else None
        found = list_checkpoints(checkpoint_root)
        logged = sorted(self.rollout_log.frames_by_step()) if self.rollout_log is not None else None
        self.start_step, self.state, self.replay_until = resume_point(found, list_sharded(state_root), logged)
        self.oldest_kept = min(found[0].step if found else 0, self.start_step)
        """The oldest step a resume may still start from: logged batches before it are dropped."""

    def logged_batches(self) -> dict[int, RolloutBatch]:
        """Logged batches for steps >= ``start_step`` (the --local run replays them), after dropping the
        records no resume can need any more. Empty on ranks other than 0."""
        if self.rollout_log is None:
            return {}
        self.rollout_log.compact(self.oldest_kept)  # older batches live on only in the weights
        return self.rollout_log.batches_from(self.start_step)

    def replay(
        self, session: Replays, on_step: Callable[[StepMetrics], None] | None = None
    ) -> list[StepMetrics]:
        """Rank 0: train ``session`` again on every logged step from its step up to ``replay_until``, on
        all of each step's logged batches (admitted again as at that step); a step whose batches are all
        refused now ends the replay. The metrics of each step trained, also given to ``on_step``."""
        if self.rollout_log is None:
            return []
        self.rollout_log.compact(self.oldest_kept)
        frames = self.rollout_log.frames_by_step()
        done: list[StepMetrics] = []
        while session.step < self.replay_until:
            prepared = []
            for frame in frames.get(session.step, []):
                try:
                    prepared.append(session.admit(decode(frame, RolloutBatch)))
                except (NodeError, RemoteProtocolError) as exc:
                    log.warning("replaying step %d: a logged batch is refused now: %s", session.step, exc)
            if not prepared:
                break
            metrics = session.train(prepared)
            done.append(metrics)
            if on_step is not None:
                on_step(metrics)
        return done

    def holds_kept(self, step: int, staged: Path) -> bool:
        """Rank 0, for step ``step`` about to be trained: if it is a replayed step whose checkpoint is on
        disk in the published dtype, link that checkpoint's weights to ``staged`` (its policy file), so
        the step keeps the bytes peers may hold and the file stays whatever the writer prunes. False for
        a new step, or if there is no such checkpoint (a kill may leave a half-pruned directory)."""
        if step > self.replay_until:
            return False
        source = step_dir(self.checkpoint_root, step) / "model.safetensors"
        if not checkpoint_kept(self.checkpoint_root, step) or weights_dtype(source) != self.published_dtype:
            return False
        try:
            staged.parent.mkdir(parents=True, exist_ok=True)
            staged.unlink(missing_ok=True)
            os.link(source, staged)
        except OSError:
            return False
        return True
