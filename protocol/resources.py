"""What a node has and what a run needs: the hardware and requirement records the role policy compares.

Pure records: ``prime_node/hardware.py`` probes the machine into a ``HardwareProfile`` (its GPUs as
``GpuInfo``), the run config's model shape becomes ``RunRequirements`` (weights, KV cache, the dtype and
the CPU speed it takes), and ``roles.choose_role`` weighs one against the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from protocol.errors import InvariantError

MIB = 1 << 20


def format_mib(mib: float) -> str:
    """Memory for people: ``512 MiB``, ``2.1 GiB``."""
    if not math.isfinite(mib):
        return "? MiB"
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib:.0f} MiB"


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as the probe saw it. ``compute_capability`` is None when the probe could not tell."""

    index: int
    name: str
    vram_mib: int
    compute_capability: tuple[int, int] | None = None

    @property
    def bf16(self) -> bool | None:
        """bfloat16 arithmetic needs compute capability 8.0 (Ampere) or newer."""
        return None if self.compute_capability is None else self.compute_capability >= (8, 0)


@dataclass(frozen=True)
class HardwareProfile:
    """What this node can offer: its (selected) GPUs, CPU cores, RAM and free disk of its data dir."""

    gpus: tuple[GpuInfo, ...]
    cpu_cores: int
    ram_mib: int
    disk_free_mib: int
    gpu_source: str = "none"
    """Where the GPU list came from: nvml, nvidia-smi, torch, or none."""
    cpu_decode_s_per_gb: float = 0.0
    """Measured: seconds one CPU decode step of the run's batch takes per GB of weights on the cores this
    node gives its role (measured once the run is known); 0 when not measured (the policy estimates it
    from ``cpu_cores``)."""

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    @property
    def total_vram_mib(self) -> int:
        return sum(gpu.vram_mib for gpu in self.gpus)

    @property
    def largest_vram_mib(self) -> int:
        return max((gpu.vram_mib for gpu in self.gpus), default=0)

    @property
    def bf16(self) -> bool | None:
        """True if every GPU does bf16, False if one does not, None if unknown or no GPU."""
        flags = [gpu.bf16 for gpu in self.gpus]
        if False in flags:
            return False
        return None if not flags or None in flags else True

    def describe(self) -> dict[str, Any]:
        """JSON-ready form for the status page."""
        return {
            "gpus": [
                {
                    "index": gpu.index,
                    "name": gpu.name,
                    "vram_mib": gpu.vram_mib,
                    "compute_capability": None
                    if gpu.compute_capability is None
                    else f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}",
                }
                for gpu in self.gpus
            ],
            "gpu_source": self.gpu_source,
            "cpu_cores": self.cpu_cores,
            "ram_mib": self.ram_mib,
            "disk_free_mib": self.disk_free_mib,
            "bf16": self.bf16,
            "cpu_decode_s_per_gb": round(self.cpu_decode_s_per_gb, 4),
        }


@dataclass(frozen=True)
class RunRequirements:
    """What running the run's model takes, from what a run config knows about the model."""

    param_count: int
    dtype_bytes: int = 2
    """Bytes per weight as served: 2 for bf16/fp16, 4 for fp32 (the tiny CPU models)."""
    context_tokens: int = 2048
    """Prompt plus completion tokens of one sequence (sizes the KV cache)."""
    kv_bytes_per_token: int = 0
    """KV-cache bytes per token of one sequence (2 x layers x kv width x dtype bytes); 0 if unknown."""
    concurrent_sequences: int = 1
    """Sequences an inferer keeps in flight at once (sizes the KV cache)."""
    cpu_ok: bool = False
    """The run allows inference on CPU (tiny models); otherwise an inferer needs a GPU."""
    min_tokens_per_s: float = 0.0
    """Slowest acceptable CPU inferer, in generated tokens per second (estimated, see RolePolicyConfig)."""
    multi_gpu: bool = False
    """The inference engine can shard the model over all of a node's GPUs (else: the largest one)."""
    needs_bf16: bool = False
    """The weights are bf16 and must be computed in bf16 (GPUs older than Ampere cannot)."""
    validator_dtype_bytes: int = 0
    """Bytes per weight a validator recomputes in; 0: ``dtype_bytes``."""
    validator_policies: int = 1
    """Policies a validator holds loaded at once (a batch is checked against the policy it was made with,
    and batches of the last async_level + 1 steps are accepted)."""
    validator_cpu_ok: bool = True
    """The run lets validators recompute on CPU (a run can admit only GPU validators)."""

    def __post_init__(self) -> None:
        if (
            min(
                self.param_count,
                self.dtype_bytes,
                self.context_tokens,
                self.concurrent_sequences,
                self.validator_policies,
            )
            < 1
        ):
            raise InvariantError(
                "param_count, dtype_bytes, context_tokens, concurrent_sequences and validator_policies "
                "must be >= 1",
                reason="bad_role_config",
            )
        if self.validator_dtype_bytes < 0:
            raise InvariantError("validator_dtype_bytes must be >= 0", reason="bad_role_config")
        if self.kv_bytes_per_token < 0 or not self.min_tokens_per_s >= 0:
            raise InvariantError(
                "kv_bytes_per_token and min_tokens_per_s must be >= 0", reason="bad_role_config"
            )

    @classmethod
    def for_model(
        cls,
        *,
        param_count: int,
        dtype_bytes: int,
        num_layers: int,
        kv_width: int,
        context_tokens: int,
        concurrent_sequences: int = 1,
        cpu_ok: bool = False,
        min_tokens_per_s: float = 0.0,
        needs_bf16: bool = False,
        validator_dtype_bytes: int = 0,
        validator_policies: int = 1,
        validator_cpu_ok: bool = True,
    ) -> RunRequirements:
        """From a transformer's shape: ``kv_width`` = key/value heads x head dim."""
        return cls(
            param_count=param_count,
            dtype_bytes=dtype_bytes,
            context_tokens=context_tokens,
            kv_bytes_per_token=2 * num_layers * kv_width * dtype_bytes,
            concurrent_sequences=concurrent_sequences,
            cpu_ok=cpu_ok,
            min_tokens_per_s=min_tokens_per_s,
            needs_bf16=needs_bf16,
            validator_dtype_bytes=validator_dtype_bytes,
            validator_policies=validator_policies,
            validator_cpu_ok=validator_cpu_ok,
        )

    @property
    def weights_mib(self) -> float:
        """One copy of the weights as an inferer holds them."""
        return self.param_count * self.dtype_bytes / MIB

    @property
    def validator_weights_mib(self) -> float:
        """Every policy a validator holds, in its dtype."""
        per_weight = self.validator_dtype_bytes or self.dtype_bytes
        return self.validator_policies * self.param_count * per_weight / MIB

    @property
    def kv_cache_mib(self) -> float:
        return self.kv_bytes_per_token * self.context_tokens * self.concurrent_sequences / MIB
