"""Probe this machine into a ``HardwareProfile``: GPUs and VRAM, CPU cores, RAM, free disk.

GPUs come from the first source that answers: NVML (if ``pynvml`` is installed), then ``nvidia-smi``
(bounded by a timeout; its output is parsed as untrusted text), then torch, but only when torch is already
imported (importing it costs seconds). A machine without NVIDIA GPUs gets an empty GPU list, not an
error; only an explicit ``--gpu 0,1`` naming GPUs that are not there fails.

The CPU side of a role (its torch threads, its measured decode speed) is ``cpu_compute.py``'s.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from prime_node.errors import NodeError
from protocol.peer_record import HardwareSummary
from protocol.resources import GpuInfo, HardwareProfile

log = logging.getLogger(__name__)

MAX_GPUS = 64
MAX_GPU_INDEX = 1023
MAX_GPU_NAME_CHARS = 64
MAX_SMI_OUTPUT = 64 << 10
NVIDIA_SMI_TIMEOUT = 3.0
_QUERY = "index,name,memory.total,compute_cap"
_INDEX = re.compile(r"[0-9]{1,4}")
_CAPABILITY = re.compile(r"([0-9]{1,2})\.([0-9]{1,2})")

__all__ = [
    "GpuInfo",
    "GpuSelection",
    "HardwareProfile",
    "parse_gpu_selection",
    "parse_nvidia_smi",
    "probe",
    "select_device",
]


@dataclass(frozen=True)
class GpuSelection:
    """``--gpu``: all visible GPUs (auto), none (CPU only), or the listed indices."""

    mode: Literal["auto", "none", "list"]
    indices: tuple[int, ...] = ()

    def __str__(self) -> str:
        return ",".join(map(str, self.indices)) if self.mode == "list" else self.mode


def parse_gpu_selection(text: str) -> GpuSelection:
    """``auto``, ``none`` or a comma-separated list of distinct GPU indices (``0,1``)."""
    value = text.strip().lower()
    if value == "auto":
        return GpuSelection("auto")
    if value == "none":
        return GpuSelection("none")
    parts = [part.strip() for part in value.split(",")]
    if not value or not all(_INDEX.fullmatch(part) for part in parts):
        raise NodeError(
            f"--gpu {text[:40]!r}: expected auto, none or GPU indices such as 0,1", reason="bad_gpu_selection"
        )
    indices = tuple(int(part) for part in parts)
    if len(set(indices)) != len(indices) or max(indices) > MAX_GPU_INDEX or len(indices) > MAX_GPUS:
        raise NodeError(
            f"--gpu {text[:40]!r}: GPU indices must be distinct and at most {MAX_GPU_INDEX}",
            reason="bad_gpu_selection",
        )
    return GpuSelection("list", indices)


def parse_nvidia_smi(output: str, *, with_capability: bool = True) -> tuple[GpuInfo, ...]:
    """Rows of ``nvidia-smi --query-gpu=index,name,memory.total[,compute_cap] --format=csv,noheader,nounits``.

    Rows that do not parse (messages, ``[N/A]`` memory, junk) are skipped; at most MAX_GPUS are kept.
    """
    gpus: list[GpuInfo] = []
    seen: set[int] = set()
    tail = 2 if with_capability else 1
    for line in output[:MAX_SMI_OUTPUT].splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) < 2 + tail or not _INDEX.fullmatch(parts[0]):
            continue
        index = int(parts[0])
        name = ", ".join(parts[1 : len(parts) - tail]).strip()
        memory = parts[len(parts) - tail]
        if index in seen or index > MAX_GPU_INDEX or not re.fullmatch(r"[0-9]{1,9}", memory):
            continue
        capability = None
        if with_capability and (match := _CAPABILITY.fullmatch(parts[-1])):
            capability = (int(match[1]), int(match[2]))
        seen.add(index)
        gpus.append(GpuInfo(index, _clean_name(name), int(memory), capability))
        if len(gpus) >= MAX_GPUS:
            break
    return tuple(gpus)


def _clean_name(name: str) -> str:
    printable = "".join(ch for ch in name if ch.isprintable())
    return printable[:MAX_GPU_NAME_CHARS] or "GPU"


def _probe_nvml() -> tuple[GpuInfo, ...] | None:
    try:
        nvml: Any = importlib.import_module("pynvml")
    except ImportError:
        return None
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError: no driver, or no permission
        log.debug("NVML unavailable: %s", exc)
        return None
    try:
        gpus = []
        for index in range(min(int(nvml.nvmlDeviceGetCount()), MAX_GPUS)):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            vram = int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // (1 << 20)
            try:
                major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
                capability: tuple[int, int] | None = (int(major), int(minor))
            except Exception:
                capability = None
            gpus.append(GpuInfo(index, _clean_name(str(name)), vram, capability))
        return tuple(gpus)
    except Exception as exc:
        log.warning("NVML probe failed, trying nvidia-smi: %s", exc)
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvmlShutdown: %s", exc)


def _run_smi(path: str, query: str) -> tuple[int, str]:
    done = subprocess.run(
        [path, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
        capture_output=True,
        timeout=NVIDIA_SMI_TIMEOUT,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    return done.returncode, (done.stdout[:MAX_SMI_OUTPUT] + done.stderr[:4096]).decode(errors="replace")


def _probe_nvidia_smi() -> tuple[GpuInfo, ...] | None:
    path = shutil.which("nvidia-smi")
    if path is None:
        return None
    try:
        code, text = _run_smi(path, _QUERY)
        if code != 0 and "compute_cap" in text:  # drivers before ~510 do not know the field
            code, text = _run_smi(path, _QUERY.rsplit(",", 1)[0])
            return parse_nvidia_smi(text, with_capability=False) if code == 0 else None
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi failed: %s", exc)
        return None
    if code != 0:
        log.info("nvidia-smi exited with %d: %s", code, text.strip()[:200])
        return None
    return parse_nvidia_smi(text)


def _probe_torch() -> tuple[GpuInfo, ...] | None:
    """Ask torch only if something imported it already (the probe itself must stay cheap). Another thread
    may still be importing it (``join`` preloads torch beside the probe): then wait for that import to
    finish, which ``import_module`` does under the module's import lock, rather than read a half-made
    module ("partially initialized module 'torch' has no attribute 'cuda'", logged as a failure)."""
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return None
    if getattr(getattr(torch, "__spec__", None), "_initializing", False):
        torch = importlib.import_module("torch")
    try:
        if not torch.cuda.is_available():
            return ()
        gpus = []
        for index in range(min(int(torch.cuda.device_count()), MAX_GPUS)):
            props = torch.cuda.get_device_properties(index)
            gpus.append(
                GpuInfo(
                    index,
                    _clean_name(str(props.name)),
                    int(props.total_memory) // (1 << 20),
                    (int(props.major), int(props.minor)),
                )
            )
        return tuple(gpus)
    except Exception as exc:
        log.warning("torch.cuda probe failed: %s", exc)
        return None


def _find_gpus() -> tuple[str, tuple[GpuInfo, ...]]:
    for source, find in (("nvml", _probe_nvml), ("nvidia-smi", _probe_nvidia_smi), ("torch", _probe_torch)):
        found = find()
        if found is not None:
            return source, found
    return "none", ()


def select_gpus(
    found: tuple[GpuInfo, ...], selection: GpuSelection, source: str, visible: str | None
) -> tuple[GpuInfo, ...]:
    """Apply ``--gpu`` (and, for auto, ``CUDA_VISIBLE_DEVICES``) to the GPUs a probe found."""
    if selection.mode == "none":
        return ()
    if selection.mode == "auto":
        if visible is None or source == "torch":  # torch already numbers only the visible devices
            return found
        entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
        if not all(re.fullmatch(r"-?[0-9]{1,4}", entry) for entry in entries):
            return found  # UUIDs or MIG names: cannot map them to indices cheaply, keep all
        wanted: list[int] = []
        for entry in entries:  # CUDA stops at the first invalid index
            if int(entry) < 0:
                break
            wanted.append(int(entry))
        return tuple(gpu for gpu in found if gpu.index in wanted)
    by_index = {gpu.index: gpu for gpu in found}
    missing = [index for index in selection.indices if index not in by_index]
    if missing:
        have = ", ".join(str(gpu.index) for gpu in found) or "none"
        raise NodeError(
            f"--gpu {selection}: no GPU {', '.join(map(str, missing))} on this machine "
            f"(GPUs found: {have}, via {source})",
            reason="gpu_not_found",
        )
    return tuple(by_index[index] for index in selection.indices)


def _cgroup_limit(path: str) -> str | None:
    try:
        return Path(path).read_text()[:256].strip()
    except OSError:
        return None


def cpu_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cgroup_limit("/sys/fs/cgroup/cpu.max")
    if quota and (match := re.fullmatch(r"([0-9]{1,18}) ([0-9]{1,18})", quota)) and int(match[2]) > 0:
        cores = min(cores, max(1, math.ceil(int(match[1]) / int(match[2]))))
    return max(1, cores)


def ram_mib() -> int:
    """Physical RAM, capped by a cgroup v2 memory limit."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    limit = _cgroup_limit("/sys/fs/cgroup/memory.max")
    if limit and re.fullmatch(r"[0-9]{1,20}", limit) and total:
        total = min(total, int(limit))
    return total // (1 << 20)


