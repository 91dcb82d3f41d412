"""Shared fixtures: one tiny model directory per session (random weights: tests need shapes, not skill)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from prime_node.ml.model import create_tiny_model, save_model_dir

    model, tokenizer = create_tiny_model(seed=0)
    out = tmp_path_factory.mktemp("tiny")
    save_model_dir(model, tokenizer, out)
    return out
