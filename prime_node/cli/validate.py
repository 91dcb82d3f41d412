"""``prime-node validate BATCH_FILE --model DIR``: the validator's checks, offline, on one signed batch file.

The file holds one rollout-batch envelope frame as a worker publishes it. The model directory stands
for the batch's claimed policy; the run config supplies the schedule seed, the batch shape and the
staleness bound. Offline there is no clock to compare with and no replay history, so the envelope is
judged as of its own timestamp, and the trainer step defaults to the batch's policy step.
Exit status: 0 accepted, 2 rejected, 1 an error of ours (unreadable model or config).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prime_node.cli.options import JsonOption
from prime_node.errors import NodeError
from protocol.codec import decode
from protocol.envelope import Envelope, EnvelopeVerifier
from protocol.errors import ProtocolError
from protocol.rollouts import RolloutBatch

if TYPE_CHECKING:
    from prime_node.verification.validator import ValidationResult

MAX_FILE_BYTES = Envelope.MAX_BYTES  # the largest envelope frame the wire format carries


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)


def validate(
    batch_file: Annotated[Path, typer.Argument(help="A signed rollout-batch frame.", dir_okay=False)],
    model: Annotated[Path, typer.Option("--model", help="Model directory holding the claimed policy.")],
    config: Annotated[
        Path | None, typer.Option("--config", help="The run's TOML config (default: built-in defaults).")
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
    result = _run(frame, model, config, current_step)
    batch_id = result.batch_id.hex()
    reasons = [str(r) for r in result.reasons]
    verdict = {
        "batch_id": batch_id,
        "accepted": result.accepted,
        "reasons": reasons,
        "rejected_samples": sorted(result.rejected_samples),
        "rewards": result.rewards,
        "detail": result.detail,
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


def _require_a_signed_batch(frame: bytes) -> None:
    """NodeError ``not_a_batch`` unless ``frame`` is a signed envelope around a rollout batch: a verdict
    judges a worker by its signature, and a file that carries none (a config, a truncated download, the
    unsigned frames of the trainer's rollouts.log) names no worker to judge (issue 36: `validate` called
    every one of them a cheat)."""
    try:
        envelope = decode(frame, Envelope)
    except ProtocolError as exc:
        try:
            decode(frame, RolloutBatch)
        except ProtocolError:
            raise NodeError(
                f"not a signed rollout batch ({exc.reason}): pass a batch as a worker published it, e.g. "
                "one a validator saved",
                reason="not_a_batch",
            ) from None
        raise NodeError(
            "an unsigned rollout batch (the trainer's rollouts.log keeps batches without the worker's "
            "signature): validate needs the signed frame the worker published",
            reason="not_a_batch",
        ) from None
    try:
        decode(envelope.payload, RolloutBatch)
    except ProtocolError:
        kind = envelope.domain.split("/")[2] if envelope.domain.count("/") >= 2 else envelope.domain
        raise NodeError(f"a signed {kind!r} envelope, not a rollout batch", reason="not_a_batch") from None


def _run(
    frame: bytes, model_dir: Path, config_path: Path | None, current_step: int | None
) -> ValidationResult:
    from prime_node.config import load_run_config
    from prime_node.ml.engines import load_engine
    from prime_node.ml.model import check_model_dir
    from prime_node.ml.tokenizer import load_tokenizer
    from prime_node.tasks.factory import build_task
    from prime_node.verification.proving import rollout_domain
    from prime_node.verification.reasons import Reason
    from prime_node.verification.validator import BatchValidator

    if len(frame) > MAX_FILE_BYTES:
        from crypto.digests import blake3
        from prime_node.verification.validator import ValidationResult

        result = ValidationResult(batch_id=blake3(frame))
        result.reject(Reason.MALFORMED_ENVELOPE, f"file is larger than {MAX_FILE_BYTES} bytes")
        return result
    _require_a_signed_batch(frame)
    run = load_run_config(config_path)
    check_model_dir(model_dir)
    tokenizer = load_tokenizer(model_dir)
    engine = load_engine(model_dir, tokenizer, engine=run.engine, dtype=run.validator_dtype)
    now_ms, step = 0, 0
    try:
        envelope = decode(frame, Envelope)
        now_ms = envelope.timestamp_ms
        step = decode(envelope.payload, RolloutBatch).policy_step
    except ProtocolError:
        pass  # the validator reports exactly what is wrong with the bytes
    validator = BatchValidator(
        run,
        build_task(run.task),
        tokenizer,
        lambda _step: engine,
        rollout_verifier=EnvelopeVerifier(rollout_domain(run.run_id)),
    )
    judged_at = step if current_step is None else current_step
    return validator.validate_frame(frame, now_ms=now_ms, current_step=judged_at)
