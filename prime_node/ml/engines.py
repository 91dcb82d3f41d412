"""The one place an inference engine is built, and what each pair of engines is calibrated as.

Every role builds its engine through ``setup_engine`` (a model already in memory) or ``load_engine`` (a
model directory), naming the family of the run config's ``engine`` field and the dtype of its role
(``inference_dtype`` for inferers, ``validator_dtype`` for validators). Adding a backend (vLLM on a
GPU) means one entry in ``_BACKENDS`` and, for validators, calibrated entries for the pairs it takes
part in: TOPLOC bounds in ``crypto.toploc.CALIBRATED_THRESHOLDS`` and sampling tolerances in
``SAMPLING_TOLERANCES`` below, both keyed by (inferer (family, dtype), validator (family, dtype)).

A validator never shares the inferer's exact kernels, so every bound is measured across kernel sets and
thread counts (``benchmarks/verification_dtypes.py``, docs/verification.md *Across dtypes and
machines*); a pair without both entries is refused when the run config is loaded and when a validator
starts, never at the first batch.

Importing this module does not import torch: the backend is imported when an engine is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from crypto.toploc import CALIBRATED_THRESHOLDS, EngineKey, Thresholds
from prime_node.errors import NodeError
from prime_node.ml.engine import TorchEngine
from prime_node.ml.model import DTYPES, load_model

DEFAULT_ENGINE: Final = "torch"
"""The family of ``RunConfig.engine``'s default, for the few callers that hold a model but no config."""
DEFAULT_DTYPE: Final = "float32"


@dataclass(frozen=True)
class SamplingTolerances:
    """How far a validator's recomputed log-probs and sampling scores may sit from an honest inferer's."""

    logprob: float
    """Largest |claimed − recomputed| log-prob of one token."""
    replay: float
    """Largest amount a claimed token's seeded score may fall below the best one (``replay_margin``)."""


# Per (inferer, validator) engine pair, measured by benchmarks/verification_dtypes.py (docs/verification.md).
# float32 → float32: KV-cache generation vs prefill moved log-probs by ≤ 1.2e-6 on fresh models (1.9e-6
# across kernel sets and threads) and by 1.17e-4 on a policy after ~250 RL steps (one honest batch of
# 1,116 in a demo run); weights perturbed by 1 % moved them by ≥ 5e-3.
# A bfloat16 inferer checked in float32: honest log-prob error ≤ 0.021 and replay margin ≤ 0.017 (1,000
# batches, native and scalar kernels); the bounds are ~2.4× and ~6× that. Perturbed weights (log-prob
# error ≥ 0.047) are caught by TOPLOC's mantissa bounds first; a changed or written-in token falls ≥ 7
# below the seeded rule's best score, far beyond 0.1. bfloat16 → bfloat16 is refused until it has a
# 1,000-batch run across kernel sets (see crypto.toploc.CALIBRATED_THRESHOLDS).
_F32, _BF16 = ("torch", "float32"), ("torch", "bfloat16")
_BF16_INFERER = SamplingTolerances(logprob=0.05, replay=0.1)
SAMPLING_TOLERANCES: Mapping[tuple[EngineKey, EngineKey], SamplingTolerances] = MappingProxyType(
    {
        (_F32, _F32): SamplingTolerances(logprob=1e-3, replay=1e-4),
        (_BF16, _F32): _BF16_INFERER,
    }
)


@dataclass(frozen=True)
class EngineSpec:
    """An engine family and the dtype it computes in: one side of everything calibrated per pair."""

    family: str
    dtype: str

    @property
    def key(self) -> EngineKey:
        return (self.family, self.dtype)

    def toploc_thresholds(self) -> Thresholds:
        """The TOPLOC bounds for this engine checked by the same engine (``calibration(self, self)``)."""
        return calibration(self, self).toploc


@dataclass(frozen=True)
class Calibration:
    """Everything a validator of ``validator`` compares against work of ``inferer`` with."""

    inferer: EngineSpec
    validator: EngineSpec
    toploc: Thresholds
    sampling: SamplingTolerances


