"""The validator's check pipeline for one signed rollout batch (DESIGN §7).

Stages run cheapest first, and the first stage that finds a problem ends the check, so a cheater is
told exactly what gave it away and no prefill is spent on a batch already known to be bad:

1. envelope: decodes, right domain, fresh, signature recovers the signer, not a replay;
2. header, read from the payload's first kilobyte before any sample is decoded (``peek_header``): a
   RolloutBatch of this run, signed by its own ``worker``; its policy step lies within
   ``[current − async_level, current]`` and the validator holds that policy; its shape (group size,
   sample count) and temperature are the run's, and its size is within what an honest batch of that
   shape can take. Only then is the batch decoded (work proportional to its bytes);
3. schedule: every group's task and every sample's seed are the ones protocol/schedule.py draws for
   (worker, policy step, batch counter, run seed); every prompt is its task's prompt;
4. completions: tokens in the vocabulary, at most ``max_new_tokens``, ended legitimately (EOS as the
   last token and nowhere else, or exactly the length limit), a well-formed TOPLOC proof of the
   right size;
5. recomputation: one prefill of all samples with the claimed policy, then per sample the TOPLOC
   check, the replay of the seeded sampling rule on the recomputed logits (a token the rule would
   not pick fails here: TOPLOC alone misses a single changed token) and the claimed log-probs
   against the recomputed ones.

Rewards are computed only for the samples stage 5 replayed (``verified_groups``): a completion whose
tokens were not checked against the model is never executed (a code task runs it), and the verdict
vouches for the replayed groups alone. The batch format carries no rewards to trust.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from crypto.digests import blake3
from crypto.errors import CryptoError
from crypto.toploc import Thresholds, decode_proofs, split_proofs
from prime_node.ml.engine import prefill_replay
from prime_node.ml.engines import run_calibration
from prime_node.ml.evaluation import encode_prompt
from prime_node.ml.oom_retry import prefill_in_chunks
from prime_node.verification.proofs import check_proofs
from prime_node.verification.reasons import Reason
from protocol import schedule
from protocol.codec import decode
from protocol.envelope import Envelope, EnvelopeVerifier
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.rollouts import BatchHeader, RolloutBatch, peek_header, proof_size
from protocol.verdict import Verdict

if TYPE_CHECKING:
    from prime_node.config import RunConfig
    from prime_node.ml.engine import InferenceEngine
    from prime_node.tasks.base import TaskSource

log = logging.getLogger(__name__)
ROLLOUT_KIND = "rollouts"

# Bytes an honest batch may take beyond its tokens and proofs (msgpack headers: under 40 per sample and
# 200 for the batch), and the prompt length it is allowed per sample: twice the drawn task's, so a batch
# refused for its size is far beyond any honest one and an off-schedule batch still gets its own reason.
SAMPLE_OVERHEAD_BYTES = 64
BATCH_OVERHEAD_BYTES = 512
PROMPT_CACHE = 4096


@dataclass(frozen=True)
class CheckPolicy:
    """Acceptance bounds of the recomputation stage, calibrated for one engine family."""

    toploc: Thresholds | None = None
    """TOPLOC bounds; None: those calibrated for the run config's (inferer, validator) engine pair."""
    logprob_tolerance: float | None = None
    """Largest claimed − recomputed log-prob error; None: the pair's calibrated one
    (``prime_node.ml.engines.SAMPLING_TOLERANCES``)."""
    replay_tolerance: float | None = None
    """Largest seeded-score margin of a claimed token; None: the pair's calibrated one."""
    recompute_groups: int = 0
    """Recompute only this many (k) of a batch's G groups, drawn with the validator's secret key (0: all).
    A worker that falsifies c groups passes one check with probability C(G − c, k) / C(G, k); the
    peer-score ban turns repeated cheating into near-certain exclusion. Stages 1–4 always see every
    sample. Only the recomputed groups are vouched for (``Verdict.verified_groups``), scored and trained
    on: the others are never executed, whatever the verdict."""


