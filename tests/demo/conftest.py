"""A tiny model directory per session (random weights: orchestration tests need a model dir, not skill)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from prime_node.ml.model import create_tiny_model, save_model_dir

    torch.set_num_threads(1)
    model, tokenizer = create_tiny_model(seed=0)
    out = tmp_path_factory.mktemp("tiny")
    save_model_dir(model, tokenizer, out)
    return out
