"""Sizing a run's model for the role policy: parameters from the checkpoint's headers (whatever dtype the
file holds), memory in the dtype each role computes in, CPU inference where the run allows it and a
measured (or estimated) decode rate keeps up, and the torch threads a role is given. Fake hardware
profiles and a header-only Qwen3-0.6B checkpoint: nothing of 0.6B size is built."""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest

from prime_node.config import RunConfig
from prime_node.cpu_compute import default_threads, measure_cpu_decode, role_threads
from prime_node.errors import NodeError
from prime_node.hardware import cpu_cores
from prime_node.ml.architectures import create_model, model_shape, write_model_dir
from prime_node.roles import role_runner as runner_module
from prime_node.roles.choice import needed_tokens_per_s
from prime_node.roles.role_runner import measured_profile, requirements_for
from prime_node.roles.trainer_service import trainer_threads
from protocol.resources import GpuInfo, HardwareProfile
from protocol.roles import (
    INFERER,
    SEEDER,
    VALIDATOR,
    RolePolicyConfig,
    SwarmDemand,
    choose_role,
    cpu_tokens_per_s,
    inference_fit,
    validation_fit,
)

GIB_MIB = 1024
HOME_CPU = HardwareProfile((), cpu_cores=2, ram_mib=24 * GIB_MIB, disk_free_mib=100_000)
"""The 2-core, 24 GiB machine the 0.6b run is meant to fit on."""
POLICY = RolePolicyConfig()
PARAMS_06B = 596_049_920
RUN_06B: dict[str, Any] = {
    "group_size": 8,
    "prompts_per_step": 8,
    "max_new_tokens": 128,
    "async_level": 2,
    "inference_dtype": "bfloat16",
    "validator_dtype": "float32",
}
"""64 samples x 128 tokens per batch, within 3 policy steps: 45.5 tokens/s needed."""


def _run(**fields: Any) -> RunConfig:
    return RunConfig.model_validate({**RUN_06B, **fields})


