"""The FSDP2 trainer in one process (world size 1 of the same code), and rank 0's step message.

Multi-rank behaviour (2 gloo ranks against 1) is in test_local_run.py; these run in-process on real
forward and backward passes of the tiny model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from prime_node.config import RunConfig
from prime_node.errors import NodeError
from prime_node.ml.checkpoint import model_weights
from prime_node.ml.distributed import DistInfo, ensure_process_group
from prime_node.ml.fsdp import full_weights, local_state_bytes
from prime_node.ml.model import load_model
from prime_node.ml.prepared import Prepared, decode_prepared, encode_prepared
from prime_node.ml.tokenizer import load_tokenizer
from prime_node.ml.trainer import GRPOTrainer


def _prepared(tokenizer: Any, samples: int = 8, seed: int = 3) -> Prepared:
    """Random completions after a fixed prompt, random advantages and behaviour log-probs: enough for a
    real gradient (nothing here needs the task)."""
    generator = torch.Generator().manual_seed(seed)
    prompt = [5, 6, 7, 8]
    sequences, behaviour = [], []
    for _ in range(samples):
        length = int(torch.randint(1, 6, (1,), generator=generator))
        completion = torch.randint(3, len(tokenizer), (length,), generator=generator).tolist()
        sequences.append(prompt + completion)
        behaviour.append((-2.0 - torch.rand(length, generator=generator, dtype=torch.float64)).tolist())
    advantages = torch.randn(samples, generator=generator, dtype=torch.float64).tolist()
    return Prepared(0, sequences, [len(prompt)] * samples, advantages, 0.25, samples // 4, 1, behaviour)


def _config(tmp_path: Path, **extra: object) -> RunConfig:
    return RunConfig.model_validate(
        {
            "output_dir": str(tmp_path),
            "max_new_tokens": 6,
            "micro_batch_samples": 3,
            "grad_clip": 1e9,
            **extra,
        }
    )


def _trainer(model_dir: Path, tmp_path: Path, **extra: object) -> GRPOTrainer:
    return GRPOTrainer(
        _config(tmp_path, **extra),
        load_model(model_dir),
        load_tokenizer(model_dir),
        checkpoint_root=tmp_path / "checkpoints",
        dist=DistInfo(),
    )


def _full_gradient(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {
        name: p.grad.full_tensor().clone()
        for name, p in trainer.model.named_parameters()
        if p.grad is not None
    }


def _gap(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """Worst over tensors of max|expected - got| / max|expected| (as in test_local_run)."""
    assert expected.keys() == got.keys()
    return max(float((expected[k] - got[k]).abs().max() / expected[k].abs().max()) for k in expected)


def test_the_step_message_round_trips_and_refuses_malformed_bytes(tiny_model_dir: Path) -> None:
    prepared = _prepared(load_tokenizer(tiny_model_dir))
    assert decode_prepared(encode_prepared(prepared)) == prepared  # floats exact: float64 on the wire
    without = dataclasses.replace(prepared, behaviour_logprobs=[])  # "recompute" batches carry none
    assert decode_prepared(encode_prepared(without)) == without
    empty = Prepared(3, [], [], [], 0.0, 0, 4)  # every group dropped: still a step
    assert decode_prepared(encode_prepared(empty)) == empty
    data = encode_prepared(prepared)
    for broken in (data[:-8], data + b"\0" * 8, b"\1" * 8 + data[8:], b""):
        with pytest.raises(NodeError) as info:
            decode_prepared(broken)
        assert info.value.reason == "bad_step_message"


def test_sharding_keeps_the_tied_head_and_gathers_the_saved_format(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    plain = model_weights(load_model(tiny_model_dir))
    trainer = _trainer(tiny_model_dir, tmp_path)
    model = trainer.model
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert all(isinstance(p, DTensor) for p in model.parameters())
    gathered = full_weights(model)  # what the Hugging Face checkpoint gets: tied head left out
    assert gathered.keys() == plain.keys() and "lm_head.weight" not in gathered
    assert all(torch.equal(gathered[k], plain[k]) for k in plain)
    metrics = trainer.train_step(_prepared(trainer.tokenizer))
    moved = full_weights(model)
    assert metrics.grad_norm > 0 and moved.keys() == plain.keys()
    assert any(not torch.equal(moved[k], plain[k]) for k in plain)
    # The embedding's gradient includes the head's: one parameter, one gradient.
    assert trainer.model.model.embed_tokens.weight.grad is trainer.model.lm_head.weight.grad


def test_state_bytes_count_parameters_gradients_and_both_adam_moments(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = _trainer(tiny_model_dir, tmp_path)
    params = sum(p.to_local().nbytes for p in trainer.model.parameters())
    assert local_state_bytes(trainer.model, trainer.optimizer) == params  # no gradient, no moments yet
    trainer.train_step(_prepared(trainer.tokenizer))
    steps = sum(s["step"].nbytes for s in trainer.optimizer.state.values())
    assert local_state_bytes(trainer.model, trainer.optimizer) == 4 * params + steps


def test_activation_checkpointing_gives_the_same_gradient(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Recomputing each layer in the backward pass runs the same kernels on the same inputs: measured
    gap 0.0 with native and with ATEN_CPU_CAPABILITY=default kernels; 1e-6 allows a kernel that
    reassociates differently when called again."""
    plain = _trainer(tiny_model_dir, tmp_path / "plain")
    checkpointed = _trainer(tiny_model_dir, tmp_path / "ac", activation_checkpointing=True)
    prepared = _prepared(plain.tokenizer)
    first, second = plain.train_step(prepared), checkpointed.train_step(prepared)
    assert first.loss == pytest.approx(second.loss, rel=1e-6, abs=1e-9)
    assert _gap(_full_gradient(plain), _full_gradient(checkpointed)) < 1e-6


def test_bfloat16_compute_keeps_float32_master_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    """train_dtype = "bfloat16": forward and backward in bf16, gradients and AdamW in fp32. Measured
    against the fp32 gradient of the same batch: gap 1.40e-2 with native (AVX2) and with
    ATEN_CPU_CAPABILITY=default kernels (bf16 keeps 8 bits of mantissa); the bound 0.1 is ~7x that,
    and a gradient scaled by a world-size factor of 2 would be off by 0.5."""
    exact = _trainer(tiny_model_dir, tmp_path / "fp32")
    bf16 = _trainer(tiny_model_dir, tmp_path / "bf16", train_dtype="bfloat16")
    prepared = _prepared(exact.tokenizer)
    exact.train_step(prepared)
    metrics = bf16.train_step(prepared)
    assert torch.isfinite(torch.tensor(metrics.loss)) and metrics.grad_norm > 0
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in bf16.model.parameters())
    assert _gap(_full_gradient(exact), _full_gradient(bf16)) < 0.1
    assert all(t.dtype == torch.float32 for t in full_weights(bf16.model).values())  # checkpoints stay fp32


def test_one_process_group_serves_every_session_of_a_process() -> None:
    ensure_process_group(DistInfo(), "cpu")
    ensure_process_group(DistInfo(), "cpu")  # idempotent: tests open many sessions in one process
    with pytest.raises(NodeError) as info:
        ensure_process_group(DistInfo(rank=0, world_size=2), "cpu")
    assert info.value.reason == "bad_config"
