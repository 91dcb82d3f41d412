"""Loading a sharded training state (sharded_checkpoint.py writes it) into the live model and optimizer.

DCP reads its ``.metadata`` with pickle and non-tensor items with ``torch.load(weights_only=False)``:
here the metadata goes through an unpickler that resolves only DCP's own metadata classes, and nothing is
stored as a non-tensor item (the optimizer's hyper-parameters live in ``complete.json``), so a tampered
directory is refused with a NodeError instead of running code.
"""

from __future__ import annotations

import io
import logging
import pickle
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from prime_node.errors import NodeError
from prime_node.ml.sharded_checkpoint import (
    ShardedCheckpoint,
    alone_is_intended,
    current_world_size,
    is_distributed,
)

log = logging.getLogger(__name__)

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}
"""What DCP's ``.metadata`` pickle may name (read off the files torch 2.13 writes), plus torch dtypes."""


def load_sharded(ckpt: ShardedCheckpoint, model: Any, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """Load ``ckpt`` into the live (possibly FSDP2-sharded) ``model`` and ``optimizer``; collective on every
    rank. Works at a world size other than the one that wrote it (DCP reshards). Returns its ``meta``;
    NodeError ``bad_checkpoint`` if the files do not fit the model or cannot be read."""
    if ckpt.world_size != current_world_size():
        log.info("resharding %s from %d to %d ranks", ckpt.path, ckpt.world_size, current_world_size())
    optimizer.zero_grad(set_to_none=True)  # lets get_state_dict create the optimizer state to load into
    model_state, optimizer_state = get_state_dict(model, optimizer)
    live_groups: list[dict[str, Any]] = list(optimizer_state["param_groups"])  # type: ignore[arg-type]
    if len(live_groups) != len(ckpt.optimizer_groups):
        raise NodeError(
            f"{ckpt.path}: {len(ckpt.optimizer_groups)} optimizer groups, not {len(live_groups)}",
            reason="bad_checkpoint",
        )
    try:
        with alone_is_intended():
            dcp_load(
                {"model": model_state, "optimizer": optimizer_state["state"]},
                storage_reader=_MetadataCheckingReader(str(ckpt.path)),
                planner=_TensorsOnlyPlanner(),
                no_dist=not is_distributed(),
            )
        for live, saved in zip(live_groups, ckpt.optimizer_groups, strict=True):
            live.update({k: _like(live.get(k), v) for k, v in saved.items()})
        set_state_dict(
            model,
            optimizer,
            model_state_dict=model_state,
            optim_state_dict=optimizer_state,
        )
    except NodeError:
        raise
    except (
        CheckpointException,
        OSError,
        RuntimeError,
        ValueError,
        KeyError,
        TypeError,
        AssertionError,
    ) as exc:
        raise NodeError(
            f"cannot load sharded checkpoint {ckpt.path}: {exc}", reason="bad_checkpoint"
        ) from exc
    return dict(ckpt.meta)


def _like(live: object, saved: object) -> object:
    """A saved hyper-parameter in the live value's type (JSON turned AdamW's ``betas`` tuple into a list)."""
    if isinstance(live, tuple) and isinstance(saved, list):
        return tuple(saved)
    return saved


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _METADATA_CLASSES
        if allowed or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which is not allowed")


def _read_dcp_metadata(handle: IO[bytes]) -> Metadata:
    try:
        metadata = _RestrictedUnpickler(handle).load()
    except Exception as exc:  # any malformed pickle: EOFError, UnpicklingError, TypeError, ...
        raise ValueError(f"unreadable checkpoint metadata: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise ValueError(f"checkpoint metadata is a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class _MetadataCheckingReader(FileSystemReader):
    """DCP's file reader with its ``.metadata`` read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(Path(self.path) / name, "rb") as handle:
            metadata = _read_dcp_metadata(handle)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """Refuses DCP's non-tensor items: loading one would be ``torch.load(weights_only=False)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise ValueError(f"checkpoint item {read_item.dest_index.fqn} is not a tensor")
