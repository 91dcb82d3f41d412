"""The GRPO trainer: the model, its optimizer and the step around the pure loss.

Batches arrive admitted (``prepared.prepare``: prompts checked, rewards recomputed, flat groups
dropped). The optimizer step (``train_step``) computes the GRPO loss over micro-batches normalised by the
batch's total completion tokens (each rank takes a strided shard of the samples; FSDP2 reduce-scatters
the gradients, so each rank's shard holds the sum over ranks), clips the global gradient norm and
applies AdamW to the local shards. How a stale batch is
corrected follows ``config.objective`` (see ``prime_node.ml.grpo``): "recompute" recomputes the old
log-probs itself under the policy version that generated the batch (kept in memory, or read back from
its checkpoint); "behaviour" (the default), "decoupled" and "masked_is" use the behaviour log-probs
the sampler put in every sample (checked by validators in networked runs) and need no old model.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prime_node.config import RunConfig
from prime_node.errors import NodeError
from prime_node.ml.checkpoint import list_checkpoints, step_dir
from prime_node.ml.chunked_head import policy_token_stats
from prime_node.ml.distributed import DistInfo
from prime_node.ml.fsdp import (
    clip_gradients,
    load_local_shards,
    load_safetensors_shards,
    local_shards,
    resolve_train_dtype,
    shard_model,
    sharded_copy,
    training_mesh,
)
from prime_node.ml.grpo import grpo_loss
from prime_node.ml.lr_schedule import learning_rate_at
from prime_node.ml.model import weight_files
from prime_node.ml.prepared import Prepared

log = logging.getLogger(__name__)


@dataclass
class StepMetrics:
    step: int
    policy_step: int
    reward_mean: float
    groups_kept: int
    groups_dropped: int
    loss: float
    kl: float
    entropy: float
    clipped_fraction: float
    grad_norm: float
    staleness: int = 0
    """Trainer step minus the policy step that generated the batch (0: on-policy)."""
    is_fraction: float = 0.0
    """Share of completion tokens whose importance weight hit ``is_cap`` (decoupled) or that the
    ratio band masked (masked_is); 0 for recompute."""
    learning_rate: float = 0.0
    """The rate this step's update used (``lr_schedule``)."""


