"""How much GPU memory generation needs, and the largest generation batch that fits (pure arithmetic).

An inferer on a GPU plans before it loads the model: weights, plus per sample a KV cache of
``(prompt + max new tokens) x layers x kv heads x head dim x 2 (K and V) x dtype bytes``, plus the
activations of one layer's forward over the prompt and the float32 logits of the last position
(``vocab x 4`` bytes) in decode. When the run's batch does not fit, the inferer generates it in smaller
chunks (each sample is seeded on its own, so the samples do not change); when not even one sample fits
it refuses with the numbers and the fix. The estimate is an upper bound in spirit, not a promise: the
OOM retry (``prime_node.ml.oom_retry``) covers what it misses.

A validator plans its prefills the same way (``plan_prefill``): the samples it re-checks go through one
forward in chunks sized to the memory left beside the policies it holds.

``doctor`` prints the generation plan. No torch here: the model's shape comes from its ``config.json`` and the
safetensors headers (parameter counts, without reading the weights).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from prime_node.errors import NodeError
from prime_node.ml.sampling import replay_chunk_rows

DTYPE_BYTES: Final = {"float32": 4, "bfloat16": 2, "float16": 2}
LOGIT_BYTES: Final = 4
"""Logits are upcast to float32 before the sampling rule sees them (``ml/engine.py``)."""
SAMPLING_BYTES_PER_LOGIT: Final = 32
"""Device bytes per (sample, vocabulary entry) of ``sampling.gumbel_noise_torch`` and the float64 scores:
four [batch, vocab] 8-byte tensors live at once. Measured on an H200 (docs/gpu.md): the 0.6b shape
(151,936-token vocabulary) generating 256 + 128 tokens peaked at 4.68 GiB for 64 samples and 13.77 GiB
for 256; without this term the plan (its reserve left out) was 0.59 and 0.76 GiB short, with it and the
reserve it plans 4.87 and 14.66 GiB."""
RESERVE_BYTES: Final = 512 << 20
"""Kept free beyond the estimate: the CUDA context, cuBLAS workspaces, allocator fragmentation."""
MAX_HEADER_BYTES: Final = 64 << 20
GIB: Final = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: parameter count and the sizes its KV cache and logits scale with."""

    params: int
    hidden_size: int
    intermediate_size: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any], params: int) -> ModelShape:
        """From a Hugging Face ``config.json`` (``head_dim`` and ``num_key_value_heads`` default as in
        transformers: hidden / heads, and the attention heads)."""
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            kv_value = config.get("num_key_value_heads")
            head_value = config.get("head_dim")
            return cls(
                params=params,
                hidden_size=hidden,
                intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
                layers=int(config["num_hidden_layers"]),
                kv_heads=int(kv_value) if kv_value is not None else heads,
                head_dim=int(head_value) if head_value is not None else hidden // max(1, heads),
                vocab=int(config["vocab_size"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise NodeError(f"config.json lacks a model size field: {exc}", reason="bad_model_dir") from exc


@dataclass(frozen=True)
class GenerationSettings:
    """The run's settings that size generation: one batch of ``batch`` samples."""

    batch: int
    prompt_tokens: int
    """The longest prompt of the batch (or an estimate of it)."""
    max_new_tokens: int
    dtype: str = "float32"

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_new_tokens


def weights_bytes(shape: ModelShape, settings: GenerationSettings) -> int:
    return shape.params * settings.dtype_bytes


def kv_cache_bytes(shape: ModelShape, settings: GenerationSettings, batch: int) -> int:
    """K and V of every layer for every position a sample reaches."""
    return batch * settings.tokens * shape.layers * shape.kv_heads * shape.head_dim * 2 * settings.dtype_bytes


def activation_bytes(shape: ModelShape, settings: GenerationSettings, batch: int) -> int:
    """The peak beside the cache: one layer's forward over the prompt (its input, q/k/v/attention output
    and the MLP's two intermediate tensors), the last position's float32 logits in decode, and the seeded
    sampling rule's working set on the device (float64 scores and the int64 hash of every vocabulary
    entry: ``SAMPLING_BYTES_PER_LOGIT``), and the float32 final hidden states of every generated token,
    which stay on the device for the proof."""
    layer = batch * settings.prompt_tokens * (4 * shape.hidden_size + 2 * shape.intermediate_size)
    per_logit = LOGIT_BYTES + SAMPLING_BYTES_PER_LOGIT
    hidden = batch * settings.max_new_tokens * shape.hidden_size * 4
    return layer * settings.dtype_bytes + batch * shape.vocab * per_logit + hidden


def needed_bytes(shape: ModelShape, settings: GenerationSettings, batch: int) -> int:
    """Everything generation of ``batch`` samples holds at its peak, the reserve included."""
    return (
        weights_bytes(shape, settings)
        + kv_cache_bytes(shape, settings, batch)
        + activation_bytes(shape, settings, batch)
        + RESERVE_BYTES
    )


def prefill_sample_bytes(shape: ModelShape, settings: GenerationSettings) -> int:
    """One sample's share of a validation prefill over ``settings.tokens`` positions (no KV cache kept):
    one layer's forward over all of them, the final hidden states in the model's dtype, and its
    completion rows' hidden states upcast to float32, which stay on the device for the proof check."""
    layer = settings.tokens * (4 * shape.hidden_size + 2 * shape.intermediate_size) * settings.dtype_bytes
    final = settings.tokens * shape.hidden_size * settings.dtype_bytes
    return layer + final + settings.max_new_tokens * shape.hidden_size * 4


def replay_bytes(shape: ModelShape, settings: GenerationSettings) -> int:
    """The validator's replay of one chunk of positions (``sampling.replay_in_chunks``): the head's logits
    in the model's dtype and in float32, and the seeded rule's float64 working set, ``replay_chunk_rows``
    rows of the vocabulary (never more rows than a completion has)."""
    rows = min(settings.max_new_tokens, replay_chunk_rows(shape.vocab))
    return rows * shape.vocab * (settings.dtype_bytes + LOGIT_BYTES + SAMPLING_BYTES_PER_LOGIT)


def plan_prefill(shape: ModelShape, settings: GenerationSettings, available_bytes: int) -> int:
    """How many of ``settings.batch`` samples one validation prefill takes at once on a device with
    ``available_bytes`` free beside the already loaded weights: at least 1 (a sample that does not fit is
    the OOM retry's to report, with its numbers), at most the batch. The replay after it holds one chunk of
    positions' logits at a time (``replay_bytes``), which is set aside first."""
    spare = available_bytes - RESERVE_BYTES - replay_bytes(shape, settings)
    per_sample = max(1, prefill_sample_bytes(shape, settings))
    return max(1, min(settings.batch, spare // per_sample))


def _gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"


@dataclass(frozen=True)
class VramPlan:
    """The plan for one device: the batch that fits (0: not even one sample) and the numbers behind it."""

    device: str
    available_bytes: int
    wanted_batch: int
    batch: int
    weights_bytes: int
    per_sample_bytes: int
    needed_bytes: int
    """What ``batch`` samples need (one sample's when ``batch`` is 0)."""

    @property
    def fits(self) -> bool:
        return self.batch >= 1

    @property
    def shrunk(self) -> bool:
        return 1 <= self.batch < self.wanted_batch

    def describe(self) -> str:
        """One line for logs and ``doctor``."""
        head = (
            f"{self.device}: {_gib(self.available_bytes)} free; weights {_gib(self.weights_bytes)}, "
            f"{_gib(self.per_sample_bytes)} per sample (KV cache and activations)"
        )
        if not self.fits:
            return f"{head}: not even one sample fits (needs {_gib(self.needed_bytes)})"
        if self.shrunk:
            return (
                f"{head}: generates in chunks of {self.batch} of the run's {self.wanted_batch} samples "
                f"(needs {_gib(self.needed_bytes)})"
            )
        return f"{head}: the run's {self.wanted_batch} samples fit (needs {_gib(self.needed_bytes)})"

    def require(self) -> int:
        """The batch to generate in; NodeError ``vram_too_small`` (the numbers, the fix) when none fits."""
        if not self.fits:
            raise NodeError(
                f"the model does not fit on {self.device}: {self.describe()}; use a GPU with at least "
                f"{_gib(self.needed_bytes)} free (close what else runs on it), or pass --gpu none to "
                "validate or seed on the CPU",
                reason="vram_too_small",
            )
        return self.batch


def plan_generation(
    shape: ModelShape, settings: GenerationSettings, available_bytes: int, *, device: str = "cuda"
) -> VramPlan:
    """The largest batch of at most ``settings.batch`` samples whose ``needed_bytes`` fit in
    ``available_bytes`` (never more than the run asks: the batch is only ever split, never resampled)."""
    weights = weights_bytes(shape, settings)
    per_sample = kv_cache_bytes(shape, settings, 1) + activation_bytes(shape, settings, 1)
    spare = available_bytes - weights - RESERVE_BYTES
    batch = max(0, min(settings.batch, spare // per_sample if per_sample else settings.batch))
    return VramPlan(
        device=device,
        available_bytes=available_bytes,
        wanted_batch=settings.batch,
        batch=batch,
        weights_bytes=weights,
        per_sample_bytes=per_sample,
        needed_bytes=needed_bytes(shape, settings, max(1, batch)),
    )


def safetensors_params(path: Path) -> int:
    """Parameters in one safetensors file, from its header (the weights are not read)."""
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > MAX_HEADER_BYTES:
                raise ValueError(f"header of {length} bytes")
            header = json.loads(handle.read(length))
        return sum(
            math.prod(int(d) for d in entry["shape"])
            for name, entry in header.items()
            if name != "__metadata__"
        )
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError) as exc:
        raise NodeError(f"unreadable safetensors header in {path}: {exc}", reason="bad_model_dir") from exc


def model_shape(model_dir: Path) -> ModelShape:
    """The shape of the model in ``model_dir`` (Hugging Face layout)."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise NodeError(f"cannot read {model_dir / 'config.json'}: {exc}", reason="bad_model_dir") from exc
    if not isinstance(config, dict):
        raise NodeError(f"{model_dir / 'config.json'} is not a JSON object", reason="bad_model_dir")
    params = sum(safetensors_params(p) for p in sorted(model_dir.glob("*.safetensors")))
    return ModelShape.from_config(config, params)
