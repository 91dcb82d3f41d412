"""Files shipped inside the package: the demo's warmed-up tiny model.

``tiny_arithmetic/`` is a Hugging Face model directory (config, tokenizer, model.safetensors) as
``prime_node.ml.model.save_model_dir`` writes it, plus ``prime_node_model.json``: how it was made
(``scripts/make_demo_model.py``) and the held-out accuracy measured when it was. The demo copies it instead
of warming a model up on the spot, because the same seeded warm-up lands on a different model on another
CPU (DESIGN §11): shipping the weights gives every machine the same starting point.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from prime_node.errors import NodeError

DEMO_MODEL = "tiny_arithmetic"
INFO_FILE = "prime_node_model.json"


def demo_model_dir() -> Path:
    """The packaged demo model's directory (read-only in an installed package: copy it to train on it)."""
    path = Path(__file__).resolve().parent / DEMO_MODEL
    if not (path / "model.safetensors").is_file() or not (path / INFO_FILE).is_file():
        raise NodeError(
            f"the packaged demo model is missing from {path} (a broken install?)", reason="bad_model_dir"
        )
    return path


def demo_model_info() -> dict[str, Any]:
    """What ``scripts/make_demo_model.py`` recorded: recipe, parameters, warm-up, held-out accuracy."""
    info: dict[str, Any] = json.loads((demo_model_dir() / INFO_FILE).read_text())
    return info


def copy_demo_model(out_dir: Path) -> dict[str, Any]:
    """Copy the packaged demo model into ``out_dir`` (created; existing files of the same name are
    overwritten) and return its recorded info."""
    source = demo_model_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file():
            shutil.copyfile(path, out_dir / path.name)
    return demo_model_info()
