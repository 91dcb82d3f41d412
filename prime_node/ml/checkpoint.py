"""Trainer checkpoints: one Hugging Face-format directory per step, written atomically, no pickle.

    OUT/checkpoints/step_00000012/
        config.json, generation_config.json, tokenizer.json, tokenizer_config.json   (copied from the base)
        model.safetensors          the policy after 12 optimizer steps (loadable by transformers)
        optimizer.safetensors      AdamW moments (only from callers that pass them: the FSDP2
                                   trainer keeps its sharded moments in OUT/train_state instead)
        trainer_state.json         {"step": 12, ...}

A step directory is built under ``.tmp`` and renamed into place after its files are fsynced, so a kill at
any moment leaves either the whole checkpoint or none. Only the newest ``keep`` are kept. The policy
directories the networked trainer shares (``write_policy_dir``: ``OUT/policies/step_N``) are built by
the same code from the same weights file (a hard link): one write per policy, in the published dtype.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from prime_node.atomic_files import fsync_directory, fsync_path
from prime_node.errors import NodeError

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
POLICY_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
"""What a shared policy directory holds beside its weights: what a peer needs to load it."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def model_weights(model: Any) -> dict[str, torch.Tensor]:
    """The weights as saved: contiguous copies, without the tied output projection."""
    state = model.state_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return {
        name: tensor.detach().to("cpu").contiguous().clone()
        for name, tensor in state.items()
        if not (tied and name == "lm_head.weight")
    }


def optimizer_snapshot(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """AdamW state as (tensors, metadata) copies that stay valid while training goes on."""
    return _optimizer_tensors(optimizer)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"state.{index}.{key}"] = tensor.detach().to("cpu").contiguous().clone()
    return tensors, {"param_groups": json.dumps(state["param_groups"])}


def load_optimizer_state(optimizer: torch.optim.Optimizer, path: Path) -> None:

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        groups = json.loads(metadata["param_groups"])
    except (OSError, SafetensorError, KeyError, ValueError) as exc:
        raise NodeError(f"unreadable optimizer state {path}: {exc}", reason="bad_checkpoint") from exc
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = tensor
    optimizer.load_state_dict({"state": dict(sorted(state.items())), "param_groups": groups})


def save_checkpoint(
    root: Path, step: int, model: Any, optimizer: torch.optim.Optimizer, base_dir: Path, extra: dict[str, Any]
) -> Checkpoint:
    """Write step ``step`` atomically under ``root`` (model files other than weights come from base_dir)."""
    return write_checkpoint(root, step, model_weights(model), optimizer_snapshot(optimizer), base_dir, extra)


def write_checkpoint(
    root: Path,
    step: int,
    weights: dict[str, torch.Tensor] | Path,
    optimizer_state: tuple[dict[str, torch.Tensor], dict[str, str]] | None,
    base_dir: Path,
    extra: dict[str, Any],
) -> Checkpoint:
    """``save_checkpoint`` from snapshots (weights as ``model_weights`` returns them, or a finished
    safetensors file of them, which is hard-linked in: the FSDP2 trainer's ranks write it together).
    The FSDP2 trainer passes no optimizer state: its AdamW shards live in ``sharded_checkpoint.py``."""
    final = _build_step_dir(
        root,
        step,
        weights,
        base_dir,
        _MODEL_FILES,
        durable=True,
        extra=extra,
        optimizer_state=optimizer_state,
    )
    return Checkpoint(step, final)


def write_policy_dir(root: Path, step: int, weights: dict[str, torch.Tensor] | Path, base_dir: Path) -> Path:
    """``root/step_N`` with what peers need of policy ``step`` (``POLICY_FILES`` and the weights; nothing
    private), renamed into place; an existing one is kept as it is (peers may hold its bytes already).
    ``weights`` as for ``write_checkpoint``: the trainer passes the same file its checkpoint links, so
    the shared policy and the checkpoint are one file on disk. Not fsynced: a kill loses at most
    a directory the trainer writes again from its checkpoint when it resumes."""
    final = step_dir(root, step)
    if (final / "model.safetensors").is_file():
        return final
    return _build_step_dir(root, step, weights, base_dir, POLICY_FILES, durable=False, extra=None)


def _build_step_dir(
    root: Path,
    step: int,
    weights: dict[str, torch.Tensor] | Path,
    base_dir: Path,
    names: tuple[str, ...],
    *,
    durable: bool,
    extra: dict[str, Any] | None,
    optimizer_state: tuple[dict[str, torch.Tensor], dict[str, str]] | None = None,
) -> Path:
    """The one writer of step directories: under ``.tmp``, the base's ``names``, the weights (a hard
    link to a finished file, or tensors saved), ``trainer_state.json`` when ``extra`` is given; fsynced
    when ``durable``; then renamed into place."""
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for name in names:
        if (base_dir / name).is_file():
            shutil.copyfile(base_dir / name, tmp / name)
    if isinstance(weights, Path):
        link_or_copy(weights, tmp / "model.safetensors")
    else:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if optimizer_state is not None:
        tensors, metadata = optimizer_state
        save_file(tensors, str(tmp / "optimizer.safetensors"), metadata=metadata)
    if extra is not None:
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **extra}, sort_keys=True))
    if durable:
        for item in tmp.iterdir():
            fsync_path(item)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    if durable:
        fsync_directory(root)
    return final


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` holding ``source``'s bytes: a hard link (the files are never rewritten in place), or a
    copy where the two are on different file systems (or one without hard links)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def prune_step_dirs(root: Path, newest: int, keep: int) -> None:
    """Remove ``root/step_N`` directories with N <= ``newest - keep`` (``write_policy_dir``'s)."""
    if not root.is_dir():
        return
    for item in root.iterdir():
        match = _STEP_DIR.match(item.name)
        if match and int(match.group(1)) <= newest - keep:
            shutil.rmtree(item, ignore_errors=True)


def weights_dtype(path: Path) -> str | None:
    """The dtype of the floating tensors in a safetensors file, by its header ("F32" -> "float32",
    "BF16" -> "bfloat16", "F16" -> "float16"); None if it has none or the header is unreadable."""
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
    try:
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if not 0 < size <= 100 << 20:
                return None
            header = json.loads(handle.read(size))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(header, dict):
        return None
    for name, entry in header.items():
        if name != "__metadata__" and isinstance(entry, dict) and entry.get("dtype") in names:
            return names[entry["dtype"]]
    return None


def list_checkpoints(root: Path) -> list[Checkpoint]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for item in root.iterdir():
        match = _STEP_DIR.match(item.name)
        if match and (item / "trainer_state.json").is_file() and (item / "model.safetensors").is_file():
            found.append(Checkpoint(int(match.group(1)), item))
    return sorted(found, key=lambda c: c.step)


def prune_checkpoints(root: Path, keep: int) -> None:
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old.path, ignore_errors=True)


def read_weights(checkpoint: Path, filename: str = "model.safetensors") -> dict[str, torch.Tensor]:
    try:
        return load_file(str(checkpoint / filename))
    except (OSError, SafetensorError) as exc:
        raise NodeError(f"unreadable weights in {checkpoint}: {exc}", reason="bad_checkpoint") from exc


def load_weights_into(model: Any, weights: dict[str, torch.Tensor]) -> None:
    """Load saved weights (without the tied head) into a live model."""
    with torch.no_grad():
        missing, unexpected = model.load_state_dict(weights, strict=False)
    allowed = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - allowed or unexpected:
        raise NodeError(
            f"checkpoint weights do not fit the model: missing {missing}, unexpected {unexpected}",
            reason="bad_checkpoint",
        )
