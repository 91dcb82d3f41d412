"""GRPO: group-normalised advantages and the two-sided clipped policy loss. Pure tensor code.

Per completion token with ratio r = exp(logp - old_logp) and the sample's advantage A:

    A >= 0:  J = min(r · A, clip(r, 1 - eps_low, 1 + eps_high) · A)              (PPO)
    A <  0:  J = min(min(r, delta) · A, clip(r, 1 - eps_low, 1 + eps_high) · A)  (two-sided)

PPO alone leaves J = r·A unbounded below when A < 0 and r grows (a token the old policy disliked and the
new one loves): the cap delta bounds it, as in INTELLECT-2. The loss is -J summed over completion tokens
and divided by a caller-given ``normalizer`` (the number of completion tokens in the *whole* optimizer
batch, across micro-batches and processes), so gradient accumulation and data parallelism give the
same gradient as one big batch. Optional terms: a KL penalty toward a reference policy (the k3
estimator exp(ref - logp) - (ref - logp) - 1, always >= 0) and an entropy bonus.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean) / (std + eps) within each row of ``rewards`` [groups, G]; a constant row gives 0."""
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    centered = rewards - mean
    return torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))


def clipped_objective(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    delta: float,
) -> torch.Tensor:
    """Per-token J (see the module doc); ``advantages`` broadcasts against ``logp``."""
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    capped = torch.where(advantages < 0, torch.clamp(ratio, max=delta), ratio) * advantages
    return torch.minimum(capped, clipped)


@dataclass
class LossParts:
    loss: torch.Tensor
    policy: float
    kl: float
    entropy: float
    clipped_fraction: float


def grpo_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    normalizer: float,
    temperature: float,
    eps_low: float,
    eps_high: float,
    delta: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
) -> LossParts:
    """Loss of one micro-batch. ``logits`` [B, T, V] predict ``targets`` [B, T]; ``mask`` [B, T] marks
    completion tokens; ``old_logp`` [B, T]; ``advantages`` [B]."""
    scale = temperature if temperature > 0 else 1.0
    log_probs = torch.log_softmax(logits.float() / scale, dim=-1)
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    objective = clipped_objective(logp, old_logp, adv, eps_low=eps_low, eps_high=eps_high, delta=delta)
    policy_loss = -(objective * mask).sum() / normalizer
    loss = policy_loss
    kl_value = torch.zeros(())
    if ref_logp is not None and kl_coef > 0:
        diff = ref_logp - logp
        kl_value = ((torch.exp(diff) - diff - 1.0) * mask).sum() / normalizer
        loss = loss + kl_coef * kl_value
    entropy_value = torch.zeros(())
    if entropy_coef > 0:
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        entropy_value = (entropy * mask).sum() / normalizer
        loss = loss - entropy_coef * entropy_value
    with torch.no_grad():
        ratio = torch.exp(logp - old_logp)
        outside = ((ratio < 1 - eps_low) | (ratio > 1 + eps_high)).to(mask.dtype)
        clipped_fraction = float((outside * mask).sum() / normalizer)
    return LossParts(
        loss,
        float(policy_loss.detach()),
        float(kl_value.detach()),
        float(entropy_value.detach()),
        clipped_fraction,
    )