@dataclass
class ValidationResult:
    """What the pipeline found; ``verdict()`` turns it into the message a validator signs."""

    batch_id: bytes
    batch: RolloutBatch | None = None
    reasons: list[Reason] = field(default_factory=list)
    rejected_samples: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    """Per sample of ``verified_groups``, in order."""
    detail: str = ""
    header: BatchHeader | None = None
    """The authenticated header (its signer is its worker), known before the batch is decoded: a batch
    refused on its header still gets a verdict that charges its worker."""
    verified_groups: list[int] = field(default_factory=list)
    """Groups whose every sample passed recomputation (set only on an accepted batch)."""

    @property
    def accepted(self) -> bool:
        return not self.reasons

    def reject(self, reason: Reason, detail: str, sample: int | None = None) -> None:
        if reason not in self.reasons:
            self.reasons.append(reason)
        if sample is not None and sample not in self.rejected_samples:
            self.rejected_samples.append(sample)
        if not self.detail:
            self.detail = detail

    def verdict(self) -> Verdict | None:
        """The verdict to sign, or None when the bytes do not name a batch its signer made (nothing to
        attribute)."""
        header = self.header if self.batch is None else BatchHeader.of(self.batch)
        if header is None:
            return None
        return Verdict(
            run_id=header.run_id,
            batch_id=self.batch_id,
            worker=header.worker,
            policy_step=header.policy_step,
            batch_counter=header.batch_counter,
            accepted=self.accepted,
            reasons=tuple(str(r) for r in self.reasons),
            rejected_samples=tuple(sorted(self.rejected_samples)),
            rewards=tuple(self.rewards) if self.accepted else (),
            verified_groups=tuple(self.verified_groups) if self.accepted else (),
        )


