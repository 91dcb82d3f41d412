"""The one place an inference engine is built, and what each engine family is calibrated as.

Every role builds its engine through ``setup_engine`` (a model already in memory) or ``load_engine`` (a
model directory), naming the family the run config's ``engine`` field gives; adding a backend (vLLM on
a GPU, a bf16 torch engine) means one entry in ``_BACKENDS`` and, for validators, one calibrated entry in
``crypto.toploc.CALIBRATED_THRESHOLDS`` keyed by the family and the dtype the engine computes in.

Importing this module does not import torch: the backend is imported when an engine is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from crypto.toploc import CALIBRATED_THRESHOLDS, Thresholds
from prime_node.errors import NodeError
from prime_node.ml.engine import TorchEngine
from prime_node.ml.model import load_model

DEFAULT_ENGINE: Final = "torch"
"""The family of ``RunConfig.engine``'s default, for the few callers that hold a model but no config."""


@dataclass(frozen=True)
class EngineSpec:
    """An engine family and the dtype it computes in: the key of everything calibrated per engine."""

    family: str
    dtype: str

    def toploc_thresholds(self) -> Thresholds:
        """The TOPLOC acceptance bounds calibrated on honest runs of this engine; NodeError
        ``uncalibrated_engine`` when there are none (a validator must not guess them)."""
        found = CALIBRATED_THRESHOLDS.get((self.family, self.dtype))
        if found is None:
            raise NodeError(
                f"no TOPLOC thresholds are calibrated for engine {self.family!r} in {self.dtype}; "
                "run benchmarks/toploc.py on it and add them to crypto.toploc.CALIBRATED_THRESHOLDS",
                reason="uncalibrated_engine",
            )
        return found


def _build_torch(model: Any, tokenizer: Any, policy_step: int) -> TorchEngine:
    return TorchEngine(
        model,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        policy_step=policy_step,
    )


# family -> (its spec, how to wrap a loaded model). ``prime_node.ml.model.load_model`` loads in float32.
_BACKENDS: Mapping[str, tuple[EngineSpec, Callable[[Any, Any, int], TorchEngine]]] = MappingProxyType(
    {"torch": (EngineSpec("torch", "float32"), _build_torch)}
)


def engine_spec(family: str) -> EngineSpec:
    """The spec of engine family ``family``; NodeError ``unknown_engine`` for a family we cannot build."""
    backend = _BACKENDS.get(family)
    if backend is None:
        known = ", ".join(sorted(_BACKENDS))
        raise NodeError(f"unknown inference engine {family!r} (known: {known})", reason="unknown_engine")
    return backend[0]


def setup_engine(
    model: Any, tokenizer: Any, *, engine: str = DEFAULT_ENGINE, policy_step: int = 0
) -> TorchEngine:
    """An engine of family ``engine`` over ``model`` (already loaded), stopping at the tokenizer's EOS
    and padding with its pad token, reporting ``policy_step`` as the policy it holds."""
    engine_spec(engine)
    return _BACKENDS[engine][1](model, tokenizer, policy_step)


def load_engine(
    model_dir: Path,
    tokenizer: Any,
    *,
    engine: str = DEFAULT_ENGINE,
    device: str = "cpu",
    policy_step: int = 0,
) -> TorchEngine:
    """``setup_engine`` over the model in ``model_dir`` (Hugging Face layout, safetensors only). The
    family is checked before the model is read, so a bad config fails without loading weights."""
    engine_spec(engine)
    return setup_engine(
        load_model(model_dir, device=device), tokenizer, engine=engine, policy_step=policy_step
    )
