"""The run configuration: one TOML file describes a training run for every role.

Loading order: the TOML file, then environment variables ``PRIME_NODE_RUN__<FIELD>`` (nested fields
joined by ``__``, e.g. ``PRIME_NODE_RUN__TASK__KIND=math``), then explicit overrides from CLI flags.
Any invalid value is reported as one line naming the field: ``run.toml: grpo field eps_low: ...``.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from crypto.errors import CryptoError
from crypto.keys import Address
from prime_node.config.problems import describe_problems, env_origins
from prime_node.errors import NodeError
from protocol.envelope import Envelope
from protocol.names import RUN_ID_PATTERN
from protocol.rollouts import MAX_PROMPT_TOKENS, proof_size

MAX_ROLLOUT_FRAME = Envelope.MAX_BYTES
"""The largest sealed rollout batch the wire format carries (one envelope frame)."""
SAMPLE_OVERHEAD_BYTES = 64
"""A sample's encoding beyond its token, log-prob and proof bytes (task id, seed, headers)."""
FRAME_OVERHEAD_BYTES = 4096
"""A batch frame's encoding beyond its samples (header, envelope, signature), generously."""


def honest_batch_bytes(*, samples: int, max_new_tokens: int) -> int:
    """The most bytes an honest sealed batch of ``samples`` completions of at most ``max_new_tokens``
    tokens can take, with a 1/8 margin: per sample the wire format's longest prompt (the config cannot
    know the task's tokenized prompts: validators check those per batch), the completion's token ids and
    log-probs and its TOPLOC proof."""
    per_sample = 4 * MAX_PROMPT_TOKENS + 8 * max_new_tokens + proof_size(max_new_tokens)
    return (samples * (per_sample + SAMPLE_OVERHEAD_BYTES)) * 9 // 8 + FRAME_OVERHEAD_BYTES


ENV_PREFIX = "PRIME_NODE_RUN__"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class TaskConfig(_Strict):
    """Which verifiable task the run trains on."""

    kind: Literal["arithmetic", "math", "code"] = "arithmetic"
    """Task family: procedural addition (the demo), exact-answer math, or Python code with tests."""
    path: Path | None = None
    """JSONL or parquet file of tasks (math: question/answer; code: prompt/tests). Unused by arithmetic."""
    digits: int = Field(2, ge=1, le=6)
    """Arithmetic: digits per operand."""
    reverse_answer: bool = True
    """Arithmetic: write the sum least-significant digit first (learnable by tiny models)."""
    code_timeout_s: float = Field(5.0, gt=0, le=120)
    """Code: wall-clock limit of one test run; a timeout scores 0."""
    code_memory_mb: int = Field(512, ge=64, le=65536)
    """Code: address-space limit of one test run, in MiB."""
    chat: bool = False
    """Math: pose each question as a user turn through the model's chat template, asking for a
    \\boxed{} answer (the model directory's tokenizer must have a chat template)."""

    @model_validator(mode="after")
    def _needs_path(self) -> TaskConfig:
        if self.kind != "arithmetic" and self.path is None:
            raise ValueError(f"task kind {self.kind!r} needs a path to its task file")
        if self.chat and self.kind != "math":
            raise ValueError("task.chat is supported by the math task only")
        return self


class LengthRewardConfig(_Strict):
    """Optional reward toward a target completion length, added to the checker's score."""

    coef: float = Field(0.0, ge=0, le=10)
    """Weight of the bonus coef * max(0, 1 - |n - target| / target); 0 disables it."""
    target_tokens: int = Field(0, ge=0, le=1 << 20)
    """Completion length (tokens) that earns the full bonus."""