class BatchValidator:
    """Checks rollout batches of one run against the run config, the schedule and a recomputation.

    ``engines(step)`` returns an engine holding policy ``step`` (or None if this validator does not
    have it); ``rollout_verifier`` holds the freshness window and replay cache of rollout envelopes.
    A run whose (inferer, validator) engine pairs have no calibrated bounds, or that does not admit
    validators on ``device`` (where this validator's engines compute), is refused here (NodeError
    ``uncalibrated_engine`` / ``device_not_admitted``), before any batch is judged.
    """

    def __init__(
        self,
        config: RunConfig,
        task: TaskSource,
        tokenizer: Any,
        engines: Callable[[int], InferenceEngine | None],
        *,
        rollout_verifier: EnvelopeVerifier,
        policy: CheckPolicy = CheckPolicy(),
        sampling_key: bytes | None = None,
        device: str = "cpu",
    ) -> None:
        self.config = config
        self.task = task
        self.tokenizer = tokenizer
        self.engines = engines
        self.rollout_verifier = rollout_verifier
        self.policy = policy
        self.calibration = run_calibration(config, device)
        self.engine_thresholds = self.calibration.toploc
        self.sampling_key = os.urandom(32) if sampling_key is None else sampling_key
        self._pool = task.train_ids()
        self._prompts: OrderedDict[int, list[int]] = OrderedDict()  # task id → encoded prompt (bounded)

    def validate_frame(self, frame: bytes, *, now_ms: int, current_step: int) -> ValidationResult:
        """Run every stage on one envelope frame as received from the network or read from disk."""
        result = ValidationResult(batch_id=blake3(frame))
        try:
            envelope = decode(frame, Envelope)
        except ProtocolError as exc:
            result.reject(Reason.MALFORMED_ENVELOPE, str(exc))
            return self._logged(result)
        try:
            self.rollout_verifier.verify(envelope, now_ms=now_ms)
        except RemoteProtocolError as exc:
            # No verdict names the worker here: a forged, stale or replayed envelope may have been sent
            # by anyone. The peer that delivered it is scored by the network layer instead.
            known = exc.reason in Reason._value2member_map_
            result.reject(Reason(exc.reason) if known else Reason.MALFORMED_ENVELOPE, str(exc))
            return self._logged(result)
        try:
            header = peek_header(envelope.payload)
        except ProtocolError as exc:
            result.reject(Reason.MALFORMED_BATCH, str(exc))
            return self._logged(result)
        if envelope.signer != header.worker:
            # No verdict either: it would charge the named worker for what someone else signed.
            result.reject(Reason.SIGNER_NOT_WORKER, f"signed by {envelope.signer}, names {header.worker}")
            return self._logged(result)
        result.header = header
        engine = self._check_header(header, current_step, result)
        if engine is None or not self._check_size(header, len(envelope.payload), result):
            return self._logged(result)
        try:
            result.batch = decode(envelope.payload, RolloutBatch)
        except ProtocolError as exc:
            result.reject(Reason.MALFORMED_BATCH, str(exc))
            return self._logged(result)
        self._check_samples(result.batch, engine, result)
        return self._logged(result)

    def check_batch(
        self, batch: RolloutBatch, *, current_step: int, result: ValidationResult | None = None
    ) -> ValidationResult:
        """Stages 2–5 on an already authenticated batch."""
        result = result or ValidationResult(batch_id=b"\x00" * 32, batch=batch)
        engine = self._check_header(BatchHeader.of(batch), current_step, result)
        if engine is not None:
            self._check_samples(batch, engine, result)
        return result

    def _check_samples(self, batch: RolloutBatch, engine: InferenceEngine, result: ValidationResult) -> None:
        """Stages 3–5; rewards for the replayed groups of an accepted batch."""
        if not self._check_schedule(batch, result):
            return
        if not self._check_completions(batch, result):
            return
        groups = self.recomputed_groups(batch, result.batch_id)
        self._recompute(batch, groups, engine, result)
        if result.accepted:
            from prime_node.ml.prepared import batch_rewards

            # Only now, and only for replayed groups: scoring may execute a completion (code tasks).
            result.verified_groups = groups
            result.rewards = batch_rewards(batch, self.task, self.tokenizer, self.config, groups=groups)

    # -- stage 2 ----------------------------------------------------------------------------------------

    def _check_header(
        self, header: BatchHeader, current_step: int, result: ValidationResult
    ) -> InferenceEngine | None:
        """The header against the run; the engine holding its policy, or None (rejected)."""
        config = self.config
        if header.run_id != config.run_id:
            result.reject(Reason.WRONG_RUN, f"batch of run {header.run_id!r}")
            return None
        if header.policy_step > current_step:
            result.reject(
                Reason.FUTURE_POLICY, f"policy {header.policy_step} is ahead of step {current_step}"
            )
            return None
        if header.policy_step < current_step - config.async_level:
            detail = f"policy {header.policy_step} is older than {current_step} − {config.async_level}"
            result.reject(Reason.STALE_POLICY, f"{detail} (async_level)")
            return None
        if header.group_size != config.group_size or header.sample_count != config.samples_per_step:
            result.reject(
                Reason.WRONG_SHAPE,
                f"{header.sample_count} samples in groups of {header.group_size}, run uses "
                f"{config.prompts_per_step} groups of {config.group_size}",
            )
            return None
        if header.temperature != config.temperature:
            result.reject(
                Reason.WRONG_TEMPERATURE, f"temperature {header.temperature} ≠ {config.temperature}"
            )
            return None
        engine = self.engines(header.policy_step)
        if engine is None:
            result.reject(Reason.UNKNOWN_POLICY, f"this validator does not hold policy {header.policy_step}")
        return engine

    def _check_size(self, header: BatchHeader, payload_bytes: int, result: ValidationResult) -> bool:
        """Refuse a payload no honest batch with this header reaches, before decoding it (after the engine
        lookup, which gives a validator that starts without one its tokenizer)."""
        limit = self._size_limit(header)
        if payload_bytes > limit:
            result.reject(
                Reason.WRONG_SHAPE,
                f"{payload_bytes} bytes, more than the {limit} a batch of this run can take",
            )
        return result.accepted

    def _size_limit(self, header: BatchHeader) -> int:
        """Payload bytes an honest batch with this header stays under: per sample at most twice its drawn
        task's prompt, ``max_new_tokens`` tokens and log-probs, their proof, and encoding overhead."""
        drawn = schedule.task_indices(
            header.worker,
            header.policy_step,
            header.batch_counter,
            self.config.seed,
            pool_size=len(self._pool),
            count=header.groups,
        )
        limit = self.config.max_new_tokens
        per_completion = 8 * limit + proof_size(limit) + SAMPLE_OVERHEAD_BYTES
        prompts = sum(2 * 4 * len(self._prompt(self._pool[index])) for index in drawn)
        return header.group_size * (prompts + header.groups * per_completion) + BATCH_OVERHEAD_BYTES

    def _prompt(self, task_id: int) -> list[int]:
        """The task's encoded prompt, cached (least recently used dropped beyond ``PROMPT_CACHE``)."""

        cached = self._prompts.get(task_id)
        if cached is None:
            cached = self._prompts[task_id] = encode_prompt(self.tokenizer, self.task.prompt(task_id))
            while len(self._prompts) > PROMPT_CACHE:
                self._prompts.popitem(last=False)
        else:
            self._prompts.move_to_end(task_id)
        return cached

    # -- stage 3 ----------------------------------------------------------------------------------------

    def _check_schedule(self, batch: RolloutBatch, result: ValidationResult) -> bool:
        drawn = schedule.draw(
            batch.worker,
            batch.policy_step,
            batch.batch_counter,
            self.config.seed,
            pool_size=len(self._pool),
            groups=batch.groups,
            group_size=batch.group_size,
        )
        for g, (index, seeds) in enumerate(zip(drawn.task_indices, drawn.seeds, strict=True)):
            expected_task = self._pool[index]
            for j, sample in enumerate(batch.group(g)):
                number = g * batch.group_size + j
                if sample.task_id != expected_task:
                    result.reject(Reason.OFF_SCHEDULE_TASK, f"group {g} holds task {sample.task_id}", number)
                    continue
                if sample.seed != seeds[j]:
                    result.reject(Reason.WRONG_SEED, f"sample {number} has seed {sample.seed}", number)
                if list(sample.prompt_tokens()) != self._prompt(expected_task):
                    result.reject(Reason.WRONG_PROMPT, f"sample {number} lacks its task's prompt", number)
        return result.accepted

    # -- stage 4 ----------------------------------------------------------------------------------------

    def _check_completions(self, batch: RolloutBatch, result: ValidationResult) -> bool:
        vocab = len(self.tokenizer)
        eos = self.tokenizer.eos_token_id
        limit = self.config.max_new_tokens
        for number, sample in enumerate(batch.samples):
            tokens = sample.completion_tokens()
            if len(tokens) > limit or max(tokens) >= vocab:
                result.reject(Reason.BAD_COMPLETION, f"sample {number}: too long or bad token", number)
                continue
            if not _terminated_legitimately(tokens, sample.finished, eos, limit):
                result.reject(Reason.ILLEGITIMATE_TERMINATION, f"sample {number} stops without cause", number)
                continue
            if not sample.proof:
                result.reject(Reason.MISSING_PROOF, f"sample {number} carries no TOPLOC proof", number)
                continue
            try:
                decode_proofs(split_proofs(sample.proof, len(tokens)))
            except CryptoError as exc:
                result.reject(Reason.MALFORMED_PROOF, f"sample {number}: {exc}", number)
        return result.accepted

    # -- stage 5 ----------------------------------------------------------------------------------------

    def _recompute(
        self, batch: RolloutBatch, groups: list[int], engine: InferenceEngine, result: ValidationResult
    ) -> None:
        """One prefill of the samples of ``groups``; then the TOPLOC check per sample and the sampling
        replay and log-prob comparison on all checked tokens at once (one pass each, not one per sample)."""
        import torch

        numbers = [g * batch.group_size + j for g in groups for j in range(batch.group_size)]
        samples = [batch.samples[n] for n in numbers]
        prompts = [list(s.prompt_tokens()) for s in samples]
        completions = [list(s.completion_tokens()) for s in samples]
        # On a GPU: chunks sized to its free memory, halved on OOM, never a partial result.
        prefills = prefill_in_chunks(engine, prompts, completions)
        try:
            checks = check_proofs([p.hidden for p in prefills], [s.proof for s in samples])
        except CryptoError as exc:  # stage 4 decoded every proof; this would be a bug, not the worker's
            raise AssertionError(f"proof became undecodable between stages: {exc}") from exc
        thresholds = self.engine_thresholds if self.policy.toploc is None else self.policy.toploc
        calibrated = self.calibration.sampling
        replay_tolerance = _or(self.policy.replay_tolerance, calibrated.replay)
        logprob_tolerance = _or(self.policy.logprob_tolerance, calibrated.logprob)
        for number, chunk_checks in zip(numbers, checks, strict=True):
            for check in chunk_checks:
                failure = thresholds.failure(check)
                if failure is not None:
                    result.reject(Reason(failure), f"sample {number}: {check}", number)
                    break
        # Per token, from the hidden states a chunk of positions at a time (never [tokens, vocab] logits).
        own, margins = prefill_replay(prefills, completions, batch.temperature, [s.seed for s in samples])
        claimed = torch.tensor([v for s in samples for v in s.completion_logprobs()], dtype=torch.float32)
        errors = (own.cpu() - claimed).abs()
        # Per-sample maxima in two numpy reductions instead of two torch calls per sample (NaN
        # propagates in both, and argmax picks the first maximum in both).
        margin_values = margins.detach().cpu().numpy()
        error_values = errors.detach().cpu().numpy()
        starts = np.cumsum([0, *(len(c) for c in completions)])[:-1]
        worst_margins = np.maximum.reduceat(margin_values, starts).tolist()
        worst_errors = np.maximum.reduceat(error_values, starts).tolist()
        for number, completion, start, worst, worst_error in zip(
            numbers, completions, starts.tolist(), worst_margins, worst_errors, strict=True
        ):
            if worst > replay_tolerance:
                where = int(np.argmax(margin_values[start : start + len(completion)]))
                detail = f"sample {number}: the seeded rule does not pick token {where} (margin {worst:.3g})"
                result.reject(Reason.SAMPLING_MISMATCH, detail, number)
                continue
            if not worst_error <= logprob_tolerance:
                detail = f"sample {number}: log-prob off by {worst_error:.3g}"
                result.reject(Reason.LOGPROB_MISMATCH, detail, number)

    def recomputed_groups(self, batch: RolloutBatch, batch_id: bytes) -> list[int]:
        """Groups the recomputation covers, ascending: all, or ``policy.recompute_groups`` of them drawn
        with this validator's secret ``sampling_key`` (a worker cannot predict or grind the choice)."""
        groups = self.policy.recompute_groups
        if groups <= 0 or groups >= batch.groups:
            return list(range(batch.groups))
        digest = blake3(self.sampling_key + batch_id)
        rng = np.random.default_rng(int.from_bytes(digest[:16], "big"))
        return sorted(int(g) for g in rng.choice(batch.groups, size=groups, replace=False))

    def recomputed_samples(self, batch: RolloutBatch, batch_id: bytes) -> list[int]:
        """Sample numbers of ``recomputed_groups``."""
        size = batch.group_size
        return [g * size + j for g in self.recomputed_groups(batch, batch_id) for j in range(size)]

    def _logged(self, result: ValidationResult) -> ValidationResult:
        if not result.accepted:
            reasons = ",".join(result.reasons)
            log.info("rejected batch %s: %s (%s)", result.batch_id.hex()[:16], reasons, result.detail)
        return result


def _terminated_legitimately(tokens: Sequence[int], finished: bool, eos: int, limit: int) -> bool:
    """EOS exactly at the end (finished), or no EOS at all and exactly ``limit`` tokens (cut off)."""
    if eos in tokens[:-1]:
        return False
    if finished:
        return tokens[-1] == eos
    return tokens[-1] != eos and len(tokens) == limit


def _or(explicit: float | None, calibrated: float) -> float:
    return calibrated if explicit is None else explicit
