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
    assert validator.engine_thresholds is CALIBRATED_THRESHOLDS[(("torch", "float32"), ("torch", "float32"))]
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
