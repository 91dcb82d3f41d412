"""The CPU side of a role: the torch threads it computes with, and how fast those threads decode.

``role_threads`` turns ``join --threads`` into a count (by default every core this process may use, or
``OMP_NUM_THREADS`` where a launcher such as the demo or torchrun set it); ``measure_cpu_decode`` times a
decode-sized matrix product on them, so the role policy can judge a CPU inferer by measurement instead of
an estimate. The machine's probes (GPUs, cores, RAM, disk) are ``hardware.py``'s.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Mapping

from prime_node.errors import NodeError
from prime_node.hardware import cpu_cores

MAX_THREADS = 1024
MEASURE_IN_FEATURES = 4096
MEASURE_OUT_FEATURES = 8192
"""The measured weight: 4096 x 8192 (128 MiB in float32, 64 MiB in bfloat16), past the caches like a
model's layers, so the product streams it from memory as a decode step does."""
MEASURE_MAX_BATCH = 64
MEASURE_BUDGET_S = 0.5


def default_threads(env: Mapping[str, str] | None = None) -> int:
    """The torch threads of a standalone node's role: ``OMP_NUM_THREADS`` when a launcher set it (the demo
    gives each of its processes 1, torchrun each rank 1), else every core this process may use."""
    value = (os.environ if env is None else env).get("OMP_NUM_THREADS", "").strip()
    if re.fullmatch(r"[0-9]{1,4}", value) and 0 < int(value) <= MAX_THREADS:
        return int(value)
    return cpu_cores()


def role_threads(threads: int) -> int:
    """The torch threads a role computes with for ``join --threads`` (0: ``default_threads``). Worker
    threads call ``torch.set_num_threads`` with it themselves: torch keeps the count per OS thread."""
    if not 0 <= threads <= MAX_THREADS:
        raise NodeError(f"--threads {threads}: use 0 (all cores) to {MAX_THREADS}", reason="bad_flag")
    return threads or default_threads()


def measure_cpu_decode(
    dtype: str,
    batch: int,
    threads: int,
    *,
    in_features: int = MEASURE_IN_FEATURES,
    out_features: int = MEASURE_OUT_FEATURES,
    budget_s: float = MEASURE_BUDGET_S,
) -> float:
    """Seconds per GB of weights that one decode step of ``batch`` sequences takes on ``threads`` torch
    threads of this CPU, in ``dtype`` (float32 or bfloat16): the best of a few products of a [batch, in]
    state with an [out, in] weight within ``budget_s``, the way a decode step multiplies every layer's
    weights (a CPU without native bf16 shows it here). Batches above ``MEASURE_MAX_BATCH`` are measured at
    that size and scaled as if compute-bound (an overestimate of the time, never an underestimate).
    Imports torch: call it in a worker thread, once the run's dtype and batch are known."""
    import torch

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise NodeError(f"cannot measure CPU decoding in {dtype!r}", reason="bad_config")
    rows = max(1, min(batch, MEASURE_MAX_BATCH))
    torch.set_num_threads(max(1, threads))
    weight = torch.full((out_features, in_features), 0.01, dtype=torch_dtype)
    state = torch.full((rows, in_features), 0.01, dtype=torch_dtype)
    best = math.inf
    with torch.inference_mode():
        torch.nn.functional.linear(state, weight)  # warm-up: first-touch pages, kernel selection
        started = time.perf_counter()
        for _ in range(8):
            began = time.perf_counter()
            torch.nn.functional.linear(state, weight)
            best = min(best, time.perf_counter() - began)
            if time.perf_counter() - started > budget_s:
                break
    weight_gb = weight.numel() * weight.element_size() / 1e9
    return max(best, 1e-9) / weight_gb * max(1.0, batch / rows)
