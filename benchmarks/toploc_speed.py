"""TOPLOC proof building and checking: today's code against the pre-issue-11 code, same process.

Prints ONE JSON line. For each batch shape, the old implementation (kept verbatim in
tests/verification/toploc_legacy.py) and the current one build proofs for the same float32 hidden
states and check them, alternating old/new ``--repeats`` times; reported are the medians and the ratio
old / new of the medians (> 1: the new code is faster). Both must produce the same proof bytes and the
same checks, or the benchmark fails.

Shapes:
  * demo: 16 prompts × 8 samples, 1–5 new tokens each (uniform), hidden size 64 (the networked demo);
  * realistic: ``--samples`` completions × ``--tokens`` tokens, hidden size 4096 (Gaussian values with
    two large "massive activation" channels, as real LLM hidden states have). The full realistic batch
    (128 × 2000) is 4 GiB of float32, too much for a shared CPU box; the default 8 samples keep the
    per-chunk cost, which is what scales (the work is linear in the number of chunks).

Usage: .venv/bin/python benchmarks/toploc_speed.py [--repeats 5] [--samples 8] [--tokens 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from prime_node.verification import proofs as current
from tests.verification import toploc_legacy as legacy


def demo_batch(rng: np.random.Generator) -> list[torch.Tensor]:
    return [
        torch.from_numpy(rng.standard_normal((int(rng.integers(1, 6)), 64)).astype(np.float32))
        for _ in range(16 * 8)
    ]


def realistic_batch(rng: np.random.Generator, samples: int, tokens: int) -> list[torch.Tensor]:
    out = []
    for _ in range(samples):
        hidden = rng.standard_normal((tokens, 4096), dtype=np.float32)
        hidden[:, 1234] *= 200.0
        hidden[:, 2345] *= -60.0
        out.append(torch.from_numpy(hidden))
    return out


def timed(function: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = function()
    return time.perf_counter() - started, result


def as_tuples(checks: list[list[Any]]) -> list[list[tuple[Any, ...]]]:
    return [[tuple(vars(check).values()) for check in per] for per in checks]


def compare(name: str, hiddens: list[torch.Tensor], repeats: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"build_old": [], "build_new": [], "check_old": [], "check_new": []}
    # Warm-up (inverse tables, Lagrange basis) and the equality check.
    old_proofs = legacy.build_proofs(hiddens)
    new_proofs = current.build_proofs(hiddens)
    if old_proofs != new_proofs:
        raise SystemExit(f"{name}: proof bytes differ between the old and the new implementation")
    if as_tuples(legacy.check_proofs(hiddens, old_proofs)) != as_tuples(
        current.check_proofs(hiddens, new_proofs)
    ):
        raise SystemExit(f"{name}: checks differ between the old and the new implementation")
    for _ in range(repeats):
        times["build_old"].append(timed(lambda: legacy.build_proofs(hiddens))[0])
        times["build_new"].append(timed(lambda: current.build_proofs(hiddens))[0])
        times["check_old"].append(timed(lambda: legacy.check_proofs(hiddens, old_proofs))[0])
        times["check_new"].append(timed(lambda: current.check_proofs(hiddens, new_proofs))[0])
    medians = {key: statistics.median(values) for key, values in times.items()}
    chunks = sum(-(-int(h.shape[0]) // 32) for h in hiddens)
    return {
        "completions": len(hiddens),
        "chunks": chunks,
        "hidden_size": int(hiddens[0].shape[1]),
        "tokens": sum(int(h.shape[0]) for h in hiddens),
        "build_ms_old": round(medians["build_old"] * 1e3, 2),
        "build_ms_new": round(medians["build_new"] * 1e3, 2),
        "build_speedup": round(medians["build_old"] / medians["build_new"], 2),
        "check_ms_old": round(medians["check_old"] * 1e3, 2),
        "check_ms_new": round(medians["check_new"] * 1e3, 2),
        "check_speedup": round(medians["check_old"] / medians["check_new"], 2),
        "build_us_per_chunk_new": round(medians["build_new"] / chunks * 1e6, 1),
        "speedup_range_build": [
            round(min(o / n for o, n in zip(times["build_old"], times["build_new"], strict=True)), 2),
            round(max(o / n for o, n in zip(times["build_old"], times["build_new"], strict=True)), 2),
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"benchmark": "toploc_speed", "repeats": args.repeats}
    out["demo"] = compare("demo", demo_batch(rng), args.repeats)
    out["realistic"] = compare("realistic", realistic_batch(rng, args.samples, args.tokens), args.repeats)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
