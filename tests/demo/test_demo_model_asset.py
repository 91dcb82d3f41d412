"""The demo's packaged model (prime_node/assets/tiny_arithmetic): small, loadable by our loader, and as
good as ``scripts/make_demo_model.py`` recorded when it made it.

Greedy decoding of one fixed model barely depends on the CPU's kernels: measured on the AVX2 machine
that made it, 0.27 on the 200 held-out tasks natively and with ``ATEN_CPU_CAPABILITY=default`` (scalar
kernels) alike. The ±0.05 margin (10 of 200 tasks) leaves room for another CPU flipping a few argmax ties.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prime_node.assets import INFO_FILE, copy_demo_model, demo_model_dir, demo_model_info
from tests import warm_cli

MAX_BYTES = 1_000_000
MARGIN = 0.05


def test_the_asset_is_a_small_complete_model_directory() -> None:
    directory = demo_model_dir()
    names = {path.name for path in directory.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", INFO_FILE} <= names
    assert not any(name.endswith((".bin", ".pt", ".pth", ".pkl")) for name in names)  # no pickle weights
    assert sum(path.stat().st_size for path in directory.rglob("*") if path.is_file()) < MAX_BYTES
    info = demo_model_info()
    assert info["warmup_steps"] > 0 and info["heldout_tasks"] == 200
    assert 0.15 <= info["heldout_accuracy"] <= 0.35  # a start RL can improve on by well over +0.4


def test_the_asset_loads_and_reaches_its_recorded_heldout_accuracy() -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    from prime_node.ml.engine import TorchEngine
    from prime_node.ml.evaluation import greedy_accuracy
    from prime_node.ml.model import load_model, parameter_count
    from prime_node.ml.tokenizer import load_tokenizer
    from prime_node.tasks.arithmetic import ArithmeticTask

    torch.set_num_threads(1)
    info = demo_model_info()
    model = load_model(demo_model_dir())  # AutoModelForCausalLM.from_pretrained, safetensors only
    tokenizer = load_tokenizer(demo_model_dir())
    assert isinstance(model, Qwen2ForCausalLM)
    assert parameter_count(model) == info["parameters"] < 200_000
    assert all(p.dtype == torch.float32 for p in model.parameters())
    task = ArithmeticTask(2)
    assert task.name == info["task"]
    engine = TorchEngine(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    ids = list(task.eval_ids())[: info["heldout_tasks"]]
    accuracy = greedy_accuracy(engine, tokenizer, task, ids, max_new_tokens=info["max_new_tokens"])
    assert accuracy == pytest.approx(info["heldout_accuracy"], abs=MARGIN)


def test_the_demo_copies_the_asset_instead_of_warming_up(tmp_path: Path) -> None:
    from prime_node.demo.orchestrator import make_model
    from prime_node.ml.model import check_model_dir

    said: list[str] = []
    info = make_model(tmp_path / "model", said.append)
    check_model_dir(tmp_path / "model")
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == (
        demo_model_dir() / "model.safetensors"
    ).read_bytes()
    assert info["warmup_steps"] == demo_model_info()["warmup_steps"]
    assert len(said) == 1 and "from the package" in said[0] and f"{info['warmup_steps']} steps" in said[0]
    assert copy_demo_model(tmp_path / "again")["parameters"] == info["parameters"]


def test_init_model_from_package_copies_the_asset(tmp_path: Path) -> None:
    import json
    import sys

    out = tmp_path / "m"
    command = [sys.executable, "-m", "prime_node", "init-model", "--tiny", "--from-package", str(out)]
    command.append("--json")
    done = warm_cli.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["warmup_steps"] == demo_model_info()["warmup_steps"]
    assert (out / "model.safetensors").read_bytes() == (demo_model_dir() / "model.safetensors").read_bytes()
