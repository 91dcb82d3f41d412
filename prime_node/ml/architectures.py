"""Named model shapes (``--arch qwen3 --size tiny|small|0.6b``) and the models and tokenizers built from
them.

A shape is a real architecture's config: Qwen3 is grouped-query attention, rotary position embeddings,
RMSNorm (including Qwen3's per-head RMSNorm on queries and keys) and a SwiGLU MLP, built by transformers'
own ``Qwen3ForCausalLM``, so a directory written here loads with the Auto classes like a hub checkpoint
and exercises the code paths a full-size Qwen3 run takes. ``tiny`` and ``small`` are small sizes for tests
and benchmarks; ``0.6b`` is Qwen3-0.6B's own shape (its config.json on the hub: hidden 1024, 28 layers,
MLP 3072, 16 query / 8 key-value heads of 128, tied head, rope theta 1e6, 40,960 positions).

Head: ``tiny`` and ``0.6b`` tie the output head to the embeddings (as Qwen3-0.6B to 4B do) and ``small``
unties it (as Qwen3-8B and larger do). With a 4K vocabulary tying would save only 1.6M of ~16M
parameters, and between the sizes the trainer, the FSDP sharding and the full-state-dict gather are
tested on both layouts real checkpoints come in.

Vocabulary: each shape has its own size (``0.6b``: Qwen3's 151,936), and ``vocab_size`` overrides it. The
model's embedding has exactly as many rows as the tokenizer has ids: the project's BPE is trained on the
packaged corpus up to that size and filled with reserved ids past what the corpus supports
(``prime_node.ml.bpe_tokenizer``), so every id a model can sample is a token.

Dtype: a shape names the dtype its checkpoints are written in (``0.6b``: bfloat16, as Qwen3 ships; the
small ones float32). Weights are initialised in float32 with the seed and then cast, so a bfloat16
directory holds the float32 model rounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prime_node.errors import NodeError
from prime_node.ml.bpe_tokenizer import MAX_VOCAB, MIN_VOCAB, train_bpe_tokenizer
from prime_node.ml.model import DTYPES, save_model_dir


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
    dtype: str = "float32"
    """The dtype its checkpoints are written in unless told otherwise (``init-model --dtype auto``)."""

    def parameters(self, vocab_size: int | None = None) -> int:
        """Exactly what ``parameter_count`` of the built model says, at ``vocab_size`` (default: the
        shape's) and without building it: the embedding (twice when the head is untied), per layer the
        q/k/v/o projections, the per-head q/k norms, the SwiGLU MLP and two RMSNorms, and the final norm."""
        vocab = self.vocab_size if vocab_size is None else vocab_size
        hidden, heads, kv_heads, head_dim = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        attention = hidden * head_dim * (2 * heads + 2 * kv_heads) + 2 * head_dim
        layer = attention + 3 * hidden * self.intermediate_size + 2 * hidden
        embeddings = vocab * hidden * (1 if self.tie_embeddings else 2)
        return embeddings + self.num_layers * layer + hidden


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
    # Qwen3-0.6B: 596M parameters at its 151,936-token vocabulary (440M of them outside the embedding),
    # 444.6M at a 4,096-token one.
    ("qwen3", "0.6b"): ModelShape(
        vocab_size=MAX_VOCAB,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        tie_embeddings=True,
        max_positions=40_960,
        dtype="bfloat16",
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


def checked_vocab(shape: ModelShape, vocab_size: int | None) -> int:
    """``vocab_size`` (None: the shape's), or NodeError ``bad_flag`` with the range when it is out of it."""
    vocab = shape.vocab_size if vocab_size is None else vocab_size
    if not MIN_VOCAB <= vocab <= MAX_VOCAB:
        raise NodeError(
            f"--vocab {vocab}: choose {MIN_VOCAB} (256 bytes + specials) to {MAX_VOCAB} (Qwen3's vocabulary)",
            reason="bad_flag",
        )
    return vocab


def checked_dtype(shape: ModelShape, dtype: str | None) -> str:
    """``dtype`` in the long spelling (bf16/fp32 accepted; None or "auto": the shape's), or NodeError."""
    names = {"bf16": "bfloat16", "fp32": "float32", **{name: name for name in DTYPES}}
    if dtype is None or dtype == "auto":
        return shape.dtype
    if dtype not in names:
        raise NodeError(f"--dtype {dtype!r}: use auto, bf16 or fp32", reason="bad_flag")
    return names[dtype]


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


def create_model(
    arch: str,
    size: str,
    seed: int,
    *,
    vocab_size: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
) -> tuple[Any, Any]:
    """A freshly initialised (model, tokenizer) pair in eval mode, ``vocab_size`` ids (None: the shape's),
    weights in ``dtype``; the same ``seed`` gives the same weights and the same vocabulary in any process
    on one machine. The global torch RNG is left as it was. ``device="meta"`` builds the model without
    memory or initialisation (its shapes and config only: parameter counts, checks)."""
    import torch
    from transformers import Qwen3ForCausalLM

    shape = model_shape(arch, size)
    tokenizer = train_bpe_tokenizer(checked_vocab(shape, vocab_size))
    config = model_config(shape, tokenizer)
    torch_dtype = getattr(torch, checked_dtype(shape, dtype))
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.random.set_rng_state(rng_state)
    model.to(torch_dtype)  # cast after a float32 initialisation: one seed, one model, in every dtype
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval()  # type: ignore[no-untyped-call]
    return model, tokenizer


def write_model_dir(
    arch: str,
    size: str,
    seed: int,
    out_dir: Path,
    *,
    vocab_size: int | None = None,
    dtype: str = "float32",
) -> Path:
    """Create the model and write it as a Hugging Face directory (safetensors in ``dtype``, tokenizer with
    its chat template in tokenizer_config.json); returns ``out_dir``."""
    model, tokenizer = create_model(arch, size, seed, vocab_size=vocab_size, dtype=dtype)
    save_model_dir(model, tokenizer, out_dir)
    return out_dir
