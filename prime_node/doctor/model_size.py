"""What the run's model takes on this machine: bytes per checkpoint, the checkpoints a node keeps, and the
requirements the role policy reads.

A joining node learns the model from the swarm (the pinned trainer's announcement, then the first
checkpoint's size: ``prime_node.roles.runner.requirements_for``). The doctor runs before that, so it reads
``--model DIR`` (a local Hugging Face directory) or ``--run-config FILE`` (its ``model_dir`` and
``async_level``), else assumes ``DEFAULT_PARAMS`` in bf16: a model a home GPU can serve, and the largest
the role policy lets a CPU validate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from prime_node.config.run import RunConfig, load_run_config
from prime_node.errors import NodeError
from prime_node.roles.runner import requirements_for
from protocol.roles import RunRequirements

DEFAULT_PARAMS: Final = 1_500_000_000
DEFAULT_DTYPE_BYTES: Final = 2
DEFAULT_CONTEXT_TOKENS: Final = 2048
JOIN_KEEP: Final = 3
"""``prime-node join`` keeps at least this many checkpoint versions (cli/node.py), and at least
``async_level + 1`` once the run is known (roles/runner.py)."""


@dataclass(frozen=True)
class ModelEstimate:
    checkpoint_bytes: int
    keep: int
    """K: checkpoint versions a node holds at once."""
    source: str
    """Where the numbers come from, for the report."""
    requirements: RunRequirements

    @property
    def disk_needed_bytes(self) -> int:
        """K versions held plus one arriving (its pieces are on disk until it is complete)."""
        return (self.keep + 1) * self.checkpoint_bytes


def default_estimate(keep: int = JOIN_KEEP) -> ModelEstimate:
    requirements = RunRequirements(
        param_count=DEFAULT_PARAMS, dtype_bytes=DEFAULT_DTYPE_BYTES, context_tokens=DEFAULT_CONTEXT_TOKENS
    )
    return ModelEstimate(
        checkpoint_bytes=DEFAULT_PARAMS * DEFAULT_DTYPE_BYTES,
        keep=keep,
        source=f"default estimate: {DEFAULT_PARAMS / 1e9:.1f} B parameters in bf16 "
        "(pass --model or --run-config)",
        requirements=requirements,
    )


def estimate(model_dir: Path | None, run_config: Path | None) -> ModelEstimate:
    """From ``--model`` / ``--run-config`` (see the module doc). NodeError on an unreadable one."""
    config = load_run_config(run_config) if run_config is not None else RunConfig.model_validate({})
    keep = max(JOIN_KEEP, config.async_level + 1)
    directory = model_dir if model_dir is not None else config.model_dir if run_config is not None else None
    if directory is None:
        return default_estimate(keep)
    if not directory.is_dir():
        raise NodeError(f"model directory {directory} does not exist", reason="bad_config")
    size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    if size == 0:
        raise NodeError(f"{directory} holds no *.safetensors weights", reason="bad_config")
    return ModelEstimate(
        checkpoint_bytes=sum(p.stat().st_size for p in directory.iterdir() if p.is_file()),
        keep=keep,
        source=f"model {directory}",
        requirements=requirements_for(config, directory),
    )
