"""The inferer loads on the device the role runner chose and, on a GPU, plans VRAM first (synthetic free
memory here): the run's batch whole, in chunks, or a refusal before any weights are loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.errors import NodeError
from prime_node.ml.oom_retry import ChunkedEngine
from prime_node.ml.vram_plan import GIB
from prime_node.roles.inferer_service import InfererService


def _inferer(device: str, free_bytes: int) -> InfererService:
    return InfererService(
        key=WalletKey.generate(),
        run_config=RunConfig.model_validate({"max_new_tokens": 64}),
        swarm=None,  # type: ignore[arg-type]
        device=device,
        free_vram=lambda _device: free_bytes,
    )


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``load_engine`` calls (the engine itself is built on the CPU: there is no GPU here)."""
    from prime_node.ml import engines
    from prime_node.roles import inferer_model

    real = engines.load_engine
    calls: list[dict[str, Any]] = []

    def fake(model_dir: Path, tokenizer: Any, **options: Any) -> Any:
        calls.append(options)
        return real(model_dir, tokenizer, **{**options, "device": "cpu"})

    monkeypatch.setattr(inferer_model, "load_engine", fake)  # where the inferer looks it up
    return calls


def test_on_the_cpu_nothing_is_planned_and_batches_stay_whole(
    tiny_model_dir: Path, loads: list[dict[str, Any]]
) -> None:
    inferer = _inferer("cpu", 0)
    inferer._load(0, tiny_model_dir)
    assert loads[0]["device"] == "cpu" and inferer.vram_plan is None
    assert isinstance(inferer.model.engine, ChunkedEngine) and inferer.model.engine.max_batch is None
    assert inferer.status()["device"] == "cpu"


def test_a_roomy_gpu_generates_the_run_batch_whole(tiny_model_dir: Path, loads: list[dict[str, Any]]) -> None:
    inferer = _inferer("cuda:1", 40 * GIB)
    inferer._load(0, tiny_model_dir)
    assert loads[0]["device"] == "cuda:1"
    assert inferer.model.engine.max_batch == inferer.config.samples_per_step
    assert inferer.status()["vram_plan"].startswith("cuda:1: 40.00 GiB free")


def test_a_small_gpu_shrinks_the_generation_batch_not_the_run(
    tiny_model_dir: Path, loads: list[dict[str, Any]]
) -> None:
    probe = _inferer("cuda:0", 40 * GIB)
    probe._load(0, tiny_model_dir)
    plan = probe.vram_plan
    assert plan is not None
    room = plan.weights_bytes + (512 << 20) + 3 * plan.per_sample_bytes  # three samples' worth
    inferer = _inferer("cuda:0", room)
    inferer._load(0, tiny_model_dir)
    assert inferer.model.engine.max_batch == 3 < inferer.config.samples_per_step
    assert "chunks of 3" in inferer.status()["vram_plan"]


def test_a_gpu_too_small_for_one_sample_is_refused_before_loading(
    tiny_model_dir: Path, loads: list[dict[str, Any]]
) -> None:
    inferer = _inferer("cuda:0", 1 << 20)
    with pytest.raises(NodeError) as caught:
        inferer._load(0, tiny_model_dir)
    assert caught.value.reason == "vram_too_small" and "GiB" in str(caught.value)
    assert loads == []
