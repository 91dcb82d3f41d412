"""Where a rollout batch's round trip goes: per-stage durations a service reports in its status section.

A batch crosses three processes (inferer → validator → trainer), so no single clock sees its whole trip.
Each service times the stages it runs (``generate``, ``validate``, ``train`` ...) and, for the hops
between processes, compares the signed envelope's timestamp with its own wall clock (meaningful when
the clocks agree, as on one machine; on the internet it includes skew). ``benchmarks/swarm_learning.py``
adds the stages of all nodes into one breakdown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class StageTimes:
    """Count and total seconds per stage name; O(stages) memory whatever the run length."""

    _count: dict[str, int] = field(default_factory=dict)
    _total: dict[str, float] = field(default_factory=dict)

    def add(self, stage: str, seconds: float) -> None:
        """Record one duration; negative or non-finite values (clock skew, a bad timestamp) are clamped
        to zero rather than dropped, so counts stay comparable between stages."""
        value = seconds if math.isfinite(seconds) and seconds > 0 else 0.0
        self._count[stage] = self._count.get(stage, 0) + 1
        self._total[stage] = self._total.get(stage, 0.0) + value

    def mean(self, stage: str) -> float:
        count = self._count.get(stage, 0)
        return self._total[stage] / count if count else 0.0

    def summary(self) -> dict[str, dict[str, float]]:
        """``{stage: {"mean_s": ..., "count": ...}}``, JSON-ready for a status section."""
        return {
            stage: {"mean_s": round(self.mean(stage), 5), "count": self._count[stage]}
            for stage in sorted(self._count)
        }
