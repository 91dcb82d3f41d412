"""`prime-node validate` as a user runs it: a real process, a real model directory, real batch files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from prime_node.ml.model import create_tiny_model, save_model_dir
from prime_node.testing.adversary import build_scenario
from protocol.codec import decode
from protocol.envelope import Envelope
from tests import warm_cli
from tests.cli_in_process import run_cli

CONFIG = """
run_id = "adversary"
group_size = 4
prompts_per_step = 2
max_new_tokens = 12
temperature = 1.0
async_level = 2
seed = 7
"""


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_NODE_")}
    return warm_cli.run(
        [sys.executable, "-m", "prime_node", *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("validate")
    model, tokenizer = create_tiny_model(0)
    save_model_dir(model, tokenizer, root / "model")
    (root / "run.toml").write_text(CONFIG, encoding="utf-8")
    scenario = build_scenario()  # the same seed-0 model, run id, shape and schedule seed as CONFIG
    (root / "honest.batch").write_bytes(scenario.honest_frames(1)[0])
    tampered = scenario.attack_frames("tampered_token", 2)[0]
    (root / "tampered.batch").write_bytes(tampered)
    (root / "cut.batch").write_bytes(tampered[: len(tampered) // 2])
    return {"root": root, "model": root / "model", "config": root / "run.toml"}


def validate(files: dict[str, Path], name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    batch = str(files["root"] / name)
    return run("validate", batch, "--model", str(files["model"]), "--config", str(files["config"]), *extra)


def test_an_honest_batch_file_is_accepted(files: dict[str, Path]) -> None:
    result = validate(files, "honest.batch", "--json")
    assert result.returncode == 0, result.stderr
    verdict = json.loads(result.stdout)
    assert verdict["accepted"] is True and verdict["reasons"] == [] and len(verdict["rewards"]) == 8


def test_a_tampered_or_truncated_file_is_a_clear_rejection(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In this process (torch is loaded here already): the verdicts are the command's; it runs as a real
    process in the two other tests."""
    for name in [k for k in os.environ if k.startswith("PRIME_NODE_")]:
        monkeypatch.delenv(name)

    def judge(name: str, *extra: str) -> subprocess.CompletedProcess[str]:
        options = ("--model", str(files["model"]), "--config", str(files["config"]), *extra)
        return run_cli(capsys, "validate", str(files["root"] / name), *options)

    tampered = judge("tampered.batch")
    assert tampered.returncode == 2 and "Traceback" not in tampered.stderr
    assert tampered.stdout.startswith("rejected") and "sampling_mismatch" in tampered.stdout
    # Bytes that are no signed batch name no worker to judge: an error, never a verdict (issue 36: a
    # truncated file, run.toml or the trainer's unsigned rollouts.log frames were "rejected" as cheats).
    cut = judge("cut.batch", "--json")
    assert cut.returncode == 1 and "Traceback" not in cut.stderr and not cut.stdout
    assert "not a signed rollout batch" in cut.stderr
    config = run_cli(capsys, "validate", str(files["config"]), "--model", str(files["model"]))
    assert config.returncode == 1 and "not a signed rollout batch" in config.stderr
    unsigned = files["root"] / "unsigned.batch"
    signed = decode((files["root"] / "honest.batch").read_bytes(), Envelope)
    unsigned.write_bytes(signed.payload)  # the encoded batch alone, as the trainer's rollouts.log keeps it
    logged = run_cli(capsys, "validate", str(unsigned), "--model", str(files["model"]))
    assert logged.returncode == 1 and "an unsigned rollout batch" in logged.stderr


def test_a_missing_model_is_one_line_of_error(files: dict[str, Path]) -> None:
    result = run("validate", str(files["root"] / "honest.batch"), "--model", str(files["root"] / "nope"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "does not exist" in result.stderr
