"""The hardware probe: nvidia-smi parsing on captured outputs, --gpu parsing and selection, the real probe."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prime_node.errors import NodeError
from prime_node.hardware import (
    GpuSelection,
    parse_gpu_selection,
    parse_nvidia_smi,
    probe,
    select_gpus,
    to_summary,
)
from prime_node.node.runner import local_hardware
from protocol.resources import GpuInfo

# `nvidia-smi --query-gpu=index,name,memory.total,compute_cap --format=csv,noheader,nounits`
RTX_4090 = "0, NVIDIA GeForce RTX 4090, 24564, 8.9\n"
H100_X8 = "".join(f"{i}, NVIDIA H100 80GB HBM3, 81559, 9.0\n" for i in range(8))
# A driver without the compute_cap field, queried again without it.
OLD_DRIVER_T4 = "0, Tesla T4, 15360\n1, Tesla T4, 15360\n"
GARBAGE = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"
    "0, , , \n"
    "x, NVIDIA A100, 40960, 8.0\n"
    "1, NVIDIA A100, [N/A], 8.0\n"
    "2, NVIDIA A100, -5, 8.0\n"
    "99999, NVIDIA A100, 40960, 8.0\n"
    "\x00\xff,,,,\n"
    "3\n"
)
MIXED = "0, NVIDIA A100-SXM4-40GB, 40960, 8.0\nWARNING: infoROM is corrupted at gpu 0000:00:04.0\n"


def test_one_rtx_4090() -> None:
    [gpu] = parse_nvidia_smi(RTX_4090)
    assert gpu == GpuInfo(0, "NVIDIA GeForce RTX 4090", 24564, (8, 9))
    assert gpu.bf16 is True


def test_eight_h100() -> None:
    gpus = parse_nvidia_smi(H100_X8)
    assert [gpu.index for gpu in gpus] == list(range(8))
    assert {gpu.vram_mib for gpu in gpus} == {81559}
    assert {gpu.compute_capability for gpu in gpus} == {(9, 0)}


def test_old_driver_without_compute_capability() -> None:
    gpus = parse_nvidia_smi(OLD_DRIVER_T4, with_capability=False)
    assert [(gpu.name, gpu.vram_mib, gpu.compute_capability) for gpu in gpus] == [
        ("Tesla T4", 15360, None)
    ] * 2
    assert gpus[0].bf16 is None


def test_garbage_and_empty_give_no_gpu() -> None:
    assert parse_nvidia_smi(GARBAGE) == ()
    assert parse_nvidia_smi("") == ()
    assert parse_nvidia_smi("No devices were found\n") == ()


def test_messages_between_rows_are_skipped() -> None:
    [gpu] = parse_nvidia_smi(MIXED)
    assert (gpu.name, gpu.vram_mib, gpu.compute_capability) == ("NVIDIA A100-SXM4-40GB", 40960, (8, 0))


def test_a_name_with_commas_and_duplicate_indices() -> None:
    gpus = parse_nvidia_smi("0, Odd, GPU, 1000, 7.5\n0, Again, 2000, 7.5\n")
    assert [(gpu.name, gpu.vram_mib) for gpu in gpus] == [("Odd, GPU", 1000)]


@given(st.text(max_size=400))
def test_any_text_parses_to_a_bounded_list_or_nothing(text: str) -> None:
    gpus = parse_nvidia_smi(text)
    assert len(gpus) <= 64
    for gpu in gpus:
        assert gpu.vram_mib >= 0 and 0 <= gpu.index <= 1023 and 0 < len(gpu.name) <= 64


def test_gpu_selection_parsing() -> None:
    assert parse_gpu_selection("auto") == GpuSelection("auto")
    assert parse_gpu_selection(" NONE ") == GpuSelection("none")
    assert parse_gpu_selection("0,1") == GpuSelection("list", (0, 1))
    assert parse_gpu_selection("3, 2") == GpuSelection("list", (3, 2))
    assert str(parse_gpu_selection("0,1")) == "0,1"


@pytest.mark.parametrize(
    "bad", ["", "all", "0,", "0,0", "-1", "1.5", "gpu0", "²", "0;1", "5000", ",".join("0" * 80)]
)
def test_bad_gpu_selection_is_one_clear_error(bad: str) -> None:
    with pytest.raises(NodeError, match="--gpu") as raised:
        parse_gpu_selection(bad)
    assert raised.value.reason == "bad_gpu_selection"


def test_selection_of_found_gpus() -> None:
    h100s = parse_nvidia_smi(H100_X8)
    assert select_gpus(h100s, GpuSelection("auto"), "nvidia-smi", None) == h100s
    assert select_gpus(h100s, GpuSelection("none"), "nvidia-smi", None) == ()
    assert [g.index for g in select_gpus(h100s, GpuSelection("list", (5, 1)), "nvml", None)] == [5, 1]
    # auto honours CUDA_VISIBLE_DEVICES (CUDA stops at the first invalid entry), ignores UUID lists
    assert [g.index for g in select_gpus(h100s, GpuSelection("auto"), "nvml", "2,3")] == [2, 3]
    assert [g.index for g in select_gpus(h100s, GpuSelection("auto"), "nvml", "1,-1,4")] == [1]
    assert select_gpus(h100s, GpuSelection("auto"), "nvml", "") == ()
    assert select_gpus(h100s, GpuSelection("auto"), "nvml", "GPU-8f3c,GPU-12ab") == h100s
    with pytest.raises(NodeError, match="no GPU 9") as raised:
        select_gpus(h100s, GpuSelection("list", (0, 9)), "nvml", None)
    assert raised.value.reason == "gpu_not_found"


def test_real_probe_on_this_machine(tmp_path: Path) -> None:
    profile = probe(parse_gpu_selection("auto"), tmp_path / "not-yet" / "created", env={})
    assert profile.cpu_cores > 0 and profile.ram_mib > 0 and profile.disk_free_mib > 0
    assert profile.gpu_count == len(profile.gpus) and profile.total_vram_mib >= 0
    summary = to_summary(profile)
    assert (summary.cpu_cores, summary.gpu_count) == (profile.cpu_cores, profile.gpu_count)
    assert local_hardware().cpu_cores == profile.cpu_cores
    cpu_only = probe(GpuSelection("none"), tmp_path)
    assert cpu_only.gpus == () and cpu_only.gpu_source == "none"
    described = profile.describe()
    assert described["cpu_cores"] == profile.cpu_cores and isinstance(described["gpus"], list)


def test_listing_gpus_on_a_machine_without_them(tmp_path: Path) -> None:
    profile = probe(GpuSelection("auto"), tmp_path)
    if profile.gpu_count:
        pytest.skip("this machine has GPUs")
    with pytest.raises(NodeError, match="no GPU 0"):
        probe(parse_gpu_selection("0"), tmp_path)


def test_the_torch_probe_waits_for_an_import_another_thread_has_started() -> None:
    """``join`` imports torch in a thread beside the hardware probe: the probe used to read the half-made
    module and log "torch.cuda probe failed: partially initialized module 'torch' has no attribute
    'cuda'" on an ordinary start (issue 36). A fresh process, so torch is really being imported."""
    program = textwrap.dedent(
        """
        import logging, sys, threading
        logging.basicConfig(level=logging.WARNING)
        from prime_node import hardware
        threading.Thread(target=lambda: __import__("torch"), daemon=True).start()
        while "torch" not in sys.modules:
            pass
        half_made = getattr(sys.modules["torch"].__spec__, "_initializing", False)
        found = hardware._probe_torch()
        print("half_made", half_made, "found", found)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "half_made True" in result.stdout  # the probe did meet a module still being imported
    assert "found ()" in result.stdout or "found ((" in result.stdout  # an answer: no GPU, or the GPUs
    assert "probe failed" not in result.stderr
