"""Modelled access links and the physical lower bound on broadcast time.

Each node has an upload rate, a download rate (bytes/s) and a one-way latency (s); the network core is
assumed never to be the bottleneck, as for peers on the public internet. A message from a to b takes
``latency[a] + latency[b]``. Latencies come from a few classes (same continent, across an ocean, ...),
which is also what lets the simulator deliver one broadcast in a few events instead of one per receiver.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

MB = 1_000_000
LATENCY_CLASSES = (0.005, 0.020, 0.040, 0.080)


@dataclass(frozen=True, slots=True)
class Link:
    upload: float
    download: float
    latency: float


@dataclass(frozen=True)
class LinkModel:
    """Peers draw upload and download log-uniformly from their ranges (bytes/s), latency from the classes."""

    upload_range: tuple[float, float] = (25 * MB, 250 * MB)
    download_range: tuple[float, float] = (200 * MB, 1250 * MB)
    origin_upload: float = 1250 * MB
    latencies: tuple[float, ...] = LATENCY_CLASSES

    def draw(self, count: int, rng: random.Random) -> list[Link]:
        return [
            Link(
                _log_uniform(rng, *self.upload_range),
                _log_uniform(rng, *self.download_range),
                rng.choice(self.latencies),
            )
            for _ in range(count)
        ]

    def origin(self, rng: random.Random) -> Link:
        return Link(self.origin_upload, self.origin_upload, rng.choice(self.latencies))


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def broadcast_bound(size: float, origin_upload: float, peers: list[Link]) -> float:
    """T* = max(F/u_s, F/d_min, N·F/(u_s + Σu_i)): no schedule can deliver F to every peer faster."""
    return max(
        size / origin_upload,
        size / min(p.download for p in peers),
        len(peers) * size / (origin_upload + sum(p.upload for p in peers)),
    )
