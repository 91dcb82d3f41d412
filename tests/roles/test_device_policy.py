"""The one device policy (``hardware.select_device``): --gpu and the trainer's ranks -> the device of every
engine and the trainer, with a fake CUDA probe (no GPU needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.errors import NodeError
from prime_node.hardware import GpuSelection, select_device, to_summary
from prime_node.ml.distributed import init_from_env
from prime_node.roles.role_runner import RoleRunner
from protocol.codec import decode, encode
from protocol.peer_record import HardwareSummary
from protocol.resources import GpuInfo, HardwareProfile

TWO = (GpuInfo(0, "A", 24_000, (8, 9)), GpuInfo(1, "B", 24_000, (8, 9)))


def _profile(*gpus: GpuInfo, source: str = "nvml") -> HardwareProfile:
    return HardwareProfile(gpus=gpus, cpu_cores=4, ram_mib=16_000, disk_free_mib=100_000, gpu_source=source)


def _never() -> int:
    raise AssertionError("the CPU policy must not ask CUDA")


def test_gpu_one_is_cuda_one_and_none_or_no_gpu_is_the_cpu() -> None:
    assert (
        select_device(_profile(TWO[1]), GpuSelection("list", (1,)), cuda_devices=lambda: 2, env={})
        == "cuda:1"
    )
    assert select_device(_profile(*TWO), GpuSelection("auto"), cuda_devices=lambda: 2, env={}) == "cuda:0"
    assert select_device(_profile(), GpuSelection("none"), cuda_devices=_never) == "cpu"
    assert select_device(_profile(), GpuSelection("auto"), cuda_devices=_never) == "cpu"


def test_a_gpu_that_disappeared_is_a_clear_error_not_a_cpu_run() -> None:
    with pytest.raises(NodeError) as caught:
        select_device(_profile(TWO[1]), GpuSelection("list", (1,)), cuda_devices=lambda: 1, env={})
    assert caught.value.reason == "gpu_unavailable"
    assert "GPU 1" in str(caught.value) and "--gpu none" in str(caught.value)
    with pytest.raises(NodeError):
        select_device(_profile(*TWO), GpuSelection("auto"), cuda_devices=lambda: 0, env={})


def test_torch_numbers_only_the_visible_gpus() -> None:
    both = _profile(GpuInfo(2, "C", 80_000), GpuInfo(3, "D", 80_000))
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert select_device(both, GpuSelection("auto"), rank=1, env=env, cuda_devices=lambda: 2) == "cuda:1"
    with pytest.raises(NodeError, match="hidden by CUDA_VISIBLE_DEVICES"):
        select_device(both, GpuSelection("auto"), env={"CUDA_VISIBLE_DEVICES": "3"}, cuda_devices=lambda: 1)
    via_torch = _profile(GpuInfo(1, "B", 24_000), source="torch")  # torch's indices are already its own
    assert select_device(via_torch, GpuSelection("auto"), env=env, cuda_devices=lambda: 2) == "cuda:1"


@given(st.integers(1, 8), st.integers(0, 9))
def test_each_trainer_rank_takes_its_own_gpu_of_the_selection(count: int, rank: int) -> None:
    gpus = tuple(GpuInfo(i, "G", 24_000) for i in range(count))
    selection = GpuSelection("list", tuple(i for i in range(count)))
    if rank < count:
        device = select_device(_profile(*gpus), selection, rank=rank, env={}, cuda_devices=lambda: count)
        assert device == f"cuda:{rank}"
    else:
        with pytest.raises(NodeError, match="--nproc"):
            select_device(_profile(*gpus), selection, rank=rank, env={}, cuda_devices=lambda: count)
    assert select_device(_profile(*gpus), GpuSelection("none"), rank=rank, cuda_devices=_never) == "cpu"


def test_torchrun_ranks_and_the_one_process_trainer_get_their_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert init_from_env(GpuSelection("none")).device == "cpu"
    monkeypatch.setattr("prime_node.ml.distributed.probe", lambda selection, *a, **k: _profile(*TWO))
    monkeypatch.setattr("prime_node.hardware.cuda_device_count", lambda: 2)
    info = init_from_env(GpuSelection("auto"))
    assert (info.device, info.world_size) == ("cuda:1", 1)
    monkeypatch.setattr("prime_node.hardware.cuda_device_count", lambda: 1)
    with pytest.raises(NodeError, match="torch can use 1 CUDA device"):
        init_from_env(GpuSelection("auto"))


def test_the_peer_record_carries_the_device() -> None:
    summary = to_summary(_profile(TWO[1]), "cuda:1")
    assert decode(encode(summary), HardwareSummary).device == "cuda:1"
    assert to_summary(_profile()).device == ""


class _Swarm:
    def locate(self, step: int) -> Path | None:
        return None

    async def wait_changed(self) -> None:
        return None

    def newest(self) -> tuple[int, Path] | None:
        return None


def _runner(gpus: GpuSelection, profile: HardwareProfile) -> RoleRunner:
    runner = RoleRunner(
        key=WalletKey.generate(),
        run_id="device",
        swarm=_Swarm(),  # type: ignore[arg-type]
        data_dir=Path("unused"),
        gpus=gpus,
    )
    runner.profile = profile
    return runner


@pytest.mark.parametrize("role", ["inferer", "validator"])
async def test_the_role_runner_hands_the_selected_gpu_to_the_role_and_reports_it(
    role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("prime_node.hardware.cuda_device_count", lambda: 2)
    runner = _runner(GpuSelection("list", (1,)), _profile(TWO[1]))
    runner.device = runner._device_for(role)
    services: list[Any] = runner._build(role, RunConfig.model_validate({}))
    device = services[-1].device if role == "inferer" else services[-1].settings.device
    assert device == runner.device == "cuda:1"
    assert runner.status()["device"] == "cuda:1"
    summary = runner._summary()
    assert summary is not None and summary.device == "cuda:1"
    assert runner._device_for("seeder") == ""


def test_gpu_none_keeps_every_role_on_the_cpu() -> None:
    runner = _runner(GpuSelection("none"), _profile())
    assert runner._device_for("inferer") == runner._device_for("validator") == "cpu"
