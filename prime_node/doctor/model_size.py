"""What the run's model takes on this machine: bytes per checkpoint, the checkpoints a node keeps, and the
requirements the role policy reads.

A joining node learns the model from the swarm (the pinned trainer's announcement, then the first
checkpoint's size: ``prime_node.roles.role_runner.requirements_for``). With ``--run RUN@0xTRAINER,BOOTSTRAP``
the doctor learns both the same way (``run_model.learn_run``, ``from_run``); otherwise it reads
``--model DIR`` (a local Hugging Face directory) or ``--run-config FILE`` (its ``model_dir`` and
``async_level``), else assumes ``DEFAULT_PARAMS`` in bf16: a model a home GPU can serve, and the largest
the role policy lets a CPU validate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from prime_node.config.run import RunConfig, load_run_config
from prime_node.doctor.run_model import RunModel
from prime_node.errors import NodeError
from prime_node.ml.vram_plan import ModelShape
from prime_node.roles.choice import requirements_for_shape
from prime_node.roles.role_runner import requirements_for
from protocol.resources import RunRequirements

DEFAULT_PARAMS: Final = 1_500_000_000
DEFAULT_DTYPE_BYTES: Final = 2
DEFAULT_CONTEXT_TOKENS: Final = 2048
JOIN_KEEP: Final = 3
"""``prime-node join`` keeps at least this many checkpoint versions (cli/node.py), and at least
``async_level + 1`` once the run is known (roles/role_runner.py)."""


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


def from_run(model: RunModel) -> ModelEstimate:
    """From what ``--run`` learnt: the run's config and its newest checkpoint. NodeError when neither
    the run nor a checkpoint of it was found (``model.error``)."""

    config = model.config
    if config is None or model.checkpoint_bytes is None:
        raise NodeError(model.error or "the run is not known", reason="bad_run")
    shape = model.shape
    run = f"run {model.run_id}: checkpoint step {model.step}"
    if shape is None:  # the peer served no config.json: the parameter count from the file sizes
        params = model.params_from_sizes or 0
        shape = ModelShape(params, 0, 0, layers=1, kv_heads=0, head_dim=0, vocab=0)
        source = (
            f"{run}, {params / 1e9:.3g} B parameters (from its file sizes in {config.published_dtype}; "
            "the KV cache is not counted: the peer did not serve config.json)"
        )
    else:
        source = (
            f"{run}, {shape.params / 1e9:.3g} B parameters, {shape.layers} layers "
            f"(its config.json and safetensors headers), inference in {config.inference_dtype} on "
            f"{'/'.join(config.inferer_devices)}"
        )
    return ModelEstimate(
        checkpoint_bytes=model.checkpoint_bytes,
        keep=max(JOIN_KEEP, config.async_level + 1),
        source=source,
        requirements=requirements_for_shape(config, shape),
    )
