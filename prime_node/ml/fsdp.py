"""FSDP2 for the trainer: the device mesh, sharding a causal LM, and the few operations on its shards.

Parameters, gradients and AdamW state are sharded over every rank with PyTorch's own
``torch.distributed.fsdp.fully_shard`` (one FSDP unit per decoder layer plus the root, which holds the
embeddings, the final norm and the output head, so a tied head stays one parameter). A single process
is world size 1 of the same code: ``distributed.ensure_process_group`` gives it a 1-rank group.

- **Gradient reduction** sums over ranks (FSDP2's default divides by the world size): every rank's
  loss is already divided by the whole batch's completion tokens, so the sum is the 1-rank gradient.
- **Mixed precision** (``train_dtype``): "bfloat16" computes in bf16 with gradients reduced in fp32
  while the sharded master weights and AdamW moments stay fp32; "float32" computes in fp32; "auto" is
  bf16 on CUDA and fp32 on CPU (CPU bf16 matmuls are slow, and fp32 keeps CPU runs comparable).
- **Activation checkpointing** (``activation_checkpointing``): each decoder layer recomputes its
  activations in the backward pass (transformers' own per-layer checkpointing, non-reentrant, so the
  parameter names and therefore checkpoints are unchanged).
- **Built on the meta device** (``build_sharded_model``): the model is created without memory, sharded,
  and only then each rank's shards are allocated and read from the safetensors files (every rank its
  own rows), so no rank ever holds the whole model, in fp32 or otherwise.
- **Policies out, per rank**: ``write_safetensors_shards`` writes one safetensors file (the saved
  format: tied head left out) in which every rank writes its own rows: nothing is gathered, and the
  bytes are on their way to disk before the next optimizer step can change them. ``full_weights``
  gathers the whole model to rank 0 where that is really wanted (tests, tools); it never returns
  storage shared with the live parameters (at world size 1 the gather alone would).
- **Past policies and frozen copies** (``local_shards``, ``load_local_shards``, ``sharded_copy``) stay
  sharded: each rank copies its own shards, without communication.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from prime_node.errors import NodeError
from prime_node.ml.distributed import DistInfo, ensure_process_group
from prime_node.ml.model import build_empty_model, load_config, weight_files

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

TRAIN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_train_dtype(setting: str, device: str) -> torch.dtype:
    """The compute dtype for ``train_dtype`` ("auto", "float32" or "bfloat16") on ``device``."""
    if setting == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if setting not in TRAIN_DTYPES:
        raise NodeError(f"train_dtype {setting!r} is not auto, float32 or bfloat16", reason="bad_config")
    return TRAIN_DTYPES[setting]


def training_mesh(dist: DistInfo, device: str) -> DeviceMesh:
    """A 1-D mesh over every rank of the job (creating a 1-rank process group when there is none)."""
    from torch.distributed.device_mesh import init_device_mesh

    ensure_process_group(dist, device)
    return init_device_mesh(torch.device(device).type, (dist.world_size,))


def _decoder_layers(model: Any) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise NodeError(
            f"{type(model).__name__} has no model.layers: cannot shard it per decoder layer",
            reason="bad_model_dir",
        )
    return list(layers)


def shard_model(
    model: Any,
    mesh: DeviceMesh,
    *,
    compute_dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
) -> Any:
    """Shard ``model`` in place over ``mesh`` (each decoder layer, then the root) and return it.

    Every rank must hold the same full weights beforehand (each keeps its own chunk of them)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if activation_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise NodeError(
                f"{type(model).__name__} does not support activation checkpointing", reason="bad_config"
            )
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    policy = MixedPrecisionPolicy()
    if compute_dtype != torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    units = [*_decoder_layers(model), model]
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    for unit in units:
        # Sum, not FSDP's default mean: the loss is already normalised by the whole batch's tokens.
        # (A plain SUM collective: gloo has no PREMUL_SUM, which a divide factor alone would use.)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return model


def _drops_tied_head(model: Any) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False))


