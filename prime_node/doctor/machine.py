"""GPU and VRAM, RAM, and free disk for the checkpoints a node keeps, from ``prime_node.hardware.probe``."""

from __future__ import annotations

from typing import Final

from prime_node.doctor.model_size import ModelEstimate
from prime_node.doctor.report import FAIL, PASS, WARN, Check
from protocol.resources import HardwareProfile, format_mib
from protocol.roles import RolePolicyConfig, inference_fit

MIN_RAM_MIB: Final = 2048
"""Below this even a seeder struggles: Python, libp2p and a loaded torch take ~1 GiB."""
GIB: Final = 1 << 30


def check_gpu(profile: HardwareProfile, model: ModelEstimate) -> Check:
    details = {"gpus": profile.describe()["gpus"], "source": profile.gpu_source, "bf16": profile.bf16}
    if not profile.gpus:
        return Check(
            "gpu",
            PASS,
            "none (CPU only: this node can validate small models and seed checkpoint pieces)",
            None,
            details,
        )
    names = ", ".join(f"{g.index}: {g.name} {format_mib(g.vram_mib)}" for g in profile.gpus)
    value = f"{profile.gpu_count} GPU(s) via {profile.gpu_source}: {names}"
    fit = inference_fit(profile, model.requirements, RolePolicyConfig())
    if not fit.ok:
        return Check(
            "gpu",
            WARN,
            f"{value}; too small to infer the run's model ({fit.why})",
            "fine for validating and seeding; a larger GPU is needed to infer this model",
            details,
        )
    return Check("gpu", PASS, f"{value}; {fit.why}", None, details)


def check_ram(profile: HardwareProfile) -> Check:
    details = {"ram_mib": profile.ram_mib, "cpu_cores": profile.cpu_cores, "minimum_mib": MIN_RAM_MIB}
    value = f"{format_mib(profile.ram_mib)} RAM, {profile.cpu_cores} CPU core(s) usable"
    if profile.ram_mib < MIN_RAM_MIB:
        return Check(
            "ram",
            FAIL,
            f"{value}: less than {format_mib(MIN_RAM_MIB)}",
            "give the node more memory (raise the container or cgroup memory limit)",
            details,
        )
    return Check("ram", PASS, value, None, details)


def check_disk(profile: HardwareProfile, model: ModelEstimate, where: str) -> Check:
    need_mib = model.disk_needed_bytes / (1 << 20)
    details = {
        "free_mib": profile.disk_free_mib,
        "needed_mib": round(need_mib),
        "checkpoint_mib": round(model.checkpoint_bytes / (1 << 20), 1),
        "keep": model.keep,
        "path": where,
        "model": model.source,
    }
    value = (
        f"{format_mib(profile.disk_free_mib)} free at {where}; {model.keep}+1 checkpoints of "
        f"{format_mib(model.checkpoint_bytes / (1 << 20))} need {format_mib(need_mib)}"
    )
    if profile.disk_free_mib < need_mib:
        return Check(
            "disk",
            FAIL,
            value,
            "free disk space there, or pass --data-dir on a disk with room (the same --data-dir to join)",
            details,
        )
    return Check("disk", PASS, value, None, details)