def disk_free_mib(data_dir: Path) -> int:
    """Free space where the data dir is (or will be: its nearest existing parent)."""
    path = data_dir.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free // (1 << 20)
    except OSError:
        return 0


def probe(
    gpus: GpuSelection, data_dir: Path | None = None, *, env: Mapping[str, str] | None = None
) -> HardwareProfile:
    """This machine as the role policy sees it. Raises NodeError only if listed GPUs are not there."""
    environ = os.environ if env is None else env
    source, found = ("none", ()) if gpus.mode == "none" else _find_gpus()
    selected = select_gpus(found, gpus, source, environ.get("CUDA_VISIBLE_DEVICES"))
    return HardwareProfile(
        gpus=selected,
        cpu_cores=cpu_cores(),
        ram_mib=ram_mib(),
        disk_free_mib=disk_free_mib(data_dir if data_dir is not None else Path.cwd()),
        gpu_source=source,
    )


def to_summary(profile: HardwareProfile, device: str = "") -> HardwareSummary:
    """The heartbeat's short form; ``gpu_vram_mib`` is the total over the selected GPUs, ``device`` where
    the node's role computes (``select_device``; empty while it runs no model)."""
    cap = (1 << 31) - 1
    return HardwareSummary(
        cpu_cores=min(profile.cpu_cores, 1 << 16),
        ram_mib=min(profile.ram_mib, cap),
        gpu_count=min(profile.gpu_count, 1024),
        gpu_vram_mib=min(profile.total_vram_mib, cap),
        device=device,
    )


