"""``prime-node validate BATCH_FILE``: the validator's checks, offline, on one signed batch file.

The file holds one rollout-batch envelope frame as a worker published it: one a node kept with
``--keep-batches`` (``DATA_DIR/batches/*.batch``) or any other copy. A kept batch's sidecar says which
policy it claims, where that policy was and which run config it belongs to, so neither ``--model`` nor
``--config`` is needed while the policy is still on disk; otherwise ``--model`` is the claimed policy's
directory (the trainer's ``OUT/policies/step_N``) and ``--config`` the run's TOML. Offline there is no
clock to compare with and no replay history, so the envelope is judged as of its own timestamp, and the
trainer step defaults to the batch's policy step.
Exit status: 0 accepted, 2 rejected, 1 an error of ours: a file that is not a signed rollout batch (a
config, the trainer's unsigned rollouts.log frames, a truncated download: it names no worker, so it gets
no verdict), a policy or config that cannot be found or read.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prime_node.cli.options import JsonOption
from prime_node.errors import NodeError
from prime_node.verification.batch_archive import (
    BatchNote,
    find_policy,
    is_model_dir,
    read_note,
    read_run_config,
)
from protocol.codec import decode
from protocol.envelope import Domain, Envelope, EnvelopeVerifier
from protocol.errors import ProtocolError
from protocol.rollouts import RolloutBatch

if TYPE_CHECKING:
    from prime_node.config.run import RunConfig
    from prime_node.verification.validator import ValidationResult

MAX_FILE_BYTES = Envelope.MAX_BYTES  # the largest envelope frame the wire format carries
NOT_A_BATCH = "not a signed rollout batch"
ROLLOUT_LOG_MAGIC = b"PNRL"  # every record of prime_node/ml/rollout_log.py starts with it


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)


def validate(
    batch_file: Annotated[
        Path,
        typer.Argument(
            help="A signed rollout-batch frame, e.g. DATA_DIR/batches/FILE.batch.", dir_okay=False
        ),
    ],
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            help="Model directory holding the claimed policy (default: the one a kept batch's sidecar "
            "names, while it is on disk).",
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="The run's TOML config (default: the run config a kept batch's node saved beside it, "
            "else built-in defaults).",
        ),
    ] = None,
    current_step: Annotated[
        int | None, typer.Option("--current-step", help="Trainer step to judge staleness against.")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Check one rollout batch file and print the verdict with its reasons."""
    try:
        with batch_file.open("rb") as handle:
            frame = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise NodeError(f"cannot read {batch_file}: {exc.strerror or exc}", reason="bad_batch_file") from exc
    claim = read_claim(frame, batch_file)
    inputs = resolve_inputs(claim, batch_file, model, config)
    if not as_json:
        typer.echo(
            f"policy step {claim.batch.policy_step}: {inputs.model_dir}; run config: "
            f"{inputs.config_path or 'built-in defaults'}",
            err=True,
        )
    result = _run(frame, inputs, current_step)
    batch_id = result.batch_id.hex()
    reasons = [str(r) for r in result.reasons]
    verdict = {
        "batch_id": batch_id,
        "accepted": result.accepted,
        "reasons": reasons,
        "rejected_samples": sorted(result.rejected_samples),
        "rewards": result.rewards,
        "detail": result.detail,
        "worker": str(claim.envelope.signer),
        "policy_step": claim.batch.policy_step,
        "policy_dir": str(inputs.model_dir),
        "config": None if inputs.config_path is None else str(inputs.config_path),
    }
    if as_json:
        typer.echo(json.dumps(verdict))
    elif result.accepted:
        mean = sum(result.rewards) / len(result.rewards) if result.rewards else 0.0
        typer.echo(f"accepted  batch {batch_id[:16]}  mean recomputed reward {mean:.3f}")
    else:
        typer.echo(f"rejected  batch {batch_id[:16]}  reasons: {', '.join(reasons)}")
        typer.echo(f"  {result.detail}")
    if not result.accepted:
        raise typer.Exit(code=2)


@dataclass(frozen=True)
class Claim:
    """What a signed batch file says of itself: the envelope, the batch, the run its signature is for."""

    envelope: Envelope
    batch: RolloutBatch
    run_id: str | None
    """The run of the envelope's domain (None if the domain is not one: the validator says so)."""


@dataclass(frozen=True)
class Inputs:
    model_dir: Path
    config_path: Path | None
    run: RunConfig


def read_claim(frame: bytes, path: Path) -> Claim:
    """The signed batch in ``frame``; NodeError ``not_a_batch`` (never a verdict) for anything else: a
    verdict judges a worker by its signature, and a file that carries none (a config, a truncated
    download, the unsigned frames of the trainer's rollouts.log) names no worker to judge (issue 36:
    `validate` called every one of them a cheat)."""
    if frame.startswith(ROLLOUT_LOG_MAGIC):
        raise NodeError(
            f"{NOT_A_BATCH}: {path.name} is the trainer's rollout log, which keeps the batches it trained on "
            "without the workers' signatures; validate needs a signed batch: run a validator or the "
            "trainer with --keep-batches N and pass a file from its DATA_DIR/batches/",
            reason="not_a_batch",
        )
    if len(frame) > MAX_FILE_BYTES:
        raise NodeError(
            f"{NOT_A_BATCH}: {path} is larger than the largest envelope ({MAX_FILE_BYTES} bytes)",
            reason="not_a_batch",
        )
    try:
        envelope = decode(frame, Envelope)
    except ProtocolError as exc:
        raise NodeError(_what_it_is(frame, path, exc.reason), reason="not_a_batch") from None
    try:
        batch = decode(envelope.payload, RolloutBatch)
    except ProtocolError:
        kind = envelope.domain.split("/")[2] if envelope.domain.count("/") >= 2 else envelope.domain
        raise NodeError(
            f"{NOT_A_BATCH}: a signed {kind[:40]!r} envelope, not a rollout batch", reason="not_a_batch"
        ) from None
    try:
        run_id: str | None = Domain.parse(envelope.domain).run
    except ProtocolError:
        run_id = None
    return Claim(envelope, batch, run_id)


