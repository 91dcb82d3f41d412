"""The validator takes its TOPLOC bounds from the run's engine family and dtype, or an explicit policy."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from crypto.toploc import CALIBRATED_THRESHOLDS, Thresholds
from prime_node.errors import NodeError
from prime_node.ml import engines
from prime_node.testing.adversary import build_scenario, validator_for
from prime_node.verification.reasons import Reason
from prime_node.verification.validator import CheckPolicy


def test_the_validator_uses_the_thresholds_of_the_runs_engine() -> None:
    scenario = build_scenario(group_size=2, groups=1, max_new_tokens=6)
    validator = validator_for(scenario)
    assert scenario.config.engine == "torch"
    cpu_f32 = ("torch", "float32", "cpu")
    assert validator.engine_thresholds is CALIBRATED_THRESHOLDS[(cpu_f32, cpu_f32)]
    assert CheckPolicy().toploc is None  # the default policy defers to the run's engine
    [frame] = scenario.honest_frames(0)
    result = validator.validate_frame(frame, now_ms=scenario.now_ms, current_step=scenario.current_step)
    assert result.accepted, result.detail


def test_an_explicit_policy_overrides_the_engines_thresholds() -> None:
    scenario = build_scenario(group_size=2, groups=1, max_new_tokens=6)
    validator = validator_for(scenario)
    # Bounds no chunk can meet: the honest batch is now rejected by the TOPLOC check itself.
    impossible = Thresholds(max_exp_mismatches=-1, max_mant_err_mean=0.0, max_mant_err_median=0.0)
    validator.policy = CheckPolicy(toploc=impossible)
    [frame] = scenario.honest_frames(1)
    result = validator.validate_frame(frame, now_ms=scenario.now_ms, current_step=scenario.current_step)
    assert result.reasons == [Reason.TOPLOC_EXPONENT_MISMATCH]


def test_a_run_on_an_uncalibrated_engine_is_refused_before_any_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = build_scenario(group_size=2, groups=1, max_new_tokens=6)
    monkeypatch.setattr(engines, "SAMPLING_TOLERANCES", {})  # no pair calibrated
    with pytest.raises(NodeError) as caught:
        validator_for(scenario)
    assert caught.value.reason == "uncalibrated_engine"


class _SmallGpu:
    """The scenario's real engine behind a prefill that runs out of GPU memory above two samples."""

    def __init__(self, engine: object) -> None:
        self.engine = engine
        self.policy_step = engine.policy_step  # type: ignore[attr-defined]
        self.prefill_sizes: list[int] = []

    def prefill(self, prompts: list[list[int]], completions: list[list[int]]) -> object:
        import torch

        self.prefill_sizes.append(len(prompts))
        if len(prompts) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return self.engine.prefill(prompts, completions)  # type: ignore[attr-defined]


def test_a_prefill_that_runs_out_of_gpu_memory_is_halved_and_the_verdict_is_the_same() -> None:
    scenario = build_scenario(group_size=2, groups=2, max_new_tokens=6)
    small = _SmallGpu(scenario.engine)
    [frame] = scenario.honest_frames(0)
    whole = validator_for(scenario).validate_frame(
        frame, now_ms=scenario.now_ms, current_step=scenario.current_step
    )
    scenario.engine = small
    chunked = validator_for(scenario).validate_frame(
        frame, now_ms=scenario.now_ms, current_step=scenario.current_step
    )
    assert whole.accepted and chunked.accepted, (whole.detail, chunked.detail)
    assert small.prefill_sizes[0] > 2 and max(small.prefill_sizes[1:]) <= 2  # the OOM, then halves
    assert sum(small.prefill_sizes[1:]) == small.prefill_sizes[0]  # every sample checked once