class RunConfig(_Strict):
    """Everything that defines a training run. Every role of every node reads the same file."""

    run_id: str = Field("demo", pattern=RUN_ID_PATTERN)
    """Name of the run: part of every signed message's domain and of the DHT key."""
    model_dir: Path | None = None
    """Local Hugging Face-format model directory to start from (config, tokenizer, safetensors)."""
    output_dir: Path = Path("runs/demo")
    """Where the trainer writes checkpoints (one HF directory per step) and its rollout log."""
    trainer_address: str | None = Field(None, pattern=r"^0x[0-9a-fA-F]{40}$")
    """Ethereum address of the run's trainer key; only it may publish checkpoints."""
    task: TaskConfig = Field(default_factory=lambda: TaskConfig.model_validate({}))
    """The verifiable task."""
    length_reward: LengthRewardConfig = Field(default_factory=lambda: LengthRewardConfig.model_validate({}))
    """Optional length shaping of the reward."""

    group_size: int = Field(8, ge=2, le=1024)
    """Completions sampled per task (G); advantages are normalised within each group."""
    prompts_per_step: int = Field(16, ge=1, le=4096)
    """Tasks (groups) per rollout batch and per optimizer step."""
    micro_batch_samples: int = Field(256, ge=1, le=65536)
    """Samples per forward/backward chunk in the trainer (gradient accumulation beyond it)."""
    max_new_tokens: int = Field(8, ge=1, le=16384)
    """Longest completion, in tokens."""
    temperature: float = Field(0.7, ge=0, le=100)
    """Sampling temperature of rollouts (part of the replayable sampling rule)."""
    max_steps: int = Field(100, ge=0)
    """Optimizer steps to run (the trainer stops there)."""

    learning_rate: float = Field(5e-4, gt=0, le=1)
    """AdamW learning rate."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """How the learning rate changes over ``max_steps`` (prime_node/ml/lr_schedule.py): "constant", or a
    "linear" / "cosine" decay to ``learning_rate * lr_min_ratio`` at ``max_steps``."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up to ``learning_rate`` before the schedule starts."""
    lr_min_ratio: float = Field(0.0, ge=0, le=1)
    """Where a decaying schedule ends, as a fraction of ``learning_rate``."""
    weight_decay: float = Field(0.0, ge=0, le=1)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    eps_low: float = Field(0.2, ge=0, lt=1)
    """PPO clip: the ratio may fall to 1 - eps_low before its gradient is cut."""
    eps_high: float = Field(0.28, ge=0, le=10)
    """PPO clip: the ratio may rise to 1 + eps_high before its gradient is cut."""
    delta: float = Field(4.0, gt=1, le=100)
    """Two-sided clipping: for negative advantages the ratio is capped at delta."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty (k3 estimator) toward the initial model; 0 disables it."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus; 0 disables it."""
    objective: Literal["recompute", "behaviour", "decoupled", "masked_is"] = "behaviour"
    """Off-policy correction of stale rollouts (docs/rl.md, *Off-policy correction*, where the
    benchmarks/offpolicy.py ablation picks the default): "recompute" clips around the generating
    policy's log-probs recomputed by the trainer (an extra forward pass and a copy of the model);
    "behaviour" clips the same way around the inferer's verified behaviour log-probs mu (no extra
    forward pass: the ratio pi / mu is a truncated importance weight); "decoupled" clips around the
    trainer's current weights and multiplies each token by the truncated importance weight
    min(pi_prox / mu, is_cap) from mu; "masked_is" weighs each token by pi / mu, drops the policy
    gradient of tokens whose ratio leaves [is_mask_low, is_mask_high] and adds
    is_kl_coef * (log pi/mu)^2."""
    is_cap: float = Field(2.0, ge=1, le=1000)
    """decoupled: cap of the truncated importance weight pi_prox / mu (bounds the variance a very stale
    or unlucky token can add)."""
    is_mask_low: float = Field(0.5, gt=0, le=1)
    """masked_is: tokens with pi / mu below this carry no policy gradient."""
    is_mask_high: float = Field(2.0, ge=1, le=1000)
    """masked_is: tokens with pi / mu above this carry no policy gradient."""
    is_kl_coef: float = Field(1e-3, ge=0)
    """masked_is: weight of the (log pi/mu)^2 penalty on every completion token; 0 disables it."""

    async_level: int = Field(2, ge=0, le=16)
    """Staleness bound: rollouts from policy step >= current - async_level are accepted."""
    max_rollout_batch_bytes: int = Field(MAX_ROLLOUT_FRAME, ge=1 << 10, le=MAX_ROLLOUT_FRAME)
    """Largest sealed rollout-batch frame, in bytes: inferers refuse to publish a bigger one, validators
    and the trainer refuse its announcement before fetching a byte (docs/verification.md, *Rollout
    batches over the data plane*). Left unset, it is derived from the run's shapes: the most an honest
    batch of ``prompts_per_step`` groups of ``group_size`` completions of ``max_new_tokens`` can take
    (``honest_batch_bytes``), at most the wire format's envelope cap; set, it overrides that (e.g. lower,
    for a task whose prompts are known to be short)."""
    local_inference: Literal["thread", "process"] = "process"
    """--local: generate in a child process (no GIL shared with training: measured faster), or in a
    thread of the trainer process."""
    engine: Literal["torch"] = "torch"
    """Inference engine family every role builds (``prime_node.ml.engines.setup_engine``): ``torch`` is
    transformers on CPU/CUDA. Validators accept TOPLOC proofs with the bounds calibrated for the pair
    (inferer family and dtype, validator family and dtype)."""
    inference_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype inferers generate in. With ``validator_dtype`` it must name a calibrated pair
    (docs/verification.md, *Across dtypes and machines*); others are refused when the config loads."""
    validator_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype validators recompute in (their prefill): see ``inference_dtype``."""
    inferer_devices: tuple[Literal["cpu", "cuda"], ...] = Field(("cpu",), min_length=1)
    """Device kinds inferers may generate on (``--gpu`` picks a node's device; a node whose device is not
    listed refuses the role). Every inferer device × validator device must be a calibrated pair in the
    run's dtypes, e.g. ``inference_dtype = "bfloat16"``, ``inferer_devices = ["cpu", "cuda"]`` with float32
    validators on the CPU (docs/gpu.md)."""
    validator_devices: tuple[Literal["cpu", "cuda"], ...] = Field(("cpu",), min_length=1)
    """Device kinds validators may recompute on: see ``inferer_devices``."""
    seed: int = Field(0, ge=0, lt=1 << 63)
    """Run seed: input of the task schedule and of every sample seed."""
    torch_seed: int = Field(0, ge=0, lt=1 << 63)
    """Seed of torch's generator in the trainer (initialisation of anything random)."""
    threads: int = Field(0, ge=0, le=1024)
    """torch intra-op threads per pipeline stage; 0 gives each stage half of this process's cores."""
    train_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of the FSDP2 trainer (prime_node/ml/fsdp.py): "bfloat16" computes in bf16 and
    reduces gradients in fp32 over fp32 master weights; "auto" is bfloat16 on CUDA, float32 on CPU."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory, ~1/3 more compute)."""
    eval_every: int = Field(0, ge=0)
    """Greedy held-out evaluation every this many steps (0: only at start and end)."""
    eval_tasks: int = Field(200, ge=0)
    """Held-out tasks per evaluation."""
    keep_checkpoints: int = Field(0, ge=0)
    """Checkpoints kept on disk; never fewer than async_level + 1 (stale batches need their policy)."""
    checkpoint_every: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    """Save the training state (sharded float32 weights and AdamW moments, 12 bytes per parameter:
    what a restart resumes from) after every this many steps, and after the last; the policy checkpoint
    is written every step regardless, and a restart replays the rollout log's batches since the newest
    training state. "auto": after the steps whose training time since the previous save is at least 10×
    that save's measured duration, so saving takes at most 10 % of the run (docs/rl.md, *Checkpoints off
    the step's path*)."""
    publish_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """dtype of the policies the trainer publishes to the swarm ("auto": bfloat16, which every inferer
    accepts: it loads the policy into ``inference_dtype``, and validators recompute from the same
    published weights, so TOPLOC's calibrated pairs are unchanged). The trainer keeps its float32 master
    weights; bfloat16 halves the checkpoint and makes consecutive policies mostly bit-identical, so
    deltas are small (docs/deltas.md: fp32 policies change ~92% of their values every step)."""
    delta_snapshot_every: int = Field(10, ge=1)
    """Publish a full checkpoint every this many steps and a delta against the previous policy in
    between (1: never deltas). A peer that missed too much fetches the newest full state."""
    delta_max_share: float = Field(0.5, gt=0, le=1)
    """A delta larger than this share of the full checkpoint is not published: the full one is."""
    trusted_validators: tuple[Annotated[str, Field(pattern=r"^0x[0-9a-fA-F]{40}$")], ...] = Field(
        (), max_length=64
    )
    """Addresses of the validators whose signed verdicts the trainer counts. A networked trainer refuses
    to start with none (it would have no way to tell honest rollouts from forged ones); local runs
    ignore it."""
    verdict_quorum: int = Field(1, ge=1, le=64)
    """Distinct trusted validators that must accept a batch (and none reject it) before it is trained on."""

    @field_validator("adam_betas")
    @classmethod
    def _betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in value):
            raise ValueError("each beta must lie in [0, 1)")
        return value

    @field_validator("trusted_validators")
    @classmethod
    def _checksummed(cls, value: tuple[str, ...]) -> tuple[str, ...]:

        for text in value:
            try:
                Address.parse(text)
            except CryptoError as exc:
                raise ValueError(str(exc)) from exc
        return value

    @model_validator(mode="after")
    def _calibrated_engines(self) -> RunConfig:
        from crypto.toploc import CALIBRATED_THRESHOLDS

        for inferer_device in self.inferer_devices:
            for validator_device in self.validator_devices:
                inferer = (self.engine, self.inference_dtype, inferer_device)
                validator = (self.engine, self.validator_dtype, validator_device)
                if (inferer, validator) in CALIBRATED_THRESHOLDS:
                    continue
                pairs = sorted(CALIBRATED_THRESHOLDS)
                calibrated = ", ".join(
                    f"{i[1]} on {i[2]} → {v[1]} on {v[2]}" for i, v in pairs if i[0] == self.engine
                )
                raise ValueError(
                    f"{self.engine} inferers in {self.inference_dtype} on {inferer_device} checked by "
                    f"validators in {self.validator_dtype} on {validator_device} is not a calibrated pair "
                    f"(inference_dtype on inferer_devices → validator_dtype on validator_devices: "
                    f"{calibrated}); see docs/verification.md and docs/gpu.md"
                )
        return self

    @model_validator(mode="after")
    def _reachable_quorum(self) -> RunConfig:
        if self.trusted_validators and self.verdict_quorum > len(set(self.trusted_validators)):
            raise ValueError(
                f"verdict_quorum {self.verdict_quorum} exceeds the "
                f"{len(set(self.trusted_validators))} distinct trusted validators"
            )
        return self

    @model_validator(mode="after")
    def _derived_batch_cap(self) -> RunConfig:
        if "max_rollout_batch_bytes" not in self.model_fields_set:
            honest = honest_batch_bytes(samples=self.samples_per_step, max_new_tokens=self.max_new_tokens)
            # The model is frozen; the derived value is set once, here, as if it had been given.
            object.__setattr__(self, "max_rollout_batch_bytes", max(1 << 10, min(MAX_ROLLOUT_FRAME, honest)))
        return self

    @property
    def samples_per_step(self) -> int:
        return self.group_size * self.prompts_per_step

    @property
    def published_dtype(self) -> Literal["float32", "bfloat16"]:
        """dtype of the policies on the swarm (``publish_dtype`` with "auto" resolved)."""
        return "bfloat16" if self.publish_dtype == "auto" else self.publish_dtype

    @property
    def checkpoints_to_keep(self) -> int:
        return max(self.keep_checkpoints, self.async_level + 1)


