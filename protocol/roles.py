"""The role policy: which job a node takes in a run, decided from its hardware and the swarm's demand.

Pure and sans-IO: ``prime_node/hardware.py`` probes the machine into a ``HardwareProfile``, the run's
model becomes ``RunRequirements`` (both records are ``resources.py``'s), the node's services count the
swarm's signals into a ``SwarmDemand``, and ``choose_role`` turns them into a ``RoleDecision`` with a
reason a person can read. The caller keeps the returned ``RoleState`` and asks again as demand changes.

Rules, in order:

1. A pinned role (``--role``) always wins; pinning ``trainer`` without the run's trainer key is an error.
2. The holder of the run's trainer key is the trainer (only it may publish checkpoints).
3. A node that can neither infer nor validate the run's model seeds checkpoint pieces.
4. A node that can do only one of them does that one.
5. A node that can do both balances the swarm: it validates while validation lags (backlog at or above
   ``backlog_high``, or no validator at all while inferers produce) and infers once validation keeps up
   again (backlog at or below ``backlog_low`` with at least ``min_validators`` other validators). The gap
   between the two thresholds and a minimum dwell time in a role (``min_dwell_s``) keep it from flapping:
   between two demand-driven switches at least ``min_dwell_s`` pass, and under steady demand a node
   switches at most once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal, get_args

from protocol.errors import InvariantError, LocalProtocolError
from protocol.resources import HardwareProfile, RunRequirements, format_mib

Role = Literal["trainer", "inferer", "validator", "seeder"]
"""Every job a node can hold in a run: the one definition the config, records and services use."""
RoleSetting = Literal["auto", "trainer", "inferer", "validator", "seeder"]
"""What a node's config and peer record may say: a role, or ``auto`` before the policy has chosen."""
TRAINER: Final = "trainer"
INFERER: Final = "inferer"
VALIDATOR: Final = "validator"
SEEDER: Final = "seeder"
AUTO: Final = "auto"
ROLES: tuple[Role, ...] = get_args(Role)
ROLE_SETTINGS: tuple[RoleSetting, ...] = get_args(RoleSetting)


@dataclass(frozen=True)
class SwarmDemand:
    """What the swarm needs now, as this node sees it in gossip and peer records (others only, not self)."""

    backlog: int = 0
    """Rollout batches published but not yet validated."""
    inferers: int = 0
    """Other live nodes in the inferer role."""
    validators: int = 0
    """Other live nodes in the validator role."""
    validator_batches_per_s: float = 0.0
    """The swarm's recent validation throughput (only shown in reasons)."""


@dataclass(frozen=True)
class RolePolicyConfig:
    """How this node chooses: its pin and key, safety margins, and the hysteresis of switching."""

    pinned: str | None = None
    """``--role``: a fixed role (trainer, inferer, validator, seeder); None or "auto": the policy chooses."""
    holds_trainer_key: bool = False
    """This node's wallet is the run's trainer address."""
    vram_margin: float = 0.2
    """Fraction added to weights + KV cache for activations and fragmentation."""
    vram_overhead_mib: int = 1024
    """Fixed GPU memory taken by the CUDA context and allocator."""
    ram_margin: float = 0.5
    """Fraction added to weights + KV cache when the model runs on CPU (the OS and Python need room too)."""
    ram_overhead_mib: int = 512
    """Fixed RAM for the process itself when the model runs on CPU."""
    cpu_bytes_per_s_per_core: float = 2e9
    """Estimated weight bytes streamed per second per core while decoding (one sequence is memory-bound)."""
    cpu_flops_per_core: float = 2e10
    """Estimated FLOP/s per core of a batched decode's matrix products (a batch is compute-bound). Measured
    (``cpu_compute.measure_cpu_decode``, batch 64) per core of a busy 2-core EPYC VM: ~9e9 in float32, ~5e9
    in bfloat16 (no native bf16); the measurement replaces this estimate wherever a node takes one."""
    cpu_validator_max_params: int = 1_500_000_000
    """Validation is one prefill per batch, so CPU validation is fine for models up to this size."""
    backlog_high: int = 8
    """An inferer turns validator at or above this many unvalidated batches."""
    backlog_low: int = 2
    """A validator turns inferer at or below this many unvalidated batches (must be < backlog_high)."""
    min_validators: int = 1
    """A validator stays while fewer than this many other validators are live (must be >= 1)."""
    min_dwell_s: float = 60.0
    """Least time in a role before a demand-driven switch."""

    def __post_init__(self) -> None:
        if self.pinned is not None and self.pinned not in ROLE_SETTINGS:
            raise InvariantError(
                f"unknown role {self.pinned[:16]!r}: expected one of {', '.join(ROLES)} or auto",
                reason="bad_role_config",
            )
        if not 0 <= self.backlog_low < self.backlog_high:
            raise InvariantError(
                "need 0 <= backlog_low < backlog_high (the gap is the hysteresis)", reason="bad_role_config"
            )
        if self.min_validators < 1:
            raise InvariantError(
                "min_validators must be >= 1, or the last validator could leave", reason="bad_role_config"
            )
        if not (self.min_dwell_s >= 0 and self.vram_margin >= 0 and self.ram_margin >= 0):
            raise InvariantError("min_dwell_s and the margins must be >= 0", reason="bad_role_config")
        if not (self.cpu_bytes_per_s_per_core > 0 and self.cpu_flops_per_core > 0):
            raise InvariantError(
                "cpu_bytes_per_s_per_core and cpu_flops_per_core must be > 0", reason="bad_role_config"
            )

    @property
    def pin(self) -> Role | None:
        """The pinned role, or None when the policy chooses (``auto`` or no pin)."""
        return next((role for role in ROLES if role == self.pinned), None)


