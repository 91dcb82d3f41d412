"""One training session: the side effects around the pure GRPO step, written once (DESIGN §6, §10).

nanoGPT's shape: the model and the loss (``grpo.py``, ``GRPOTrainer``) are tensor code; resume,
durability, checkpoints and evaluation live in the loop around them. Both the --local run
(``local_run.py``) and the networked trainer (``roles/trainer_service.py``) drive a
``TrainingSession``, so the two agree by construction on every rule below instead of by review:

- **Open.** Resume from the newest sharded training state and replay the rollout log's batches of the
  steps after it (``resume.py``: --local through ``logged_batches``, the networked trainer through
  ``replay``), so no trained batch is lost; or start from the base model, step 0's files going the way
  of every step's. With torch.distributed every rank looks before rank 0 writes, and only rank 0
  writes the rollout log, Hugging Face checkpoints and metrics (every rank writes its own shards).
- **Step.** Admitted batches of one policy step are merged into one optimizer batch; their frames are
  appended to ``OUT/rollouts.log`` and fsynced *before* the step trains on them; after the step every
  rank writes its own rows of the new policy's one weights file, in the published dtype
  (``OUT/policy_staging``): nothing is gathered, no rank holds the whole model, and the file holds
  this step's weights whatever the next optimizer step does. A background writer hard-links it into
  the policy's Hugging Face checkpoint (fsynced, renamed into place); ``publish_policy`` links it into
  the directory the networked trainer shares. When ``state_save_due`` says so (rank 0 decides and
  sends the decision with the step) every rank starts saving its shards in the background
  (``AsyncShardedSaver``); the next optimizer step waits for that save, nothing else does. One line
  goes to ``OUT/metrics.jsonl``.
- **Memory.** The model is built on the meta device and each rank reads only its own rows of the
  weights (``fsdp.build_sharded_model``); past policies live on each rank as its own shards
  (``PolicyHistory``, "recompute" only) or in those files: per rank ~16 bytes per parameter / N.
- **Ranks.** Under torchrun rank 0 alone admits batches (a reward may come from executing code: no
  other rank re-scores) and drives the session: ``train`` broadcasts the merged batch
  (``encode_prepared``, no pickle) and every rank runs the step; ranks > 0 sit in ``follow`` until
  rank 0's ``close`` broadcasts stop. Every collective happens in the constructor, ``train``,
  ``follow`` and ``close``; ``weights`` and ``evaluate`` are rank 0's local calls.
- **Evaluate.** Held-out greedy accuracy on an engine of its own (loaded on first use), so the
  networked trainer can evaluate one policy while it trains the next.

What differs between the drivers stays with them: where batches come from, torch threads and device,
how logged batches are replayed (--local: ``logged_batches``, interleaved with generation; the
networked trainer: ``replay`` before it takes new batches), and sharing the policy directories.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from prime_node.config import RunConfig
from prime_node.errors import NodeError
from prime_node.ml.checkpoint import (
    prune_step_dirs,
    read_weights,
    step_dir,
    weights_dtype,
    write_policy_dir,
)
from prime_node.ml.checkpoint_writer import CheckpointWriter
from prime_node.ml.distributed import DistInfo
from prime_node.ml.engine import TorchEngine
from prime_node.ml.engines import load_engine
from prime_node.ml.evaluation import greedy_accuracy
from prime_node.ml.fsdp import (
    build_sharded_model,
    resolve_train_dtype,
    training_mesh,
    write_safetensors_shards,
)
from prime_node.ml.prepared import Prepared, decode_prepared, encode_prepared, prepare
from prime_node.ml.resume import Resume, checkpoint_kept
from prime_node.ml.rollout_batch import with_tied_head
from prime_node.ml.rollout_log import RolloutLog
from prime_node.ml.sharded_checkpoint import AsyncShardedSaver, ShardedCheckpoint, state_save_due
from prime_node.ml.sharded_load import load_sharded
from prime_node.ml.tokenizer import load_tokenizer
from prime_node.ml.trainer import GRPOTrainer, StepMetrics
from prime_node.tasks.factory import build_task
from protocol.rollouts import RolloutBatch

log = logging.getLogger(__name__)
Weights = dict[str, torch.Tensor]


def merge_prepared(parts: Sequence[Prepared]) -> Prepared:
    """One optimizer batch from several admitted batches of the same policy step."""
    if not parts or len({p.policy_step for p in parts}) != 1:
        raise ValueError("merge needs batches of one policy step")
    if len(parts) == 1:
        return parts[0]
    samples = sum(p.groups_kept + p.groups_dropped for p in parts)
    merged = Prepared(parts[0].policy_step, [], [], [], 0.0, 0, 0)
    for part in parts:
        merged.sequences += part.sequences
        merged.prompt_lengths += part.prompt_lengths
        merged.advantages += part.advantages
        merged.behaviour_logprobs += part.behaviour_logprobs
        merged.groups_kept += part.groups_kept
        merged.groups_dropped += part.groups_dropped
        merged.reward_mean += part.reward_mean * (part.groups_kept + part.groups_dropped) / samples
    return merged


_MMAP_THRESHOLD = 128 << 10


def _return_freed_blocks() -> None:
    """Have glibc map every block of 128 KiB or more on its own, so that freeing it gives the memory
    back. Its default threshold raises itself (up to 32 MiB) whenever such a block is freed, after
    which a step's transient tensors (all-gathered layers, activations, gloo's buffers) are carved from
    heaps that keep their pages: measured on a 98.6M-parameter Qwen3 at world size 1, resident memory
    after a step went from the state + 0.78 GiB to the state + 0.39 GiB (peak + 1.02 → + 0.67 GiB).
    Other C libraries (no ``mallopt``) are left alone."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    m_mmap_threshold = -3
    mallopt(ctypes.c_int(m_mmap_threshold), ctypes.c_int(_MMAP_THRESHOLD))


