"""Small but real Hugging Face-format model directories for swarm tests: a config, a tokenizer file and
safetensors shards of random weights (written with safetensors itself, no torch needed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_model_dir(path: Path, *, weight_bytes: int = 256 << 10, shards: int = 2, seed: int = 0) -> Path:
    """Create ``path`` holding about ``weight_bytes`` of float32 weights over ``shards`` files."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128}, indent=2
        )
    )
    (path / "tokenizer.json").write_text(
        json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}}})
    )
    per_shard = max(1, weight_bytes // shards // 4)
    for shard in range(shards):
        tensors = {
            f"layers.{shard}.weight": rng.standard_normal(per_shard // 2).astype(np.float32),
            f"layers.{shard}.bias": rng.standard_normal(per_shard - per_shard // 2).astype(np.float32),
        }
        save_file(tensors, str(path / f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"))
    return path


def read_tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` by relative name: for byte-identical comparisons."""
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