@dataclass(frozen=True)
class RoleState:
    """The role a node holds and since when (the caller's clock, seconds)."""

    role: Role
    since: float


@dataclass(frozen=True)
class RoleDecision:
    role: Role
    reason: str
    changed: bool

    def next_state(self, current: RoleState | None, now: float) -> RoleState:
        """The state to keep for the next call: ``since`` moves only when the role changed."""
        if current is None or self.changed:
            return RoleState(self.role, now)
        return current


@dataclass(frozen=True)
class Fit:
    """Whether a node can take on a job, and why in words."""

    ok: bool
    why: str
    on_gpu: bool = field(default=False)


def _gpu_fit(
    profile: HardwareProfile, req: RunRequirements, policy: RolePolicyConfig, weights_mib: float
) -> Fit:
    needed = (weights_mib + req.kv_cache_mib) * (1 + policy.vram_margin) + policy.vram_overhead_mib
    if profile.gpu_count == 0:
        return Fit(False, f"no GPU ({format_mib(needed)} VRAM needed)")
    if req.needs_bf16 and profile.bf16 is False:
        return Fit(False, "a GPU lacks bf16 (compute capability < 8.0)")
    usable = profile.total_vram_mib if req.multi_gpu else profile.largest_vram_mib
    if usable >= needed:
        return Fit(True, f"{format_mib(usable)} VRAM >= {format_mib(needed)} needed", on_gpu=True)
    return Fit(False, f"{format_mib(usable)} VRAM < {format_mib(needed)} needed")


def _ram_fit(
    profile: HardwareProfile, req: RunRequirements, policy: RolePolicyConfig, weights_mib: float
) -> Fit:
    needed = (weights_mib + req.kv_cache_mib) * (1 + policy.ram_margin) + policy.ram_overhead_mib
    if profile.ram_mib >= needed:
        return Fit(True, f"{format_mib(profile.ram_mib)} RAM >= {format_mib(needed)} needed")
    return Fit(False, f"{format_mib(profile.ram_mib)} RAM < {format_mib(needed)} needed")


def cpu_tokens_per_s(profile: HardwareProfile, req: RunRequirements, policy: RolePolicyConfig) -> float:
    """Tokens per second a CPU inferer generates over the run's batch (``concurrent_sequences`` decoded
    together): every decode step streams all weights through the cores once and multiplies them with each
    sequence's state, so a step takes the longer of the two. A measured step
    (``profile.cpu_decode_s_per_gb``) replaces the estimate. Python overhead is left out: it only matters
    for models small enough to be fast anyway."""
    weight_bytes = req.param_count * req.dtype_bytes
    if profile.cpu_decode_s_per_gb > 0:
        step_s = profile.cpu_decode_s_per_gb * weight_bytes / 1e9
    else:
        cores = max(1, profile.cpu_cores)
        stream_s = weight_bytes / (cores * policy.cpu_bytes_per_s_per_core)
        compute_s = 2 * req.param_count * req.concurrent_sequences / (cores * policy.cpu_flops_per_core)
        step_s = max(stream_s, compute_s)
    return req.concurrent_sequences / step_s


def inference_fit(profile: HardwareProfile, req: RunRequirements, policy: RolePolicyConfig) -> Fit:
    """Can this node generate rollouts fast enough: on a GPU with room to spare, or on CPU if allowed."""
    gpu = _gpu_fit(profile, req, policy, req.weights_mib)
    if gpu.ok:
        return gpu
    if not req.cpu_ok:
        return Fit(False, f"{gpu.why}; the run does not allow CPU inference")
    ram = _ram_fit(profile, req, policy, req.weights_mib)
    if not ram.ok:
        return Fit(False, f"{gpu.why}; CPU: {ram.why}")
    speed = cpu_tokens_per_s(profile, req, policy)
    if speed < req.min_tokens_per_s:
        return Fit(False, f"CPU: ~{speed:.3g} tokens/s < {req.min_tokens_per_s:.3g} needed")
    return Fit(True, f"CPU: {ram.why}, ~{speed:.3g} tokens/s >= {req.min_tokens_per_s:.3g} needed")


