"""Why a validator rejects a rollout batch: one stable code per failed check (they travel in verdicts).

Envelope failures take their codes from protocol/envelope.py's ``Reject``, the one place they are defined,
so a reason seen in a verdict and one seen in a node's log mean the same thing.
"""

from __future__ import annotations

from enum import StrEnum

from protocol.envelope import Reject


class Reason(StrEnum):
    # The envelope: an undecodable frame, then every Reject of protocol/envelope.py.
    MALFORMED_ENVELOPE = "malformed_envelope"
    WRONG_DOMAIN = Reject.WRONG_DOMAIN.value
    EXPIRED = Reject.EXPIRED.value
    FROM_THE_FUTURE = Reject.FROM_THE_FUTURE.value
    BAD_SIGNATURE = Reject.BAD_SIGNATURE.value
    SIGNER_MISMATCH = Reject.SIGNER_MISMATCH.value
    REPLAY = Reject.REPLAY.value
    BEHIND_REPLAY_WINDOW = Reject.BEHIND_REPLAY_WINDOW.value
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


BELOW_FLOOR = "below_floor"
"""Not a verdict reason (no verdict ever carries it): a batch whose policy step is below the lowest the
trainer still accepts (its signed demand) is dropped on arrival, before it is fetched or judged, and its
worker is not charged: it was honest, only late. Kept apart from ``stale_policy`` (a judged batch older
than ``async_level``) and the trainer's ``stale_in_queue``, because the cure differs: a worker that keeps
producing below the floor should follow the trainer's demand."""