def calibration(inferer: EngineSpec, validator: EngineSpec) -> Calibration:
    """The bounds calibrated for work of ``inferer`` checked by ``validator``; NodeError
    ``uncalibrated_engine`` when the pair has none (a validator must not guess them: too loose admits a
    cheater, too tight rejects honest workers)."""
    key = (inferer.key, validator.key)
    toploc = CALIBRATED_THRESHOLDS.get(key)
    sampling = SAMPLING_TOLERANCES.get(key)
    if toploc is None or sampling is None:
        raise NodeError(
            f"no verification bounds are calibrated for {inferer.family} {inferer.dtype} inferers checked "
            f"by {validator.family} {validator.dtype} validators (calibrated: {describe_pairs()}); run "
            "benchmarks/verification_dtypes.py on that pair and add its entries",
            reason="uncalibrated_engine",
        )
    return Calibration(inferer, validator, toploc, sampling)


def describe_pairs() -> str:
    """The calibrated pairs, as ``inferer → validator`` text for error messages."""
    pairs = sorted(set(CALIBRATED_THRESHOLDS) & set(SAMPLING_TOLERANCES))
    return ", ".join(f"{i[0]} {i[1]} → {v[0]} {v[1]}" for i, v in pairs) or "none"


def run_calibration(run: Any) -> Calibration:
    """``calibration`` of a run config's inferer and validator engines (``engine``, ``inference_dtype``,
    ``validator_dtype``)."""
    return calibration(
        engine_spec(run.engine, run.inference_dtype), engine_spec(run.engine, run.validator_dtype)
    )


def _build_torch(model: Any, tokenizer: Any, policy_step: int) -> TorchEngine:
    return TorchEngine(
        model,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        policy_step=policy_step,
    )


# family -> (the dtypes it computes in, how to wrap a loaded model).
_BACKENDS: Mapping[str, tuple[tuple[str, ...], Callable[[Any, Any, int], TorchEngine]]] = MappingProxyType(
    {"torch": (DTYPES, _build_torch)}
)


def engine_spec(family: str, dtype: str = DEFAULT_DTYPE) -> EngineSpec:
    """The spec of engine family ``family`` computing in ``dtype``; NodeError ``unknown_engine`` for a
    family we cannot build, ``unsupported_dtype`` for a dtype it does not compute in."""
    backend = _BACKENDS.get(family)
    if backend is None:
        known = ", ".join(sorted(_BACKENDS))
        raise NodeError(f"unknown inference engine {family!r} (known: {known})", reason="unknown_engine")
    if dtype not in backend[0]:
        raise NodeError(
            f"engine {family!r} does not compute in {dtype!r} (one of {', '.join(backend[0])})",
            reason="unsupported_dtype",
        )
    return EngineSpec(family, dtype)


def setup_engine(
    model: Any,
    tokenizer: Any,
    *,
    engine: str = DEFAULT_ENGINE,
    dtype: str = DEFAULT_DTYPE,
    policy_step: int = 0,
) -> TorchEngine:
    """An engine of family ``engine`` over ``model`` (already loaded, cast to ``dtype`` in place when it
    is not in it), stopping at the tokenizer's EOS and padding with its pad token, reporting
    ``policy_step`` as the policy it holds."""
    import torch

    spec = engine_spec(engine, dtype)
    wanted = getattr(torch, spec.dtype)
    if any(p.dtype != wanted for p in model.parameters()):
        model.to(wanted)
    return _BACKENDS[engine][1](model, tokenizer, policy_step)


def load_engine(
    model_dir: Path,
    tokenizer: Any,
    *,
    engine: str = DEFAULT_ENGINE,
    dtype: str = DEFAULT_DTYPE,
    device: str = "cpu",
    policy_step: int = 0,
) -> TorchEngine:
    """``setup_engine`` over the model in ``model_dir`` (Hugging Face layout, safetensors only), loaded
    in ``dtype``. The family and dtype are checked before the model is read, so a bad config fails
    without loading weights."""
    engine_spec(engine, dtype)
    return setup_engine(
        load_model(model_dir, device=device, dtype=dtype),
        tokenizer,
        engine=engine,
        dtype=dtype,
        policy_step=policy_step,
    )