@pytest.fixture(scope="module")
def qwen3_06b_headers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-0.6B checkpoint as the swarm delivers one, minus its weights: config.json and a bf16
    safetensors file whose header names every tensor's real shape (sizing reads no more than that)."""
    out = tmp_path_factory.mktemp("qwen3-0.6b-headers")
    model, _ = create_model("qwen3", "0.6b", 0, dtype="auto", device="meta")
    model.config.save_pretrained(str(out))
    header: dict[str, Any] = {}
    offset = 0
    for name, parameter in model.named_parameters():  # a tied head is one tensor, as save_pretrained writes
        size = parameter.numel() * 2
        header[name] = {
            "dtype": "BF16",
            "shape": list(parameter.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header).encode()
    (out / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return out


def test_a_bf16_checkpoint_has_as_many_parameters_as_its_fp32_twin(tmp_path: Path) -> None:
    """The old rule (file bytes / 4) read a bf16 file as half the model."""
    fp32 = write_model_dir("qwen3", "tiny", 0, tmp_path / "fp32")
    bf16 = write_model_dir("qwen3", "tiny", 0, tmp_path / "bf16", dtype="bfloat16")
    params = model_shape("qwen3", "tiny").parameters()
    for directory in (fp32, bf16):
        for run, inferer_bytes in ((_run(inference_dtype="float32"), 4), (_run(), 2)):
            req = requirements_for(run, directory)
            assert req.param_count == params and req.dtype_bytes == inferer_bytes
            assert req.validator_dtype_bytes == 4 and req.validator_policies == 3


def test_the_06b_run_needs_what_its_shape_and_dtypes_say(qwen3_06b_headers: Path) -> None:
    req = requirements_for(_run(), qwen3_06b_headers)
    assert req.param_count == PARAMS_06B and req.cpu_ok and req.validator_cpu_ok
    assert req.weights_mib == pytest.approx(PARAMS_06B * 2 / (1 << 20))  # one bf16 copy
    assert req.validator_weights_mib == pytest.approx(3 * PARAMS_06B * 4 / (1 << 20))  # 3 fp32 policies
    assert req.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2
    assert req.context_tokens == 64 + 128 and req.concurrent_sequences == 64
    assert req.min_tokens_per_s == pytest.approx(64 * 128 / (60 * 3)) == needed_tokens_per_s(_run())


def test_a_fast_enough_cpu_infers_the_06b_model_and_a_slow_one_validates(qwen3_06b_headers: Path) -> None:
    req = requirements_for(_run(), qwen3_06b_headers)
    fast = dataclasses.replace(HOME_CPU, cpu_decode_s_per_gb=0.5)  # 0.6 s a step: ~107 tokens/s
    slow = dataclasses.replace(HOME_CPU, cpu_decode_s_per_gb=2.0)  # 2.4 s a step: ~27 tokens/s
    assert cpu_tokens_per_s(fast, req, POLICY) == pytest.approx(64 / (0.5 * PARAMS_06B * 2 / 1e9))
    decision = choose_role(fast, req, SwarmDemand(), None, 0.0, POLICY)
    assert decision.role == INFERER and "tokens/s >= 45.5 needed" in decision.reason
    decision = choose_role(slow, req, SwarmDemand(), None, 0.0, POLICY)
    assert decision.role == VALIDATOR and "26.8 tokens/s < 45.5 needed" in decision.reason
    # Unmeasured: 2 cores estimated; the batch's products bound a step at ~1.9 s (~34 tokens/s).
    assert cpu_tokens_per_s(HOME_CPU, req, POLICY) == pytest.approx(64 / (2 * PARAMS_06B * 64 / 4e10))
    assert not inference_fit(HOME_CPU, req, POLICY).ok
    one_sequence = dataclasses.replace(req, concurrent_sequences=1)  # then streaming the weights bounds it
    assert cpu_tokens_per_s(HOME_CPU, one_sequence, POLICY) == pytest.approx(2 * 2e9 / (PARAMS_06B * 2))


def test_the_run_config_can_still_forbid_cpu_roles(qwen3_06b_headers: Path) -> None:
    fast = dataclasses.replace(HOME_CPU, cpu_decode_s_per_gb=0.1)
    gpu_inferers = requirements_for(_run(inferer_devices=["cuda"]), qwen3_06b_headers)
    assert not gpu_inferers.cpu_ok
    fit = inference_fit(fast, gpu_inferers, POLICY)
    assert not fit.ok and "does not allow CPU inference" in fit.why
    assert choose_role(fast, gpu_inferers, SwarmDemand(), None, 0.0, POLICY).role == VALIDATOR
    gpu_validators = requirements_for(
        _run(inference_dtype="float32", validator_dtype="bfloat16", validator_devices=["cuda"]),
        qwen3_06b_headers,
    )
    fit = validation_fit(fast, gpu_validators, POLICY)
    assert not fit.ok and "does not allow CPU validation" in fit.why
    assert choose_role(fast, gpu_validators, SwarmDemand(), None, 0.0, POLICY).role == INFERER


def test_memory_is_counted_in_each_roles_dtype_and_copies(qwen3_06b_headers: Path) -> None:
    """8 GiB: one bf16 copy and its KV cache fit (~4.1 GiB with margins), three fp32 policies do not
    (~12.5 GiB)."""
    req = requirements_for(_run(), qwen3_06b_headers)
    laptop = dataclasses.replace(HOME_CPU, ram_mib=8 * GIB_MIB, cpu_decode_s_per_gb=0.5)
    assert inference_fit(laptop, req, POLICY).ok
    fit = validation_fit(laptop, req, POLICY)
    assert not fit.ok and "8.0 GiB RAM < 12." in fit.why
    assert choose_role(laptop, req, SwarmDemand(), None, 0.0, POLICY).role == INFERER
    tiny_ram = dataclasses.replace(laptop, ram_mib=2 * GIB_MIB)
    assert choose_role(tiny_ram, req, SwarmDemand(), None, 0.0, POLICY).role == SEEDER
    one_policy = requirements_for(_run(async_level=0, validator_dtype="float32"), qwen3_06b_headers)
    assert one_policy.validator_weights_mib == pytest.approx(req.validator_weights_mib / 3)


def test_a_gpu_that_holds_the_policies_needs_no_cpu_measurement(
    qwen3_06b_headers: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    req = requirements_for(_run(), qwen3_06b_headers)
    gpu = dataclasses.replace(HOME_CPU, gpus=(GpuInfo(0, "RTX 4090", 24_564, (8, 9)),), gpu_source="nvml")
    assert validation_fit(gpu, req, POLICY).on_gpu and inference_fit(gpu, req, POLICY).on_gpu

    def never(*args: Any, **kwargs: Any) -> float:
        raise AssertionError("nothing to measure: a node with a GPU infers on it, or the run forbids the CPU")

    monkeypatch.setattr(runner_module, "measure_cpu_decode", never)
    assert measured_profile(gpu, _run(), 2) is gpu
    assert measured_profile(HOME_CPU, _run(inferer_devices=["cuda"]), 2) is HOME_CPU


def test_the_runner_measures_the_cpu_in_the_runs_dtype_and_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, int, int]] = []

    def fake(dtype: str, batch: int, threads: int) -> float:
        asked.append((dtype, batch, threads))
        return 0.75

    monkeypatch.setattr(runner_module, "measure_cpu_decode", fake)  # where the runner looks it up
    profile = measured_profile(HOME_CPU, _run(), 2)
    assert asked == [("bfloat16", 64, 2)] and profile.cpu_decode_s_per_gb == 0.75
    assert profile.describe()["cpu_decode_s_per_gb"] == 0.75


def test_measuring_cpu_decoding_returns_a_rate() -> None:
    for dtype in ("float32", "bfloat16"):
        seconds = measure_cpu_decode(dtype, 4, 1, in_features=256, out_features=512, budget_s=0.05)
        assert seconds > 0 and math.isfinite(seconds)
    with pytest.raises(NodeError):
        measure_cpu_decode("float16", 4, 1, in_features=8, out_features=8)


def test_hostile_checkpoints_are_node_errors(tmp_path: Path, qwen3_06b_headers: Path) -> None:
    run = _run()
    with pytest.raises(NodeError) as caught:
        requirements_for(run, tmp_path)  # no config.json
    assert caught.value.reason == "bad_model_dir"
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((qwen3_06b_headers / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(NodeError) as caught:
        requirements_for(run, broken)
    assert caught.value.reason == "bad_model_dir" and "header" in str(caught.value)
    (broken / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    with pytest.raises(NodeError, match="holds no weights"):
        requirements_for(run, broken)


def test_threads_are_the_cores_given_to_the_role(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_threads({"OMP_NUM_THREADS": "3"}) == 3
    for unset in ({}, {"OMP_NUM_THREADS": ""}, {"OMP_NUM_THREADS": "0"}, {"OMP_NUM_THREADS": "lots"}):
        assert default_threads(unset) == cpu_cores()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert role_threads(0) == cpu_cores()  # a standalone node: every core it may use
    assert role_threads(1) == 1  # the demo's joiners: --threads 1
    with pytest.raises(NodeError) as caught:
        role_threads(5000)
    assert caught.value.reason == "bad_flag"
    assert trainer_threads(_run(threads=3)) == 3
    assert trainer_threads(_run()) == cpu_cores()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun and the demo give each process one
    assert trainer_threads(_run()) == 1
