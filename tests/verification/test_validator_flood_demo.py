"""Issue 13 item 4 on real processes: ``prime-node demo`` (trainer, inferer, validator on 127.0.0.1, real
libp2p) keeps training while an extra identity gossips signed rollout frames claiming the step after the
newest announced one, five a second. Before the fix the validator waited 30 s on each such frame inside
its check loop and the trainer stopped."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.verification.policy_flood import run_demo

STEPS = 30


@pytest.mark.slow
def test_the_demo_keeps_training_while_a_peer_floods_future_step_frames(tmp_path: Path) -> None:
    result = run_demo(tmp_path / "demo", steps=STEPS, attack=True, timeout_s=120)
    assert result["returncode"] == 0, result["stderr_tail"]
    summary = result["summary"]
    flood = result["flood"]
    assert flood["sent"] >= 25, flood  # the flood ran for the whole training, not just its end
    assert summary["steps"] >= STEPS and summary["accepted_by_worker"]["inferer-1"] >= STEPS
    # Its frames were judged once their step existed, refused for what they are, and it was charged.
    validator = result["status"]["validator-1"]
    assert validator["counters"].get("offence_bad_data", 0) >= 1, validator["counters"]
    assert flood["peer_id"] in validator["banned"], validator["events"]
    assert validator["sections"]["validation"]["accepted"] >= STEPS
