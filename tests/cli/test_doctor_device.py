"""``doctor``'s device check: the device each role uses (a fake CUDA probe) and the VRAM plan for
synthetic GPU sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from prime_node.config import RunConfig
from prime_node.doctor.device import check_device
from prime_node.doctor.report import FAIL, PASS, WARN
from prime_node.hardware import GpuSelection
from protocol.resources import GpuInfo, HardwareProfile

RUN = RunConfig.model_validate({})


def _profile(*vram_mib: int) -> HardwareProfile:
    gpus = tuple(GpuInfo(i, "G", v, (8, 9)) for i, v in enumerate(vram_mib))
    return HardwareProfile(gpus=gpus, cpu_cores=4, ram_mib=16_000, disk_free_mib=100_000, gpu_source="nvml")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A 1.5 M-parameter model's config and weights (only the shapes matter)."""
    config = {
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 2048,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(
        {"embed": torch.zeros(2048, 256), "layers": torch.zeros(1000, 1000)}, str(tmp_path / "m.safetensors")
    )
    return tmp_path


def test_cpu_only_says_so_and_never_asks_cuda() -> None:
    check = check_device(_profile(), GpuSelection("auto"), RUN, None, cuda_devices=lambda: 1 // 0)
    assert check.status == PASS and check.details["device"] == "cpu"
    assert "inferer/validator on cpu" in check.value


def test_every_role_and_trainer_rank_gets_its_gpu(model_dir: Path) -> None:
    check = check_device(
        _profile(24_000, 24_000), GpuSelection("auto"), RUN, model_dir, cuda_devices=lambda: 2
    )
    assert check.status == PASS
    assert check.details["device"] == "cuda:0" and check.details["trainer_ranks"] == ["cuda:0", "cuda:1"]
    assert check.details["vram_plan"]["batch"] == RUN.samples_per_step
    assert "VRAM plan cuda:0: 23.44 GiB free" in check.value


def test_a_gpu_torch_cannot_use_fails_with_the_fix() -> None:
    check = check_device(_profile(24_000), GpuSelection("auto"), RUN, None, cuda_devices=lambda: 0)
    assert check.status == FAIL and check.fix is not None and "--gpu none" in check.fix


def test_the_plan_shrinks_or_refuses_on_small_gpus(model_dir: Path) -> None:
    long_run = RunConfig.model_validate({"max_new_tokens": 4096})
    small = check_device(_profile(560), GpuSelection("auto"), long_run, model_dir, cuda_devices=lambda: 1)
    assert small.status == WARN and small.details["vram_plan"]["batch"] < long_run.samples_per_step
    tiny = check_device(_profile(100), GpuSelection("auto"), long_run, model_dir, cuda_devices=lambda: 1)
    assert tiny.status == FAIL and tiny.details["vram_plan"]["batch"] == 0
    assert "not even one sample fits" in tiny.value