def _what_it_is(frame: bytes, path: Path, reason: str) -> str:
    """Why ``frame`` (no envelope) is not a batch, in the words of what it looks like."""
    try:
        decode(frame, RolloutBatch)
    except ProtocolError:
        pass
    else:
        return (
            f"{NOT_A_BATCH}: an unsigned rollout batch (the trainer's rollouts.log keeps batches without "
            "the worker's signature); validate needs the signed frame the worker published: run a "
            "validator or the trainer with --keep-batches N and pass a file from DATA_DIR/batches/"
        )
    try:
        text = frame.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and path.suffix == ".json" and path.with_suffix(".batch").is_file():
        return (
            f"{NOT_A_BATCH}: {path.name} is the sidecar of {path.with_suffix('.batch').name}: pass that file"
        )
    if text is not None and text.lstrip().startswith(("{", "[")):
        return (
            f"{NOT_A_BATCH}: {path.name} is a JSON file (a kept batch's sidecar or the run config saved "
            "beside it?); pass the .batch file"
        )
    if text is not None:
        try:
            document = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            document = {}
        if document:
            return (
                f"{NOT_A_BATCH}: {path.name} is a TOML file (a run config goes in --config); pass a batch "
                "a node kept with --keep-batches N (DATA_DIR/batches/*.batch)"
            )
    return (
        f"{NOT_A_BATCH} ({reason}): pass a batch as a worker published it, e.g. one a node kept with "
        "--keep-batches N (DATA_DIR/batches/*.batch)"
    )


def resolve_inputs(claim: Claim, batch_file: Path, model: Path | None, config: Path | None) -> Inputs:
    """The policy directory and run config to judge with: the flags, else what a kept batch's sidecar
    names; NodeError naming exactly what to pass when neither finds them."""
    from prime_node.config import load_run_config
    from prime_node.ml.model import check_model_dir

    note = read_note(batch_file)
    model_dir = model if model is not None else _claimed_policy(claim, batch_file, note)
    check_model_dir(model_dir)
    saved = note.run_config if note is not None and config is None else None
    from_sidecar = saved is not None and saved.is_file()
    if saved is not None and from_sidecar:
        config_path: Path | None = saved
        run = read_run_config(saved)
    else:
        config_path = config
        run = load_run_config(config)
    if claim.run_id is not None and claim.run_id != run.run_id and not from_sidecar:
        raise NodeError(
            f"this batch is signed for run {claim.run_id!r} but the run config is run {run.run_id!r}"
            f"{'' if config_path else ' (built-in defaults)'}: pass --config with run {claim.run_id!r}'s "
            "run.toml",
            reason="wrong_run",
        )
    return Inputs(model_dir, config_path, run)


def _claimed_policy(claim: Claim, batch_file: Path, note: BatchNote | None) -> Path:
    step = claim.batch.policy_step
    if note is not None and note.policy_dir is not None and is_model_dir(note.policy_dir):
        return note.policy_dir
    roots = list(note.policy_roots if note is not None else ())
    if batch_file.resolve().parent.name == "batches":  # DATA_DIR/batches: the node's own swarm store
        roots.append(batch_file.resolve().parent.parent / "swarm" / "checkpoints")
    found = find_policy(roots, step)
    if found is not None:
        return found
    looked = f" (looked in {', '.join(str(r) for r in roots)})" if roots else ""
    raise NodeError(
        f"this batch claims policy step {step}, which is not on this disk{looked}: pass --model DIR with "
        f"that policy, e.g. the trainer's OUT/policies/step_{step:08d} (the trainer keeps the newest few "
        "steps there)",
        reason="no_policy",
    )


def _run(frame: bytes, inputs: Inputs, current_step: int | None) -> ValidationResult:
    from prime_node.ml.engines import load_engine
    from prime_node.ml.tokenizer import load_tokenizer
    from prime_node.tasks.factory import build_task
    from prime_node.verification.proving import rollout_domain
    from prime_node.verification.validator import BatchValidator

    run, model_dir = inputs.run, inputs.model_dir
    tokenizer = load_tokenizer(model_dir)
    engine = load_engine(model_dir, tokenizer, engine=run.engine, dtype=run.validator_dtype)
    envelope = decode(frame, Envelope)  # read_claim decoded it already: this cannot fail
    step = decode(envelope.payload, RolloutBatch).policy_step
    validator = BatchValidator(
        run,
        build_task(run.task),
        tokenizer,
        lambda _step: engine,
        rollout_verifier=EnvelopeVerifier(rollout_domain(run.run_id)),
    )
    judged_at = step if current_step is None else current_step
    return validator.validate_frame(frame, now_ms=envelope.timestamp_ms, current_step=judged_at)
