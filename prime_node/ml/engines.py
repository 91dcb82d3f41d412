"""The one place an inference engine is built, and what each pair of engines is calibrated as.

Every role builds its engine through ``setup_engine`` (a model already in memory) or ``load_engine`` (a
model directory), naming the family of the run config's ``engine`` field and the dtype of its role
(``inference_dtype`` for inferers, ``validator_dtype`` for validators) on the device ``--gpu`` chose
(``hardware.select_device``). Adding a backend (vLLM on a GPU) means one entry in ``_BACKENDS`` and, for
validators, calibrated entries for the pairs it takes part in: TOPLOC bounds in
``crypto.toploc.CALIBRATED_THRESHOLDS`` and sampling tolerances in ``SAMPLING_TOLERANCES`` below, both
keyed by (inferer (family, dtype, device kind), validator (family, dtype, device kind)).

A run config names the device kinds its inferers and validators may compute on (``inferer_devices``,
``validator_devices``; the CPU alone by default); every combination must be a calibrated pair, and a node
whose device is not admitted refuses the role with the fix (``admit_device``). A batch does not say
which device made it, so a validator checks with the loosest bounds of the inferer devices the run admits.

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
# below the seeded rule's best score, far beyond 0.1. bfloat16 → bfloat16 on the CPU is refused until it
# has a 1,000-batch run across kernel sets (see crypto.toploc.CALIBRATED_THRESHOLDS).
# On an H200 (benchmarks/gpu.py, 1,000 honest batches per pair): cuda bf16 → cuda bf16 honest log-prob
# error ≤ 0.024 and replay margin ≤ 0.020; cuda bf16 → cpu fp32 ≤ 0.020 / 0.016; cpu fp32 → cuda bf16
# ≤ 0.022 / 0.019: inside the bf16 tolerances, with changed tokens ≥ 6.8 below the best score.
_F32, _BF16 = ("torch", "float32", "cpu"), ("torch", "bfloat16", "cpu")
_CUDA_BF16 = ("torch", "bfloat16", "cuda")
_BF16_INFERER = SamplingTolerances(logprob=0.05, replay=0.1)
SAMPLING_TOLERANCES: Mapping[tuple[EngineKey, EngineKey], SamplingTolerances] = MappingProxyType(
    {
        (_F32, _F32): SamplingTolerances(logprob=1e-3, replay=1e-4),
        (_BF16, _F32): _BF16_INFERER,
        (_CUDA_BF16, _CUDA_BF16): _BF16_INFERER,
        (_CUDA_BF16, _F32): _BF16_INFERER,
        (_F32, _CUDA_BF16): _BF16_INFERER,
    }
)
DEVICE_KINDS: Final = ("cpu", "cuda")


def device_kind(device: str) -> str:
    """``"cpu"`` or ``"cuda"`` for a torch device string (``"cuda:1"`` → ``"cuda"``): what calibration is
    keyed by (one GPU of a kind computes as another). NodeError ``unsupported_device`` for anything else."""
    kind = device.split(":", 1)[0]
    if kind not in DEVICE_KINDS:
        raise NodeError(
            f"device {device!r} is not one of {', '.join(DEVICE_KINDS)}", reason="unsupported_device"
        )
    return kind


@dataclass(frozen=True)
class EngineSpec:
    """An engine family and the dtype it computes in: one side of everything calibrated per pair."""

    family: str
    dtype: str
    device: str = "cpu"
    """The device kind (``device_kind``)."""

    @property
    def key(self) -> EngineKey:
        return (self.family, self.dtype, self.device)

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
            f"no verification bounds are calibrated for {describe(inferer.key)} inferers checked by "
            f"{describe(validator.key)} validators (calibrated: {describe_pairs()}); run "
            "benchmarks/verification_dtypes.py (CPU) or benchmarks/gpu.py (GPU) on that pair and add its "
            "entries",
            reason="uncalibrated_engine",
        )
    return Calibration(inferer, validator, toploc, sampling)


def describe(key: EngineKey) -> str:
    family, dtype, device = key
    return f"{family} {dtype} on {device}"


def describe_pairs() -> str:
    """The calibrated pairs, as ``inferer → validator`` text for error messages."""
    pairs = sorted(set(CALIBRATED_THRESHOLDS) & set(SAMPLING_TOLERANCES))
    return ", ".join(f"{describe(i)} → {describe(v)}" for i, v in pairs) or "none"


def admit_device(run: Any, role: str, device: str) -> None:
    """NodeError ``device_not_admitted`` when the run config does not let ``role`` ("inferer" or
    "validator") compute on ``device``: its pairs with the other role's devices were never calibrated."""
    kind = device_kind(device)
    admitted = run.inferer_devices if role == "inferer" else run.validator_devices
    if kind not in admitted:
        field = "inferer_devices" if role == "inferer" else "validator_devices"
        flag = "--gpu auto (or a GPU index)" if kind == "cpu" else "--gpu none"
        raise NodeError(
            f"this run admits {role}s on {', '.join(admitted)} only ({field}), and this node's {role} "
            f"would compute on {device}: start it with {flag}, "
            f"or use a run config that admits {kind} (docs/gpu.md lists the calibrated pairs)",
            reason="device_not_admitted",
        )


def run_calibration(run: Any, validator_device: str = "cpu") -> Calibration:
    """The bounds a validator on ``validator_device`` checks a run's batches with: ``calibration`` of each
    inferer device kind the run admits against this validator's engine, combined to the loosest bounds
    (a batch does not say which device made it). NodeError when a pair is not calibrated or this
    validator's device is not admitted."""
    admit_device(run, "validator", validator_device)
    validator = engine_spec(run.engine, run.validator_dtype, device_kind(validator_device))
    pairs = [
        calibration(engine_spec(run.engine, run.inference_dtype, kind), validator)
        for kind in run.inferer_devices
    ]
    if len(pairs) == 1:
        return pairs[0]
    toploc = Thresholds(
        max_exp_mismatches=max(p.toploc.max_exp_mismatches for p in pairs),
        max_mant_err_mean=max(p.toploc.max_mant_err_mean for p in pairs),
        max_mant_err_median=max(p.toploc.max_mant_err_median for p in pairs),
    )
    sampling = SamplingTolerances(
        logprob=max(p.sampling.logprob for p in pairs), replay=max(p.sampling.replay for p in pairs)
    )
    return Calibration(pairs[0].inferer, validator, toploc, sampling)


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


def engine_spec(family: str, dtype: str = DEFAULT_DTYPE, device: str = "cpu") -> EngineSpec:
    """The spec of engine family ``family`` computing in ``dtype`` on device kind ``device``; NodeError
    ``unknown_engine`` for a family we cannot build, ``unsupported_dtype`` for a dtype it does not compute
    in, ``unsupported_device`` for a device kind we do not calibrate."""
    backend = _BACKENDS.get(family)
    if backend is None:
        known = ", ".join(sorted(_BACKENDS))
        raise NodeError(f"unknown inference engine {family!r} (known: {known})", reason="unknown_engine")
    if dtype not in backend[0]:
        raise NodeError(
            f"engine {family!r} does not compute in {dtype!r} (one of {', '.join(backend[0])})",
            reason="unsupported_dtype",
        )
    return EngineSpec(family, dtype, device_kind(device))


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
