"""VRAM planning (pure arithmetic): the chosen batch fits, the estimate grows with the batch, a refusal
names the numbers and the fix; and the model's shape is read from config.json and safetensors headers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prime_node.errors import NodeError
from prime_node.ml.vram_plan import (
    GIB,
    RESERVE_BYTES,
    GenerationSettings,
    ModelShape,
    activation_bytes,
    kv_cache_bytes,
    model_shape,
    needed_bytes,
    plan_generation,
    plan_prefill,
    prefill_sample_bytes,
    replay_bytes,
)

shapes = st.builds(
    ModelShape,
    params=st.integers(1_000, 10**10),
    hidden_size=st.integers(16, 8192),
    intermediate_size=st.integers(16, 32768),
    layers=st.integers(1, 96),
    kv_heads=st.integers(1, 64),
    head_dim=st.integers(8, 256),
    vocab=st.integers(100, 300_000),
)
settings = st.builds(
    GenerationSettings,
    batch=st.integers(1, 1024),
    prompt_tokens=st.integers(1, 8192),
    max_new_tokens=st.integers(1, 8192),
    dtype=st.sampled_from(["float32", "bfloat16"]),
)
QWEN_05B = ModelShape(
    params=494_032_768,
    hidden_size=896,
    intermediate_size=4864,
    layers=24,
    kv_heads=2,
    head_dim=64,
    vocab=151_936,
)


def test_the_kv_cache_and_logits_follow_the_formula() -> None:
    run = GenerationSettings(batch=64, prompt_tokens=200, max_new_tokens=312, dtype="bfloat16")
    assert kv_cache_bytes(QWEN_05B, run, 64) == 64 * 512 * 24 * 2 * 64 * 2 * 2
    layer = 64 * 200 * (4 * 896 + 2 * 4864) * 2
    # float32 logits (4 B) and the device sampling rule's four 8-byte [batch, vocab] tensors (32 B), and
    # the float32 hidden states of the generated tokens kept for the proof
    hidden = 64 * 312 * 896 * 4
    assert activation_bytes(QWEN_05B, run, 64) == layer + 64 * 151_936 * (4 + 32) + hidden


@given(shapes, settings, st.integers(1, 1024))
def test_the_estimate_grows_with_the_batch(shape: ModelShape, run: GenerationSettings, batch: int) -> None:
    assert needed_bytes(shape, run, batch + 1) > needed_bytes(shape, run, batch) > RESERVE_BYTES


@given(shapes, settings, st.integers(0, 1 << 44))
def test_the_chosen_batch_fits_and_is_the_largest_that_does(
    shape: ModelShape, run: GenerationSettings, available: int
) -> None:
    plan = plan_generation(shape, run, available)
    assert 0 <= plan.batch <= run.batch
    if plan.fits:
        assert needed_bytes(shape, run, plan.batch) <= available
        assert plan.needed_bytes == needed_bytes(shape, run, plan.batch)
        assert plan.require() == plan.batch
    if plan.batch < run.batch:
        assert needed_bytes(shape, run, plan.batch + 1) > available


@given(shapes, settings)
def test_a_refusal_names_the_numbers_and_the_fix(shape: ModelShape, run: GenerationSettings) -> None:
    plan = plan_generation(shape, run, needed_bytes(shape, run, 1) - 1, device="cuda:1")
    assert not plan.fits
    with pytest.raises(NodeError) as caught:
        plan.require()
    message = str(caught.value)
    assert caught.value.reason == "vram_too_small"
    assert "cuda:1" in message and "--gpu none" in message
    assert len(re.findall(r"[0-9]+\.[0-9]{2} GiB", message)) >= 4  # free, weights, per sample, needed


@given(shapes, settings, st.integers(0, 1 << 44))
def test_a_validation_prefill_takes_the_largest_chunk_that_fits(
    shape: ModelShape, run: GenerationSettings, available: int
) -> None:
    chunk = plan_prefill(shape, run, available)
    assert 1 <= chunk <= run.batch  # one sample at least: past that the OOM retry reports the numbers
    spare = available - RESERVE_BYTES - replay_bytes(shape, run)
    if chunk > 1:
        assert chunk * prefill_sample_bytes(shape, run) <= spare
    if chunk < run.batch:
        assert (chunk + 1) * prefill_sample_bytes(shape, run) > spare


def test_a_prefill_plan_for_a_real_size_batch() -> None:
    """64 samples of 256 + 1024 tokens of a 0.5B model in bf16: ~32 MiB each beside the replay's chunk
    (110 positions of the 151,936-token vocabulary: 0.6 GiB), so 8 GiB free takes them all at once and
    2 GiB free takes them in chunks."""
    run = GenerationSettings(batch=64, prompt_tokens=256, max_new_tokens=1024, dtype="bfloat16")
    assert replay_bytes(QWEN_05B, run) == 110 * 151_936 * (2 + 4 + 32)
    per_sample = prefill_sample_bytes(QWEN_05B, run)
    assert per_sample == 1280 * (4 * 896 + 2 * 4864) * 2 + 1280 * 896 * 2 + 1024 * 896 * 4
    assert plan_prefill(QWEN_05B, run, 8 * GIB) == 64
    assert 1 < plan_prefill(QWEN_05B, run, 2 * GIB) < 64


def test_a_small_gpu_generates_the_run_batch_in_chunks() -> None:
    run = GenerationSettings(batch=256, prompt_tokens=256, max_new_tokens=1024, dtype="bfloat16")
    roomy = plan_generation(QWEN_05B, run, 80 * GIB)
    assert roomy.batch == 256 and not roomy.shrunk
    small = plan_generation(QWEN_05B, run, 4 * GIB)
    assert small.shrunk and 1 <= small.batch < 256
    assert f"chunks of {small.batch} of the run's 256" in small.describe()


def test_the_shape_comes_from_config_and_safetensors_headers(tiny_model_dir: Path) -> None:
    import torch

    from prime_node.ml.model import load_model

    shape = model_shape(tiny_model_dir)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    model = load_model(tiny_model_dir, device="cpu")
    assert shape.params == sum(p.numel() for p in model.parameters())  # a tied head counts once
    assert (shape.layers, shape.vocab) == (config["num_hidden_layers"], config["vocab_size"])
    assert shape.kv_heads == config.get("num_key_value_heads", config["num_attention_heads"])
    assert isinstance(next(model.parameters()), torch.Tensor)


def test_a_broken_model_dir_is_a_node_error(tmp_path: Path) -> None:
    with pytest.raises(NodeError):
        model_shape(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(NodeError, match="model size"):
        model_shape(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(NodeError, match="safetensors header"):
        model_shape(tmp_path)
