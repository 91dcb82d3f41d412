"""One training session: the side effects around the pure GRPO step, written once (DESIGN §6, §10).

nanoGPT's shape: the model and the loss (``grpo.py``, ``GRPOTrainer``) are tensor code; resume,
durability, checkpoints and evaluation live in the loop around them. Both the --local run
(``local_run.py``) and the networked trainer (``roles/trainer_service.py``) drive a
``TrainingSession``, so the two agree by construction on every rule below instead of by review:

- **Open.** Resume from the newest step that has both a complete Hugging Face checkpoint in
  ``OUT/checkpoints`` (the policy the swarm shares) and sharded training state in ``OUT/train_state``
  (FSDP2 weights and AdamW moments, ``sharded_checkpoint.py``), or start from the base model and write
  both for step 0 first. With torch.distributed every rank looks before rank 0 writes, and only rank 0
  writes the rollout log, Hugging Face checkpoints and metrics (every rank writes its own shards).
- **Step.** Admitted batches of one policy step are merged into one optimizer batch; their frames are
  appended to ``OUT/rollouts.log`` and fsynced *before* the step trains on them; after the step every
  rank saves its shards, then every rank writes its own rows of the new policy's weights file
  (``OUT/policy_staging``, fp32, plus one in the published dtype when that differs): nothing is
  gathered, no rank holds the whole model, and the file holds this step's weights whatever the next
  optimizer step does. A background writer hard-links it into the policy's Hugging Face checkpoint
  (fsynced, renamed into place), and one line goes to ``OUT/metrics.jsonl``.
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
whether logged batches are replayed (--local: ``logged_batches``; the networked trainer continues with
fresh batches), and the policy directories the networked trainer shares.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import queue
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from prime_node.config import RunConfig
from prime_node.errors import NodeError
from prime_node.ml.checkpoint import (
    Checkpoint,
    list_checkpoints,
    prune_checkpoints,
    read_weights,
    step_dir,
    write_checkpoint,
)
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
from prime_node.ml.rollout_batch import with_tied_head
from prime_node.ml.rollout_log import RolloutLog
from prime_node.ml.sharded_checkpoint import (
    ShardedCheckpoint,
    list_sharded,
    load_sharded,
    prune_sharded,
    save_sharded,
)
from prime_node.ml.tokenizer import load_tokenizer
from prime_node.ml.trainer import (
    GRPOTrainer,
    Prepared,
    StepMetrics,
    decode_prepared,
    encode_prepared,
    prepare,
)
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


def _resume_point(
    checkpoints: Sequence[Checkpoint], sharded: Sequence[ShardedCheckpoint]
) -> ShardedCheckpoint | None:
    """The newest step with both a Hugging Face checkpoint (the policy the swarm shares) and sharded
    training state (weights and AdamW moments): a kill may leave either one a step ahead."""
    shared = {c.step for c in checkpoints}
    both = [c for c in sharded if c.step in shared]
    return both[-1] if both else None


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


class CheckpointWriter:
    """Finishes step checkpoints on a background thread, in order, from weights files the ranks have
    written already (``write_safetensors_shards``): hard-linked in, fsynced, renamed into place.

    The training loop pays only for writing the weights into the page cache; the fsyncs run while the
    next step trains. What the writer gets is a finished file, never tensors the optimizer may change.
    A kill may leave the newest checkpoint a step or two behind: every batch trained since is in the
    rollout log (a --local restart replays them; a networked one continues from the checkpoint).
    """

    def __init__(
        self,
        root: Path,
        base_dir: Path,
        keep: int,
        extra: dict[str, Any],
        on_written: Callable[[int], None] | None = None,
    ) -> None:
        self._on_written = on_written
        self._jobs: queue.Queue[tuple[int, Path] | None] = queue.Queue()
        self.written = -1
        """The newest step finished (read by the training thread: staging files up to it may go)."""
        self._root, self._base, self._keep, self._extra = root, base_dir, keep, extra
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # torch's intra-op thread count is per OS thread (OpenMP); copying tensors needs no more than one.
        torch.set_num_threads(1)
        while (job := self._jobs.get()) is not None:
            step, weights = job
            try:
                write_checkpoint(self._root, step, weights, None, self._base, self._extra)
                self.written = step
                if self._on_written is not None:
                    self._on_written(step)
                prune_checkpoints(self._root, self._keep)
            except BaseException as exc:
                self._error = exc
                return

    def submit(self, step: int, weights: Path) -> None:
        if self._error is not None:
            raise NodeError(f"writing a checkpoint failed: {self._error}", reason="checkpoint_failed")
        self._jobs.put((step, weights))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        if self._error is not None:
            raise NodeError(f"writing a checkpoint failed: {self._error}", reason="checkpoint_failed")


class TrainingSession:
    """The model, optimizer, rollout log, checkpoint writer and evaluation engine of one run (see the
    module doc). One call at a time, except that ``evaluate`` given weights (taken with ``weights``
    beforehand) may run in another thread beside ``train``: it has its own engine and tokenizer.

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
        found = list_checkpoints(self.checkpoint_root)
        resume = _resume_point(found, list_sharded(self.state_root))
        if self.dist.world_size > 1:
            self.dist.barrier()  # every rank has looked before rank 0 writes anything
        if found and resume is None:
            raise NodeError(
                f"{self.checkpoint_root} has checkpoints but {self.state_root} no training state for any "
                "of them (written before sharded checkpoints existed?): start a new output_dir",
                reason="bad_checkpoint",
            )
        self.start_step = resume.step if resume else 0
        self.source = step_dir(self.checkpoint_root, resume.step) if resume else base
        """Where the starting weights came from: the resumed step's checkpoint, or the base model."""
        self._oldest_kept = found[0].step if found else 0
        self.staging = config.output_dir / "policy_staging"
        if self.dist.is_main:  # what a killed run staged is in its checkpoints or lost with its step
            shutil.rmtree(self.staging, ignore_errors=True)
        self.model = build_sharded_model(
            self.source,
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
        if resume is not None:
            load_sharded(resume, self.trainer.model, self.trainer.optimizer)
            log.info("resuming from %s and %s", self.source, resume.path)
            self._stage_policy(master=False)  # its checkpoint has the master weights already
        else:
            self._save_state()
            self._stage_policy()
            if self.dist.is_main:
                staged = self._staged(0, "float32")
                write_checkpoint(self.checkpoint_root, 0, staged, None, base, self._extra)
        self.rollout_log: RolloutLog | None = None
        self._writer: CheckpointWriter | None = None
        if self.dist.is_main:
            self.rollout_log = RolloutLog(config.output_dir / "rollouts.log")
            self._writer = CheckpointWriter(
                self.checkpoint_root, base, config.checkpoints_to_keep, self._extra
            )
        self.eval_ids = list(self.task.eval_ids())[: config.eval_tasks]
        self._eval_engine: TorchEngine | None = None
        self._eval_tokenizer: Any = None
        self._in_step = False  # a step's collectives are under way (rank 0 must not send stop then)
        self._stopped = False

    @property
    def step(self) -> int:
        """The current policy: the number of optimizer steps taken."""
        return self.trainer.step

    def logged_batches(self) -> dict[int, RolloutBatch]:
        """Logged batches for steps >= ``start_step`` (the --local run replays them), after dropping the
        records every kept checkpoint already contains. Empty on ranks other than 0."""
        if self.rollout_log is None:
            return {}
        self.rollout_log.compact(self._oldest_kept)  # older batches live on only in the weights
        return self.rollout_log.batches_from(self.start_step)

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
        (scoring may execute code): the merged batch goes to the other ranks as it is, never re-scored.
        """
        if not self.dist.is_main:
            raise RuntimeError("ranks other than 0 train inside follow(), on rank 0's batches")
        if self._stopped:
            raise RuntimeError("the session is closed")
        merged = merge_prepared(prepared)
        if self.rollout_log is not None:
            for frame in frames:
                self.rollout_log.append(self.step, frame)  # durable before any training on it
        if self.dist.world_size > 1:
            self._in_step = True  # from here on, the other ranks are inside this step's collectives
            self.dist.broadcast_bytes(encode_prepared(merged))
        return self._step(merged)

    def follow(self, on_step: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
        """Ranks > 0: train every step rank 0 broadcasts until rank 0's ``close``; the metrics of each."""
        if self.dist.is_main:
            raise RuntimeError("rank 0 drives the session with train() and close()")
        done: list[StepMetrics] = []
        while message := self.dist.broadcast_bytes(None):
            metrics = self._step(decode_prepared(message))
            done.append(metrics)
            if on_step is not None:
                on_step(metrics)
        self._stopped = True
        return done

    def _step(self, merged: Prepared) -> StepMetrics:
        """The step every rank runs (its collectives included), then rank 0's files."""
        self._in_step = True
        metrics = self.trainer.train_step(merged)
        self._save_state()
        self._stage_policy()
        self._in_step = False
        if self._writer is not None:
            self._writer.submit(self.step, self._staged(self.step, "float32"))
            self._prune_staging(self._writer.written)
            with open(self.config.output_dir / "metrics.jsonl", "a", encoding="utf-8") as handle:
                handle.write(json.dumps(asdict(metrics)) + "\n")
        return metrics

    def _save_state(self) -> None:
        """Collective: the sharded weights and AdamW state of the current step (resume needs them and
        the step's Hugging Face checkpoint); rank 0 then drops those older than the resume point."""
        save_sharded(
            self.state_root,
            self.step,
            self.trainer.model,
            self.trainer.optimizer,
            meta={"run_id": self.config.run_id},
        )
        if self.dist.is_main:
            sharded = list_sharded(self.state_root)
            resume = _resume_point(list_checkpoints(self.checkpoint_root), sharded)
            if resume is not None:
                prune_sharded(self.state_root, sum(1 for c in sharded if c.step >= resume.step))

    def _staged(self, step: int, dtype: str) -> Path:
        return self.staging / f"step_{step:08d}.{dtype}.safetensors"

    def _stage_policy(self, *, master: bool = True) -> None:
        """Collective: every rank writes its rows of the current policy into ``policy_staging``: the
        fp32 master weights (``master``; the checkpoint's file) and, when the run publishes another
        dtype, the weights in that dtype (what the --local inference child loads)."""
        model, step = self.trainer.model, self.step
        if master:
            write_safetensors_shards(model, self._staged(step, "float32"))
        published = self.config.published_dtype
        if published != "float32":
            write_safetensors_shards(model, self._staged(step, published), dtype=getattr(torch, published))

    def _prune_staging(self, written: int) -> None:
        """Rank 0: drop staged files no reader needs any more: older than the policies a batch may come
        from (and the --local child may still load), and already in a finished checkpoint."""
        keep_from = min(self.step - self.config.async_level - 1, written)
        for item in self.staging.glob("step_*.safetensors"):
            step = item.name[5:13]
            if step.isdigit() and int(step) < keep_from:
                item.unlink(missing_ok=True)

    def weights(self, step: int) -> Weights:
        """Policy ``step``'s fp32 weights (CPU tensors, tied head left out), read from its file: its
        checkpoint, or the staged file while the checkpoint is being finished (NodeError
        ``missing_policy`` if pruned). A fresh copy for every call: nothing shares the trainer's
        storage."""
        final, staged = step_dir(self.checkpoint_root, step), self._staged(step, "float32")
        for directory, name in ((final, "model.safetensors"), (staged.parent, staged.name)) * 2:
            if (directory / name).is_file():
                try:
                    return read_weights(directory, name)
                except NodeError:
                    if (directory / name).exists():
                        raise
                    # renamed or pruned while read: the other location has it
        raise NodeError(f"weights of policy step {step} are not on disk any more", reason="missing_policy")

    def policy_file(self, step: int) -> Path:
        """The safetensors file of policy ``step`` in the run's published dtype (for a hand-off: link
        or copy it before the next step, which may prune it)."""
        published = self.config.published_dtype
        for candidate in (
            self._staged(step, published),
            step_dir(self.checkpoint_root, step) / "model.safetensors",
        ):
            if candidate.is_file() and (published == "float32" or candidate.parent == self.staging):
                return candidate
        raise NodeError(f"policy step {step} has no {published} file any more", reason="missing_policy")

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
        stuck in its collectives and torchrun ends them), then wait for the checkpoints submitted so
        far (NodeError ``checkpoint_failed`` if one failed). Idempotent."""
        try:
            if self.dist.is_main and self.dist.world_size > 1 and not self._stopped and not self._in_step:
                self.dist.broadcast_bytes(b"")
        finally:  # a dead rank must not cost the checkpoints already queued
            self._stopped = True
            writer, self._writer = self._writer, None
            if writer is not None:
                writer.close()
