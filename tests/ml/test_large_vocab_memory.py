"""Never [B, T, V]: at Qwen3's real 151,936-token vocabulary (on a model of hidden size 16), no tensor of
a training step or of a validator's recomputation is larger than one chunk of logits.

How it is measured, deterministically: a ``TorchDispatchMode`` sees the output of every torch operation
(forward, backward, checkpoint recomputation, optimizer, FSDP2 collectives) and records the largest
storage; numpy's allocations (the CPU replay hashes its noise in numpy) are counted by ``tracemalloc``,
which numpy reports to. Neither depends on timing or on the allocator's RSS. The chunk budgets are
lowered so that the batch spans many chunks; the same hook shows the full-logits path it replaces.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from prime_node.ml import chunked_head, sampling

VOCAB = 151_936
TRAIN_ROWS = 32
"""Positions per chunk of the training loss: 19.4 MB of float32 logits at this vocabulary."""
REPLAY_ROWS = 16
"""Positions per chunk of the validator's replay: 19.4 MB of float64 scores."""


class LargestTensor(TorchDispatchMode):
    """Records the largest storage (bytes) any torch operation returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.op = ""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                size = value.untyped_storage().nbytes()
                if size > self.bytes:
                    self.bytes, self.op = size, str(func)
        return out


def _largest(work: Callable[[], Any]) -> tuple[Any, LargestTensor, int]:
    """``work()``'s result, its largest torch tensor and the peak of numpy/Python allocations (bytes)."""
    mode = LargestTensor()
    tracemalloc.start()
    try:
        with mode:
            result = work()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, mode, peak


def _big_vocab_model() -> tuple[Any, Any]:
    """A one-layer Qwen2 of hidden size 16 (the project's tiny config) with a 151,936-token vocabulary
    and the character tokenizer (every prompt id is in range; generated ids span the whole vocabulary)."""
    from transformers import Qwen2ForCausalLM

    from prime_node.ml.model import TinySpec, tiny_config
    from prime_node.ml.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    spec = TinySpec(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_config(VOCAB, tokenizer.eos_token_id, tokenizer.pad_token_id, spec))
    return model.eval(), tokenizer


def test_a_training_step_never_holds_more_than_one_chunk_of_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole FSDP2 step: forward, backward (each chunk recomputed), the old policy's and the KL
    reference's log-probs, the optimizer. 8 samples of 40 tokens: the full logits were 16x one chunk."""
    from prime_node.config import RunConfig
    from prime_node.ml.distributed import DistInfo
    from prime_node.ml.prepared import Prepared
    from prime_node.ml.trainer import GRPOTrainer, _micro_batch

    monkeypatch.setattr(chunked_head, "LOGIT_CHUNK_BYTES", TRAIN_ROWS * VOCAB * 4)
    model, tokenizer = _big_vocab_model()
    generator = torch.Generator().manual_seed(1)
    sequences = [
        torch.randint(3, 90, (10,), generator=generator).tolist()
        + torch.randint(3, VOCAB, (30,), generator=generator).tolist()
        for _ in range(8)
    ]
    ids, _, _ = _micro_batch(sequences, [10] * 8, tokenizer.pad_token_id)
    with LargestTensor() as full, torch.no_grad():  # the path this replaces: [B, T, V] logits
        model(input_ids=ids, use_cache=False)
    assert full.bytes >= ids.numel() * VOCAB * 4

    config = RunConfig(
        group_size=4,
        prompts_per_step=2,
        max_new_tokens=30,
        objective="recompute",
        kl_coef=0.05,
        entropy_coef=0.01,
        micro_batch_samples=8,
    )
    trainer = GRPOTrainer(config, model, tokenizer, checkpoint_root=tmp_path, dist=DistInfo())
    trainer.step = 1  # a batch of policy 0: its log-probs are recomputed under the stored policy
    prepared = Prepared(0, sequences, [10] * 8, [1.0, -1.0] * 4, 0.0, 2, 0)
    metrics, mode, numpy_peak = _largest(lambda: trainer.train_step(prepared))
    chunk = TRAIN_ROWS * VOCAB * 4
    assert mode.bytes <= chunk, (mode.bytes, mode.op)
    assert full.bytes >= 8 * chunk
    assert numpy_peak < chunk
    assert metrics.grad_norm > 0 and metrics.entropy > 11  # ~ln(151,936) = 11.9: a near-uniform policy


def test_a_validator_recomputation_never_holds_more_than_one_chunk_of_scores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stage 5 of the validator (prefill, TOPLOC check, replay, log-probs) on an honest batch of 8
    completions of up to 24 tokens: it accepts, and its largest tensor and numpy peak stay a few chunks
    (the whole [tokens, vocab] float64 scores were 12x one chunk, and numpy's noise several times that)."""
    from prime_node.config import RunConfig
    from prime_node.ml.engines import setup_engine
    from prime_node.tasks.arithmetic import ArithmeticTask
    from prime_node.testing.adversary import validator_for
    from prime_node.verification.cheating import Scenario
    from prime_node.verification.validator import ValidationResult

    monkeypatch.setattr(sampling, "REPLAY_CHUNK_BYTES", REPLAY_ROWS * VOCAB * 8)
    model, tokenizer = _big_vocab_model()
    config = RunConfig(group_size=4, prompts_per_step=2, max_new_tokens=24, temperature=1.0, seed=7)
    engine = setup_engine(model, tokenizer, engine=config.engine)
    scenario = Scenario(config=config, task=ArithmeticTask(2), tokenizer=tokenizer, engine=engine)
    batch = scenario.batch(0)
    tokens = sum(len(s.completion_tokens()) for s in batch.samples)
    assert tokens >= 12 * REPLAY_ROWS
    validator = validator_for(scenario)
    result = ValidationResult(batch_id=b"large-vocabulary")
    _, mode, numpy_peak = _largest(
        lambda: validator._recompute(batch, list(range(batch.groups)), engine, result)
    )
    assert result.accepted, result.detail
    chunk = REPLAY_ROWS * VOCAB * 8
    assert mode.bytes <= chunk, (mode.bytes, mode.op)
    assert numpy_peak <= 5 * chunk  # the hash of the noise holds ~4 chunk-sized uint64 temporaries
