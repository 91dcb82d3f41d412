"""The engine factory: the run config's ``engine`` and dtypes pick the backend; unknown families, dtypes
and uncalibrated (inferer, validator) pairs are NodeErrors before any model is read."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch

from crypto.toploc import CALIBRATED_THRESHOLDS, Thresholds
from prime_node.config import RunConfig
from prime_node.config.run import validate_run_config
from prime_node.errors import NodeError
from prime_node.ml import engines
from prime_node.ml.engine import SamplingParams, TorchEngine
from prime_node.ml.engines import (
    DEFAULT_ENGINE,
    SAMPLING_TOLERANCES,
    EngineSpec,
    SamplingTolerances,
    admit_device,
    calibration,
    device_kind,
    engine_spec,
    load_engine,
    run_calibration,
    setup_engine,
)
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


def test_a_bf16_engine_computes_in_bf16_and_hands_out_float32(tiny_model_dir: Path) -> None:
    """TOPLOC compares upcast float32 hidden states and the sampling rule float64 scores, whatever the
    engine computes in."""
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = load_engine(tiny_model_dir, tokenizer, dtype="bfloat16")
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    params = SamplingParams(max_new_tokens=5, return_hidden=True)
    [completion] = engine.generate([[22, 23, 16]], [1], params)
    assert completion.hidden is not None and completion.hidden.dtype == torch.float32
    [prefill] = engine.prefill([[22, 23, 16]], [completion.tokens])
    assert prefill.hidden.dtype == prefill.logits.dtype == torch.float32
    # The same engine replays its own tokens: KV-cache decoding and prefill agree to bf16 rounding.
    assert (prefill.hidden - completion.hidden).abs().max() < 0.1


def test_setup_engine_casts_a_model_to_the_dtype_asked_for() -> None:
    model, tokenizer = create_tiny_model(seed=0)
    setup_engine(model, tokenizer, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(NodeError) as caught:
        setup_engine(model, tokenizer, dtype="float16")
    assert caught.value.reason == "unsupported_dtype"


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


F32 = ("torch", "float32", "cpu")


def test_thresholds_are_keyed_by_the_inferer_and_validator_engines() -> None:
    torch_f32 = EngineSpec("torch", "float32").toploc_thresholds()
    # The float32 torch engine checking itself: numbers unchanged since the table was keyed by one engine.
    assert torch_f32 == Thresholds(max_exp_mismatches=8, max_mant_err_mean=2.0, max_mant_err_median=1.0)
    assert torch_f32 is CALIBRATED_THRESHOLDS[(F32, F32)]
    assert engine_spec("torch").toploc_thresholds() is torch_f32
    pair = run_calibration(RunConfig.model_validate({}))
    assert (pair.toploc, pair.sampling) == (torch_f32, SAMPLING_TOLERANCES[(F32, F32)])
    vllm = EngineSpec("vllm", "float32")
    for inferer, validator in ((vllm, vllm), (EngineSpec("torch", "float32"), vllm)):
        with pytest.raises(NodeError) as caught:
            calibration(inferer, validator)
        assert caught.value.reason == "uncalibrated_engine"
        assert "vllm float32" in str(caught.value)
        assert "torch float32 on cpu → torch float32 on cpu" in str(caught.value)


def test_every_calibrated_pair_has_both_its_toploc_bounds_and_its_sampling_tolerances() -> None:
    assert set(CALIBRATED_THRESHOLDS) == set(SAMPLING_TOLERANCES)
    for inferer, validator in CALIBRATED_THRESHOLDS:
        pair = calibration(engine_spec(*inferer), engine_spec(*validator))
        # Bounds that could not reject anything would accept a forged proof.
        assert pair.toploc.max_exp_mismatches < 128 - 90 + 1
        assert 0 < pair.sampling.replay < 1 and 0 < pair.sampling.logprob < 1


@pytest.mark.parametrize("pair", [(*i[1:], *v[1:]) for i, v in CALIBRATED_THRESHOLDS if i[0] == "torch"])
def test_a_run_config_accepts_every_calibrated_pair(pair: tuple[str, str, str, str]) -> None:
    inference_dtype, inferer_device, validator_dtype, validator_device = pair
    run = validate_run_config(
        {
            "inference_dtype": inference_dtype,
            "validator_dtype": validator_dtype,
            "inferer_devices": [inferer_device],
            "validator_devices": [validator_device],
        },
        source="run.toml",
    )
    found = run_calibration(run, validator_device)
    assert (found.inferer.dtype, found.inferer.device, found.validator.dtype, found.validator.device) == pair


def test_a_run_refuses_device_pairs_never_calibrated_and_nodes_on_devices_it_does_not_admit() -> None:
    # A float32 GPU inferer was never measured against anything: refused when the config loads.
    with pytest.raises(NodeError) as caught:
        validate_run_config({"inferer_devices": ["cuda"]}, source="run.toml")
    assert caught.value.reason == "bad_config" and "float32 on cuda" in str(caught.value)
    # bf16 inferers on CPUs and GPUs, float32 validators on CPUs: both pairs calibrated.
    run = validate_run_config(
        {"inference_dtype": "bfloat16", "inferer_devices": ["cpu", "cuda"]}, source="run.toml"
    )
    assert run_calibration(run, "cpu").validator == EngineSpec("torch", "float32", "cpu")
    admit_device(run, "inferer", "cuda:1")
    admit_device(run, "inferer", "cpu")
    with pytest.raises(NodeError) as caught:
        admit_device(run, "validator", "cuda:0")  # the run admits CPU validators only
    assert caught.value.reason == "device_not_admitted" and "--gpu none" in str(caught.value)
    with pytest.raises(NodeError) as caught:
        run_calibration(run, "cuda:0")
    assert caught.value.reason == "device_not_admitted"
    with pytest.raises(NodeError) as caught:
        admit_device(RunConfig.model_validate({}), "inferer", "cuda:0")  # the default run: CPUs only
    assert caught.value.reason == "device_not_admitted" and "inferer_devices" in str(caught.value)
    with pytest.raises(NodeError) as caught:
        device_kind("mps")
    assert caught.value.reason == "unsupported_device"


def test_a_validator_checks_with_the_loosest_bounds_of_the_inferer_devices_the_run_admits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch does not say which device made it: two admitted inferer devices give the larger bound of
    each, never the tighter one (which would reject the other device's honest work)."""
    cpu_bf16, cuda_bf16 = ("torch", "bfloat16", "cpu"), ("torch", "bfloat16", "cuda")
    tight = Thresholds(max_exp_mismatches=4, max_mant_err_mean=3.0, max_mant_err_median=1.0)
    loose = Thresholds(max_exp_mismatches=9, max_mant_err_mean=1.0, max_mant_err_median=2.0)
    monkeypatch.setattr(engines, "CALIBRATED_THRESHOLDS", {(cpu_bf16, F32): tight, (cuda_bf16, F32): loose})
    monkeypatch.setattr(
        engines,
        "SAMPLING_TOLERANCES",
        {(cpu_bf16, F32): SamplingTolerances(0.01, 0.2), (cuda_bf16, F32): SamplingTolerances(0.03, 0.1)},
    )
    run = RunConfig.model_validate({"inference_dtype": "bfloat16", "inferer_devices": ["cpu", "cuda"]})
    found = run_calibration(run)
    assert found.toploc == Thresholds(max_exp_mismatches=9, max_mant_err_mean=3.0, max_mant_err_median=2.0)
    assert found.sampling == SamplingTolerances(logprob=0.03, replay=0.2)


def test_a_run_config_names_only_dtypes_the_engine_computes_in() -> None:
    with pytest.raises(NodeError) as caught:
        validate_run_config({"inference_dtype": "float16"}, source="run.toml")
    assert caught.value.reason == "bad_config" and "inference_dtype" in str(caught.value)
    with pytest.raises(NodeError) as caught:
        engine_spec("torch", "float16")
    assert caught.value.reason == "unsupported_dtype"


def test_the_threshold_table_cannot_be_changed_at_run_time() -> None:
    with pytest.raises(TypeError):
        CALIBRATED_THRESHOLDS[(F32, ("torch", "bfloat16", "cpu"))] = CALIBRATED_THRESHOLDS[(F32, F32)]  # type: ignore[index]
    with pytest.raises(TypeError):
        SAMPLING_TOLERANCES[(F32, ("torch", "bfloat16", "cpu"))] = SAMPLING_TOLERANCES[(F32, F32)]  # type: ignore[index]
    with pytest.raises(TypeError):
        engines._BACKENDS["vllm"] = engines._BACKENDS["torch"]  # type: ignore[index]