def _saved_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, live tensor) of everything the saved format holds: the state dict (parameters, as
    DTensors when sharded, and persistent buffers) without the tied head."""
    tied = _drops_tied_head(model)
    return [
        (name, tensor)
        for name, tensor in model.state_dict(keep_vars=True).items()
        if isinstance(tensor, torch.Tensor) and not (tied and name == "lm_head.weight")
    ]


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's rows of ``tensor`` and the index of the first (FSDP2 shards dim 0 like torch.chunk);
    a plain tensor is every rank's whole."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return tensor, 0
    placements = tensor.placements
    if len(placements) != 1 or placements[0] != Shard(0) or tensor.dim() == 0:
        raise NodeError(
            f"unsupported sharding {placements} of a {tensor.dim()}-d tensor", reason="bad_config"
        )
    local = tensor.to_local()
    mesh = tensor.device_mesh
    rows = tensor.shape[0]
    chunk = -(-rows // mesh.size())
    start = min(mesh.get_local_rank() * chunk, rows)
    if local.shape[0] != min(chunk, rows - start):
        raise RuntimeError(f"a local shard of {local.shape[0]} rows, expected {min(chunk, rows - start)}")
    return local, start


def _live_storages(model: Any) -> set[int]:
    return {_local_rows(t)[0].untyped_storage().data_ptr() for _, t in _saved_tensors(model)}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _agree(error: BaseException | None, what: str) -> None:
    """Collective: every rank raises NodeError if any rank failed (none is left waiting in a collective
    the others have left)."""
    import torch.distributed as dist

    failed = torch.tensor([0 if error is None else 1 + _rank()], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":  # NCCL reduces device tensors only
            failed = failed.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if int(failed) == 0:
        return
    if error is not None:
        raise NodeError(f"{what}: {error}", reason="checkpoint_failed") from error
    raise NodeError(f"{what}: rank {int(failed) - 1} failed", reason="checkpoint_failed")


def materialize(model: Any, device: str) -> None:
    """Allocate a meta-device (sharded) model's storage on ``device``, keeping its buffers' values
    (``to_empty`` leaves every tensor uninitialised; non-persistent buffers are not in checkpoints)."""
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])


def build_sharded_model(
    model_dir: Path,
    mesh: DeviceMesh,
    *,
    device: str,
    compute_dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
) -> Any:
    """The model of ``model_dir`` sharded over ``mesh`` in fp32: built on the meta device, sharded,
    then each rank allocates and reads only its own rows of the safetensors files (1/N of the weights
    per rank; nothing is broadcast). NodeError ``bad_model_dir`` for anything the files get wrong."""
    config = load_config(model_dir)
    files = weight_files(model_dir)
    model = build_empty_model(config)
    shard_model(model, mesh, compute_dtype=compute_dtype, activation_checkpointing=activation_checkpointing)
    materialize(model, device)
    load_safetensors_shards(model, files)
    return model


_FLOATS = {"F64", "F32", "F16", "BF16"}


def load_safetensors_shards(model: Any, files: dict[str, Path]) -> None:
    """Fill each rank's shards of ``model`` (saved-format names) from ``files`` (tensor name → the
    safetensors file holding it, ``model.weight_files``), reading only this rank's rows. Tensors the
    model does not have (a tied head) are ignored; a missing tensor, a shape or dtype that does not fit,
    or an unreadable file is a NodeError ``bad_model_dir``."""
    from safetensors import SafetensorError, safe_open

    wanted = _saved_tensors(model)
    missing = sorted(name for name, _ in wanted if name not in files)
    if missing:
        raise NodeError(f"the weights lack {', '.join(missing[:5])}", reason="bad_model_dir")
    by_file: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in wanted:
        by_file.setdefault(files[name], []).append((name, tensor))
    for path, tensors in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as handle, torch.no_grad():
                for name, tensor in tensors:
                    part = handle.get_slice(name)
                    if list(part.get_shape()) != list(tensor.shape):
                        raise NodeError(
                            f"{name} in {path} has shape {part.get_shape()}, the model {list(tensor.shape)}",
                            reason="bad_model_dir",
                        )
                    if (part.get_dtype() in _FLOATS) != tensor.is_floating_point():
                        raise NodeError(f"{name} in {path} is {part.get_dtype()}", reason="bad_model_dir")
                    local, start = _local_rows(tensor)
                    if local.numel():
                        local.copy_(part[start : start + local.shape[0]] if tensor.dim() else part[...])
        except (OSError, SafetensorError) as exc:
            raise NodeError(f"unreadable weights {path}: {exc}", reason="bad_model_dir") from exc


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def write_safetensors_shards(model: Any, path: Path, *, dtype: torch.dtype | None = None) -> None:
    """Collective: ``path`` becomes a safetensors file of the model in the saved format (tied head left
    out; floating tensors in ``dtype``, default as they are), readable by ``safetensors`` and
    transformers. Rank 0 writes the header and sizes the file, then every rank writes its own rows at
    their offsets: no gather, no rank holds more than one converted shard at a time, and the file
    has the weights of this moment whatever the optimizer does next. It appears under ``path`` (a
    rename) only once every rank has written; on a failure of any rank every rank raises NodeError.
    The ranks must share the file system (as for ``sharded_checkpoint``)."""

    def kind_of(tensor: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype

    # Widest dtypes first (as safetensors orders them): every tensor starts aligned to its item size.
    tensors = sorted(_saved_tensors(model), key=lambda item: -kind_of(item[1]).itemsize)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets: list[int] = []
    end = 0
    for name, tensor in tensors:
        kind = kind_of(tensor)
        size = tensor.numel() * kind.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[kind],
            "shape": list(tensor.shape),
            "data_offsets": [end, end + size],
        }
        offsets.append(end)
        end += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    data_start = 8 + len(encoded)
    temp = path.with_name(path.name + ".tmp")
    error: BaseException | None = None
    if _rank() == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(temp, "wb") as handle:
                handle.write(struct.pack("<Q", len(encoded)) + encoded)
                handle.truncate(data_start + end)
        except OSError as exc:
            error = exc
    _agree(error, f"creating {temp}")
    try:
        fd = os.open(temp, os.O_WRONLY)
        try:
            for (_, tensor), offset in zip(tensors, offsets, strict=True):
                local, start = _local_rows(tensor)
                if local.numel() == 0 or (start == 0 and local is tensor and _rank() != 0):
                    continue  # nothing here, or a whole (unsharded) tensor rank 0 writes
                kind = kind_of(tensor)
                rows = local.detach().to(device="cpu", dtype=kind).contiguous()
                row_bytes = rows[0].numel() * kind.itemsize if rows.dim() else 0
                raw = rows.reshape(-1).view(torch.uint8).numpy().data
                _pwrite_all(fd, raw, data_start + offset + start * row_bytes)
        finally:
            os.close(fd)  # on a network file system, close hands the bytes to the server
    except OSError as exc:
        error = exc
    _agree(error, f"writing {temp}")
    if _rank() == 0:
        try:
            os.replace(temp, path)
        except OSError as exc:
            error = exc
    _agree(error, f"publishing {path}")


def full_weights(model: Any, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Collective: the whole model as CPU tensors on rank 0 (saved format: tied head left out;
    floating tensors in ``dtype``, default as they are); an empty dict on the other ranks.

    Never storage shared with the live parameters: at world size 1 gathering a shard returns the
    shard itself (and moving a CPU tensor to the CPU is no copy), so such a tensor is cloned; at
    larger world sizes the gather has made new tensors already and nothing is copied twice."""
    from torch.distributed.tensor import DTensor

    live = _live_storages(model)
    out: dict[str, torch.Tensor] = {}
    main = _rank() == 0
    for name, tensor in _saved_tensors(model):
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # collective per tensor
        if not main:
            continue
        kind = dtype if dtype is not None and full.is_floating_point() else full.dtype
        full = full.detach().to(device="cpu", dtype=kind).contiguous()
        if full.untyped_storage().data_ptr() in live:
            full = full.clone()
        out[name] = full
    return out


