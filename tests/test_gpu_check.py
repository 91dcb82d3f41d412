"""The GPU device check (benchmarks/gpu.py) runs its whole code path on the CPU with --dry-run.

On a GPU machine the same script measures decode speed, proof overhead, the GPU verification pairs and
the trainer (docs/gpu.md); here every section must complete at toy sizes and report what the real run
reports, so the one call a lent GPU gets does not fail on a path nobody ran.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from prime_node.verification.cheating import ATTACKS, EXPECTED_REASONS

ROOT = Path(__file__).resolve().parents[1]
STATS = {"exp_mismatches", "mant_err_mean", "mant_err_median", "logprob_error", "replay_margin"}
# Attacks that checks needing no calibrated bound catch: the dry run (no bounds) must already see them.
BOUNDLESS = ("replayed_batch", "stale_policy", "off_schedule", "bad_signature")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # hang guard: the subprocess's own, ~18 × a quiet run
def test_the_gpu_check_dry_run_reports_every_section(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run", "--honest-batches", "1",
               "--cpu-workers", "1", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1800)  # hang guard
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and "errors" not in result
    assert set(result["section_s"]) == {"throughput", "proof", "calibration", "trainer"}

    rows = result["throughput"]
    assert {(r["model"], r["batch"]) for r in rows} == {
        (m, b) for m in ("small", "0.6b (toy)") for b in (1, 2)
    }
    for row in rows:
        assert row["ours_tok_s"] > 0 and row["hf_generate_tok_s"] > 0 and row["bandwidth_bound_tok_s"] > 0
    assert math.isfinite(result["proof"]["overhead"])

    pairs = result["calibration"]["pairs"]
    assert set(pairs) == {"cuda_bf16->cuda_bf16", "cuda_bf16->cpu_f32", "cpu_f32->cuda_bf16"}
    for pair in pairs.values():
        assert pair["honest_batches"] == 1 and len(pair["honest"]) == 1
        assert set(pair["honest"][0]) >= STATS
        assert pair["honest_rejected_without_bounds"] == {}
        assert set(pair["reasons_by_attack"]) == set(ATTACKS)
        for attack in BOUNDLESS:
            assert {str(r) for r in EXPECTED_REASONS[attack]} & set(pair["reasons_by_attack"][attack])
        for attack in ("other_model", "perturbed_weights", "tampered_token", "inflated_reward"):
            assert set(pair["attacks"][attack][0]) >= STATS  # recomputed: their distances came back

    trainer = result["trainer"]
    for run in trainer.values():
        assert len(run["losses"]) == 3 and all(math.isfinite(x) for x in run["losses"])
        assert run["checkpoint_read_back_equal"] and run["checkpoint_tensors"] > 0
        assert run["largest_loss_difference_to_cpu"] <= 1e-4  # the same CPU here: only float noise


def test_the_gpu_check_without_a_gpu_points_to_the_dry_run() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--sections", "proof"],
        capture_output=True,
        text=True,
        check=False,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode != 0 and "--dry-run" in done.stderr
