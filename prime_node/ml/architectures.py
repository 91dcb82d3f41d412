"""Named model shapes (``--arch qwen3 --size tiny|small``) and the models and tokenizers built from them.

A shape is a real architecture's config at a small size: Qwen3 is grouped-query attention, rotary
position embeddings, RMSNorm (including Qwen3's per-head RMSNorm on queries and keys) and a SwiGLU MLP,
built by transformers' own ``Qwen3ForCausalLM``, so a directory written here loads with the Auto classes
like a hub checkpoint and exercises the code paths a full-size Qwen3 run takes.

Head: ``tiny`` ties the output head to the embeddings (as Qwen3-0.6B to 4B do) and ``small`` unties it
(as Qwen3-8B and larger do). With a 4K vocabulary tying would save only 1.6M of ~16M parameters, and
between the two sizes the trainer, the FSDP sharding and the full-state-dict gather are tested on both
layouts real checkpoints come in.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prime_node.errors import NodeError
from prime_node.ml.bpe_tokenizer import train_bpe_tokenizer
from prime_node.ml.model import save_model_dir


@dataclass(frozen=True)
class ModelShape:
    """The size of one named model (everything else is the architecture's default)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_embeddings: bool
    max_positions: int
    rope_theta: float = 1_000_000.0


SHAPES: dict[tuple[str, str], ModelShape] = {
    # ~0.26M parameters: fast enough for every test that needs a real forward pass.
    ("qwen3", "tiny"): ModelShape(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=192,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_embeddings=True,
        max_positions=1024,
    ),
    # ~16M parameters: the model the FSDP benchmark and the dtype calibration run on.
    ("qwen3", "small"): ModelShape(
        vocab_size=4096,
        hidden_size=384,
        intermediate_size=1024,
        num_layers=8,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        tie_embeddings=False,
        max_positions=4096,
    ),
}

ARCHES = tuple(sorted({arch for arch, _ in SHAPES}))
SIZES = tuple(size for arch, size in SHAPES if arch == ARCHES[0])


def model_shape(arch: str, size: str) -> ModelShape:
    shape = SHAPES.get((arch, size))
    if shape is None:
        known = ", ".join(f"{a}/{s}" for a, s in SHAPES)
        raise NodeError(f"no model {arch!r} of size {size!r} (known: {known})", reason="bad_flag")
    return shape


def model_config(shape: ModelShape, tokenizer: Any) -> Any:
    """The transformers ``Qwen3Config`` of ``shape``, its vocabulary and specials from ``tokenizer``."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=shape.tie_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        use_sliding_window=False,
    )


def create_model(arch: str, size: str, seed: int) -> tuple[Any, Any]:
    """A freshly initialised (model, tokenizer) pair in eval mode; the same ``seed`` gives the same
    weights and the same vocabulary in any process on one machine. The global torch RNG is left as
    it was."""
    import torch
    from transformers import Qwen3ForCausalLM

    shape = model_shape(arch, size)
    tokenizer = train_bpe_tokenizer(shape.vocab_size)
    config = model_config(shape, tokenizer)
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    finally:
        torch.random.set_rng_state(rng_state)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval()  # type: ignore[no-untyped-call]
    return model, tokenizer


def write_model_dir(arch: str, size: str, seed: int, out_dir: Path) -> Path:
    """Create the model and write it as a Hugging Face directory (safetensors, tokenizer with its chat
    template in tokenizer_config.json); returns ``out_dir``."""
    model, tokenizer = create_model(arch, size, seed)
    save_model_dir(model, tokenizer, out_dir)
    return out_dir