def local_shards(model: Any) -> dict[str, torch.Tensor]:
    """Copies of this rank's shards of every parameter (saved-format names): a past policy at 1/N of
    the weights per rank, never sharing storage with the parameters the optimizer updates."""
    return {name: _local_rows(t)[0].detach().clone() for name, t in _saved_tensors(model)}


def load_local_shards(model: Any, shards: dict[str, torch.Tensor]) -> None:
    """``local_shards`` of a model sharded the same way into ``model`` (no communication)."""
    tensors = _saved_tensors(model)
    if {name for name, _ in tensors} != shards.keys():
        raise NodeError("the shards do not fit the model", reason="bad_checkpoint")
    with torch.no_grad():
        for name, tensor in tensors:
            _local_rows(tensor)[0].copy_(shards[name])


def sharded_copy(model: Any, *, compute_dtype: torch.dtype = torch.float32) -> Any:
    """A frozen copy of the sharded ``model`` (same mesh, same shards; eval mode), built on the meta
    device and filled from this rank's own shards: 1/N of the weights per rank, no communication."""
    from torch.distributed.tensor import DTensor

    first = next(model.parameters())
    if not isinstance(first, DTensor):
        raise NodeError("sharded_copy needs a sharded model", reason="bad_config")
    copy = build_empty_model(model.config)
    shard_model(copy, first.device_mesh, compute_dtype=compute_dtype)
    materialize(copy, str(first.to_local().device))
    load_local_shards(copy, {name: _local_rows(t)[0] for name, t in _saved_tensors(model)})
    with torch.no_grad():
        source = dict(model.named_buffers())
        for name, buffer in copy.named_buffers():
            buffer.copy_(source[name])
    return copy.eval()


def clip_gradients(model: Any, max_norm: float) -> float:
    """Collective: clip the global gradient norm over every rank's shards; the norm before clipping."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def local_state_bytes(model: Any, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's shards of the parameters, their gradients and the optimizer state."""
    from torch.distributed.tensor import DTensor

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    total = 0
    for param in model.parameters():
        total += local(param).nbytes
        if param.grad is not None:
            total += local(param.grad).nbytes
    for state in optimizer.state.values():
        total += sum(local(v).nbytes for v in state.values() if isinstance(v, torch.Tensor))
    return total
