"""The engine factory: the run config's ``engine`` picks the backend; unknown families are NodeErrors."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch

from crypto.toploc import CALIBRATED_THRESHOLDS, Thresholds
from prime_node.config import RunConfig
from prime_node.errors import NodeError
from prime_node.ml import engines
from prime_node.ml.engine import SamplingParams, TorchEngine
from prime_node.ml.engines import DEFAULT_ENGINE, EngineSpec, engine_spec, load_engine, setup_engine
from prime_node.ml.model import create_tiny_model
from prime_node.ml.tokenizer import load_tokenizer


def test_the_default_engine_is_the_run_configs_default() -> None:
    assert RunConfig.model_validate({}).engine == DEFAULT_ENGINE == "torch"


@pytest.mark.parametrize("family", typing.get_args(RunConfig.model_fields["engine"].annotation))
def test_every_family_a_run_config_accepts_can_be_built_and_validated(family: str) -> None:
    spec = engine_spec(family)
    assert spec.family == family
    assert isinstance(spec.toploc_thresholds(), Thresholds)


def test_setup_engine_wraps_a_model_with_the_tokenizers_special_tokens() -> None:
    model, tokenizer = create_tiny_model(seed=0)
    engine = setup_engine(model, tokenizer, engine=RunConfig.model_validate({}).engine, policy_step=7)
    assert isinstance(engine, TorchEngine) and engine.model is model
    assert engine.policy_step == 7
    assert (engine.eos_token_id, engine.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert setup_engine(model, tokenizer).policy_step == 0


def test_load_engine_reads_a_model_directory_in_the_specs_dtype(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    config = RunConfig.model_validate({})
    engine = load_engine(tiny_model_dir, tokenizer, engine=config.engine, policy_step=3)
    assert isinstance(engine, TorchEngine) and engine.policy_step == 3
    assert engine_spec(config.engine).dtype == "float32"
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    [completion] = engine.generate([[22, 23, 16]], [1], SamplingParams(max_new_tokens=4))
    assert 1 <= len(completion.tokens) <= 4


def test_an_unknown_engine_is_a_node_error_before_any_model_is_read(tmp_path: Path) -> None:
    model, tokenizer = create_tiny_model(seed=0)
    with pytest.raises(NodeError) as caught:
        engine_spec("vllm")
    assert caught.value.reason == "unknown_engine" and "torch" in str(caught.value)
    with pytest.raises(NodeError) as caught:
        setup_engine(model, tokenizer, engine="vllm")
    assert caught.value.reason == "unknown_engine"
    # The directory does not exist: the family is refused first, not the missing model.
    with pytest.raises(NodeError) as caught:
        load_engine(tmp_path / "missing", tokenizer, engine="vllm")
    assert caught.value.reason == "unknown_engine"


def test_a_run_config_refuses_an_engine_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="engine"):
        RunConfig.model_validate({"engine": "vllm"})


def test_thresholds_are_keyed_by_family_and_dtype() -> None:
    torch_f32 = EngineSpec("torch", "float32").toploc_thresholds()
    # Today's numbers for our float32 torch engine, unchanged by the move to a table.
    assert torch_f32 == Thresholds(max_exp_mismatches=8, max_mant_err_mean=2.0, max_mant_err_median=1.0)
    assert torch_f32 is CALIBRATED_THRESHOLDS[("torch", "float32")]
    assert engine_spec("torch").toploc_thresholds() is torch_f32
    for spec in (EngineSpec("torch", "bfloat16"), EngineSpec("vllm", "float32")):
        with pytest.raises(NodeError) as caught:
            spec.toploc_thresholds()
        assert caught.value.reason == "uncalibrated_engine"
        assert spec.family in str(caught.value) and spec.dtype in str(caught.value)


def test_the_threshold_table_cannot_be_changed_at_run_time() -> None:
    with pytest.raises(TypeError):
        CALIBRATED_THRESHOLDS[("torch", "bfloat16")] = CALIBRATED_THRESHOLDS[("torch", "float32")]  # type: ignore[index]
    with pytest.raises(TypeError):
        engines._BACKENDS["vllm"] = engines._BACKENDS["torch"]  # type: ignore[index]
