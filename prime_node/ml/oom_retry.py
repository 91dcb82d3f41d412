"""Generation that survives running out of GPU memory: free, halve the chunk, retry.

Each sample is seeded on its own (counter-based Gumbel on (seed, position), ``ml/sampling.py``), so a batch
generated in chunks holds the same samples as one generated whole. ``run_in_chunks`` therefore splits a
batch into chunks of at most ``max_batch``; on ``torch.cuda.OutOfMemoryError`` it empties the CUDA cache,
halves the chunk and retries it, down to one sample, then raises a NodeError with the numbers. It returns
every result or raises: a caller never sees (so never publishes) a partial batch, and the engine's weights
do not change in between, so never a mixed one.

``ChunkedEngine`` wraps an engine with it (``generate`` and ``prefill``) and remembers the chunk that last
worked, so one OOM costs one retry, not one per batch. ``prefill_in_chunks`` is the validator's: its
chunks start at what ``vram_plan.plan_prefill`` says fits in the device's free memory.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from prime_node.errors import NodeError
from prime_node.ml.vram_plan import GenerationSettings, ModelShape, plan_prefill

if TYPE_CHECKING:
    import torch

    from prime_node.ml.engine import Completion, InferenceEngine, Prefill, SamplingParams, TorchEngine

log = logging.getLogger(__name__)
T = TypeVar("T")


def is_oom(exc: BaseException) -> bool:
    """``torch.cuda.OutOfMemoryError`` (torch is only looked up if already imported: it raised it)."""
    torch_module: Any = sys.modules.get("torch")
    return torch_module is not None and isinstance(exc, torch_module.cuda.OutOfMemoryError)


def free_cuda_cache() -> None:
    """Give the allocator's cached blocks back after an OOM (nothing to do without CUDA)."""
    torch_module: Any = sys.modules.get("torch")
    if torch_module is not None and torch_module.cuda.is_available():
        torch_module.cuda.empty_cache()


def cuda_free_bytes(device: str) -> int:
    """Free memory on a CUDA device now."""
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def prefill_in_chunks(
    engine: InferenceEngine,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    free_bytes: Callable[[str], int] | None = None,
) -> list[Prefill]:
    """``engine.prefill`` of every sample, in chunks planned to the free memory of the engine's device
    (``free_bytes``: the CUDA query on a GPU, no plan on the CPU; tests pass synthetic sizes) and halved on
    OOM; all results in order, or an error, never a part."""
    count = len(prompts)
    if count != len(completions):
        raise ValueError("one completion per prompt")
    limit = max(1, count)
    device = str(getattr(engine, "device", "cpu"))
    model = getattr(engine, "model", None)
    if free_bytes is None and device.startswith("cuda"):
        free_bytes = cuda_free_bytes
    if free_bytes is not None and count and model is not None:
        params = sum(int(p.numel()) for p in model.parameters())
        shape = ModelShape.from_config(model.config.to_dict(), params)
        settings = GenerationSettings(
            batch=count,
            prompt_tokens=max(len(p) for p in prompts),
            max_new_tokens=max(len(c) for c in completions),
            dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        )
        limit = plan_prefill(shape, settings, free_bytes(device))
    prefills, _ = run_in_chunks(
        lambda start, stop: engine.prefill(prompts[start:stop], completions[start:stop]),
        count,
        max_batch=limit,
    )
    return prefills


def run_in_chunks(
    work: Callable[[int, int], list[T]],
    count: int,
    *,
    max_batch: int,
    free: Callable[[], None] = free_cuda_cache,
) -> tuple[list[T], int]:
    """``work(start, stop)`` over ``[0, count)`` in chunks of at most ``max_batch``, halving a chunk that
    runs out of GPU memory; returns all results in order and the chunk size that last worked.

    NodeError ``out_of_gpu_memory`` when a single item does not fit; any other exception passes through."""
    if max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    results: list[T] = []
    size = max_batch
    start = 0
    while start < count:
        stop = min(count, start + size)
        out_of_memory, detail = False, ""
        try:
            part = work(start, stop)
        except Exception as exc:
            if not is_oom(exc):
                raise
            out_of_memory = True
            detail = (str(exc).strip().splitlines() or ["out of memory"])[0][:200]
        if out_of_memory:  # outside the except block: the exception's frames (and tensors) are gone
            free()
            if stop - start == 1:
                raise NodeError(
                    f"out of GPU memory generating a single sample ({detail}): the model and one sample's "
                    "KV cache do not fit; use a GPU with more free memory, or pass --gpu none",
                    reason="out_of_gpu_memory",
                )
            size = max(1, (stop - start) // 2)
            log.warning("out of GPU memory on a chunk of %d: retrying in chunks of %d", stop - start, size)
            continue
        if len(part) != stop - start:
            raise ValueError(f"{len(part)} results for {stop - start} items")
        results.extend(part)
        start = stop
    return results, size


class ChunkedEngine:
    """An engine whose ``generate`` and ``prefill`` run in chunks of at most ``max_batch`` (None: whole
    batches) and survive OOM (module doc). Everything else is the wrapped engine's."""

    def __init__(self, engine: TorchEngine, *, max_batch: int | None = None) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.shrinks = 0
        """How often an OOM shrank the chunk."""

    @property
    def policy_step(self) -> int:
        return self.engine.policy_step

    @policy_step.setter
    def policy_step(self, step: int) -> None:
        self.engine.policy_step = step

    @property
    def model(self) -> Any:
        return self.engine.model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def load_weights(self, state: Mapping[str, torch.Tensor], policy_step: int) -> None:
        self.engine.load_weights(state, policy_step)

    def _chunked(self, work: Callable[[int, int], list[T]], count: int) -> list[T]:
        if count == 0:
            return work(0, 0)
        limit = min(count, self.max_batch or count)
        results, size = run_in_chunks(work, count, max_batch=limit)
        if size < limit:
            self.shrinks += 1
            self.max_batch = size
        return results

    def generate(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], params: SamplingParams
    ) -> list[Completion]:
        if len(prompts) != len(seeds):
            raise ValueError("one seed per prompt")
        return self._chunked(
            lambda a, b: self.engine.generate(prompts[a:b], seeds[a:b], params), len(prompts)
        )

    def prefill(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[Prefill]:
        if len(prompts) != len(completions):
            raise ValueError("one completion per prompt")
        return self._chunked(lambda a, b: self.engine.prefill(prompts[a:b], completions[a:b]), len(prompts))
