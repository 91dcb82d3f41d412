"""Python, torch and CUDA: present, the versions the project pins, and a torch build the GPU can run.

Facts are read without importing torch where possible (its version from package metadata, its CUDA build
from ``torch/version.py``): importing it takes seconds. Only on a machine with an NVIDIA GPU and a CUDA
build of torch is torch imported, to ask whether it can actually use the GPU.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from prime_node.doctor.report import FAIL, PASS, WARN, Check

log = logging.getLogger(__name__)
PYTHON_MIN: Final = (3, 11)
"""pyproject.toml: requires-python >= 3.11."""
TORCH_MIN: Final = (2, 4)
"""pyproject.toml: torch>=2.4 (scripts/install.sh picks the build)."""
CPU_TORCH_PIN: Final = "2.13.0"
"""scripts/install.sh: the CPU build installed where there is no NVIDIA GPU (proof thresholds were
calibrated with it)."""
INSTALL_FIX: Final = (
    "run scripts/install.sh from the prime-node checkout (it installs the torch build for this machine)"
)
CPU_WHEEL_FIX: Final = f".venv/bin/pip install --force-reinstall torch=={CPU_TORCH_PIN} --index-url https://download.pytorch.org/whl/cpu"
SMI_TIMEOUT_S: Final = 3.0
_VERSION = re.compile(r"([0-9]+)\.([0-9]+)")
_TORCH_CUDA = re.compile(r"^cuda\s*(?::[^=]*)?=\s*['\"]([0-9]+\.[0-9]+)", re.MULTILINE)


@dataclass(frozen=True)
class SoftwareFacts:
    python: tuple[int, int, int]
    executable: str
    torch_version: str | None
    """Installed torch (package metadata, e.g. ``2.13.0+cpu``); None if torch is not installed."""
    torch_cuda: str | None
    """CUDA version the installed torch was built for (``12.4``); None for a CPU build."""
    gpu_count: int
    driver_version: str | None = None
    driver_cuda: str | None = None
    """The newest CUDA version the NVIDIA driver supports; None without a driver."""
    cuda_usable: bool | None = None
    """``torch.cuda.is_available()`` (asked only with a GPU and a CUDA build)."""


def _major_minor(text: str | None) -> tuple[int, int] | None:
    match = _VERSION.match(text or "")
    return (int(match[1]), int(match[2])) if match else None


def check_python(facts: SoftwareFacts) -> Check:
    version = ".".join(map(str, facts.python))
    details = {"version": version, "executable": facts.executable, "required": ">=3.11"}
    if facts.python[:2] < PYTHON_MIN:
        return Check(
            "python",
            FAIL,
            f"Python {version} is older than 3.11",
            "install Python 3.11 or newer, then " + INSTALL_FIX,
            details,
        )
    return Check("python", PASS, f"Python {version} ({facts.executable})", None, details)


def check_torch(facts: SoftwareFacts) -> Check:
    """torch installed, recent enough, and a build that fits the machine (see the module doc)."""
    details: dict[str, Any] = {
        "torch": facts.torch_version,
        "torch_cuda": facts.torch_cuda,
        "driver": facts.driver_version,
        "driver_cuda": facts.driver_cuda,
        "gpu_count": facts.gpu_count,
        "cuda_usable": facts.cuda_usable,
        "required": f">={TORCH_MIN[0]}.{TORCH_MIN[1]} (CPU machines: {CPU_TORCH_PIN})",
    }
    version = facts.torch_version
    if version is None:
        return Check("torch", FAIL, "torch is not installed", INSTALL_FIX, details)
    found = _major_minor(version)
    if found is None or found < TORCH_MIN:
        return Check(
            "torch",
            FAIL,
            f"torch {version} is older than {TORCH_MIN[0]}.{TORCH_MIN[1]}",
            INSTALL_FIX,
            details,
        )
    if facts.gpu_count == 0:
        if facts.torch_cuda is not None:
            return Check(
                "torch",
                WARN,
                f"torch {version} is a CUDA {facts.torch_cuda} build but this machine has no NVIDIA GPU "
                "(it runs on CPU)",
                f"optional, saves GBs: {CPU_WHEEL_FIX}",
                details,
            )
        if version.split("+")[0] != CPU_TORCH_PIN:
            return Check(
                "torch",
                WARN,
                f"torch {version} (CPU build) differs from the pinned {CPU_TORCH_PIN} that proof thresholds "
                "were calibrated with",
                CPU_WHEEL_FIX,
                details,
            )
        return Check(
            "torch", PASS, f"torch {version}, CPU build (no NVIDIA GPU here, none needed)", None, details
        )
    if facts.torch_cuda is None:
        return Check(
            "torch",
            FAIL,
            f"torch {version} is a CPU build but this machine has {facts.gpu_count} NVIDIA GPU(s)",
            ".venv/bin/pip install --force-reinstall torch  (the CUDA build), or join with --gpu none",
            details,
        )
    built, driver = _major_minor(facts.torch_cuda), _major_minor(facts.driver_cuda)
    if built is not None and driver is not None and built[0] > driver[0]:
        return Check(
            "torch",
            FAIL,
            f"torch {version} needs CUDA {facts.torch_cuda}; the NVIDIA driver {facts.driver_version} "
            f"supports CUDA {facts.driver_cuda}",
            f"update the NVIDIA driver to one supporting CUDA {facts.torch_cuda}, or install a torch "
            f"built for CUDA {driver[0]}.x (https://pytorch.org/get-started/locally/)",
            details,
        )
    if facts.cuda_usable is False:
        return Check(
            "torch",
            FAIL,
            f"torch {version} (CUDA {facts.torch_cuda}) cannot use the GPU "
            "(torch.cuda.is_available() is False)",
            "check the driver with nvidia-smi (and CUDA_VISIBLE_DEVICES), then reinstall torch: "
            + INSTALL_FIX,
            details,
        )
    driver_text = (
        f"driver {facts.driver_version} (CUDA {facts.driver_cuda})"
        if facts.driver_version
        else "driver version unknown"
    )
    if built is not None and driver is not None and built > driver:
        return Check(
            "torch",
            WARN,
            f"torch {version} is built for CUDA {facts.torch_cuda}, newer than the {driver_text}: "
            "minor-version compatibility usually works, some kernels may not",
            f"update the NVIDIA driver to one supporting CUDA {facts.torch_cuda}",
            details,
        )
    return Check(
        "torch",
        PASS,
        f"torch {version}, CUDA {facts.torch_cuda} build, {driver_text}, GPU usable",
        None,
        details,
    )


# -- gathering --------------------------------------------------------------------------------------------


def torch_cuda_build() -> str | None:
    """The CUDA version in ``torch/version.py``, read as text (no torch import); None: CPU build or none."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        try:
            text = (Path(location) / "version.py").read_text(encoding="utf-8", errors="replace")[:8192]
        except OSError:
            continue
        return parse_torch_cuda(text)
    return None


