"""(inferer dtype, validator dtype) pairs: an uncalibrated pair is refused when the run config loads and
when a validator starts; a calibrated cross-dtype pair accepts honest work and still catches a cheat.

Real forward passes of the ``tiny`` Qwen3-shaped model (and, marked slow, the ``small`` one the bounds were
calibrated on by benchmarks/verification_dtypes.py), the inferer in bfloat16 and the validator in float32.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from crypto.toploc import CALIBRATED_THRESHOLDS
from prime_node.config import RunConfig, load_run_config
from prime_node.errors import NodeError
from prime_node.ml.engines import run_calibration, setup_engine
from prime_node.tasks.arithmetic import ArithmeticTask
from prime_node.verification.cheating import EXPECTED_REASONS, Scenario
from prime_node.verification.proving import rollout_domain
from prime_node.verification.validator import BatchValidator
from protocol.envelope import EnvelopeVerifier

UNCALIBRATED = ("float32", "bfloat16")  # float32 inferers checked by bfloat16 validators
CROSS = ("bfloat16", "float32")


def _pair(dtypes: tuple[str, str]) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
    return (("torch", dtypes[0], "cpu"), ("torch", dtypes[1], "cpu"))


def test_the_pairs_under_test_are_what_the_table_says() -> None:
    assert _pair(UNCALIBRATED) not in CALIBRATED_THRESHOLDS
    assert _pair(CROSS) in CALIBRATED_THRESHOLDS


def test_an_uncalibrated_pair_is_refused_when_the_run_config_loads(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f'inference_dtype = "{UNCALIBRATED[0]}"\nvalidator_dtype = "{UNCALIBRATED[1]}"\n')
    with pytest.raises(NodeError) as caught:
        load_run_config(path)
    assert caught.value.reason == "bad_config"
    message = str(caught.value)
    assert "float32 on cpu checked by validators in bfloat16 on cpu" in message
    assert "not a calibrated pair" in message
    assert "bfloat16 on cpu → float32 on cpu" in message  # names what would work


def test_a_validator_of_an_uncalibrated_pair_refuses_to_start() -> None:
    # A config object that skipped loading (no file, no validation) still cannot start a validator.
    run = RunConfig.model_validate({}).model_copy(
        update={"inference_dtype": UNCALIBRATED[0], "validator_dtype": UNCALIBRATED[1]}
    )
    with pytest.raises(NodeError) as caught:
        run_calibration(run)
    assert caught.value.reason == "uncalibrated_engine"
    with pytest.raises(NodeError) as caught:
        _validator(run, ArithmeticTask(2), None, lambda step: None)
    assert caught.value.reason == "uncalibrated_engine"


def _validator(run: RunConfig, task: Any, tokenizer: Any, engines: Any) -> BatchValidator:
    return BatchValidator(
        run, task, tokenizer, engines, rollout_verifier=EnvelopeVerifier(rollout_domain(run.run_id))
    )


@pytest.mark.parametrize("size", ["tiny", pytest.param("small", marks=pytest.mark.slow)])
def test_a_bf16_inferer_checked_by_a_float32_validator_passes_honest_work_and_not_a_cheat(size: str) -> None:
    """Fixed seeds, so the outcome is deterministic on one machine; the margins hold across kernel sets:
    honest worst mantissa mean 1.44 (tiny, 40 batches) and 1.27 (small, 150) against the bound 2.0, a
    changed token's replay margin ≥ 5.5 against 0.1. ~2 s (tiny), ~8–40 s (small, by machine load)."""
    from prime_node.ml.architectures import create_model

    model, tokenizer = create_model("qwen3", size, 0)
    run = RunConfig.model_validate(
        {
            "run_id": "dtypes",
            "group_size": 2,
            "prompts_per_step": 2,
            "max_new_tokens": 24,
            "temperature": 1.0,
            "inference_dtype": CROSS[0],
            "validator_dtype": CROSS[1],
        }
    )
    inferer = setup_engine(copy.deepcopy(model), tokenizer, dtype=run.inference_dtype, policy_step=5)
    checker = setup_engine(model, tokenizer, dtype=run.validator_dtype, policy_step=5)
    task = ArithmeticTask(2)
    scenario = Scenario(config=run, task=task, tokenizer=tokenizer, engine=inferer)
    validator = _validator(run, task, tokenizer, lambda step: checker if 3 <= step <= 5 else None)
    assert validator.calibration == run_calibration(run)
    for counter in range(2):
        [frame] = scenario.honest_frames(counter)
        result = validator.validate_frame(frame, now_ms=scenario.now_ms, current_step=scenario.current_step)
        assert result.accepted, result.detail
    [frame] = scenario.attack_frames("tampered_token", counter=99)
    result = validator.validate_frame(frame, now_ms=scenario.now_ms, current_step=scenario.current_step)
    assert not result.accepted
    assert set(result.reasons) & EXPECTED_REASONS["tampered_token"], result.reasons
