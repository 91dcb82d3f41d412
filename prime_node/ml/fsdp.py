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
- **Full state**: the weights the swarm shares are gathered to rank 0 as one CPU state dict
  (``full_weights``); policies are loaded back the other way (``load_full_weights``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from prime_node.errors import NodeError
from prime_node.ml.distributed import DistInfo, ensure_process_group

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


def full_weights(model: Any) -> dict[str, torch.Tensor]:
    """Collective: the whole model as CPU tensors on rank 0 (tied head left out, the saved format of
    ``checkpoint.model_weights``); an empty dict on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    tied = _drops_tied_head(model)
    return {
        name: tensor.contiguous()
        for name, tensor in state.items()
        if isinstance(tensor, torch.Tensor) and not (tied and name == "lm_head.weight")
    }


def load_full_weights(model: Any, weights: dict[str, torch.Tensor] | None) -> None:
    """Collective: rank 0's ``weights`` (saved format, tied head optional) into the sharded ``model``;
    the other ranks pass None."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state: dict[str, Any] = dict(weights or {})
    if state and _drops_tied_head(model) and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    set_model_state_dict(
        model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )


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
