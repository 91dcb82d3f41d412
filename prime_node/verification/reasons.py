"""Why a validator rejects a rollout batch: one stable code per failed check (they travel in verdicts)."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    # The envelope (protocol/envelope.py's Reject values, kept verbatim).
    MALFORMED_ENVELOPE = "malformed_envelope"
    WRONG_DOMAIN = "wrong_domain"
    EXPIRED = "expired"
    FROM_THE_FUTURE = "from_the_future"
    BAD_SIGNATURE = "bad_signature"
    SIGNER_MISMATCH = "signer_mismatch"
    REPLAY = "replay"
    BEHIND_REPLAY_WINDOW = "behind_replay_window"
    # The batch header.
    MALFORMED_BATCH = "malformed_batch"
    SIGNER_NOT_WORKER = "signer_not_worker"
    WRONG_RUN = "wrong_run"
    STALE_POLICY = "stale_policy"
    FUTURE_POLICY = "future_policy"
    UNKNOWN_POLICY = "unknown_policy"
    WRONG_SHAPE = "wrong_shape"
    WRONG_TEMPERATURE = "wrong_temperature"
    # The seeded schedule.
    OFF_SCHEDULE_TASK = "off_schedule_task"
    WRONG_SEED = "wrong_seed"
    WRONG_PROMPT = "wrong_prompt"
    # Each completion.
    BAD_COMPLETION = "bad_completion"
    ILLEGITIMATE_TERMINATION = "illegitimate_termination"
    MISSING_PROOF = "missing_proof"
    MALFORMED_PROOF = "malformed_proof"
    TOPLOC_EXPONENT_MISMATCH = "toploc_exponent_mismatch"
    TOPLOC_MANTISSA_MEAN = "toploc_mantissa_mean"
    TOPLOC_MANTISSA_MEDIAN = "toploc_mantissa_median"
    SAMPLING_MISMATCH = "sampling_mismatch"
    LOGPROB_MISMATCH = "logprob_mismatch"
