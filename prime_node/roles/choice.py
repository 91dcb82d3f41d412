"""The one place that turns (hardware, run, model, demand) into a role: ``join``'s runner calls it every
interval, and ``doctor --run`` calls it once with the same inputs (an empty swarm), so the doctor's
answer is what ``join`` would do on this machine, never an estimate of it.

``requirements_for_shape``: what the run's model needs, from its shape (parameter count, layers, KV
heads) and the run's config (dtypes, batch, devices allowed). ``decide_role``: the pure policy
(``protocol.roles.choose_role``) with the runner's settings; NodeError ``bad_role`` for a role this
node may not take (``--role trainer`` without the trainer's key).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from prime_node.config import RunConfig
from prime_node.errors import NodeError
from protocol.errors import LocalProtocolError
from protocol.resources import HardwareProfile, RunRequirements
from protocol.roles import RoleDecision, RolePolicyConfig, RoleState, SwarmDemand, choose_role

if TYPE_CHECKING:
    from prime_node.ml.vram_plan import ModelShape

PROMPT_TOKENS_ESTIMATE: Final = 64
"""Prompt tokens assumed per sequence when sizing the KV cache before any task is built."""
CPU_STEP_BUDGET_S: Final = 60.0
"""A policy step of a run small enough for CPU inferers takes about this long at most (the 0.44B model's
networked step on 2 cores: 24-30 s). A batch is still trained on while its policy is at most
``async_level`` steps old, so a CPU inferer is useful when it generates a batch within
``async_level + 1`` such steps."""
DTYPE_BYTES: Final = {"float32": 4, "bfloat16": 2}


def needed_tokens_per_s(config: RunConfig) -> float:
    """The slowest useful CPU inferer of the run: one batch (``samples_per_step`` x ``max_new_tokens``
    generated tokens) within ``async_level + 1`` policy steps of ``CPU_STEP_BUDGET_S``."""
    tokens = config.samples_per_step * config.max_new_tokens
    return tokens / (CPU_STEP_BUDGET_S * (config.async_level + 1))


def requirements_for_shape(config: RunConfig, shape: ModelShape) -> RunRequirements:
    """What the run's model needs: memory in the dtype each role computes in (inferers
    ``inference_dtype``; validators ``validator_dtype``, one copy per policy they keep), the KV cache of
    the run's batch, and whether the run lets them compute on the CPU (``inferer_devices``,
    ``validator_devices``). NodeError ``bad_model_dir`` for a model without weights."""
    if shape.params < 1:
        raise NodeError("the model holds no weights (empty safetensors headers)", reason="bad_model_dir")
    return RunRequirements.for_model(
        param_count=shape.params,
        dtype_bytes=DTYPE_BYTES[config.inference_dtype],
        num_layers=max(1, shape.layers),
        kv_width=max(0, shape.kv_heads * shape.head_dim),
        context_tokens=PROMPT_TOKENS_ESTIMATE + config.max_new_tokens,
        concurrent_sequences=config.samples_per_step,
        cpu_ok="cpu" in config.inferer_devices,
        min_tokens_per_s=needed_tokens_per_s(config),
        validator_dtype_bytes=DTYPE_BYTES[config.validator_dtype],
        validator_policies=config.async_level + 1,
        validator_cpu_ok="cpu" in config.validator_devices,
    )


def holds_trainer_key(config: RunConfig, address: object) -> bool:
    """Whether ``address`` (this node's wallet) is the run's trainer."""
    trainer = config.trainer_address
    return trainer is not None and trainer.lower() == str(address).lower()


def decide_role(
    profile: HardwareProfile,
    requirements: RunRequirements,
    demand: SwarmDemand,
    state: RoleState | None,
    now: float,
    *,
    pinned: str | None,
    holds_trainer_key: bool,
    min_dwell_s: float,
) -> RoleDecision:
    """The role to hold now (see the module doc); ``pinned`` None or "auto" lets the policy choose."""
    try:
        policy = RolePolicyConfig(
            pinned=None if pinned in (None, "auto") else pinned,
            holds_trainer_key=holds_trainer_key,
            min_dwell_s=min_dwell_s,
        )
        return choose_role(profile, requirements, demand, state, now, policy)
    except LocalProtocolError as exc:  # --role trainer without the trainer key, an unknown role
        raise NodeError(str(exc), reason="bad_role") from exc