class TrainingSession:
    """The model, optimizer, rollout log, checkpoint writers and evaluation engine of one run (see the
    module doc). One call at a time, except that these may run in another thread beside ``train``:
    ``evaluate`` given weights (taken with ``weights`` beforehand: it has its own engine and tokenizer),
    ``admit`` with a ``current_step`` (the task and tokenizer; ``train`` reads only the pad id), and
    ``publish_policy`` of a step already trained (links to that step's own file, which no later step
    writes: the networked trainer's publisher, ``roles/trainer_publisher.py``).

    ``base``: the base model directory (architecture, tokenizer and the step-0 weights; never pruned).
    ``device``: where the training model (and the evaluation engine) live; default ``dist.device`` (the
    one device policy, ``prime_node.hardware.select_device``, via ``distributed.init_from_env``).
    """

    def __init__(
        self, config: RunConfig, *, base: Path, dist: DistInfo | None = None, device: str | None = None
    ) -> None:
        torch.manual_seed(config.torch_seed)
        _return_freed_blocks()
        self.dist = dist or DistInfo()
        self.config, self.base = config, base
        self.device = device if device is not None else self.dist.device
        self.checkpoint_root = config.output_dir / "checkpoints"
        self.state_root = config.output_dir / "train_state"
        self._resume = Resume(
            config.output_dir,
            checkpoint_root=self.checkpoint_root,
            state_root=self.state_root,
            keeps_log=self.dist.is_main,
            published_dtype=config.published_dtype,
        )
        self.rollout_log: RolloutLog | None = self._resume.rollout_log
        self.start_step, self.replay_until = self._resume.start_step, self._resume.replay_until
        """``replay_until``: the newest policy the logged batches after ``start_step`` lead to (rank 0)."""
        if self.dist.world_size > 1:
            self.dist.barrier()  # every rank has looked before rank 0 writes anything
        self.source = base
        """Where the model was built from (the resumed training state is loaded over it)."""
        self.staging = config.output_dir / "policy_staging"
        if self.dist.is_main:  # what a killed run staged is in its checkpoints or lost with its step
            shutil.rmtree(self.staging, ignore_errors=True)
        self.model = build_sharded_model(
            base,
            training_mesh(self.dist, self.device),
            device=self.device,
            compute_dtype=resolve_train_dtype(config.train_dtype, self.device),
            activation_checkpointing=config.activation_checkpointing,
        )
        self.tokenizer = load_tokenizer(base)
        self.task = build_task(config.task)
        self.trainer = GRPOTrainer(
            config,
            self.model,
            self.tokenizer,
            checkpoint_root=self.checkpoint_root,
            dist=self.dist,
            step=self.start_step,
        )
        self._extra = {"run_id": config.run_id}
        self.times = {"train_s": 0.0, "state_s": 0.0, "policy_s": 0.0}
        """Seconds of this process's steps: training, and the checkpoint work on the step's path (state:
        capturing a save and waiting for the previous one before the optimizer step; policy: writing
        the policy's weights file). The background writes are not in them."""
        self._since_save_s = 0.0
        self._last_step_s = 0.0
        self._saver = AsyncShardedSaver(self.state_root, meta={"run_id": config.run_id}, keep=1)
        self.trainer.before_update = self._wait_for_state
        self._writer: CheckpointWriter | None = None
        if self.dist.is_main:
            self._writer = CheckpointWriter(
                self.checkpoint_root, base, config.checkpoints_to_keep, self._extra
            )
        self._open_state(self._resume.state)
        self.eval_ids = list(self.task.eval_ids())[: config.eval_tasks]
        self._eval_engine: TorchEngine | None = None
        self._eval_tokenizer: Any = None
        self._in_step = False  # a step's collectives are under way (rank 0 must not send stop then)
        self._stopped = False

    def _open_state(self, resume: ShardedCheckpoint | None) -> None:
        """Collective: load the resumed training state, or start step 0's files the way of every step's
        (nothing waits for them but the first optimizer step)."""
        if resume is not None:
            load_sharded(resume, self.trainer.model, self.trainer.optimizer)
            self.trainer.record_policy()  # the history's copy of this step was taken before the load
            log.info("resuming from %s (replaying logged steps up to %d)", resume.path, self.replay_until)
            self._stage_policy()  # its checkpoint may be pruned, or from a run that published in fp32
            # a run killed before this step's checkpoint was finished: write it now
            if self._writer is not None and not checkpoint_kept(self.checkpoint_root, self.start_step):
                self._writer.submit(self.start_step, self._staged(self.start_step))
            return
        self._stage_policy()
        self._save_state(0)
        if self._writer is not None and not checkpoint_kept(self.checkpoint_root, 0):
            self._writer.submit(0, self._staged(0))

    @property
    def step(self) -> int:
        """The current policy: the number of optimizer steps taken."""
        return self.trainer.step

    def logged_batches(self) -> dict[int, RolloutBatch]:
        """Logged batches for steps >= ``start_step`` (the --local run replays them), after dropping the
        records no resume can need any more. Empty on ranks other than 0."""
        return self._resume.logged_batches()

    def replay(self, on_step: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
        """Rank 0: train again every logged step from ``start_step`` up to ``replay_until`` on all of each
        step's logged batches (``Resume.replay``), so no batch trained before a kill is lost (the
        networked trainer; --local interleaves its replay with generation)."""
        return self._resume.replay(self, on_step)

    def admit(self, batch: RolloutBatch, *, current_step: int | None = None) -> Prepared:
        """``prepare`` with this run's task, tokenizer and config (RejectedBatchError if refused), for a
        trainer at ``current_step`` (default: this session's step)."""
        step = self.step if current_step is None else current_step
        return prepare(batch, current_step=step, task=self.task, tokenizer=self.tokenizer, config=self.config)

    def train(self, prepared: Sequence[Prepared], frames: Sequence[bytes] = ()) -> StepMetrics:
        """One GRPO step on admitted batches of one policy step (rank 0 only; the other ranks run
        the same step inside ``follow``).

        ``frames``: the batches' codec frames, appended (fsynced) to the rollout log before the step
        trains on them; pass none for batches that are already logged (a replay). Rank 0 alone admits
        (scoring may execute code): the merged batch goes to the other ranks as it is, never re-scored,
        with rank 0's decisions on the step's files (ranks measure different times: one decides).
        """
        if not self.dist.is_main:
            raise RuntimeError("ranks other than 0 train inside follow(), on rank 0's batches")
        if self._stopped:
            raise RuntimeError("the session is closed")
        merged = merge_prepared(prepared)
        if self.rollout_log is not None:
            for frame in frames:
                self.rollout_log.append(self.step, frame)  # durable before any training on it
        after = self.step + 1
        save = state_save_due(
            every=None if self.config.checkpoint_every == "auto" else self.config.checkpoint_every,
            step=after,
            final=after >= self.config.max_steps,
            seconds_since_save=self._since_save_s + self._last_step_s,
            last_save_s=self._saver.last_seconds,
        )
        stage = not self._resume.holds_kept(after, self._staged(after))
        if self.dist.world_size > 1:
            self._in_step = True  # from here on, the other ranks are inside this step's collectives
            self.dist.broadcast_bytes(bytes([save | stage << 1]) + encode_prepared(merged))
        return self._step(merged, save=save, stage=stage)

    def follow(self, on_step: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
        """Ranks > 0: train every step rank 0 broadcasts until rank 0's ``close``; the metrics of each."""
        if self.dist.is_main:
            raise RuntimeError("rank 0 drives the session with train() and close()")
        done: list[StepMetrics] = []
        while message := self.dist.broadcast_bytes(None):
            flags = message[0]
            metrics = self._step(decode_prepared(message[1:]), save=bool(flags & 1), stage=bool(flags & 2))
            done.append(metrics)
            if on_step is not None:
                on_step(metrics)
        self._stopped = True
        return done

    def _step(self, merged: Prepared, *, save: bool, stage: bool) -> StepMetrics:
        """The step every rank runs (its collectives included), then rank 0's files. ``stage``: write the
        new policy's weights file (not for a replayed step whose checkpoint is on disk already: peers may
        hold those bytes); ``save``: start saving the training state (``state_save_due``)."""
        self._in_step = True
        began = time.perf_counter()
        metrics = self.trainer.train_step(merged)  # waits for the previous save before it updates
        trained = time.perf_counter()
        if stage:
            self._stage_policy()
        staged = time.perf_counter()
        if save:
            self._save_state(self.step)
        ended = time.perf_counter()
        self._in_step = False
        self.times["train_s"] += trained - began
        self.times["policy_s"] += staged - trained
        self.times["state_s"] += ended - staged
        self._last_step_s = ended - began
        self._since_save_s = 0.0 if save else self._since_save_s + self._last_step_s
        if self._writer is not None:
            if stage:
                self._writer.submit(self.step, self._staged(self.step))
            self._prune_staging(self._writer.written)
            with open(self.config.output_dir / "metrics.jsonl", "a", encoding="utf-8") as handle:
                handle.write(json.dumps(asdict(metrics)) + "\n")
        return metrics

    def _save_state(self, step: int) -> None:
        """Collective: start saving the sharded weights and AdamW state of ``step`` in the background
        (``AsyncShardedSaver``: the next optimizer step waits for it, nothing else does); the newest
        complete one is kept. NodeError ``checkpoint_failed`` if the previous save failed."""
        self._saver.submit(step, self.trainer.model, self.trainer.optimizer)

    def _wait_for_state(self) -> None:
        began = time.perf_counter()
        self._saver.wait()
        self.times["state_s"] += time.perf_counter() - began

    def _staged(self, step: int) -> Path:
        return self.staging / f"step_{step:08d}.{self.config.published_dtype}.safetensors"

    def _stage_policy(self) -> None:
        """Collective: every rank writes its rows of the current policy, in the published dtype, into
        ``policy_staging``: the one file of this policy, which its checkpoint, the shared policy
        directory and the --local inference child all link. The float32 master weights are in the
        training state; nothing else writes them."""
        published = self.config.published_dtype
        write_safetensors_shards(self.trainer.model, self._staged(self.step), dtype=getattr(torch, published))

    def _prune_staging(self, written: int) -> None:
        """Rank 0: drop staged files no reader needs any more: older than the policies a batch may come
        from (and the --local child may still load), and already in a finished checkpoint."""
        keep_from = min(self.step - self.config.async_level - 1, written)
        for item in self.staging.glob("step_*.safetensors"):
            step = item.name[5:13]
            if step.isdigit() and int(step) < keep_from:
                item.unlink(missing_ok=True)

    def weights(self, step: int) -> Weights:
        """Policy ``step``'s weights as float32 CPU tensors (tied head left out), read from its file in
        the published dtype: its checkpoint, or the staged file while the checkpoint is being finished
        (NodeError ``missing_policy`` if pruned). A fresh copy for every call: nothing shares the
        trainer's storage."""
        final, staged = step_dir(self.checkpoint_root, step), self._staged(step)
        for directory, name in ((final, "model.safetensors"), (staged.parent, staged.name)) * 2:
            if (directory / name).is_file():
                try:
                    found = read_weights(directory, name)
                except NodeError:
                    if (directory / name).exists():
                        raise
                    continue  # renamed or pruned while read: the other location has it
                return {k: v.float() if v.is_floating_point() else v for k, v in found.items()}
        raise NodeError(f"weights of policy step {step} are not on disk any more", reason="missing_policy")

    def policy_file(self, step: int) -> Path:
        """The safetensors file of policy ``step`` in the run's published dtype (for a hand-off: link
        or copy it before the next step, which may prune it)."""
        published = self.config.published_dtype
        for candidate in (self._staged(step), step_dir(self.checkpoint_root, step) / "model.safetensors"):
            if candidate.is_file() and (
                candidate.parent == self.staging or weights_dtype(candidate) == published
            ):
                return candidate
        raise NodeError(f"policy step {step} has no {published} file any more", reason="missing_policy")

    def publish_policy(self, step: int) -> Path:
        """Rank 0: ``OUT/policies/step_N``, the directory the networked trainer shares: the files peers
        need, the weights a hard link to the policy's one file (``policy_file``; read and converted
        only when that is gone, e.g. a checkpoint written in another dtype). Older ones beyond what
        peers may still fetch are removed. It may run beside ``train``, whose staging pruning can
        remove the file between the look and the link: then it looks once more (the checkpoint)."""
        root = self.config.output_dir / "policies"
        try:
            final = write_policy_dir(root, step, self._policy_source(step), self.base)
        except FileNotFoundError:
            final = write_policy_dir(root, step, self._policy_source(step), self.base)
        prune_step_dirs(root, step, self.config.checkpoints_to_keep + 2)
        return final

    def _policy_source(self, step: int) -> Path | Weights:
        """``policy_file(step)``, or its weights read and converted to the published dtype."""
        try:
            return self.policy_file(step)
        except NodeError:
            dtype = getattr(torch, self.config.published_dtype)
            return {
                name: tensor.to(dtype).contiguous() if tensor.is_floating_point() else tensor
                for name, tensor in self.weights(step).items()
            }

    def evaluate(self, policy: int | Weights) -> float:
        """Held-out greedy accuracy in [0, 1] of policy ``policy`` (a step or its weights) over the run's
        ``eval_tasks`` held-out tasks, on the evaluation engine."""
        weights = self.weights(policy) if isinstance(policy, int) else policy
        if self._eval_engine is None:
            self._eval_tokenizer = load_tokenizer(self.base)
            self._eval_engine = load_engine(
                self.base, self._eval_tokenizer, engine=self.config.engine, device=self.device
            )
        engine = self._eval_engine
        engine.load_weights(with_tied_head(engine.model, weights), -1)
        return float(
            greedy_accuracy(
                engine,
                self._eval_tokenizer,
                self.task,
                self.eval_ids,
                max_new_tokens=self.config.max_new_tokens,
            )
        )

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop following (unless a step broke off midway: they are
        stuck in its collectives and torchrun ends them); every rank: wait for the training state being
        saved, and rank 0 for the checkpoints submitted so far (NodeError ``checkpoint_failed`` if one
        failed). Idempotent."""
        broken = self._in_step
        try:
            if self.dist.is_main and self.dist.world_size > 1 and not self._stopped and not broken:
                self.dist.broadcast_bytes(b"")
        finally:  # a dead rank must not cost the checkpoints already queued
            self._stopped = True
            writer, self._writer = self._writer, None
            try:
                if not broken:  # a save's collectives would wait for ranks stuck in the broken step
                    self._saver.close()
            finally:
                if writer is not None:
                    writer.close()
