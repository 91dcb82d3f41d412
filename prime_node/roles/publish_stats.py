"""What the trainer's publishing cost the swarm: full checkpoints vs deltas, bytes on the wire."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prime_node.swarm.delta_versions import Published


@dataclass
class PublishStats:
    """Counters over every policy published; ``wire_bytes_ratio`` is what deltas saved (1.0: none)."""

    full: int = 0
    delta: int = 0
    wire_bytes: int = 0
    """Bytes of what was announced: the delta when one was published, else the full checkpoint."""
    full_bytes: int = 0
    """Bytes of the full checkpoints of the same steps (what publishing without deltas would move)."""
    encode_s: float = 0.0
    reasons: Counter[str] = field(default_factory=Counter)

    def add(self, published: Published) -> None:
        if published.delta is not None:
            self.delta += 1
            self.wire_bytes += published.delta_bytes
        else:
            self.full += 1
            self.wire_bytes += published.full_bytes
        self.full_bytes += published.full_bytes
        self.encode_s += published.encode_seconds
        self.reasons[published.reason] += 1

    def summary(self) -> dict[str, Any]:
        ratio = self.wire_bytes / self.full_bytes if self.full_bytes else 1.0
        return {
            "full": self.full,
            "delta": self.delta,
            "wire_bytes": self.wire_bytes,
            "wire_bytes_ratio": round(ratio, 4),
            "encode_s": round(self.encode_s, 3),
            "reasons": dict(self.reasons),
        }