def cuda_device_count() -> int:
    """CUDA devices torch can use now (0 without a CUDA build or driver). Imports torch: call it only
    when a GPU was selected."""
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _torch_ordinal(gpu: GpuInfo, source: str, visible: str | None) -> int | None:
    """``gpu``'s index as torch numbers it (torch sees only ``CUDA_VISIBLE_DEVICES``, renumbered from 0);
    None when that variable hides it."""
    if source == "torch" or visible is None:
        return gpu.index
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if not all(re.fullmatch(r"-?[0-9]{1,4}", entry) for entry in entries):
        return gpu.index  # UUIDs or MIG names: keep the probe's numbering
    for position, entry in enumerate(entries):
        if int(entry) < 0:
            break
        if int(entry) == gpu.index:
            return position
    return None


def select_device(
    profile: HardwareProfile,
    selection: GpuSelection,
    *,
    rank: int = 0,
    env: Mapping[str, str] | None = None,
    cuda_devices: Callable[[], int] | None = None,
) -> str:
    """The one device policy: the torch device (``cpu`` or ``cuda:N``) that the ``rank``-th user of the
    ``--gpu`` selection computes on (an engine: rank 0; a torchrun trainer rank: its LOCAL_RANK).

    ``--gpu none``, or auto on a machine without GPUs, is the CPU. A selected GPU that torch cannot use now
    (``cuda_devices``, default ``cuda_device_count``; tests pass a fake) is a NodeError, never a silent
    CPU run."""
    if selection.mode == "none" or (selection.mode == "auto" and not profile.gpus):
        return "cpu"
    if rank >= len(profile.gpus):
        raise NodeError(
            f"trainer rank {rank} needs a GPU of its own but --gpu {selection} selects "
            f"{len(profile.gpus)}: start at most {len(profile.gpus)} ranks (--nproc), or pass --gpu none",
            reason="gpu_not_found",
        )
    gpu = profile.gpus[rank]
    environ = os.environ if env is None else env
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    ordinal = _torch_ordinal(gpu, profile.gpu_source, visible)
    if ordinal is None:
        raise NodeError(
            f"GPU {gpu.index} ({gpu.name}) is hidden by CUDA_VISIBLE_DEVICES={(visible or '')[:64]!r}: "
            "unset it or select a visible GPU with --gpu",
            reason="gpu_unavailable",
        )
    available = (cuda_devices or cuda_device_count)()
    if ordinal >= available:
        raise NodeError(
            f"GPU {gpu.index} ({gpu.name}) was found via {profile.gpu_source} but torch can use "
            f"{available} CUDA device(s) now (driver gone, or a CPU-only torch?): check nvidia-smi and "
            "`prime-node doctor`, or pass --gpu none to run on the CPU",
            reason="gpu_unavailable",
        )
    return f"cuda:{ordinal}"
