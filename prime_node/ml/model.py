"""Tiny Qwen2-style character models built from a config, and loading any model from a local HF directory.

A model directory is the Hugging Face layout (config.json, generation_config.json, tokenizer.json,
model.safetensors): what ``init-model --tiny`` writes is loaded by exactly the code that would load a
real checkpoint. Weights are only ever read from safetensors, never from pickle files.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prime_node.bounded_json import loads_bounded
from prime_node.errors import NodeError
from prime_node.ml.tokenizer import build_char_tokenizer

if TYPE_CHECKING:
    import torch

_LOAD_LOCK = threading.Lock()


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny model. The default (~0.12M parameters) learns two-digit addition on 2 cores."""

    hidden_size: int = 64
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 512


def tiny_config(vocab_size: int, eos_token_id: int, pad_token_id: int, spec: TinySpec = TinySpec()) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        use_sliding_window=False,
    )


def create_tiny_model(seed: int, spec: TinySpec = TinySpec()) -> tuple[Any, Any]:
    """A freshly initialised (model, tokenizer) pair; deterministic in ``seed``."""
    import torch
    from transformers import Qwen2ForCausalLM

    tokenizer = build_char_tokenizer()
    config = tiny_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, spec)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.eval()  # type: ignore[no-untyped-call]
    return model, tokenizer


def save_model_dir(model: Any, tokenizer: Any, out_dir: Path) -> None:
    """Write an HF-format directory (safetensors weights). Overwrites files of the same name."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    # A chat template goes into tokenizer_config.json (not chat_template.jinja): one file says it all.
    tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)


DTYPES = ("float32", "bfloat16")
"""The dtypes a model is loaded in for inference or training (``--dtype``)."""


def load_model(model_dir: Path, *, device: str = "cpu", dtype: str = "float32") -> Any:
    """Load a causal LM from a local HF directory in ``dtype`` (one of DTYPES), refusing pickle
    weight files."""
    if dtype not in DTYPES:
        raise NodeError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}", reason="bad_config")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    check_model_dir(model_dir)
    try:
        with _LOAD_LOCK:  # from_pretrained swaps process-wide init state (meta device): one at a time
            model: Any = AutoModelForCausalLM.from_pretrained(  # type: ignore[arg-type, unused-ignore]
                str(model_dir), local_files_only=True, use_safetensors=True, dtype=dtype
            )
    except (OSError, ValueError, KeyError) as exc:
        raise NodeError(f"cannot load a model from {model_dir}: {exc}", reason="bad_model_dir") from exc
    model.to(device)
    model.eval()
    return model


def check_model_dir(model_dir: Path) -> None:
    """A clear NodeError when a directory is not a loadable model (before transformers' long errors)."""
    if not model_dir.is_dir():
        raise NodeError(f"model directory {model_dir} does not exist", reason="bad_model_dir")
    if not (model_dir / "config.json").is_file():
        raise NodeError(
            f"{model_dir} has no config.json: not a Hugging Face model directory", reason="bad_model_dir"
        )
    if not any(model_dir.glob("*.safetensors")):
        raise NodeError(
            f"{model_dir} has no .safetensors weights (pickle weights are refused)", reason="bad_model_dir"
        )


_INDEX = "model.safetensors.index.json"
_MAX_INDEX_BYTES = 64 << 20


def load_config(model_dir: Path) -> Any:
    """The transformers config of a local HF directory (NodeError ``bad_model_dir`` if unreadable)."""
    from transformers import AutoConfig

    check_model_dir(model_dir)
    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise NodeError(f"cannot read the config of {model_dir}: {exc}", reason="bad_model_dir") from exc


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside is put on the meta device (no memory); buffers stay real, so
    non-persistent ones that checkpoints do not hold (rotary ``inv_freq``) keep their computed values."""
    import torch

    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":  # re-registering a tied one keeps it tied
            moved = module._parameters[name]
            assert moved is not None
            module._parameters[name] = type(moved)(moved.to("meta"), requires_grad=moved.requires_grad)

    setattr(torch.nn.Module, "register_parameter", register)  # noqa: B010 (a deliberate patch)
    try:
        yield
    finally:
        setattr(torch.nn.Module, "register_parameter", original)  # noqa: B010


def build_empty_model(config: Any) -> Any:
    """The causal LM of ``config`` in float32 with every parameter on the meta device (no weights read,
    no memory spent): the FSDP2 trainer shards it first and only then materialises and fills each rank's
    shards (``fsdp.build_sharded_model``), so no rank ever holds the whole model."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with _LOAD_LOCK, _parameters_on_meta():  # process-wide patch: one build at a time
            model: Any = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, dtype=torch.float32
            )
    except (ValueError, KeyError, TypeError) as exc:
        raise NodeError(f"cannot build a model from its config: {exc}", reason="bad_model_dir") from exc
    model.eval()
    return model


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Which safetensors file of ``model_dir`` holds each tensor: the index's ``weight_map`` for a
    split checkpoint, else every tensor is in ``model.safetensors``. Names and files come from disk:
    a file outside the directory, a missing one or a malformed index is a NodeError ``bad_model_dir``."""
    index = model_dir / _INDEX
    single = model_dir / "model.safetensors"
    if not index.is_file():
        if not single.is_file():
            raise NodeError(f"{model_dir} has no model.safetensors", reason="bad_model_dir")
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(single), framework="pt") as handle:
                return dict.fromkeys(handle.keys(), single)
        except (OSError, SafetensorError) as exc:
            raise NodeError(f"unreadable weights {single}: {exc}", reason="bad_model_dir") from exc
    try:
        if index.stat().st_size > _MAX_INDEX_BYTES:
            raise ValueError("too large")
        weight_map = loads_bounded(index.read_bytes())["weight_map"]
        if not isinstance(weight_map, dict):
            raise ValueError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise NodeError(f"malformed {index}: {exc}", reason="bad_model_dir") from exc
    files: dict[str, Path] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or not file.endswith(".safetensors"):
            raise NodeError(f"{index} names {file!r}: not a file of the directory", reason="bad_model_dir")
        if not (model_dir / file).is_file():
            raise NodeError(f"{index} names {file}, which is missing", reason="bad_model_dir")
        files[str(name)] = model_dir / file
    return files


def parameter_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def state_dict_copy(model: Any) -> dict[str, torch.Tensor]:
    """A detached copy of the weights (tied weights appear under each name)."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