def _micro_batch(
    sequences: Sequence[list[int]], prompt_lengths: Sequence[int], pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids [B, L-1], targets [B, L-1] and completion-token mask [B, L-1]."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, (seq, plen) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        ids[i, : len(seq)] = torch.as_tensor(seq)
        mask[i, plen : len(seq)] = True
    return ids[:, :-1], ids[:, 1:], mask[:, 1:]


def _behaviour_micro_batch(
    logprobs: Sequence[list[float]], prompt_lengths: Sequence[int], width: int
) -> torch.Tensor:
    """Behaviour log-probs [B, width] aligned with ``_micro_batch``'s targets: completion token j of a
    sample with prompt length p is target column p - 1 + j; other columns are 0 (masked out)."""
    out = torch.zeros((len(logprobs), width), dtype=torch.float32)
    for i, (values, plen) in enumerate(zip(logprobs, prompt_lengths, strict=True)):
        out[i, plen - 1 : plen - 1 + len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


class PolicyHistory:
    """This rank's shards of recent policy versions, for recomputing old log-probs of stale batches.

    Each rank keeps copies of its own shards (1/N of the weights per version, in fp32 so the old
    log-probs are the old policy's exactly): never storage shared with the live parameters, which the
    next optimizer step changes in place, and never a whole model on one rank. A version no longer in
    memory (after a restart) is read back from its checkpoint, each rank only its own rows."""

    def __init__(self, keep: int, checkpoint_root: Path) -> None:
        self.keep = keep
        self.root = checkpoint_root
        self._shards: dict[int, dict[str, torch.Tensor]] = {}

    def add(self, step: int, model: Any) -> None:
        """Snapshot ``model``'s local shards as policy ``step`` (nothing when keeping none)."""
        if self.keep <= 0:
            return
        self._shards[step] = local_shards(model)
        for old in sorted(self._shards)[: -self.keep]:
            del self._shards[old]

    def steps(self) -> list[int]:
        return sorted(self._shards)

    def load_into(self, step: int, model: Any) -> None:
        """Policy ``step`` into ``model`` (sharded like the trainee); no collective."""
        if step in self._shards:
            load_local_shards(model, self._shards[step])
            return
        path = step_dir(self.root, step)
        if not (path / "model.safetensors").is_file():
            raise NodeError(
                f"weights of policy step {step} are neither in memory nor in {path}",
                reason="missing_policy",
            )
        load_safetensors_shards(model, weight_files(path))


class GRPOTrainer:
    """The model, its optimizer and one GRPO step at a time (side effects live in the caller's loop).

    The model is sharded with FSDP2 over every rank of ``dist`` (``fsdp.py``; a single process is a
    1-rank mesh), and AdamW steps the local shards. Every rank must call ``train_step`` with the same
    batch: each forward and backward is a collective.

    ``model`` is either already sharded (the training session builds it on the meta device and
    loads each rank's shards: ``fsdp.build_sharded_model``, with this config's compute dtype and
    activation checkpointing) or a whole model, sharded here in place.

    The old-policy model ("recompute") and the KL reference (``kl_coef`` > 0) exist only when the
    objective uses them: sharded frozen copies filled from each rank's own shards (1/N of the weights
    per rank, like the trainee); the old one is loaded from each rank's policy history.
    """

    def __init__(
        self,
        config: RunConfig,
        model: Any,
        tokenizer: Any,
        *,
        checkpoint_root: Path,
        dist: DistInfo,
        step: int = 0,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.dist = dist
        self.step = step
        from torch.distributed.tensor import DTensor

        first = next(model.parameters())
        sharded = isinstance(first, DTensor)
        device = str(first.to_local().device if sharded else first.device)
        compute_dtype = resolve_train_dtype(config.train_dtype, device)
        recompute = config.objective == "recompute"
        if sharded:
            self.mesh = first.device_mesh
            self.model = model
        else:
            self.mesh = training_mesh(dist, device)
            self.model = shard_model(
                model,
                self.mesh,
                compute_dtype=compute_dtype,
                activation_checkpointing=config.activation_checkpointing,
            )
        self._old_model = sharded_copy(self.model, compute_dtype=compute_dtype) if recompute else None
        self._old_model_step: int | None = None
        self._reference = (
            sharded_copy(self.model, compute_dtype=compute_dtype) if config.kl_coef > 0 else None
        )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=config.learning_rate,
            betas=config.adam_betas,
            weight_decay=config.weight_decay,
        )
        # Only "recompute" reads old policies back (the others weigh tokens with the behaviour
        # log-probs): it keeps every policy a batch may still come from, on every rank its own shards.
        self.history = PolicyHistory(config.async_level + 1 if recompute else 0, checkpoint_root)
        self.record_policy()
        self.checkpoint_root = checkpoint_root
        self.before_update: Callable[[], None] | None = None
        """Called right before the optimizer changes the weights and moments in place (the session's
        background save of the training state waits there: ``AsyncShardedSaver``)."""

    def record_policy(self) -> None:
        """Keep the current weights (this rank's shards, copied) as policy ``self.step`` if the
        objective will need them; no collective. Published policies are the session's to write."""
        self.history.add(self.step, self.model)

    def _old_logp(self, step: int, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert self._old_model is not None
        if self._old_model_step != step:
            self.history.load_into(step, self._old_model)
            self._old_model_step = step
        return self._token_logp(self._old_model, ids, targets)

    def _token_logp(
        self, model: Any, ids: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """log_softmax(logits / T)[target] [B, T] at the positions of ``mask`` (default all; others 0),
        one chunk of positions at a time (``chunked_head``: never [B, T, V])."""
        with torch.no_grad():
            return policy_token_stats(model, ids, targets, mask, temperature=self.config.temperature).logp

    def _my_chunks(self, prepared: Prepared) -> list[list[int]]:
        """This rank's strided shard of the samples in micro-batches, padded with empty chunks to the
        count every rank runs (each forward and backward is a collective under FSDP2)."""
        world, size = self.dist.world_size, self.config.micro_batch_samples
        mine = list(range(self.dist.rank, len(prepared.sequences), world))
        chunks = [mine[i : i + size] for i in range(0, len(mine), size)]
        most = math.ceil(math.ceil(len(prepared.sequences) / world) / size)
        return chunks + [[] for _ in range(most - len(chunks))]

    def train_step(self, prepared: Prepared) -> StepMetrics:
        """One optimizer step on an admitted batch; advances ``self.step`` by one."""
        cfg = self.config
        totals = {"loss": 0.0, "kl": 0.0, "entropy": 0.0, "clipped": 0.0, "is": 0.0}
        normalizer = float(prepared.completion_tokens)
        grad_norm = 0.0
        staleness = self.step - prepared.policy_step
        learning_rate = learning_rate_at(
            self.step,
            base=cfg.learning_rate,
            schedule=cfg.lr_schedule,
            total_steps=cfg.max_steps,
            warmup_steps=cfg.lr_warmup_steps,
            min_ratio=cfg.lr_min_ratio,
        )
        uses_behaviour = cfg.objective != "recompute"
        if uses_behaviour and len(prepared.behaviour_logprobs) != len(prepared.sequences):
            raise NodeError(
                f"objective {cfg.objective!r} needs the behaviour log-probs of every sample "
                f"({len(prepared.behaviour_logprobs)} for {len(prepared.sequences)} samples)",
                reason="missing_behaviour_logprobs",
            )
        self.optimizer.zero_grad(set_to_none=False)
        if prepared.sequences:
            self.model.train()
            pad = self.tokenizer.pad_token_id
            for chunk in self._my_chunks(prepared):
                # An empty chunk (this rank ran out of samples) runs a masked-out pad sample: it joins
                # the collectives and adds nothing to the loss or the gradient.
                sequences = [prepared.sequences[i] for i in chunk] or [[pad, pad]]
                prompt_lengths = [prepared.prompt_lengths[i] for i in chunk] or [2]
                ids, targets, mask = _micro_batch(sequences, prompt_lengths, pad)
                device = next(self.model.parameters()).device
                ids, targets, mask = ids.to(device), targets.to(device), mask.to(device)
                advantages = torch.tensor(
                    [prepared.advantages[i] for i in chunk] or [0.0], dtype=torch.float32, device=device
                )
                # Per completion token only, a chunk of positions at a time: never the [B, T, V] logits.
                stats = policy_token_stats(
                    self.model, ids, targets, mask, temperature=cfg.temperature, entropy=cfg.entropy_coef > 0
                )
                behaviour = None
                old: torch.Tensor | None = None  # None: the detached training forward (pi_prox)
                if uses_behaviour:
                    behaviour = _behaviour_micro_batch(
                        [prepared.behaviour_logprobs[i] for i in chunk] or [[]],
                        prompt_lengths,
                        targets.shape[1],
                    ).to(device)
                elif prepared.policy_step != self.step:
                    old = self._old_logp(prepared.policy_step, ids, targets)
                ref = (
                    self._token_logp(self._reference, ids, targets, mask)
                    if self._reference is not None
                    else None
                )
                parts = grpo_loss(
                    stats,
                    targets,
                    old,
                    advantages,
                    mask,
                    normalizer=normalizer,
                    temperature=cfg.temperature,
                    eps_low=cfg.eps_low,
                    eps_high=cfg.eps_high,
                    delta=cfg.delta,
                    ref_logp=ref,
                    kl_coef=cfg.kl_coef,
                    entropy_coef=cfg.entropy_coef,
                    objective=cfg.objective,
                    behaviour_logp=behaviour,
                    is_cap=cfg.is_cap,
                    is_mask_low=cfg.is_mask_low,
                    is_mask_high=cfg.is_mask_high,
                    is_kl_coef=cfg.is_kl_coef,
                )
                parts.loss.backward()  # type: ignore[no-untyped-call]
                totals["loss"] += float(parts.loss.detach())
                totals["kl"] += parts.kl
                totals["entropy"] += parts.entropy
                totals["clipped"] += parts.clipped_fraction
                totals["is"] += parts.is_fraction
            self.model.eval()
        if self.dist.world_size > 1:
            totals = self.dist.sum_floats(totals)
        if prepared.sequences:
            grad_norm = clip_gradients(self.model, cfg.grad_clip)
            if math.isfinite(grad_norm):
                if self.before_update is not None:
                    self.before_update()  # a background save still reading the weights finishes first
                for group in self.optimizer.param_groups:
                    group["lr"] = learning_rate
                self.optimizer.step()
            else:
                log.warning("step %d: non-finite gradient norm, update skipped", self.step)
        self.step += 1
        self.record_policy()
        return StepMetrics(
            step=self.step,
            policy_step=prepared.policy_step,
            reward_mean=prepared.reward_mean,
            groups_kept=prepared.groups_kept,
            groups_dropped=prepared.groups_dropped,
            loss=totals["loss"],
            kl=totals["kl"],
            entropy=totals["entropy"],
            clipped_fraction=totals["clipped"],
            grad_norm=grad_norm,
            staleness=staleness,
            is_fraction=totals["is"],
            learning_rate=learning_rate,
        )


def latest_checkpoint_step(checkpoint_root: Path) -> int | None:
    found = list_checkpoints(checkpoint_root)
    return found[-1].step if found else None
