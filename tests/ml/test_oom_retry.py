"""OOM safety with an injected ``torch.cuda.OutOfMemoryError`` (on the CPU): free, halve, retry; every
result or none; and chunked generation holds the same samples as a whole batch (per-sample seeds)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prime_node.errors import NodeError
from prime_node.ml.engine import SamplingParams
from prime_node.ml.oom_retry import ChunkedEngine, is_oom, prefill_in_chunks, run_in_chunks


def _oom() -> torch.cuda.OutOfMemoryError:
    return torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@given(st.integers(0, 200), st.integers(1, 256), st.integers(1, 64))
def test_chunks_over_the_limit_are_halved_until_they_fit(count: int, max_batch: int, fits: int) -> None:
    calls: list[tuple[int, int]] = []
    freed: list[int] = []

    def work(start: int, stop: int) -> list[int]:
        calls.append((start, stop))
        if stop - start > fits:
            raise _oom()
        return list(range(start, stop))

    results, size = run_in_chunks(work, count, max_batch=max_batch, free=lambda: freed.append(1))
    assert results == list(range(count))  # every sample, in order, once
    assert all(b - a <= max_batch for a, b in calls)
    assert len(freed) == sum(1 for a, b in calls if b - a > fits)  # the cache is emptied after each OOM
    assert size <= fits if freed else size == max_batch  # the chunk to keep using


def test_a_single_sample_that_does_not_fit_raises_with_numbers_and_returns_nothing() -> None:
    def work(start: int, stop: int) -> list[int]:
        raise _oom()

    with pytest.raises(NodeError) as caught:
        run_in_chunks(work, 8, max_batch=8, free=lambda: None)
    assert caught.value.reason == "out_of_gpu_memory"
    assert "2.00 GiB" in str(caught.value) and "--gpu none" in str(caught.value)


def test_other_errors_pass_through_untouched() -> None:
    def work(start: int, stop: int) -> list[int]:
        raise RuntimeError("not memory")

    assert not is_oom(RuntimeError("not memory")) and is_oom(_oom())
    with pytest.raises(RuntimeError, match="not memory"):
        run_in_chunks(work, 4, max_batch=4, free=lambda: pytest.fail("freed without an OOM"))


class _Flaky:
    """A real engine whose batches above ``fits`` samples raise the CUDA OOM error."""

    def __init__(self, engine: Any, fits: int) -> None:
        self.engine, self.fits, self.sizes = engine, fits, []  # type: ignore[var-annotated]

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], params: SamplingParams) -> Any:
        self.sizes.append(len(prompts))
        if len(prompts) > self.fits:
            raise _oom()
        return self.engine.generate(prompts, seeds, params)

    def prefill(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> Any:
        if len(prompts) > self.fits:
            raise _oom()
        return self.engine.prefill(prompts, completions)


def test_chunked_generation_after_an_oom_holds_the_same_samples(tiny_model_dir: Path) -> None:
    from prime_node.ml.engines import load_engine
    from prime_node.ml.tokenizer import load_tokenizer

    engine = load_engine(tiny_model_dir, load_tokenizer(tiny_model_dir))
    prompts = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [15], [16, 17]]
    seeds = [101, 202, 303, 404, 505, 606]
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    whole = engine.generate(prompts, seeds, params)
    flaky = _Flaky(engine, fits=2)
    chunked = ChunkedEngine(flaky, max_batch=None)  # type: ignore[arg-type]
    parts = chunked.generate(prompts, seeds, params)
    assert [c.tokens for c in parts] == [c.tokens for c in whole]
    for a, b in zip(parts, whole, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert chunked.max_batch in {1, 2}
    assert chunked.shrinks == 1 and flaky.sizes[0] == 6
    later = len(flaky.sizes)
    chunked.generate(prompts, seeds, params)  # the shrunk chunk is remembered: no second OOM
    assert max(flaky.sizes[later:]) <= 2
    rows = chunked.prefill(prompts, [c.tokens for c in whole])
    assert len(rows) == len(prompts) and rows[3].logits.shape[0] == len(whole[3].tokens)


def test_the_wrapper_is_the_engine_for_everything_else(tiny_model_dir: Path) -> None:
    from prime_node.ml.engines import load_engine
    from prime_node.ml.tokenizer import load_tokenizer

    engine = load_engine(tiny_model_dir, load_tokenizer(tiny_model_dir), policy_step=3)
    chunked = ChunkedEngine(engine, max_batch=4)
    assert chunked.model is engine.model and chunked.policy_step == 3
    assert chunked.eos_token_id == engine.eos_token_id
    chunked.load_weights(engine.model.state_dict(), 4)
    assert engine.policy_step == chunked.policy_step == 4
    assert chunked.generate([], [], SamplingParams(max_new_tokens=2)) == []


def test_a_validation_prefill_is_planned_to_the_free_memory_and_halved_on_oom(tiny_model_dir: Path) -> None:
    """Synthetic free memory: ~2.5 samples' worth beside the reserve gives chunks of 2; a device that then
    runs out above 1 sample halves them; the rows are those of one whole prefill either way."""
    from prime_node.ml.engines import load_engine
    from prime_node.ml.tokenizer import load_tokenizer
    from prime_node.ml.vram_plan import (
        RESERVE_BYTES,
        GenerationSettings,
        ModelShape,
        prefill_sample_bytes,
        replay_bytes,
    )

    engine = load_engine(tiny_model_dir, load_tokenizer(tiny_model_dir))
    prompts = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [15]]
    completions = [[20, 21], [22, 23, 24, 25], [26], [27, 28, 29], [30, 31]]
    whole = engine.prefill(prompts, completions)
    config = engine.model.config
    shape = ModelShape.from_config(config.to_dict(), sum(p.numel() for p in engine.model.parameters()))
    run = GenerationSettings(batch=5, prompt_tokens=4, max_new_tokens=4, dtype="float32")
    free = RESERVE_BYTES + replay_bytes(shape, run) + int(2.5 * prefill_sample_bytes(shape, run))

    sizes: list[int] = []

    class Counting:
        def __init__(self, fits: int) -> None:
            self.fits, self.model, self.device = fits, engine.model, engine.device

        def prefill(self, p: Sequence[Sequence[int]], c: Sequence[Sequence[int]]) -> Any:
            sizes.append(len(p))
            if len(p) > self.fits:
                raise _oom()
            return engine.prefill(p, c)

    for fits, expected in ((5, [2, 2, 1]), (1, [2, 1, 1, 1, 1, 1])):
        sizes.clear()
        rows = prefill_in_chunks(Counting(fits), prompts, completions, free_bytes=lambda _d: free)  # type: ignore[arg-type]
        assert sizes == expected
        for got, want in zip(rows, whole, strict=True):
            assert torch.allclose(got.logits, want.logits, atol=1e-4)
            assert torch.allclose(got.hidden, want.hidden, atol=1e-4)
    sizes.clear()
    prefill_in_chunks(Counting(5), prompts, completions)  # the CPU: no plan, one pass
    assert sizes == [5]