def parse_torch_cuda(version_py: str) -> str | None:
    """The ``cuda = '12.4'`` line of torch's generated ``version.py``; None for ``cuda = None``."""
    match = _TORCH_CUDA.search(version_py)
    return match[1] if match else None


def parse_smi_banner(banner: str) -> tuple[str | None, str | None]:
    """(driver version, CUDA version) from the header ``nvidia-smi`` prints without arguments."""
    driver = re.search(r"Driver Version:\s*([0-9.]{1,32})", banner)
    cuda = re.search(r"CUDA Version:\s*([0-9]{1,3}\.[0-9]{1,3})", banner)
    return (driver[1] if driver else None), (cuda[1] if cuda else None)


def driver_info() -> tuple[str | None, str | None]:
    """(driver version, newest CUDA it supports) from NVML, else the ``nvidia-smi`` banner."""
    try:
        nvml: Any = importlib.import_module("pynvml")
        nvml.nvmlInit()
        try:
            driver = nvml.nvmlSystemGetDriverVersion()
            cuda = int(nvml.nvmlSystemGetCudaDriverVersion())
            text = driver.decode() if isinstance(driver, bytes) else str(driver)
            return text[:32], f"{cuda // 1000}.{cuda % 1000 // 10}"
        finally:
            nvml.nvmlShutdown()
    except Exception as exc:  # no pynvml, no driver, no permission: try nvidia-smi
        log.debug("NVML driver query failed: %s", exc)
    path = shutil.which("nvidia-smi")
    if path is None:
        return None, None
    try:
        done = subprocess.run(
            [path], capture_output=True, timeout=SMI_TIMEOUT_S, check=False, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("nvidia-smi failed: %s", exc)
        return None, None
    return parse_smi_banner(done.stdout[:8192].decode(errors="replace"))


def _cuda_usable() -> bool | None:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception as exc:  # a broken install raises all kinds of errors on import
        log.debug("importing torch failed: %s", exc)
        return False


def gather_software(gpu_count: int) -> SoftwareFacts:
    try:
        torch_version: str | None = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    torch_cuda = torch_cuda_build() if torch_version is not None else None
    driver, driver_cuda = driver_info() if gpu_count else (None, None)
    usable = _cuda_usable() if gpu_count and torch_cuda is not None else None
    major, minor, micro = sys.version_info[:3]
    return SoftwareFacts(
        python=(major, minor, micro),
        executable=sys.executable,
        torch_version=torch_version,
        torch_cuda=torch_cuda,
        gpu_count=gpu_count,
        driver_version=driver,
        driver_cuda=driver_cuda,
        cuda_usable=usable,
    )
