"""From a batch a node kept (``--keep-batches``) to a verdict: `prime-node validate DATA_DIR/batches/FILE`
finds the claimed policy and the run's config itself, says exactly what to pass when it cannot, and gives
no verdict at all (exit 1, "not a signed rollout batch") for a file that is not a signed batch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("torch")

from prime_node.ml.model import create_tiny_model, save_model_dir
from prime_node.ml.rollout_log import RolloutLog
from prime_node.testing.adversary import build_scenario
from prime_node.verification.batch_archive import BatchArchive
from protocol.codec import decode
from protocol.envelope import Envelope
from protocol.rollouts import RolloutBatch
from tests import warm_cli
from tests.cli_in_process import run_cli


@dataclass(frozen=True)
class Node:
    data: Path
    honest: Path
    tampered: Path
    checkpoints: Path
    step: int


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Node:
    """A validator's data dir as a run leaves it: the policy in its swarm store, two batches kept."""
    data = tmp_path_factory.mktemp("validator")
    scenario = build_scenario()  # seed-0 tiny model, run "adversary"
    honest = scenario.honest_frames(1)[0]
    step = decode(decode(honest, Envelope).payload, RolloutBatch).policy_step
    checkpoints = data / "swarm" / "checkpoints"
    model, tokenizer = create_tiny_model(0)
    save_model_dir(model, tokenizer, checkpoints / f"step-{step}-0011223344556677")
    archive = BatchArchive(
        data / "batches", 8, 1 << 26, policy_roots=(checkpoints,), run_config=scenario.config
    )
    worker = str(decode(honest, Envelope).signer)
    kept = archive.keep(honest, batch_id=decode(honest, Envelope).id().hex(), worker=worker, policy_step=step)
    tampered = scenario.attack_frames("tampered_token", 2)[0]
    cheat = archive.keep(tampered, batch_id="ff" * 32, worker=worker, policy_step=step)
    assert kept is not None and cheat is not None
    return Node(data, kept, cheat, checkpoints, step)


@pytest.fixture(autouse=True)
def _no_node_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("PRIME_NODE_")]:
        monkeypatch.delenv(name)


def test_a_kept_batch_is_judged_with_no_flags_in_a_real_process(node: Node) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_NODE_")}
    result = warm_cli.run(
        [sys.executable, "-m", "prime_node", "validate", str(node.honest)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("accepted")
    assert f"step-{node.step}-0011223344556677" in result.stderr and "run-adversary.json" in result.stderr


def test_a_kept_cheat_is_rejected_and_the_json_names_what_was_used(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_cli(capsys, "validate", str(node.tampered), "--json")
    assert result.returncode == 2, result.stderr
    verdict = json.loads(result.stdout)
    assert verdict["accepted"] is False and "sampling_mismatch" in verdict["reasons"]
    assert verdict["policy_dir"].endswith(f"step-{node.step}-0011223344556677")
    assert verdict["config"].endswith("run-adversary.json") and verdict["worker"].startswith("0x")


def test_a_kept_batch_whose_policy_is_gone_says_which_model_to_pass(
    node: Node, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    moved = tmp_path / "batches"
    shutil.copytree(node.data / "batches", moved)  # a copy elsewhere: the recorded policy dir still
    policy = next(node.checkpoints.iterdir())  # works; then the policy is pruned
    aside = tmp_path / "pruned"
    policy.rename(aside)
    try:
        result = run_cli(capsys, "validate", str(moved / node.honest.name))
        assert result.returncode == 1 and "Traceback" not in result.stderr and not result.stdout
        step = node.step
        assert f"claims policy step {step}, which is not on this disk" in result.stderr
        assert "--model" in result.stderr and f"OUT/policies/step_{step:08d}" in result.stderr
        given = run_cli(capsys, "validate", str(moved / node.honest.name), "--model", str(aside))
        assert given.returncode == 0 and given.stdout.startswith("accepted"), given.stderr
    finally:
        aside.rename(policy)


def test_a_batch_judged_against_another_runs_config_is_an_error_not_a_verdict(
    node: Node, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Before: with the built-in defaults (run "demo") an honest batch of run "adversary" was "rejected"."""
    alone = tmp_path / "honest.batch"  # no sidecar: nothing says which run
    alone.write_bytes(node.honest.read_bytes())
    policy = next(node.checkpoints.iterdir())
    result = run_cli(capsys, "validate", str(alone), "--model", str(policy))
    assert result.returncode == 1 and not result.stdout
    assert "signed for run 'adversary' but the run config is run 'demo'" in result.stderr
    assert "--config" in result.stderr


def test_files_that_are_not_signed_batches_get_no_verdict(
    node: Node, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    policy = str(next(node.checkpoints.iterdir()))
    run_toml = tmp_path / "run.toml"
    run_toml.write_text('run_id = "adversary"\ngroup_size = 4\n')
    random_bytes = tmp_path / "random.bin"
    random_bytes.write_bytes(os.urandom(4096))
    unsigned = tmp_path / "rollouts.log.frame"
    unsigned.write_bytes(decode(node.honest.read_bytes(), Envelope).payload)
    log = RolloutLog(tmp_path / "out" / "rollouts.log")  # what a trainer keeps: a real record
    log.append(3, decode(node.honest.read_bytes(), Envelope).payload)
    huge = tmp_path / "huge.bin"
    huge.write_bytes(b"\0" * (Envelope.MAX_BYTES + 1))
    cases = {
        run_toml: "run.toml is a TOML file (a run config goes in --config)",
        random_bytes: "not a signed rollout batch",
        unsigned: "an unsigned rollout batch",
        node.honest.with_suffix(".json"): f"is the sidecar of {node.honest.name}",
        huge: "larger than the largest envelope",
        log.path: "rollouts.log is the trainer's rollout log",
        node.honest.parent / "run-adversary.json": "run-adversary.json is a JSON file",
    }
    for path, words in cases.items():
        for extra in ((), ("--model", policy)):
            result = run_cli(capsys, "validate", str(path), *extra)
            assert result.returncode == 1, (path, result)
            assert "not a signed rollout batch" in result.stderr and words in result.stderr, result.stderr
            assert not result.stdout and "Traceback" not in result.stderr
            assert "rejected" not in result.stderr + result.stdout


@pytest.mark.parametrize("command", ["join", "run-trainer"])
def test_join_and_run_trainer_take_keep_batches(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    shown = run_cli(capsys, command, "--help")
    assert shown.returncode == 0 and "--keep-batches" in shown.stdout
    refused = run_cli(capsys, command, "--keep-batches", "-1")
    assert refused.returncode == 2 and "--keep-batches" in refused.stderr
