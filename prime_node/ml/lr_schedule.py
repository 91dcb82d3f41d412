"""The learning rate of each optimizer step: a pure function of the run config and the step.

Why a schedule: with a constant rate the demo's policy reaches its plateau in ~75 steps and then keeps
taking full-size steps on batches whose groups are mostly all-correct (few, noisy advantages), so the
held-out accuracy wanders by ±0.08 around the plateau and the run's end point is luck. Decaying the rate
over the run settles the policy where it got to. Being a function of the step alone, the rate resumes
exactly from a checkpoint and is the same on every rank.
"""

from __future__ import annotations

import math
from typing import Literal

LrSchedule = Literal["constant", "linear", "cosine"]


def learning_rate_at(
    step: int,
    *,
    base: float,
    schedule: LrSchedule,
    total_steps: int,
    warmup_steps: int = 0,
    min_ratio: float = 0.0,
) -> float:
    """The rate for the optimizer step that turns policy ``step`` into ``step + 1``.

    Linear warm-up from ``base / warmup_steps`` to ``base`` over the first ``warmup_steps`` steps, then
    ``constant``, or a ``linear`` / ``cosine`` decay to ``base * min_ratio`` at ``total_steps`` (and
    held there if the run goes on past it).
    """
    if step < warmup_steps:
        return base * (step + 1) / warmup_steps
    if schedule == "constant":
        return base
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return base * (min_ratio + (1.0 - min_ratio) * shape)