def validation_fit(profile: HardwareProfile, req: RunRequirements, policy: RolePolicyConfig) -> Fit:
    """Can this node check proofs (one prefill per batch) holding every policy it may need: on a GPU, or
    on CPU for small models when the run allows it."""
    weights = req.validator_weights_mib
    gpu = _gpu_fit(profile, req, policy, weights)
    if gpu.ok:
        return gpu
    if not req.validator_cpu_ok:
        return Fit(False, f"{gpu.why}; the run does not allow CPU validation")
    # A prefill is cheaper than decoding the same tokens: where CPU inference keeps up, so does validation.
    keeps_up = req.cpu_ok and cpu_tokens_per_s(profile, req, policy) >= req.min_tokens_per_s
    if not (keeps_up or req.param_count <= policy.cpu_validator_max_params):
        return Fit(False, f"{gpu.why}; too large to validate on CPU")
    ram = _ram_fit(profile, req, policy, weights)
    return Fit(ram.ok, f"CPU: {ram.why}" if ram.ok else f"{gpu.why}; CPU: {ram.why}")


def choose_role(
    profile: HardwareProfile,
    requirements: RunRequirements,
    demand: SwarmDemand,
    current: RoleState | None,
    now: float,
    policy: RolePolicyConfig,
) -> RoleDecision:
    """This node's role now. Raises LocalProtocolError if ``trainer`` is pinned without the trainer key."""
    previous = None if current is None else current.role
    pin = policy.pin
    if pin == TRAINER and not policy.holds_trainer_key:
        raise LocalProtocolError(
            "--role trainer needs the run's trainer key (this wallet is not the run's trainer_address)",
            reason="not_trainer_key",
        )
    infer = inference_fit(profile, requirements, policy)
    validate = validation_fit(profile, requirements, policy)
    if pin is not None:
        fit = {INFERER: infer, VALIDATOR: validate}.get(pin)
        note = "" if fit is None else f" ({fit.why})" if fit.ok else f" (warning: {fit.why})"
        return RoleDecision(pin, f"{pin}: pinned by --role{note}", pin != previous)
    if policy.holds_trainer_key:
        return RoleDecision(TRAINER, "trainer: this node holds the run's trainer key", previous != TRAINER)
    if not infer.ok and not validate.ok:
        reason = f"seeder: cannot infer ({infer.why}) nor validate ({validate.why})"
        return RoleDecision(SEEDER, reason, previous != SEEDER)
    if not validate.ok:
        reason = f"inferer: {infer.why}; cannot validate ({validate.why})"
        return RoleDecision(INFERER, reason, previous != INFERER)
    if not infer.ok:
        reason = f"validator: {validate.why}; cannot infer ({infer.why})"
        return RoleDecision(VALIDATOR, reason, previous != VALIDATOR)
    return _balance(infer, demand, current, now, policy)


def _balance(
    infer: Fit, demand: SwarmDemand, current: RoleState | None, now: float, policy: RolePolicyConfig
) -> RoleDecision:
    """Both jobs fit: follow demand, with a threshold gap and a minimum dwell time."""
    backlog = demand.backlog
    to_validator = None
    if backlog >= policy.backlog_high:
        to_validator = f"backlog {backlog} >= {policy.backlog_high}"
    elif demand.validators == 0 and demand.inferers >= 1:
        to_validator = f"no validator for {demand.inferers} inferer(s)"
    to_inferer = None
    if backlog <= policy.backlog_low and demand.validators >= policy.min_validators:
        to_inferer = f"backlog {backlog} <= {policy.backlog_low}, {demand.validators} other validator(s)"
    throughput = (
        f", validation {demand.validator_batches_per_s:.2f} batches/s"
        if demand.validator_batches_per_s > 0
        else ""
    )
    stay_inferer = f"inferer: {infer.why}; backlog {backlog} < {policy.backlog_high}{throughput}"
    held = None if current is None or current.role not in (INFERER, VALIDATOR) else current
    role: Role
    target: Role
    if held is None:
        if to_validator is not None:
            role, reason = VALIDATOR, f"validator: {to_validator}{throughput}"
        else:
            role, reason = INFERER, stay_inferer
        return RoleDecision(role, reason, current is None or current.role != role)
    if held.role == INFERER:
        target, why = (VALIDATOR, to_validator) if to_validator is not None else (INFERER, None)
        stay = stay_inferer
    else:
        target, why = (INFERER, to_inferer) if to_inferer is not None else (VALIDATOR, None)
        if backlog > policy.backlog_low:
            stay = f"validator: backlog {backlog} > {policy.backlog_low}{throughput}"
        else:
            stay = f"validator: only {demand.validators} other validator(s) (< {policy.min_validators})"
    if why is None:
        return RoleDecision(held.role, stay, False)
    dwelt = now - held.since
    if dwelt < policy.min_dwell_s:
        reason = (
            f"{held.role}: would switch to {target} ({why}) but has been {held.role} for "
            f"{max(dwelt, 0.0):.0f} s < {policy.min_dwell_s:.0f} s"
        )
        return RoleDecision(held.role, reason, False)
    return RoleDecision(target, f"{target}: {why}{throughput}", True)
