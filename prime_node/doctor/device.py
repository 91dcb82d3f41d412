"""The device each role would compute on (``prime_node.hardware.select_device``, as ``join`` and
``run-trainer`` use it) and, on a GPU, the VRAM plan of generation (``prime_node.ml.vram_plan``).

The plan needs the model's shape, so it is made only with ``--model`` or a ``--run-config`` naming a
model directory; it uses the GPU's total memory (the doctor does not start CUDA to ask what is free) and
assumes prompts of ``PROMPT_TOKENS`` tokens (the inferer measures its task's prompts instead).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from prime_node.config.run import RunConfig
from prime_node.doctor.report import FAIL, PASS, WARN, Check
from prime_node.errors import NodeError
from prime_node.hardware import GpuSelection, select_device
from protocol.resources import HardwareProfile

if TYPE_CHECKING:
    from prime_node.ml.vram_plan import VramPlan

PROMPT_TOKENS: Final = 256
FIX_GPU: Final = "check nvidia-smi and the torch check above, or pass --gpu none to run on the CPU"


def check_device(
    profile: HardwareProfile,
    selection: GpuSelection,
    run: RunConfig,
    model_dir: Path | None,
    *,
    cuda_devices: Callable[[], int] | None = None,
) -> Check:
    """Inferer/validator device, the trainer ranks' devices, and the generation plan on a GPU."""
    try:
        device = select_device(profile, selection, cuda_devices=cuda_devices)
        ranks = [
            select_device(profile, selection, rank=r, cuda_devices=cuda_devices)
            for r in range(max(1, len(profile.gpus)))
        ]
    except NodeError as exc:
        return Check("device", FAIL, str(exc), FIX_GPU, {"device": None})
    details: dict[str, Any] = {"device": device, "trainer_ranks": ranks, "vram_plan": None}
    value = f"inferer/validator on {device}; trainer rank(s) on {', '.join(ranks)}"
    if device == "cpu":
        return Check("device", PASS, value, None, details)
    if model_dir is None:
        return Check("device", PASS, f"{value}; pass --model for the VRAM plan", None, details)
    try:
        plan = _plan(profile, device, run, model_dir)
    except NodeError as exc:
        fix = "pass --model a Hugging Face model directory"
        return Check("device", WARN, f"{value}; no VRAM plan: {exc}", fix, details)
    details["vram_plan"] = {
        "batch": plan.batch,
        "wanted_batch": plan.wanted_batch,
        "available_bytes": plan.available_bytes,
        "weights_bytes": plan.weights_bytes,
        "per_sample_bytes": plan.per_sample_bytes,
        "needed_bytes": plan.needed_bytes,
    }
    value = f"{value}; VRAM plan {plan.describe()}"
    if not plan.fits:
        fix = "use a GPU with more memory, or --gpu none to validate or seed on the CPU"
        return Check("device", FAIL, value, fix, details)
    if plan.shrunk:
        return Check("device", WARN, value, "fine; a larger GPU generates the run's batch in one go", details)
    return Check("device", PASS, value, None, details)


def _plan(profile: HardwareProfile, device: str, run: RunConfig, model_dir: Path) -> VramPlan:
    from prime_node.ml.vram_plan import GenerationSettings, model_shape, plan_generation

    gpu = profile.gpus[0]
    settings = GenerationSettings(
        batch=run.samples_per_step,
        prompt_tokens=PROMPT_TOKENS,
        max_new_tokens=run.max_new_tokens,
        dtype=run.inference_dtype,
    )
    return plan_generation(model_shape(model_dir), settings, gpu.vram_mib << 20, device=device)