def _set_path(tree: dict[str, Any], path: list[str], value: str) -> None:
    for key in path[:-1]:
        node = tree.setdefault(key, {})
        if not isinstance(node, dict):
            raise NodeError(
                f"environment override {'.'.join(path)}: {key} is not a section", reason="bad_config"
            )
        tree = node
    tree[path[-1]] = value


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in environ.items():
        if name.startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX):
            _set_path(tree, name[len(ENV_PREFIX) :].lower().split("__"), value)
    return tree


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def validate_run_config(
    data: Mapping[str, Any], *, source: str, origins: Mapping[tuple[str | int, ...], str] | None = None
) -> RunConfig:
    """The checked config; NodeError naming every problem at once (prime_node/config/problems.py)."""
    try:
        return RunConfig.model_validate(dict(data))
    except ValidationError as exc:
        problems = describe_problems(exc, model=RunConfig, origins=origins)
        raise NodeError(problems.line(source), reason="bad_config") from exc


def load_run_config(
    path: Path | None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> RunConfig:
    """Read a TOML run config, apply env overrides then ``overrides``; NodeError on any problem."""
    data: dict[str, Any] = {}
    source = str(path) if path is not None else "run config"
    if path is not None:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise NodeError(
                f"cannot read run config {path}: {exc.strerror or exc}", reason="bad_config"
            ) from exc
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise NodeError(f"{path}: not valid TOML: {exc}", reason="bad_config") from exc
    from_env = _env_overrides(os.environ if environ is None else environ)
    data = _merge(_merge(data, from_env), overrides or {})
    return validate_run_config(data, source=source, origins=env_origins(from_env, ENV_PREFIX))
